"""Small end-to-end runs: train a few steps, checkpoint, resume, evaluate, ensemble, blocked scoring."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from itmatch.cli import main
from itmatch.config import parse_overrides
from itmatch.data.precomp import read_precomp
from itmatch.engine.checkpoint import load_checkpoint, save_checkpoint
from itmatch.engine.evaluate import encode_captions, encode_images, evaluate_models, score_matrix
from itmatch.engine.train import train
from itmatch.errors import CheckpointError, ConfigError, DataError, OverwriteError
from itmatch.models.registry import list_models, resolve_config

QUICK = {"model": {"embed_size": 32, "word_dim": 16}, "loss": {"warmup_epochs": 1},
         "train": {"epochs": 2, "batch_size": 32, "lr": 2e-3, "val_images": 40, "lr_update": 10}}


def quick_config(preset, data, **train):
    layer = {**QUICK, "data": {"path": str(data)}}
    cfg = resolve_config(preset, layer)
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def test_presets_named_as_papers():
    names = list_models()
    for expected in ("scan_t2i_avg", "scan_i2t_lse", "vsepp", "summax_t2i", "summax_i2t", "scan_i2t_lse_coco"):
        assert expected in names
    cfg = resolve_config("scan_i2t_lse")
    assert (cfg.model.scan.lambda_softmax, cfg.model.scan.lambda_lse, cfg.train.lr) == (4.0, 5.0, 2e-4)


def test_unknown_model_and_key_are_errors():
    with pytest.raises(ConfigError, match="unknown model 'scan_x'"):
        resolve_config("scan_x")
    with pytest.raises(ConfigError, match="unknown config key 'model.embed'"):
        resolve_config("vsepp", parse_overrides(["model.embed=3"]))
    with pytest.raises(ConfigError, match="expected int"):
        resolve_config("vsepp", parse_overrides(["train.epochs=many"]))


@pytest.mark.parametrize("preset", ["scan_t2i_avg", "scan_i2t_lse", "summax_t2i", "vsepp"])
def test_train_learns_and_checkpoints(tiny_precomp, tmp_path, preset):
    result = train(quick_config(preset, tiny_precomp), tmp_path / "run", progress=False)
    assert result["best_rsum"] > 150  # chance rsum on 40 images is 2 * (2.5 + 12.5 + 25) = 80
    ckpt = load_checkpoint(tmp_path / "run" / "best")
    split = read_precomp(tiny_precomp, "test")
    metrics = evaluate_models([(ckpt.model, ckpt.vocab)], split, "full")
    assert metrics["rsum"] > 120  # held-out images, well above chance (80)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["epoch"] for x in lines if "val_rsum" in x] == [1, 2]


def test_resume_continues_to_same_result(tiny_precomp, tmp_path):
    cfg = quick_config("scan_t2i_avg", tiny_precomp, epochs=2)
    full = train(cfg, tmp_path / "a", progress=False)
    first = quick_config("scan_t2i_avg", tiny_precomp, epochs=1)
    train(first, tmp_path / "b", progress=False)
    # extend the interrupted run's schedule to 2 epochs: an edited config.json is refused (it is covered by
    # the checkpoint's manifest), `--resume --set train.epochs=2` is the way; model keys cannot change
    cfg_path = tmp_path / "b" / "last" / "config.json"
    original = cfg_path.read_text()
    saved = json.loads(original)
    saved["train"]["epochs"] = 2
    cfg_path.write_text(json.dumps(saved))
    with pytest.raises(CheckpointError, match="config.json does not match the manifest"):
        train(first, tmp_path / "b", resume=True, progress=False)
    cfg_path.write_text(original)
    with pytest.raises(ConfigError, match="model.embed_size=8: cannot change when resuming"):
        train(first, tmp_path / "b", resume=True, resume_overrides={"model": {"embed_size": 8}}, progress=False)
    assert main(["train", "--out", str(tmp_path / "b"), "--resume", "--set", "model.embed_size=8"]) == 2
    # the command that started the run, re-run with --resume: its model keys equal the checkpoint's
    same = {"model": {"embed_size": 32, "word_dim": 16}, "train": {"epochs": 2}}
    resumed = train(first, tmp_path / "b", resume=True, resume_overrides=same, progress=False)
    assert resumed["best_rsum"] == pytest.approx(full["best_rsum"], abs=1e-6)
    lines = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    resumed_lines = [x for x in lines if "resumed_at_step" in x]  # the log says where the settings changed
    assert len(resumed_lines) == 1 and resumed_lines[0]["overrides"] == {"train.epochs": 2}
    with pytest.raises(OverwriteError, match="not empty"):
        train(cfg, tmp_path / "a", progress=False)


def test_init_from_starts_a_new_run_from_a_checkpoint(tiny_precomp, tmp_path):
    """train.init_from: a new run (epoch 0, new optimizer) starting from another run's weights and
    vocabulary. At a negligible lr it validates as the checkpoint it started from; from scratch it does not."""
    trained = train(quick_config("scan_t2i_avg", tiny_precomp, epochs=1), tmp_path / "a", progress=False)
    still = quick_config("scan_t2i_avg", tiny_precomp, epochs=1, lr=1e-12, init_from=str(tmp_path / "a" / "best"))
    continued = train(still, tmp_path / "b", progress=False)
    assert continued["best_rsum"] == pytest.approx(trained["best_rsum"], abs=1e-6)
    header = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[0])
    assert header["init_from"] == str(tmp_path / "a" / "best") and header["kept_init"] == 0
    scratch = train(quick_config("scan_t2i_avg", tiny_precomp, epochs=1, lr=1e-12), tmp_path / "c", progress=False)
    assert scratch["best_rsum"] < trained["best_rsum"] - 30
    with pytest.raises(CheckpointError, match="holds a 'scan' model, expected 'vsepp'"):
        train(quick_config("vsepp", tiny_precomp, init_from=str(tmp_path / "a" / "best")), tmp_path / "d",
              progress=False)


def test_resume_applies_preset_and_config_file_under_the_set_rules(tiny_precomp, tmp_path, capsys):
    """--preset / --config given with --resume were silently ignored: now a preset other than the run's, or a
    file changing a model key, is refused; a file's train.* keys apply (here: two more epochs)."""
    run = tmp_path / "run"
    train(quick_config("vsepp", tiny_precomp, epochs=1, max_batches=2), run, progress=False)
    resume = ["train", "--out", str(run), "--resume"]
    assert main([*resume, "--preset", "scan_t2i_avg"]) == 2
    assert "preset='scan_t2i_avg': cannot change when resuming (the checkpoint has preset='vsepp')" in \
        capsys.readouterr().err
    bigger = tmp_path / "bigger.yaml"
    bigger.write_text("model:\n  embed_size: 64\n")
    assert main([*resume, "--preset", "vsepp", "--config", str(bigger)]) == 2
    assert "model.embed_size=64: cannot change" in capsys.readouterr().err
    longer = tmp_path / "longer.yaml"  # the starting settings again, with a longer schedule
    longer.write_text("preset: vsepp\nmodel: {embed_size: 32, word_dim: 16}\ntrain: {epochs: 3}\n")
    assert main([*resume, "--config", str(longer), "--set", "train.epochs=2"]) == 0  # --set wins over the file
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["overrides"] for x in lines if "resumed_at_step" in x] == [{"train.epochs": 2}]
    assert max(x.get("epoch", 0) for x in lines) == 2


