"""Precomp layout round trip and its bad-input errors."""

from __future__ import annotations

import numpy as np
import pytest

from itmatch.data.precomp import read_precomp, write_captions, write_features
from itmatch.errors import DataError


def test_round_trip_is_memory_mapped(tmp_path):
    feats = np.random.default_rng(0).standard_normal((3, 4, 5)).astype(np.float32)
    write_features(tmp_path, "test", feats)
    write_captions(tmp_path, "test", ["a", "b", "c"], [f"cap {j}" for j in range(15)])
    split = read_precomp(tmp_path, "test")
    assert isinstance(split.images, np.memmap) and np.array_equal(split.images, feats)
    assert split.captions[7] == "cap 7" and split.ids == ["a", "b", "c"]
    head = split.head(2)
    assert head.n_images == 2 and len(head.captions) == 10
    assert not list(tmp_path.glob("*.partial"))


def test_caption_count_mismatch_names_file(tmp_path):
    write_features(tmp_path, "dev", np.zeros((2, 1, 3), np.float32))
    (tmp_path / "dev_caps.txt").write_text("\n".join(["x"] * 9) + "\n")
    with pytest.raises(DataError, match=r"dev_caps.txt: 9 caption lines for 2 images"):
        read_precomp(tmp_path, "dev")


def test_empty_caption_names_line(tmp_path):
    write_features(tmp_path, "dev", np.zeros((1, 1, 3), np.float32))
    (tmp_path / "dev_caps.txt").write_text("a\nb\n  \nd\ne\n")
    with pytest.raises(DataError, match=r"dev_caps.txt:3: empty caption"):
        read_precomp(tmp_path, "dev")


def test_a_caption_file_not_in_utf8_names_its_line_and_converts_in_place(tmp_path):
    """It said 'not UTF-8 text (invalid continuation byte at byte 14)': no line, no fix."""
    write_features(tmp_path, "dev", np.zeros((1, 1, 3), np.float32))
    (tmp_path / "dev_caps.txt").write_bytes("a\nb\na caf\u00e9\nd\ne\n".encode("latin1"))
    with pytest.raises(DataError, match="not UTF-8 text") as err:
        read_precomp(tmp_path, "dev")
    caps = tmp_path / "dev_caps.txt"
    assert err.value.line == 3 and f"iconv -f latin1 -t utf-8 {caps} > {tmp_path / 'dev_caps-utf8.txt'} && mv " \
        f"{tmp_path / 'dev_caps-utf8.txt'} {caps}" in err.value.hint  # (the directory reads it by its name)


def test_non_finite_features_name_image(tmp_path):
    feats = np.zeros((4, 2, 3), np.float32)
    feats[2, 1, 0] = np.nan
    write_features(tmp_path, "dev", feats)
    write_captions(tmp_path, "dev", list("abcd"), ["x"] * 20)
    with pytest.raises(DataError, match="non-finite.*image 2"):
        read_precomp(tmp_path, "dev")


def test_missing_and_truncated_features(tmp_path):
    with pytest.raises(DataError, match="itmatch extract"):
        read_precomp(tmp_path, "test")
    write_features(tmp_path, "test", np.zeros((10, 4, 8), np.float32))
    path = tmp_path / "test_ims.npy"
    path.write_bytes(path.read_bytes()[:200])
    (tmp_path / "test_caps.txt").write_text("x\n" * 50)
    with pytest.raises(DataError, match="test_ims.npy"):
        read_precomp(tmp_path, "test")


def test_f30k_caption_file_without_final_newline():
    from conftest import SHARED

    path = SHARED / "precomp-captions/f30k_precomp/test_caps.txt"
    if not path.exists():
        pytest.skip("../shared/data is absent")
    from itmatch.data.precomp import read_lines

    assert len(read_lines(path)) == 5000


def test_split_never_extracted_is_told_apart_from_an_unfinished_one(tmp_path):
    """A dataset without a dev split (or a misspelt split name) was said to have an unfinished extraction,
    with 'rerun the same itmatch extract command' as the fix, which cannot help."""
    import json

    from itmatch.data.precomp import progress_path

    meta = {"format": "itmatch-precomp", "splits": {"train": {"images": 2}, "test": {"images": 2}}}
    (tmp_path / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    with pytest.raises(DataError, match=r"split 'dev' is not in this dataset \(meta.json has: train, test\)") as err:
        read_precomp(tmp_path, "dev")
    hint = err.value.hint or ""
    assert "data.val_split=train" in hint and "--split train" in hint and "--default-split dev" in hint
    assert "rerun" not in hint
    with pytest.raises(DataError, match="not in this dataset") as err:
        read_precomp(tmp_path, "tset")
    assert (err.value.hint or "").startswith("did you mean 'test'?")
    # a split whose extraction started (its progress file is there) is the unfinished one
    progress_path(tmp_path, "dev").write_text("{}", encoding="utf-8")
    with pytest.raises(DataError, match="'dev' is not recorded as complete in meta.json: its extraction did not "
                                        "finish") as err:
        read_precomp(tmp_path, "dev")
    assert "rerun the same `itmatch extract` command" in (err.value.hint or "")


@pytest.mark.parametrize("caption", ["a dog\n", "a dog\nrunning", "a dog\u2028running", "a dog\r"])
def test_a_caption_that_would_not_be_one_line_of_the_file_is_refused(tmp_path, caption):
    """The caption file holds one caption a line and is read back with splitlines(): a break anywhere in a caption,
    a final one too ('a dog\\n' passed a check of splitlines' count), would shift every later caption."""
    captions = [caption] + [f"caption {i}" for i in range(4)]
    with pytest.raises(DataError, match="empty or spans lines"):
        write_captions(tmp_path, "train", ["a.jpg"], captions)
