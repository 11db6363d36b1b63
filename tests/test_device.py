"""Device and precision plumbing on a CPU-only machine (docs/gpu.md): the settings are checked before any
work, every tensor a model, loss or the evaluator creates follows its inputs' device, and an out-of-memory
block is retried smaller. The GPU itself is exercised by tests/test_cuda.py (marked `cuda`)."""

from __future__ import annotations

import ast
import threading
import warnings
from pathlib import Path

import pytest
import torch
from conftest import WORDS, load_script

from itmatch.cli import main
from itmatch.data.datasets import PairBatch, pad_tokens
from itmatch.data.precomp import read_precomp
from itmatch.data.vocab import Vocab
from itmatch.device import Placement, check_precision, default_device, exact_fp32, resolve, resolve_device
from itmatch.errors import ConfigError
from itmatch.inference import (
    encode_caption_buckets,
    encode_captions,
    encode_images,
    score_matrix,
    score_pairs,
    unbucket_texts,
)
from itmatch.models.registry import build_model, image_inputs, list_models, resolve_config

SRC = Path(__file__).resolve().parents[1] / "src" / "itmatch"
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the messages of a machine without a GPU")


# -- the settings ------------------------------------------------------------------------------------------

@no_gpu
def test_auto_is_the_cpu_without_a_gpu_and_cpu_is_always_there():
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu") == resolve_device(None)


@no_gpu
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:7"])
def test_cuda_without_a_gpu_names_the_setting_and_what_is_there(spec):
    with pytest.raises(ConfigError, match=rf"train.device {spec}: this torch sees no GPU.*only cpu"):
        resolve_device(spec, "train.device")


def test_a_gpu_index_beyond_the_machine_says_how_many_there_are(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (a one-GPU machine, simulated)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "H100")
    with pytest.raises(ConfigError, match=r"--device cuda:7: there is no GPU 7; torch sees 1 \(cpu, cuda:0 \(H100\)\)"):
        resolve_device("cuda:7")
    assert resolve_device("cuda") == torch.device("cuda", 0)
    monkeypatch.setenv("WORLD_SIZE", "2")  # (torchrun with more processes than GPUs: the way out is fewer processes)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match="there is no GPU 1") as err:
        resolve_device("cuda")
    assert "--nproc_per_node 1" in err.value.hint


