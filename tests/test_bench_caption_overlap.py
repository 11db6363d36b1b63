"""bench/caption_overlap.py: the test images whose captions another collection holds (docs/mmca.md)."""

from __future__ import annotations

from conftest import load_script

from itmatch.data.precomp import write_captions


def test_captions_found_elsewhere_are_counted_with_their_images(tmp_path, capsys):
    bench = load_script("bench/caption_overlap.py")
    captions = [f"image {i} caption {j}" for i in range(3) for j in range(5)]
    others = ["IMAGE 0   caption 4", "image 2 caption 0", "image 2 caption 1", "image 9 caption 0"]
    assert bench.overlap(captions, others) == (3, 2)  # (case and spacing aside; images 0 and 2)
    write_captions(tmp_path, "test", ["a", "b", "c"], captions)
    (tmp_path / "f30k.txt").write_text("\n".join(others) + "\n")
    assert bench.main(["--data", str(tmp_path), str(tmp_path / "f30k.txt")]) == 0
    assert capsys.readouterr().out.startswith("test: 3 of 15 captions, of 2 of 3 images, appear in 4 captions")