def test_selecting_or_training_on_the_test_split_is_said(tiny_precomp, caplog):
    """Allowed (a dataset of one's own may lack a dev split), never silent: its test figures are optimistic."""
    from itmatch.engine.train import prepare_data

    cfg = quick_config("vsepp", tiny_precomp)
    with caplog.at_level("WARNING", logger="itmatch.train"):
        prepare_data(cfg, None)
        assert "test split" not in caplog.text
        cfg.data.val_split = "test"
        prepare_data(cfg, None)
    assert "data.val_split is 'test': the model is selected on a test split" in caplog.text


def test_blocked_scoring_equals_one_block(tiny_precomp, tmp_path):
    cfg = quick_config("scan_i2t_avg", tiny_precomp)
    from itmatch.engine.train import prepare_data
    from itmatch.models.registry import build_model

    _, _, vocab = prepare_data(cfg, None)
    model = build_model(cfg.model).eval()
    split = read_precomp(tiny_precomp, "test")
    img = encode_images(model, split.images)
    txt = encode_captions(model, split.captions, vocab)
    whole = model.score(img, txt)
    blocked = score_matrix(model, img, txt, budget_bytes=50_000, captions_per_block=7)
    assert torch.allclose(whole, blocked, atol=1e-6)


def test_ensemble_and_checkpoint_errors(tiny_precomp, tmp_path):
    a = train(quick_config("scan_t2i_avg", tiny_precomp, epochs=1), tmp_path / "a", progress=False)
    assert a["best_rsum"] > 0
    train(quick_config("vsepp", tiny_precomp, epochs=1), tmp_path / "v", progress=False)
    # an ensemble via the CLI, with a results row
    csv_path = tmp_path / "results.csv"
    argv = [str(tmp_path / "a" / "best"), str(tmp_path / "v" / "best"), "--split", "test", "--quiet",
            "--results", str(csv_path), "--name", "ens"]
    assert main(["evaluate", *argv]) == 0
    assert "ens,scan_t2i_avg+vsepp" in csv_path.read_text()
    assert main(["evaluate", *argv]) == 2  # the row exists: refused without --force
    assert main(["evaluate", *argv, "--force"]) == 0
    # weights of another model under this config
    bad = tmp_path / "mixed"
    ck_a, ck_v = load_checkpoint(tmp_path / "a" / "best"), load_checkpoint(tmp_path / "v" / "best")
    save_checkpoint(bad, ck_v.model, ck_a.config, ck_a.vocab)
    with pytest.raises(CheckpointError, match="do not fit"):
        load_checkpoint(bad)
    with pytest.raises(CheckpointError, match="expected 'scan'"):
        load_checkpoint(tmp_path / "v" / "best", expect_arch="scan")
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(tmp_path)


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    assert main(["train", "--preset", "nope", "--data", str(tmp_path), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'nope'" in err and "Traceback" not in err
    assert main(["train", "--preset", "vsepp", "--data", str(tmp_path), "--out", str(tmp_path / "r")]) == 2
    assert "train_ims.npy" in capsys.readouterr().err


def test_training_with_same_image_pairs_masked(tiny_precomp, tmp_path):
    cfg = quick_config("summax_t2i", tiny_precomp)
    cfg.loss.mask_same_image = True
    assert train(cfg, tmp_path / "run", progress=False)["best_rsum"] > 150


def test_evaluation_reports_unknown_caption_words_and_keeps_the_metrics(tiny_precomp, tmp_path, capsys):
    """A vocabulary without 'triangle': the evaluation counts its occurrences in the evaluated captions and
    lists it, in the JSON and the printed table, and its metrics are those of the model's own scores (each
    unknown word still one <unk> step of the input)."""
    from itmatch.data.vocab import Vocab, build_vocab, tokenize
    from itmatch.engine.metrics import retrieval_metrics
    from itmatch.engine.train import prepare_data
    from itmatch.models.registry import build_model

    cfg = quick_config("vsepp", tiny_precomp)
    full = build_vocab(read_precomp(tiny_precomp, "train").captions)
    vocab = Vocab(w for w in full.idx2word[4:] if w != "triangle")
    prepare_data(cfg, vocab)
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    save_checkpoint(tmp_path / "ckpt", model, cfg, vocab)
    split = read_precomp(tiny_precomp, "test")
    triangles = sum(tokenize(c).count("triangle") for c in split.captions)
    assert main(["evaluate", str(tmp_path / "ckpt"), "--split", "test", "--quiet", "--json",
                 str(tmp_path / "m.json")]) == 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "m.json").read_text())
    report = result["unknown_words"]
    assert report["unknown"] == triangles > 0 and report["top_unknown"] == [["triangle", triangles]]
    assert report["words"] == sum(len(tokenize(c)) for c in split.captions)
    assert f"unknown words: {triangles:,} of {report['words']:,} caption words" in printed
    assert "most frequent: triangle" in printed
    scores = score_matrix(model, encode_images(model, split.images), encode_captions(model, split.captions, vocab))
    assert result["rsum"] == pytest.approx(retrieval_metrics(scores, split.per_image)["rsum"], abs=1e-9)


