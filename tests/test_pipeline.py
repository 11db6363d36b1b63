"""The main job end to end on a small embedded dataset, then the Python API on its real image files."""

from __future__ import annotations

import pytest
import torch

import itmatch
from itmatch.demo import run_demo
from itmatch.errors import DataError, OverwriteError


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    result = run_demo(out, epochs=1, n_train=60, n_eval=12, progress=False)
    assert result["n_images"] == 12 and result["rsum"] > 0
    return out


@pytest.mark.slow
def test_demo_resumes_and_refuses_foreign_directory(demo_dir, tmp_path):
    result = run_demo(demo_dir, epochs=1, n_train=60, n_eval=12, progress=False)  # every step already done
    assert result["timings"]["train"] < 5
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(OverwriteError):
        run_demo(tmp_path, epochs=1, n_train=60, n_eval=12, progress=False)
    assert (tmp_path / "precious.txt").read_text() == "keep me"


@pytest.mark.slow
def test_demo_with_more_epochs_trains_on(demo_dir, capsys):
    """`itmatch demo --epochs N` on a finished demo used to end at once, its run still at the first epochs."""
    import json

    run = demo_dir / "scan_t2i_avg"
    run_demo(demo_dir, epochs=2, n_train=60, n_eval=12, progress=False)
    assert json.loads((run / "last" / "state.json").read_text())["epoch"] == 2
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["overrides"] for x in lines if "resumed_at_step" in x] == [{"train.epochs": 2}]
    assert max(x.get("epoch", 0) for x in lines if "val_rsum" in x) == 2
    capsys.readouterr()
    run_demo(demo_dir, epochs=1, n_train=60, n_eval=12, progress=False)  # fewer: said, and nothing trained
    assert "has trained 2 epochs already, more than --epochs 1" in capsys.readouterr().err
    assert json.loads((run / "last" / "state.json").read_text())["epoch"] == 2


@pytest.mark.slow
def test_python_api_on_image_files(demo_dir):
    matcher = itmatch.load(demo_dir / "scan_t2i_avg" / "best")
    paths = sorted((demo_dir / "synth" / "images").glob("test_*.png"))[:4]
    images = matcher.encode_images(paths)
    assert images.regions.shape[:2] == (4, 49)
    texts = matcher.encode_texts(["a red circle", "two blue squares"])
    scores = matcher.score(images, texts)
    assert scores.shape == (4, 2) and torch.isfinite(scores).all()
    ranked = matcher.rank("a red circle", images, top_k=3)
    assert len(ranked) == 3 and ranked[0][1] >= ranked[1][1] >= ranked[2][1]
    # the API's features equal the extractor's for the same file
    from itmatch.data.precomp import read_precomp

    test = read_precomp(demo_dir / "precomp", "test")
    idx = test.ids.index(paths[0].name)
    assert torch.allclose(matcher.image_features([paths[0]])[0], torch.from_numpy(test.images[idx].copy()),
                          atol=1e-4)
    with pytest.raises(DataError, match="cannot read image"):
        matcher.encode_images([demo_dir / "synth" / "dataset_synth.json"])
