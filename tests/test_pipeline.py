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
