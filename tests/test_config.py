"""Config errors say where the offending key was written: FILE:LINE for a YAML file, the `--set` pair for an
override, through every way layers reach `update` (a new run's resolve_config, --resume's merge_overrides)."""

from __future__ import annotations

import pytest

from itmatch.cli import main
from itmatch.config import Config, load_yaml, merge_overrides, parse_overrides, update
from itmatch.errors import ConfigError
from itmatch.models.registry import resolve_config


def error_of(call, *args) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        call(*args)
    return err.value


def test_a_config_file_error_names_the_file_and_line_of_its_key(tmp_path):
    typo = tmp_path / "typo.yaml"
    typo.write_text("# my schedule\n\nmodel:\n  embed_size: 512\n  embed_sise: 512\n")
    err = error_of(resolve_config, "vsepp", load_yaml(typo))
    assert str(err).startswith(f"{typo}:5: unknown config key 'model.embed_sise'")
    assert err.hint == "did you mean model.embed_size?"  # (not the list of the section's 22 keys)
    far = tmp_path / "far.yaml"  # nothing close: the keys of the section
    far.write_text("train: {zzz: 1}\n")
    assert "valid keys here: train.backbone_lr_scale" in error_of(resolve_config, "vsepp", load_yaml(far)).hint
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("train:\n  lr: 0.1\n  epochs: two\n")
    err = error_of(resolve_config, "vsepp", load_yaml(wrong))
    assert (err.path, err.line, err.message) == (wrong, 3, "train.epochs: expected int, got 'two'")
    assert err.hint == "train.epochs takes an int, e.g. 30"
    out_of_range = tmp_path / "range.yaml"
    out_of_range.write_text("loss:\n  margin: -1\n")
    assert str(error_of(resolve_config, "vsepp", load_yaml(out_of_range))).startswith(f"{out_of_range}:2: loss.margin")
    preset = tmp_path / "preset.yaml"
    preset.write_text("name: mine\npreset: vsep\n")
    assert str(error_of(resolve_config, None, load_yaml(preset))).startswith(f"{preset}:2: unknown model 'vsep'")


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    """YAML keeps the last value of a duplicated key without a word: the first one was silently not used."""
    dup = tmp_path / "dup.yaml"
    dup.write_text("train:\n  epochs: 2\n  lr: 0.1\n  epochs: 3\n")
    err = error_of(load_yaml, dup)
    assert (err.path, err.line) == (dup, 4)
    assert "train.epochs is given twice, on lines 2 and 4" in err.message
    top = tmp_path / "top.yaml"
    top.write_text("train: {epochs: 2}\nmodel: {embed_size: 8}\ntrain: {lr: 0.1}\n")
    assert "train is given twice, on lines 1 and 3" in str(error_of(load_yaml, top))
    # the same name in two mappings is no duplicate; a merge key may be overridden by its mapping's own key
    fine = tmp_path / "fine.yaml"
    fine.write_text("base: &base\n  epochs: 2\n  lr: 0.1\ntrain:\n  <<: *base\n  epochs: 3\nname: train\n")
    assert load_yaml(fine)["train"] == {"epochs": 3, "lr": 0.1}


def test_a_key_brought_by_a_yaml_merge_is_located_at_its_parent(tmp_path):
    merged = tmp_path / "merged.yaml"
    merged.write_text("x: &base\n  epochz: 2\ntrain:\n  <<: *base\n")
    layer = load_yaml(merged)
    del layer["x"]
    err = error_of(resolve_config, "vsepp", layer)
    assert (err.line, err.hint) == (3, "did you mean train.epochs?")


def test_set_errors_name_their_pair_and_layers_merged_for_resume_keep_their_origins(tmp_path):
    err = error_of(resolve_config, "vsepp", parse_overrides(["train.lr=0.1", "model.embed_sise=3"]))
    assert str(err).startswith("--set model.embed_sise=3: unknown config key 'model.embed_sise'")
    assert err.hint == "did you mean model.embed_size?"
    assert error_of(resolve_config, "vsepp", parse_overrides(["train.epochs=1", "train.epochs=x"])).path == \
        "--set train.epochs=x"
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text("train:\n  epochs: 3\n  lr: fast\n")
    # a later --set of the key wins, and is what an error about it names
    merged = merge_overrides(load_yaml(schedule), {"data": {"path": "d"}}, parse_overrides(["train.lr=slow"]))
    assert error_of(update, Config(), merged).path == "--set train.lr=slow"
    merged = merge_overrides(load_yaml(schedule), parse_overrides(["train.epochs=4"]))
    err = error_of(update, Config(), merged)
    assert (err.path, err.line) == (schedule, 3)
    # a plain dict layer (Python callers) names no place, as before
    assert error_of(update, Config(), {"train": {"lr": "fast"}}).path is None


def test_the_cli_names_the_config_file_and_line(tmp_path, capsys):
    typo = tmp_path / "typo.yaml"
    typo.write_text("model:\n  embed_sise: 512\n")
    assert main(["train", "--preset", "vsepp", "--config", str(typo), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"error: {typo}:2: unknown config key 'model.embed_sise'\n  fix: did you mean model.embed_size?" in err
    assert not (tmp_path / "run").exists()