def _untrained_checkpoint(cfg, out: Path) -> Path:
    """A checkpoint of `cfg` written as `itmatch train` writes one (no training: the tests below are about
    its files, not its scores)."""
    from itmatch.engine.train import prepare_data
    from itmatch.models.registry import build_model

    _, _, vocab = prepare_data(cfg, None)
    save_checkpoint(out, build_model(cfg.model), cfg, vocab)
    return out


def test_data_path_resolves_from_the_checkpoint_wherever_it_is_evaluated(tiny_precomp, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    shutil.copytree(tiny_precomp, work / "data" / "precomp")
    monkeypatch.chdir(work)
    ckpt = _untrained_checkpoint(quick_config("vsepp", "data/precomp"), Path("runs/a/best"))  # --data data/precomp
    stored = json.loads((ckpt / "config.json").read_text())["data"]["path"]
    assert stored == "../../../data/precomp"  # from the checkpoint's directory, not from the working directory
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    argv = ["evaluate", str(work / "runs" / "a" / "best"), "--quiet"]
    assert main(argv) == 0, capsys.readouterr().err
    # the run directory moved together with its data: still found
    shutil.move(work, tmp_path / "moved")
    moved = tmp_path / "moved" / "runs" / "a" / "best"
    assert main(["evaluate", str(moved), "--quiet"]) == 0
    assert load_checkpoint(moved).config.data.path == "../moved/data/precomp"  # in memory: from the cwd again
    # the data gone: the error says where it looked
    shutil.move(tmp_path / "moved" / "data", tmp_path / "data-elsewhere")
    assert main(["evaluate", str(moved), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"looked in: {tmp_path / 'moved' / 'data' / 'precomp'}" in err and "--data DIR" in err
    assert main(["evaluate", str(moved), "--quiet", "--data", str(tmp_path / "data-elsewhere" / "precomp")]) == 0


def test_checkpoint_of_an_older_version_finds_its_working_directory_relative_data(tiny_precomp, tmp_path,
                                                                                  monkeypatch, caplog):
    """Before manifest version 2, data.path was stored as given, relative to the run's working directory:
    it is looked for from the current directory and from the checkpoint's parents, with one warning."""
    shutil.copytree(tiny_precomp, tmp_path / "work" / "data")
    ckpt = _untrained_checkpoint(quick_config("vsepp", tmp_path / "work" / "data"), tmp_path / "work" / "runs" / "a")
    config = json.loads((ckpt / "config.json").read_text())
    config["data"]["path"] = "data"
    (ckpt / "config.json").write_text(json.dumps(config))
    manifest = json.loads((ckpt / "manifest.json").read_text())  # as the previous version wrote it
    manifest = {"version": 1, "files": {k: v for k, v in manifest["files"].items() if k.endswith(".safetensors")}}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("WARNING", "itmatch.checkpoint"):
        loaded = load_checkpoint(ckpt)
    assert loaded.data_path() == "work/data"
    assert [r.getMessage() for r in caplog.records] == [
        f"{ckpt}: written by an older itmatch: config.json, state.json, vocab.json not covered by its manifest, "
        "so edits to them cannot be detected"]
    shutil.rmtree(tmp_path / "work" / "data")
    with pytest.raises(DataError, match="looked in") as err:
        load_checkpoint(ckpt).data_path()
    assert str(tmp_path / "data") in str(err.value) and str(tmp_path / "work" / "runs" / "data") in str(err.value)


def test_evaluate_refuses_an_edited_checkpoint_unless_trusted(tiny_precomp, tmp_path, capsys, caplog):
    ckpt = _untrained_checkpoint(quick_config("scan_t2i_avg", tiny_precomp), tmp_path / "ck")
    config = json.loads((ckpt / "config.json").read_text())
    config["model"]["scan"]["lambda_softmax"] = 5.0  # (not 4: SCAN's i-t value would add the lambda warning)
    (ckpt / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    assert main(["evaluate", str(ckpt), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "config.json does not match the manifest" in err and "--trust-modified" in err and "Traceback" not in err
    with caplog.at_level("WARNING", "itmatch.checkpoint"):
        assert main(["evaluate", str(ckpt), "--quiet", "--trust-modified"]) == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"{ckpt}: loading despite config.json modified: its SHA-256 differs from the manifest's (--trust-modified)"]


@pytest.mark.parametrize("mode", ["norm", "value"])
def test_gradient_clipping_bounds_the_total_norm_or_each_coordinate(mode):
    """train.grad_clip_mode: "norm" rescales all gradients together to a total l2 norm of at most the limit (SCAN),
    "value" clamps each coordinate (SMAN's reading of "clipping at 0.1"), against both written out by hand."""
    from itmatch.engine.train import clip_gradients

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(50)), torch.nn.Parameter(torch.zeros(7, 3))]
    grads = [torch.randn(50) * 2.0, torch.randn(7, 3) * 0.05]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    clip_gradients(params, 0.1, mode)
    if mode == "norm":
        total = math.sqrt(sum(float((g * g).sum()) for g in grads))
        expected = [g * (0.1 / (total + 1e-6)) for g in grads]  # (torch's clip_grad_norm_ adds 1e-6)
    else:
        expected = [torch.tensor([[min(max(float(x), -0.1), 0.1) for x in row] for row in g.reshape(-1, g.shape[-1])]
                                 ).reshape(g.shape) for g in grads]
    for p, e in zip(params, expected, strict=True):
        assert torch.allclose(p.grad, e, atol=1e-7)
