"""`itmatch analyze recall`: the recall curves `itmatch evaluate --json` records, drawn side by side; files that
cannot be compared (another test set, no curve, not an evaluation) are refused naming the file."""

from __future__ import annotations

import json

import pytest

from itmatch.cli import main


@pytest.fixture(scope="module")
def evaluations(tiny_precomp, tmp_path_factory):
    """Test-split evaluations of two tiny meanpool models (1 and 3 epochs), and a dev-split one."""
    from itmatch.engine.train import train
    from itmatch.models.registry import resolve_config

    root = tmp_path_factory.mktemp("recall")
    files = {}
    for name, epochs in (("short", 1), ("longer", 3)):
        cfg = resolve_config("meanpool", {
            "data": {"path": str(tiny_precomp)}, "model": {"embed_size": 32, "word_dim": 16},
            "train": {"epochs": epochs, "batch_size": 32, "lr": 0.002, "val_images": 40}})
        train(cfg, root / name, progress=False)
        files[name] = root / f"{name}.test.json"
        assert main(["evaluate", str(root / name / "best"), "--split", "test", "--protocol", "full", "--quiet",
                     "--json", str(files[name])]) == 0
    files["dev"] = root / "longer.dev.json"
    assert main(["evaluate", str(root / "longer" / "best"), "--split", "dev", "--protocol", "full", "--quiet",
                 "--json", str(files["dev"])]) == 0
    return files


def test_the_evaluation_json_records_both_directions_curves(evaluations):
    result = json.loads(evaluations["longer"].read_text())
    for d in ("image_to_text", "text_to_image"):
        curve = result["recall_curve"][d]
        assert len(curve) == 100 and curve == sorted(curve) and curve[-1] == 100.0  # (40 images: all found by K=40)
        assert [curve[k - 1] for k in (1, 5, 10)] == pytest.approx([result[d][f"r{k}"] for k in (1, 5, 10)])


def test_curves_of_two_models_are_drawn_and_tabled(evaluations, tmp_path, capsys):
    out = tmp_path / "recall.png"
    args = ["analyze", "recall", str(evaluations["short"]), str(evaluations["longer"]), "--out", str(out)]
    assert main(args) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    longer = json.loads(evaluations["longer"].read_text())
    assert f"| longer | text → image | {longer['text_to_image']['r1']:.1f} |" in printed  # (labels: file names)
    before = out.read_bytes()
    assert main(args) == 2  # an existing figure is kept without --force
    assert "--force" in capsys.readouterr().err and out.read_bytes() == before
    assert main([*args, "--force", "--labels", "1 epoch", "3 epochs"]) == 0
    assert "| 3 epochs | image → text |" in capsys.readouterr().out


def test_evaluations_that_cannot_be_compared_are_refused_naming_the_file(evaluations, tmp_path, capsys):
    out = tmp_path / "recall.png"
    assert main(["analyze", "recall", str(evaluations["longer"]), str(evaluations["dev"]), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(evaluations["dev"]) in err and "split 'dev' (in" in err and "'test')" in err
    older = tmp_path / "older.json"  # an evaluation from before the curves were recorded
    result = json.loads(evaluations["short"].read_text())
    del result["recall_curve"]
    older.write_text(json.dumps(result))
    assert main(["analyze", "recall", str(older), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "older.json" in err and "no recall curve" in err and "itmatch evaluate" in err
    broken = tmp_path / "broken.json"
    broken.write_text('{"image_to_text": \n')
    assert main(["analyze", "recall", str(broken), "--out", str(out)]) == 2
    assert "broken.json:2" in capsys.readouterr().err
    assert main(["analyze", "recall", str(evaluations["short"]), "--labels", "a", "b", "--out", str(out)]) == 2
    assert "2 labels for 1 evaluations" in capsys.readouterr().err
    assert not out.exists()


def test_a_two_stage_evaluation_says_where_its_curve_is_the_first_stages():
    from itmatch.analysis.recall import _legend

    assert _legend("mmca_rerank20", {"rsum": 250.04, "rerank": 20}) == "mmca_rerank20 (rsum 250.0, top 20 re-ranked)"
    assert _legend("vsepp", {"rsum": 245.9}) == "vsepp (rsum 245.9)"


def test_labels_before_the_files_are_one_per_file(evaluations, tmp_path, capsys):
    """`--labels a b A.json B.json` took the files as labels, then failed with argparse's "the following
    arguments are required: evaluations": one label per file makes the first half labels, the rest files."""
    files = [str(evaluations["short"]), str(evaluations["longer"])]
    out = tmp_path / "recall.png"
    for argv in (["--labels", "1 epoch", "3 epochs", *files, "--out", str(out)],
                 ["--out", str(out), "--labels", "1 epoch", "3 epochs", "--", *files]):
        assert main(["analyze", "recall", "--force", *argv]) == 0
        printed = capsys.readouterr().out
        assert "| 1 epoch | image → text |" in printed and "| 3 epochs | text → image |" in printed
    # words that cannot be one label per file, or labels without files, say where the files go
    for argv, said in ((["--labels", "a", *files], "--labels took every word after it as a label"),
                       (["--labels", "a", "b"], "read as labels, then as many files (a | b), but b does not")):
        assert main(["analyze", "recall", *argv, "--out", str(tmp_path / "other.png")]) == 2
        err = capsys.readouterr().err
        assert "no evaluation files given" in err and said in err and "--labels a b -- A.json B.json" in err
    assert main(["analyze", "recall", "--out", str(tmp_path / "other.png")]) == 2
    assert "no evaluation files given" in capsys.readouterr().err
    assert not (tmp_path / "other.png").exists()


def test_the_out_suffix_names_the_figures_format(evaluations, tmp_path, capsys):
    """r.svg held PNG bytes: the figure is written in the format its name says, or refused before any work."""
    from itmatch.analysis.recall import plot_recall_curves, read_evaluations
    from itmatch.errors import ConfigError

    files = [str(evaluations["short"]), str(evaluations["longer"])]
    for name, start in (("r.svg", b"<?xml"), ("r.PDF", b"%PDF"), ("r.jpg", b"\xff\xd8\xff"), ("r.png", b"\x89PNG")):
        assert main(["analyze", "recall", *files, "--out", str(tmp_path / name)]) == 0
        assert (tmp_path / name).read_bytes().startswith(start), name
    capsys.readouterr()
    for name in ("r.xyz", "r"):
        with pytest.raises(SystemExit) as stop:
            main(["analyze", "recall", *files, "--out", str(tmp_path / name)])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and "argument --out" in err and "names no picture format" in err and ".svg" in err
        assert not (tmp_path / name).exists()
    with pytest.raises(ConfigError, match="ends in '.bmp'"):
        plot_recall_curves(read_evaluations(files), tmp_path / "r.bmp")
    assert not (tmp_path / "r.bmp").exists()
