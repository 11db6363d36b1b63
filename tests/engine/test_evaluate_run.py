"""`itmatch evaluate` is a thin verb over `itmatch.engine.evaluate.evaluate_run`: the CLI and the Python call
give the same metrics JSON and the same results row (timings aside), and the library checks its settings
before any work."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from itmatch.cli import main
from itmatch.data.precomp import read_precomp
from itmatch.engine.checkpoint import save_checkpoint
from itmatch.engine.evaluate import evaluate_run
from itmatch.errors import ConfigError, DataError
from itmatch.models.registry import resolve_config

TIMINGS = ("eval_seconds",)  # wall-clock seconds differ between any two runs


def _checkpoint(preset: str, data: Path, out: Path, seed: int) -> Path:
    """An untrained tiny checkpoint, written as `itmatch train` writes one (the scores need not be good)."""
    from itmatch.engine.train import prepare_data
    from itmatch.models.registry import build_model

    cfg = resolve_config(preset, {"model": {"embed_size": 32, "word_dim": 16}, "data": {"path": str(data)}})
    cfg.name = f"{preset}-run"
    _, _, vocab = prepare_data(cfg, None)
    torch.manual_seed(seed)
    save_checkpoint(out, build_model(cfg.model), cfg, vocab)
    return out


@pytest.fixture(scope="module")
def checkpoints(tiny_precomp, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return [_checkpoint("scan_t2i_avg", tiny_precomp, root / "scan", 0),
            _checkpoint("vsepp", tiny_precomp, root / "vsepp", 1)]


def _without_timings(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k not in TIMINGS}


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return [{k: v for k, v in r.items() if k not in TIMINGS} for r in csv.DictReader(fh)]


@pytest.mark.parametrize("which", [[0], [0, 1]], ids=["one model", "ensemble"])
def test_cli_and_python_call_give_identical_json_and_row(checkpoints, tmp_path, capsys, which):
    chosen = [checkpoints[i] for i in which]
    command = "itmatch evaluate (recorded)"
    argv = ["evaluate", *map(str, chosen), "--split", "test", "--quiet", "--json", str(tmp_path / "cli.json"),
            "--results", str(tmp_path / "cli.csv"), "--name", "row", "--command", command, "--device", "cpu"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    run = evaluate_run(chosen, split="test", json_path=tmp_path / "api.json", results=tmp_path / "api.csv",
                       name="row", command=command, progress=False, device="cpu")
    from_cli = json.loads((tmp_path / "cli.json").read_text())
    from_api = json.loads((tmp_path / "api.json").read_text())
    assert _without_timings(from_cli) == _without_timings(from_api) == _without_timings(run.metrics)
    assert from_cli["checkpoints"] == [str(p) for p in chosen] and from_cli["n_images"] == 40
    assert from_cli["precision"] == "fp32"  # (what its scores' ties depend on: docs/gpu.md)
    assert _rows(tmp_path / "cli.csv") == _rows(tmp_path / "api.csv") == [
        {k: v for k, v in run.row.items() if k not in TIMINGS}]
    assert run.row["model"] == "+".join(("scan_t2i_avg", "vsepp")[i] for i in which)
    assert "rsum" in printed and "row 'row' written to" in printed
    assert f"itmatch analyze recall {tmp_path / 'cli.json'} --out recall.png" in printed  # (how to draw its curves)
    assert len(from_cli["recall_curve"]["text_to_image"]) == 100


def test_the_default_row_name_joins_the_run_names(checkpoints, tiny_precomp, tmp_path):
    run = evaluate_run(checkpoints, split="test", results=tmp_path / "r.csv", command="c", progress=False,
                       device="cpu")
    assert run.row["name"] == "scan_t2i_avg-run+vsepp-run" and run.row["dataset"] == tiny_precomp.name


def test_settings_are_checked_before_any_work(checkpoints, tmp_path):
    missing = tmp_path / "no-such-checkpoint"  # never read: each error comes first
    with pytest.raises(ConfigError, match="command that reproduces"):
        evaluate_run([missing], results=tmp_path / "r.csv")
    with pytest.raises(ConfigError, match="only with --rerank"):
        evaluate_run([missing], first_stage=checkpoints[1])
    with pytest.raises(ConfigError, match="precision"):
        evaluate_run([missing], device="cpu", precision="fp16")
    assert not (tmp_path / "r.csv").exists()


def test_threads_are_restored_after_the_run(checkpoints):
    before = torch.get_num_threads()
    evaluate_run(checkpoints[:1], split="test", threads=1, progress=False, device="cpu")
    assert torch.get_num_threads() == before


def test_each_member_of_an_ensemble_reads_its_own_features(checkpoints, tiny_precomp, tmp_path):
    """Members trained on different features of the same items (another backbone: 9 cells of 24-d instead of
    6 of 32-d) each read their own data directory; the ensemble ranks their averaged score matrices."""
    from itmatch.data.precomp import write_features
    from itmatch.engine.checkpoint import load_checkpoint
    from itmatch.engine.evaluate import split_scores
    from itmatch.engine.metrics import retrieval_metrics

    other = tmp_path / "other_backbone"
    shutil.copytree(tiny_precomp, other, ignore=shutil.ignore_patterns("*.npy"))
    rng = np.random.default_rng(3)
    for split in ("train", "dev", "test"):
        n = read_precomp(tiny_precomp, split).n_images
        write_features(other, split, rng.standard_normal((n, 9, 24)).astype(np.float32))
    wide = _checkpoint("vsepp", other, tmp_path / "wide", 2)
    run = evaluate_run([checkpoints[1], wide], split="test", progress=False, device="cpu")
    assert [Path(d).name for d in run.metrics["data"]] == [tiny_precomp.name, other.name]
    total = None
    for ckpt, data in ((checkpoints[1], tiny_precomp), (wide, other)):
        c = load_checkpoint(ckpt)
        scores = split_scores(c.model.eval(), c.vocab, read_precomp(data, "test"))
        total = scores if total is None else total + scores
    expected = retrieval_metrics(total / 2)
    assert {d: run.metrics[d] for d in expected} == expected
    # --data: once for all (here the 32-d features do not fit the 24-d model), or once each
    with pytest.raises(DataError, match="features here are 32-d but the checkpoint's model reads 24-d"):
        evaluate_run([checkpoints[1], wide], split="test", data=tiny_precomp, progress=False, device="cpu")
    again = evaluate_run([checkpoints[1], wide], split="test", data=[tiny_precomp, other], progress=False,
                         device="cpu")
    assert again.metrics["rsum"] == run.metrics["rsum"]
    with pytest.raises(ConfigError, match="3 data directories for 2 checkpoints"):
        evaluate_run([checkpoints[1], wide], data=[tiny_precomp, other, other], progress=False, device="cpu")
    # splits of other items are refused, naming the first difference: the averaged scores would pair the wrong images
    captions = (other / "test_caps.txt").read_text().splitlines()
    captions[2] = "a caption of another photo"
    (other / "test_caps.txt").write_text("\n".join(captions) + "\n")
    with pytest.raises(DataError, match="caption 3 is .* in one and 'a caption of another photo' in the other"):
        evaluate_run([checkpoints[1], wide], split="test", progress=False, device="cpu")
    assert main(["evaluate", str(checkpoints[1]), str(wide), "--split", "test", "--quiet"]) == 2


def test_features_of_another_backbone_are_refused_although_their_width_fits(tiny_precomp, tmp_path):
    """Lite0's and Lite2's cells are both 1280-d: the width check alone let a Lite0 model score Lite2 features
    (a full table, exit 0). meta.json records the backbone, the checkpoint its data.backbone."""
    def extracted_with(backbone: str) -> Path:
        root = tmp_path / backbone
        shutil.copytree(tiny_precomp, root)
        meta = {"splits": {s: {"images": read_precomp(root, s).n_images} for s in ("train", "dev", "test")}}
        (root / "meta.json").write_text(json.dumps({**meta, "format": "itmatch-precomp", "backbone": backbone}))
        return root

    lite0, lite2 = extracted_with("lite0"), extracted_with("lite2")
    checkpoint = _checkpoint("vsepp", lite0, tmp_path / "ckpt", 0)
    assert json.loads((checkpoint / "config.json").read_text())["data"]["backbone"] == "lite0"
    assert evaluate_run([checkpoint], split="test", progress=False, device="cpu").metrics["rsum"] >= 0
    with pytest.raises(DataError, match="extracted with lite2, but the checkpoint's model was trained on lite0") as e:
        evaluate_run([checkpoint], split="test", data=lite2, progress=False, device="cpu")
    assert "--backbone lite0" in e.value.hint


def test_the_metrics_say_which_data_they_are_of(tiny_search_setup, tiny_precomp, tmp_path):
    """An evaluation's JSON names its data directory and the digests `itmatch extract` recorded of the split's
    features and captions, so two evaluations can be told to be of the same split wherever it was copied; data
    made by hand (no meta.json) has no digests to give."""
    from itmatch.data.precomp import split_manifest

    precomp = tiny_search_setup["root"] / "precomp"
    run = evaluate_run([tiny_search_setup["checkpoint"]], split="dev", progress=False, device="cpu")
    manifest = split_manifest(precomp, "dev")
    assert Path(run.metrics["data"]).resolve() == precomp.resolve()
    assert run.metrics["data_sha256"] == {"features": manifest["features_sha256"],
                                          "captions": manifest["captions_sha256"]}
    copy = tmp_path / "copy"
    shutil.copytree(precomp, copy)  # (moved elsewhere: the same digests)
    moved = evaluate_run([tiny_search_setup["checkpoint"]], data=copy, split="dev", progress=False, device="cpu")
    assert moved.metrics["data_sha256"] == run.metrics["data_sha256"]
    hand_made = _checkpoint("vsepp", tiny_precomp, tmp_path / "hand", 0)
    assert evaluate_run([hand_made], split="test", progress=False, device="cpu").metrics["data_sha256"] is None