def test_a_gpu_index_other_than_the_ranks_under_torchrun_is_refused(monkeypatch):
    """Under torchrun every rank runs the same command, so `--device cuda:0` would put every rank on one GPU
    (NCCL refuses a GPU two ranks share, or waits): refused with `cuda`, each rank's own GPU; its own index passes
    this check (and then needs a GPU)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match="local rank 1") as err:
        resolve_device("cuda:0")
    assert "--device cuda" in err.value.hint
    with pytest.raises(ConfigError, match="torch sees no GPU|there is no GPU"):
        resolve_device("cuda:1")


@pytest.mark.parametrize("spec", ["tpu", "cuda:x", "gpu", "cuda:-1"])
def test_a_device_that_is_no_device_lists_the_choices(spec):
    with pytest.raises(ConfigError, match="is not a device") as info:
        resolve_device(spec)
    assert "auto, cpu, cuda, cuda:N" in info.value.hint


def test_fp16_needs_cuda_bf16_runs_on_the_cpu_and_fp32_is_no_autocast():
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match="--precision fp16 needs a CUDA device"):
        check_precision("fp16", cpu)
    with pytest.raises(ConfigError, match="'fp64' is not a precision"):
        check_precision("fp64", cpu)
    assert check_precision("bf16", cpu) == torch.bfloat16
    with Placement(cpu, "fp32").arithmetic():
        assert not torch.is_autocast_enabled("cpu")
    with Placement(cpu, "bf16").arithmetic():
        assert torch.is_autocast_enabled("cpu")
    assert not Placement(cpu, "bf16").grad_scaler().is_enabled()


def _tf32() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


@pytest.fixture
def tf32_on():
    """Both TF32 flags on for the test (torch's matmul flag is a property monkeypatch cannot set), then as before."""
    before = _tf32()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_fp32_on_a_gpu_turns_tf32_off_in_cublas_and_cudnn_and_restores_it(tf32_on):
    """PyTorch lets cuDNN use TF32 by default: fp32 on a GPU (an H200) then moved SCAN's scores by > 1e-4 from the
    CPU's through the GRU. The flags are plain process settings, so this runs without a GPU."""
    gpu_fp32 = Placement(torch.device("cuda"), "fp32")
    with gpu_fp32.arithmetic():
        assert _tf32() == (False, False)
        with gpu_fp32.arithmetic():  # nested (evaluation inside training's validation)
            assert _tf32() == (False, False)
        assert _tf32() == (False, False)  # the inner scope's exit leaves the outer one exact
    assert _tf32() == (True, True)  # what the user had set comes back
    with Placement(torch.device("cpu"), "fp32").arithmetic():
        assert _tf32() == (True, True)  # the CPU has no TF32: nothing to switch


def test_exact_fp32_scopes_in_threads_stay_exact_until_the_last_closes(tf32_on):
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def first():
        with exact_fp32():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second():
        first_in.wait(5)
        with exact_fp32():
            second_in.set()
            first_out.wait(5)
            seen.append(torch.backends.cudnn.allow_tf32)  # the first scope closed meanwhile
    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == [False]
    assert torch.backends.cudnn.allow_tf32 is True


def test_bf16_on_a_gpu_without_it_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Tesla V100")
    with pytest.raises(ConfigError, match="bf16: Tesla V100 has no bfloat16 support"):
        check_precision("bf16", torch.device("cuda", 0))


def test_precision_is_a_checked_config_key():
    with pytest.raises(ConfigError, match="train.precision: 'fp64' is not one of fp32, bf16, fp16"):
        resolve_config("vsepp", {"train": {"precision": "fp64"}})
    assert resolve_config("vsepp").train.device == "auto" and resolve_config("vsepp").train.precision == "fp32"


@no_gpu
@pytest.mark.parametrize("argv", [
    ["evaluate", "{empty}", "--device", "cuda:7"],
    ["train", "--preset", "vsepp", "--data", "{empty}", "--out", "{out}", "--device", "cuda"],
    ["train", "--preset", "vsepp", "--data", "{empty}", "--out", "{out}", "--precision", "fp16"],
    ["extract", "{empty}", "{file}", "--out", "{out}", "--device", "cuda"],
    ["index", "{empty}", "--model", "{empty}", "--out", "{out}", "--device", "cuda:1"],
    ["search", "{empty}", "a dog", "--device", "cuda"],
])
def test_every_verb_refuses_a_bad_device_before_any_work(argv, tmp_path, capsys):
    """The inputs exist (the argument checks pass) but are empty: reading any of them would fail with
    another message, so the device error shows that nothing was read."""
    out, empty, file = tmp_path / "out", tmp_path / "empty", tmp_path / "captions.txt"
    empty.mkdir()
    file.write_text("")
    given = {"{out}": str(out), "{empty}": str(empty), "{file}": str(file)}
    assert main([given.get(a, a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "--device" in err or "--precision" in err, err
    assert not out.exists()


@no_gpu
def test_train_device_in_the_config_is_named_in_its_error(tiny_precomp, tmp_path):
    from itmatch.engine.train import train

    cfg = resolve_config("vsepp", {"data": {"path": str(tiny_precomp)}, "train": {"device": "cuda:0"}})
    with pytest.raises(ConfigError, match="train.device cuda:0"):
        train(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_api_load_checks_its_device_before_reading():
    import itmatch

    with pytest.raises(ConfigError, match="device= 'tpu' is not a device"):
        itmatch.load("no/such/checkpoint", device="tpu")


# -- tensors on their inputs' device -----------------------------------------------------------------------

def _needs_backbone(preset: str) -> bool:  # pixel / NL-tail SAVE models load backbone weights
    save = resolve_config(preset).model.save
    return save.pixels or save.fusion == "nl"


def _small(preset: str):
    vocab = 30522 if preset.startswith("mmca") else 50
    cfg = resolve_config(preset, {"model": {"img_dim": 16, "vocab_size": vocab, "embed_size": 16, "word_dim": 8,
                                            "sman": {"regions": 4}, "save": {"c3_dim": 16, "c4_dim": 16}}})
    torch.manual_seed(0)
    model = build_model(cfg.model)
    scales = image_inputs(cfg.model)
    if scales:
        feats = {s: torch.rand(6, k, 16) for s, k in (("c3", 16), ("c4", 4), ("c5", 1)) if s in scales}
    else:
        feats = torch.rand(6, 4, 16)
    tokens, lengths = torch.randint(4, vocab, (6, 7)), torch.tensor([7, 3, 5, 2, 7, 4])
    return cfg, model, feats, tokens, lengths


@pytest.mark.parametrize("preset", [p for p in list_models() if not p.endswith("_coco") and not _needs_backbone(p)])
def test_every_preset_creates_its_tensors_on_its_inputs_device(preset):
    """The model and its inputs are on the CPU, the default device is `meta`: a tensor created without
    `device=` lands on meta and mixing it with the CPU tensors fails (as a CPU tensor does on a GPU),
    or leaves a meta result. Forward, scoring and the training loss with a same-image mask."""
    cfg, model, feats, tokens, lengths = _small(preset)
    image_index = torch.tensor([0, 0, 1, 2, 3, 4])
    positives = image_index[:, None] == image_index[None, :]
    with default_device("meta"):
        img, txt = model.encode_images(feats), model.encode_texts(tokens, lengths)
        scores = model.score(img, txt)
        loss = model.training_loss(img, txt, cfg.loss.margin, True, positives)
        loss.backward()
    created = [*img.tensors(), *txt.tensors(), scores, loss]
    assert all(t.device.type == "cpu" for t in created)
    assert all(p.grad is None or p.grad.device.type == "cpu" for p in model.parameters())


@pytest.fixture(scope="module")
def small_scan(tiny_precomp):
    split = read_precomp(tiny_precomp, "test")
    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>", "a", "and", *WORDS])
    cfg = resolve_config("scan_t2i_avg", {"model": {"img_dim": 32, "vocab_size": len(vocab), "embed_size": 16,
                                                    "word_dim": 8}})
    torch.manual_seed(0)
    return build_model(cfg.model).eval(), vocab, split


def test_the_evaluator_creates_its_tensors_on_the_models_device_and_scores_on_the_host(small_scan):
    """Encoding, the block plan, score_matrix and score_pairs under a `meta` default device: the same numbers
    as without it, on the host (only finished outputs are host tensors, made there explicitly)."""
    model, vocab, split = small_scan
    img, buckets = encode_images(model, split.images), encode_caption_buckets(model, split.captions, vocab)
    reference = score_matrix(model, img, buckets)
    pairs = torch.tensor([0, 3, 3, 7]), torch.tensor([1, 0, 17, 39])
    with default_device("meta"):
        img2 = encode_images(model, split.images)
        buckets2 = encode_caption_buckets(model, split.captions, vocab)
        scores = score_matrix(model, img2, buckets2)
        listed = score_pairs(model, img2, unbucket_texts(buckets2), *pairs)
    assert scores.device.type == "cpu" and torch.equal(scores, reference)
    assert torch.allclose(listed, reference[pairs], atol=1e-6)


#: where "every tensor is created on its inputs' device" is checked statically: model code, losses, metrics,
#: the inference core and two-stage scoring. Construction-time tensors (in __init__, a frozen encoder's
#: fingerprint) become parameters or buffers and move with the module.
STATIC_SCOPE = ["models", "engine/metrics.py", "inference", "retrieval/two_stage.py", "engine/evaluate.py"]
FACTORIES = {"arange", "zeros", "ones", "empty", "full", "eye", "tensor", "as_tensor", "rand", "randn",
             "randint", "randperm", "linspace"}
CONSTRUCTION = {"__init__", "_fingerprint"}


def factory_calls_without_device(path: Path) -> list[str]:
    found = []
    for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(fn, ast.FunctionDef) or fn.name in CONSTRUCTION:
            continue
        for node in ast.walk(fn):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                    and not any(k.arg == "device" for k in node.keywords)):
                found.append(f"{path.relative_to(SRC)}:{node.lineno} ({fn.name}): torch.{node.func.attr}")
    return found


def test_no_tensor_is_created_without_a_device_in_models_losses_metrics_and_the_evaluator():
    files = [f for part in STATIC_SCOPE for f in ([SRC / part] if part.endswith(".py")
                                                  else sorted((SRC / part).rglob("*.py")))]
    assert len(files) > 10
    found = [hit for f in files for hit in factory_calls_without_device(f)]
    assert not found, "pass device= (the inputs' device, or HOST for finished outputs):\n" + "\n".join(found)


def test_the_static_check_finds_a_factory_call_without_device(tmp_path):
    bad = SRC / "models" / "_probe_for_test.py"  # (inside SRC for relative_to; removed at once)
    bad.write_text("import torch\n\ndef f(x):\n    return x + torch.arange(3)\n", encoding="utf-8")
    try:
        assert factory_calls_without_device(bad) == ["models/_probe_for_test.py:4 (f): torch.arange"]
    finally:
        bad.unlink()


def test_a_pair_batch_moves_whole():
    batch = PairBatch({"c5": torch.rand(2, 4, 3)}, pad_tokens([[1, 5, 2], [1, 2]]), torch.tensor([0, 1]),
                      torch.tensor([0, 5]))
    moved = batch.to("meta")
    tensors = [*moved.images.values(), moved.text.tokens, moved.text.lengths, moved.image_index, moved.caption_index]
    assert all(t.device.type == "meta" for t in tensors)
    assert pad_tokens([[1, 2]]).tokens.device.type == "cpu"


# -- out of memory ------------------------------------------------------------------------------------------

def _oom_above(model, max_pairs: int, calls: list[tuple[int, int]]) -> None:
    """Make the model's head raise torch.OutOfMemoryError, as CUDA does, for blocks of more than
    `max_pairs` pairs (recording every block it is asked for)."""
    forward = model.head.forward

    def limited(img, txt):
        calls.append((len(img), len(txt)))
        if len(img) * len(txt) > max_pairs:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
        return forward(img, txt)

    model.head.forward = limited


def test_out_of_memory_during_scoring_retries_smaller_blocks_and_loses_nothing(small_scan):
    model, vocab, split = small_scan
    img, txt = encode_images(model, split.images), encode_captions(model, split.captions, vocab)
    reference = score_matrix(model, img, txt)
    calls: list[tuple[int, int]] = []
    _oom_above(model, 100, calls)
    try:
        with pytest.warns(UserWarning, match="out of device memory .* retrying with smaller blocks") as said:
            scores = score_matrix(model, img, txt)
        assert len(said) == 1  # said once, not per block
        assert torch.allclose(scores, reference, atol=1e-6)
        failed = [k for k, c in enumerate(calls) if c[0] * c[1] > 100]
        scored = [k for k, c in enumerate(calls) if c[0] * c[1] <= 100]
        assert max(failed) < min(scored)  # the smaller size is kept: later blocks do not fail first
        calls.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            listed = score_pairs(model, img, txt, torch.zeros(200, dtype=torch.long), torch.arange(200))
        assert torch.allclose(listed, reference[0], atol=1e-6)
    finally:
        del model.head.forward  # back to the class's forward


def test_out_of_memory_on_a_single_pair_is_an_error_that_says_so(small_scan):
    model, vocab, split = small_scan
    img, txt = encode_images(model, split.images[:2]), encode_captions(model, split.captions[:3], vocab)
    _oom_above(model, 0, [])
    try:
        with pytest.raises(ConfigError, match="out of device memory scoring a single image-caption pair"), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            score_matrix(model, img, txt)
    finally:
        del model.head.forward


# -- precision ----------------------------------------------------------------------------------------------

def test_bf16_evaluation_on_the_cpu_is_close_to_fp32_and_fp32_is_exact(small_scan):
    from itmatch.engine.evaluate import evaluate_models

    model, vocab, split = small_scan
    fp32 = evaluate_models([(model, vocab)], split, "full")
    again = evaluate_models([(model, vocab)], split, "full", precision="fp32")
    bf16 = evaluate_models([(model, vocab)], split, "full", precision="bf16")
    assert fp32["rsum"] == again["rsum"]
    assert abs(bf16["rsum"] - fp32["rsum"]) < 30  # a 40-image split: one rank step moves R@1 by 2.5
    with pytest.raises(ConfigError, match="fp16 needs a CUDA device"):
        evaluate_models([(model, vocab)], split, "full", precision="fp16")


def test_training_in_bf16_on_the_cpu_runs_and_records_its_setting(tiny_precomp, tmp_path):
    import json

    from itmatch.engine.train import train

    cfg = resolve_config("vsepp", {"data": {"path": str(tiny_precomp)}, "model": {"embed_size": 16, "word_dim": 8},
                                   "train": {"epochs": 1, "batch_size": 16, "max_batches": 3, "val_images": 10}})
    result = train(cfg, tmp_path / "run", progress=False, device="cpu", precision="bf16")
    assert result["best_rsum"] >= 0
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["train"]
    assert saved["device"] == "cpu" and saved["precision"] == "bf16"
    weights = torch.load(tmp_path / "run" / "last" / "optimizer.pt", weights_only=True)
    assert all(v.dtype == torch.float32 for s in weights["state"].values() for v in s.values() if v.dim())
    assert resolve("cpu", "bf16").precision == "bf16"


@pytest.mark.slow
def test_the_gpu_bench_runs_on_the_cpu_at_smoke_size(tmp_path):
    """bench/gpu.py takes the issue's GPU measurements; on the CPU at tiny sizes it must still run."""
    import subprocess
    import sys

    out = tmp_path / "report.json"
    bench = Path(__file__).resolve().parents[1] / "bench" / "gpu.py"
    subprocess.run([sys.executable, str(bench), "eval", "blocks", "train", "--device", "cpu", "--smoke",
                    "--images", "2", "--captions", "20", "--reference-captions", "10", "--presets", "vsepp,sman",
                    "--out", str(out)],
                   check=True, capture_output=True, timeout=600)
    import json

    report = json.loads(out.read_text())
    public = report["eval"]["public_loop"]  # in each engine mode's precision, then float64, on whole shards
    assert [r["mode"] for r in public] == ["fp32", "bf16", "fp64"]
    assert all(r["timed_shards"] == [[0, 2]] and r["captions_timed"] == 10 for r in public)
    assert public[0]["max_abs_diff_vs_engine_fp32"] < 1e-4 and public[2]["max_abs_diff_vs_engine_fp32"] < 1e-4
    bf16 = report["eval"]["modes"][1]  # its ratio to the fp32 loop is marked cross-precision
    assert bf16["mode"] == "bf16" and bf16["speedup_vs_loop_fp32_is_cross_precision"]
    assert bf16["speedup_vs_loop_same_precision"] > 0
    assert "needs CUDA" in report["eval"]["fused"]["skipped"]  # the fused kernel's rows: CUDA + triton only
    # every preset on Lite0's 49 cells (SMAN checks its grid: it failed here on 36 regions' model until 2026-12-04)
    assert {(r["preset"], r["precision"]) for r in report["train"]["steps"]} == {
        (p, precision) for p in ("vsepp", "sman") for precision in ("fp32", "bf16")}
    blocks = report["blocks"]["rows"]  # smaller caps, more blocks, the same scores
    assert blocks[0]["blocks"] > blocks[1]["blocks"] and max(r["plain_fp32_max_diff"] for r in blocks) < 1e-5


def _synchronising_call():  # what torch's sync debug mode does at a synchronising call on a GPU
    warnings.warn("called a synchronizing CUDA operation", stacklevel=1)


def test_the_sync_census_counts_each_waiting_line_of_our_source():
    """bench/gpu.py syncs (CUDA only) counts the warnings of torch.cuda.set_sync_debug_mode per line of itmatch's
    source; here the source is this file and the warnings are made by hand."""
    gpu = load_script("bench/gpu.py")
    shown = warnings.showwarning
    with gpu.counted_syncs(Path(__file__).resolve().parent) as sites:
        for _ in range(3):
            _synchronising_call()
    line = _synchronising_call.__code__.co_firstlineno + 1
    code = 'warnings.warn("called a synchronizing CUDA operation", stacklevel=1)'
    assert dict(sites) == {f"test_device.py:{line} {code}": 3}
    assert warnings.showwarning is shown


def test_the_trainer_profile_names_the_steps_python_and_ops_on_the_cpu(tiny_precomp, tmp_path, capsys):
    """bench/gpu.py profile: a few real trainer steps, then where their time went, Python functions and torch ops
    (on a GPU also by device time); on the CPU it runs the same way, without the device column."""
    import argparse

    gpu = load_script("bench/gpu.py")
    args = argparse.Namespace(data=str(tiny_precomp), max_batches=2, presets=["vsepp"], runs=str(tmp_path), top=40)
    report = gpu.section_profile(args, resolve("cpu", "fp32"))
    row, = report["rows"]
    assert row["preset"] == "vsepp" and row["steps"] == 2 and row["ms_a_step"] > 0
    own = [f["own_seconds"] for f in row["python"]]
    assert own == sorted(own, reverse=True) and any("run_backward" in f["function"] for f in row["python"])
    assert any(op["op"].startswith("aten::") for op in row["ops_by_host"]) and row["ops_by_device"] == []
    assert "profile vsepp" in capsys.readouterr().out


def test_a_gpu_schedule_on_a_cpu_only_machine_names_the_cpu_schedule(tmp_path, capsys, monkeypatch):
    """configs/flickr8k/gpu.yaml sets train.device: cuda; without CUDA, training stops before any work and
    says to use the CPU schedule."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = Path(__file__).resolve().parents[1] / "configs" / "flickr8k" / "gpu.yaml"
    out = tmp_path / "run"
    argv = ["train", "--preset", "vsepp", "--config", str(config), "--data", str(tmp_path), "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "train.device" in err and "configs/flickr8k/cpu.yaml" in err and "Traceback" not in err
    assert not out.exists()
