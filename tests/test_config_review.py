"""Config values reach the run as written, or are refused where they were written (FILE:LINE, the `--set` pair) with
a fix: the preset a later layer names keeps the earlier layers, text fields keep their text (YAML 1.1 would read
`0123` as 83), whole numbers are read in base 10, and the checks of a field's own (`option(check=...)`) run with
the other rules."""

from __future__ import annotations

import argparse

import pytest

from itmatch import config
from itmatch.argtypes import device_name
from itmatch.cli import main
from itmatch.config import Config, load_yaml, merge_overrides, parse_overrides, update
from itmatch.data import vocab
from itmatch.errors import ConfigError
from itmatch.models.registry import resolve_config


def error_of(call, *args) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        call(*args)
    return err.value


def written(tmp_path, text: str, name: str = "c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------------- the preset
def test_a_preset_named_by_a_later_layer_keeps_the_earlier_layers(tmp_path):
    """`--config FILE --set preset=vsepp` built the config from the preset, dropping every key of FILE."""
    schedule = written(tmp_path, "data:\n  path: d\nmodel:\n  embed_size: 512\ntrain:\n  epochs: 2\nname: mine\n")
    cfg = resolve_config(None, load_yaml(schedule), {"data": {"images": "photos"}}, parse_overrides(["preset=vsepp"]))
    assert (cfg.preset, cfg.model.arch, cfg.name) == ("vsepp", "vsepp", "mine")
    assert (cfg.model.embed_size, cfg.train.epochs, cfg.data.path, cfg.data.images) == (512, 2, "d", "photos")
    # the last layer naming a preset chooses it; a file naming one keeps its own keys and the --set ones after it
    named = written(tmp_path, "preset: vsepp\ntrain: {epochs: 3}\n", "named.yaml")
    cfg = resolve_config(None, load_yaml(named), parse_overrides(["preset=scan_t2i_avg", "train.lr=0.1"]))
    assert (cfg.preset, cfg.model.arch, cfg.train.epochs, cfg.train.lr) == ("scan_t2i_avg", "scan", 3, 0.1)


def test_a_layer_naming_another_preset_than_the_given_one_is_refused_where_it_names_it(tmp_path, capsys):
    """With `--preset P`, a file's `preset: Q` (or --set preset=Q) was dropped without a word."""
    named = written(tmp_path, "# schedule\npreset: scan_t2i_avg\ntrain: {epochs: 3}\n")
    err = error_of(resolve_config, "vsepp", load_yaml(named))
    assert (err.path, err.line) == (named, 2)
    assert err.message == "preset 'scan_t2i_avg' conflicts with the preset given, 'vsepp' (--preset)"
    assert err.hint == "name one preset: drop this one, or pass --preset scan_t2i_avg instead"
    assert error_of(resolve_config, "vsepp", parse_overrides(["preset=sman"])).path == "--set preset=sman"
    assert resolve_config("scan_t2i_avg", load_yaml(named)).train.epochs == 3  # the same preset: fine
    assert main(["train", "--preset", "vsepp", "--config", str(named), "--out", str(tmp_path / "run")]) == 2
    assert f"error: {named}:2: preset 'scan_t2i_avg' conflicts" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("pair", ["preset=3", "preset=true", "preset=[a]", "preset=null"])
def test_a_preset_that_is_no_presets_name_is_refused_with_its_pair(pair):
    """These were an AttributeError / TypeError traceback, or (null) silently no preset."""
    err = error_of(resolve_config, None, parse_overrides(["train.epochs=2", pair]))
    assert (err.path, err.message) == (f"--set {pair}", f"unknown model {pair.split('=')[1]!r}")
    assert "itmatch models" in err.hint


@pytest.mark.parametrize(("text", "message"), [("preset: [a]\n", "preset: expected a preset's name, got ['a']"),
                                               ("preset: 3\n", "unknown model '3'")])
def test_a_preset_that_is_no_presets_name_is_refused_at_its_line(tmp_path, text, message):
    path = written(tmp_path, "train: {epochs: 2}\n" + text)
    err = error_of(resolve_config, None, load_yaml(path))
    assert (err.path, err.line, err.message) == (path, 2, message)
    assert err.hint


# ------------------------------------------------------------------------------------- checks where written
@pytest.mark.parametrize(("pair", "message", "hint"), [
    ("train.val_rerank=-1", "train.val_rerank: -1 is out of range (must be >= 0)", None),
    ("model.arch=bogus", "model.arch: unknown arch 'bogus'", "choose one of "),
    ("train.device=gpu", "train.device: 'gpu' is not a device", "use auto, cpu, cuda or cuda:N"),
    ("train.device=cuda:abc", "train.device: 'cuda:abc' is not a device", "use auto, cpu, cuda or cuda:N"),
    ("data.tokenizer=bpe", "data.tokenizer: 'bpe' is not one of word, wordpiece", "set data.tokenizer to one of"),
    ("model.oan.kernels=1,x", "model.oan.kernels: '1,x' is not a comma list of kernel widths", "e.g. 1,2,3,5,7"),
    ("model.save.scales=c9", "model.save.scales: 'c9' is not a comma list of distinct scales among c3, c4, c5",
     "c3,c4,c5 (ms3)"),
])
def test_a_value_a_rule_refuses_is_named_with_its_pair(pair, message, hint):
    """Before, these were taken (val_rerank -1) or refused later, without the place they were written: when the
    model was built (arch, kernels), the data read (tokenizer; scales: a ValueError traceback) or the run started."""
    err = error_of(resolve_config, None, parse_overrides([pair]))
    assert (err.path, err.message) == (f"--set {pair}", message)
    assert hint is None or hint in err.hint


def test_a_value_a_check_refuses_in_a_file_is_named_at_its_line_without_a_set_hint(tmp_path):
    path = written(tmp_path, "model:\n  arch: oan\n  oan:\n    kernels: 1,x\n")
    err = error_of(resolve_config, None, load_yaml(path))
    assert (err.path, err.line) == (path, 4)
    assert "--set" not in err.hint


def test_a_device_is_checked_by_its_form_only():
    """No GPU is needed to write train.device=cuda:1 in a config (the run checks the machine when it starts); the
    --device flag says what it said before."""
    assert resolve_config(None, parse_overrides(["train.device=cuda:1"])).train.device == "cuda:1"
    with pytest.raises(argparse.ArgumentTypeError, match="^'gpu' is not a device: use auto, cpu, cuda or cuda:N$"):
        device_name("gpu")
    assert device_name(" CUDA:0 ") == "cuda:0"


def test_the_tokenizers_a_config_takes_are_the_ones_the_data_knows():
    assert config.TOKENIZERS == vocab.TOKENIZERS


def test_an_old_key_and_its_new_one_set_apart_are_refused_at_the_old_ones_line(tmp_path):
    path = written(tmp_path, "model:\n  scan: {lambda_softmax: 4}\n  lambda_softmax: 3\n")
    err = error_of(resolve_config, None, load_yaml(path))
    assert (err.path, err.line) == (path, 3)
    assert err.message.startswith("model.lambda_softmax (now model.scan.lambda_softmax) and model.scan.lambda_softmax")
    assert err.hint == "keep model.scan.lambda_softmax only: model.lambda_softmax is its old name"


# ------------------------------------------------------------------------------------------ values as written
@pytest.mark.parametrize(("pair", "key", "value"), [
    ("name=0123", "name", "0123"),  # YAML 1.1: octal 83
    ("name=1.10", "name", "1.10"),  # 1.1
    ("name=12:30", "name", "12:30"),  # sexagesimal 750
    ("name=run #2", "name", "run #2"),  # a comment: run
    ("data.path=/data/set #2/precomp", "data.path", "/data/set #2/precomp"),  # /data/set
    ("name=2024-01-01", "name", "2024-01-01"),  # a date: refused
    ("name=2024-13-45", "name", "2024-13-45"),  # a ValueError traceback
    ("name='run #2'", "name", "run #2"),  # YAML's quotes: the text inside them
    ("train.seed=0123", "train.seed", 123),  # octal 83
    ("train.seed=1_000", "train.seed", 1000),
    ("train.lr=1e-4", "train.lr", 1e-4),
    ("train.bucket_by_length=1", "train.bucket_by_length", True),  # refused: expected bool, got 1
    ("train.bucket_by_length=0", "train.bucket_by_length", False),
    ("train.resident=on", "train.resident", "on"),
])
def test_a_set_value_reaches_the_config_as_written(pair, key, value):
    cfg = resolve_config(None, parse_overrides([pair]))
    section, _, name = key.rpartition(".")
    assert getattr(getattr(cfg, section) if section else cfg, name) == value


def test_a_file_value_reaches_the_config_as_written(tmp_path):
    path = written(tmp_path, "name: 0123\ndata:\n  path: 1.10\n  vocab: 12:30\ntrain:\n  seed: 0123\n"
                             "  bucket_by_length: 1\n")
    cfg = resolve_config(None, load_yaml(path))
    assert (cfg.name, cfg.data.path, cfg.data.vocab, cfg.train.seed, cfg.train.bucket_by_length) == (
        "0123", "1.10", "12:30", 123, True)


@pytest.mark.parametrize(("pair", "text"), [("train.epochs=1:30", "1:30"), ("train.seed=0x10", "0x10"),
                                            ("model.embed_size=1.0", "1.0")])
def test_a_whole_number_is_read_in_base_10_or_refused_with_its_pair(pair, text):
    """YAML 1.1 read 1:30 as 90 and 0x10 as 16 without a word."""
    err = error_of(resolve_config, None, parse_overrides([pair]))
    key = pair.split("=")[0]
    assert (err.path, err.message) == (f"--set {pair}", f"{key}: expected int, got {text!r}")
    assert err.hint.startswith(f"{key} takes an int, e.g.")


def test_a_whole_number_in_a_file_is_refused_at_its_line(tmp_path):
    path = written(tmp_path, "train:\n  lr: 0.1\n  epochs: 1:30\n")
    err = error_of(resolve_config, None, load_yaml(path))
    assert (err.path, err.line, err.message) == (path, 3, "train.epochs: expected int, got '1:30'")


def test_merged_layers_keep_the_text_of_the_layer_a_value_came_from(tmp_path):
    """`train --resume` merges the file, --data and --set (merge_overrides): a later layer's value, even one
    without texts (a plain dict), replaces the earlier text."""
    path = written(tmp_path, "name: 0123\ntrain:\n  seed: 0123\n  epochs: 3\n")
    cfg = update(Config(), merge_overrides(load_yaml(path), parse_overrides(["train.epochs=010"])))
    assert (cfg.name, cfg.train.seed, cfg.train.epochs) == ("0123", 123, 10)
    assert update(Config(), merge_overrides(load_yaml(path), {"train": {"seed": 5}})).train.seed == 5


@pytest.mark.parametrize("text", ["train:\n  seed: 0x_\n", "name: 0b_\n"])
def test_a_number_yaml_cannot_read_is_a_config_error_naming_the_file(tmp_path, text):
    """YAML's resolver takes 0x_ for a number that int() then refuses: a ValueError traceback before."""
    path = written(tmp_path, text)
    err = error_of(load_yaml, path)
    assert err.path == path and err.message.startswith("invalid YAML")
    assert "not valid YAML" in error_of(parse_overrides, ["train.seed=0x_"]).message


# ------------------------------------------------------------------------------------------------- minor ones
def test_a_whole_number_bound_is_printed_exactly():
    err = error_of(resolve_config, None, parse_overrides(["train.seed=99999999999"]))
    assert err.message == "train.seed: 99999999999 is out of range (must be <= 4294967295)"
    assert "(must be > 0)" in error_of(resolve_config, None, parse_overrides(["train.lr=0"])).message


def test_an_empty_section_sets_nothing(tmp_path):
    """`train:` with every key commented out is null in YAML: it was an error without a fix."""
    path = written(tmp_path, "train:\n  # epochs: 3\nmodel:\n  embed_size: 8\n")
    cfg = resolve_config(None, load_yaml(path))
    assert (cfg.model.embed_size, cfg.train.epochs) == (8, Config().train.epochs)
