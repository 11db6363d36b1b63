"""The GPU path end to end (marked `cuda`; skipped where torch sees no GPU): train -> evaluate -> index ->
search on the GPU, against the same steps on the CPU; checkpoints written on either load on the other;
fp16 training with its scaler. docs/gpu.md. (Out-of-memory retries: tests/test_device.py, simulated.)"""

from __future__ import annotations

import json

import pytest
import torch

from itmatch.data.precomp import read_precomp
from itmatch.device import Placement
from itmatch.engine.checkpoint import load_checkpoint
from itmatch.engine.evaluate import evaluate_models
from itmatch.engine.train import train
from itmatch.inference import encode_captions, encode_images, score_matrix
from itmatch.models.registry import resolve_config

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")]

SMALL = {"model": {"embed_size": 32, "word_dim": 16},
         "train": {"epochs": 2, "batch_size": 32, "val_images": 20, "log_every": 100}}


def _config(preset: str, data, **train):
    return resolve_config(preset, {**SMALL, "data": {"path": str(data)}, "train": {**SMALL["train"], **train}})


@pytest.mark.parametrize("preset", ["vsepp", "scan_t2i_avg", "scan_i2t_lse", "oan"])
def test_train_and_evaluate_on_the_gpu_and_load_the_checkpoint_on_the_cpu(preset, tiny_precomp, tmp_path):
    cfg = _config(preset, tiny_precomp, device="cuda")
    result = train(cfg, tmp_path / "run", progress=False)
    assert result["best_rsum"] >= 0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["device"] == "cuda"
    optimizer = torch.load(tmp_path / "run" / "last" / "optimizer.pt", weights_only=True)  # no map_location
    assert all(v.device.type == "cpu" for s in optimizer["state"].values() for v in s.values())
    ckpt = load_checkpoint(tmp_path / "run" / "best")  # on the CPU
    split = read_precomp(tiny_precomp, "test")
    on_cpu = evaluate_models([(ckpt.model, ckpt.vocab)], split)
    on_gpu = evaluate_models([(ckpt.model.to("cuda"), ckpt.vocab)], split)
    assert abs(on_cpu["rsum"] - on_gpu["rsum"]) <= 5.0  # 40 images: a tie broken the other way moves R@1 by 2.5


def test_scores_on_the_gpu_equal_the_cpus(tiny_precomp):
    ckpt_cfg = _config("scan_t2i_avg", tiny_precomp)
    from itmatch.data.vocab import build_vocab
    from itmatch.models.registry import build_model

    split = read_precomp(tiny_precomp, "test")
    vocab = build_vocab(split.captions)
    ckpt_cfg.model.vocab_size, ckpt_cfg.model.img_dim = len(vocab), 32
    torch.manual_seed(0)
    model = build_model(ckpt_cfg.model).eval()
    cpu = score_matrix(model, encode_images(model, split.images), encode_captions(model, split.captions, vocab))
    model.cuda()
    with Placement(torch.device("cuda"), "fp32").arithmetic():  # exact: no TF32 in the GEMMs or cuDNN's GRU
        gpu = score_matrix(model, encode_images(model, split.images), encode_captions(model, split.captions, vocab))
    assert gpu.device.type == "cpu"  # finished scores come back to the host
    assert torch.allclose(cpu, gpu, atol=1e-4)


def test_a_cpu_run_resumes_on_the_gpu_and_fp16_trains_with_its_scaler(tiny_precomp, tmp_path):
    cfg = _config("scan_t2i_avg", tiny_precomp, device="cpu", epochs=1)
    train(cfg, tmp_path / "run", progress=False)
    result = train(cfg, tmp_path / "run", resume=True, progress=False, device="cuda", precision="fp16",
                   resume_overrides={"train": {"epochs": 2}})  # one more epoch for the finished run
    assert result["best_epoch"] >= 1
    trainer = torch.load(tmp_path / "run" / "last" / "trainer.pt", weights_only=True)
    assert "scaler" in trainer and trainer["scaler"]["scale"] > 0


def test_index_and_search_on_the_gpu_find_what_the_cpu_finds(tiny_search_setup, tmp_path):
    from itmatch.retrieval.index import build_index
    from itmatch.retrieval.search import Searcher

    s = tiny_search_setup
    build_index(s["photos"], s["checkpoint"], tmp_path / "gpu", device="cuda", progress=False)
    build_index(s["photos"], s["checkpoint"], tmp_path / "cpu", device="cpu", progress=False)
    on_gpu = Searcher(tmp_path / "gpu", s["checkpoint"], device="cuda").search("a red circle", 5)
    on_cpu = Searcher(tmp_path / "cpu", s["checkpoint"], device="cpu").search("a red circle", 5)
    assert [h.id for h in on_gpu][:3] == [h.id for h in on_cpu][:3]
    assert all(abs(a.score - b.score) < 1e-3 for a, b in zip(on_gpu, on_cpu, strict=True))
