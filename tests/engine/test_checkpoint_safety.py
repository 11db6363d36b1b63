"""Safe loading: nothing read executes code; SCAN/VSE++ .pth.tar import; damaged checkpoints are refused."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from itmatch.cli import main
from itmatch.data.vocab import SPECIALS, Vocab
from itmatch.engine.checkpoint import OPTIMIZER, load_checkpoint, safe_torch_load, save_checkpoint
from itmatch.engine.convert import ConversionWarning, convert_original
from itmatch.errors import CheckpointError

WORDS = ["a", "dog", "runs", "on", "grass", "red", "ball"]


class Exploit:
    """Pickles to a call that creates a marker file: what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


def scan_opt(**changes) -> argparse.Namespace:
    """The Namespace SCAN's train.py saves (its argparse defaults, with --bi_gru --max_violation)."""
    opt = argparse.Namespace(
        data_path="./data/", data_name="f30k_precomp", vocab_path="./vocab/", margin=0.2, num_epochs=30,
        batch_size=128, word_dim=12, embed_size=16, grad_clip=2.0, num_layers=1, learning_rate=0.0002,
        lr_update=15, workers=10, log_step=10, val_step=500, logger_name="./runs/runX/log",
        model_name="./runs/runX/checkpoint", resume="", max_violation=True, img_dim=20, no_imgnorm=False,
        no_txtnorm=False, raw_feature_norm="clipped_l2norm", agg_func="LogSumExp", cross_attn="t2i",
        precomp_enc_type="basic", bi_gru=True, lambda_lse=6.0, lambda_softmax=9.0, vocab_size=len(SPECIALS) + 7)
    for k, v in changes.items():
        setattr(opt, k, v)
    return opt


def save_original(path: Path, opt: argparse.Namespace, extra: object = None, weight_norm: bool = False):
    """torch.save of the dict SCAN's save_checkpoint writes, with modules named as in its model.py."""
    torch.manual_seed(0)
    fc = nn.Linear(opt.img_dim, opt.embed_size)
    img_sd = fc.state_dict()
    if weight_norm:
        v = fc.weight.detach().clone() * 3
        img_sd = {"fc.weight_g": torch.linalg.vector_norm(fc.weight.detach()).reshape(()),
                  "fc.weight_v": v, "fc.bias": fc.bias.detach()}
    else:
        img_sd = {f"fc.{k}": v for k, v in img_sd.items()}
    embed = nn.Embedding(opt.vocab_size, opt.word_dim)
    rnn = nn.GRU(opt.word_dim, opt.embed_size, opt.num_layers, batch_first=True, bidirectional=opt.bi_gru)
    txt_sd = {"embed.weight": embed.weight.detach(), **{f"rnn.{k}": v for k, v in rnn.state_dict().items()}}
    payload = {"epoch": 4, "model": [img_sd, txt_sd], "best_rsum": 412.5, "opt": opt, "Eiters": 5000}
    if extra is not None:
        payload["extra"] = extra
    torch.save(payload, path)
    return fc, embed, rnn


def scan_vocab(path: Path) -> Path:
    words = [*SPECIALS, *WORDS]
    path.write_text(json.dumps({"word2idx": {w: i for i, w in enumerate(words)},
                                "idx2word": {str(i): w for i, w in enumerate(words)}, "idx": len(words)}))
    return path


def test_convert_scan_checkpoint_reproduces_its_encoders(tmp_path):
    src = tmp_path / "model_best.pth.tar"
    fc, embed, rnn = save_original(src, scan_opt())
    with pytest.warns(ConversionWarning, match="opt.new_flag"):
        opt = scan_opt(new_flag=3)
        save_original(src, opt)
        summary = convert_original(src, tmp_path / "ck", vocab_path=scan_vocab(tmp_path / "v.json"))
    assert summary["epoch"] == 5 and summary["best_rsum"] == 412.5
    ck = load_checkpoint(tmp_path / "ck")
    mc = ck.config.model
    assert (mc.arch, mc.direction, mc.pool, mc.embed_size, mc.bidirectional) == ("scan", "t2i", "lse", 16, True)
    assert ck.config.loss.hardest and ck.config.train.lr == 2e-4 and len(ck.vocab) == 11
    # their forward (SCAN model.py) on the same inputs
    feats = torch.randn(2, 5, 20)
    ours = ck.model.encode_images(feats).regions
    ref = fc(feats)
    ref = ref / (ref.norm(dim=-1, keepdim=True) + 1e-8)
    assert torch.allclose(ours, ref, atol=1e-6)
    tokens = torch.tensor([ck.vocab.encode("a dog runs on grass")])
    words = ck.model.encode_texts(tokens, torch.tensor([tokens.shape[1]])).words
    out, _ = rnn(embed(tokens))
    out = (out[..., :16] + out[..., 16:]) / 2
    out = out / (out.norm(dim=-1, keepdim=True) + 1e-8)
    assert torch.allclose(words, out, atol=1e-6)


def test_converted_checkpoint_verifies_every_file(tmp_path, caplog):
    save_original(tmp_path / "m.pth.tar", scan_opt())
    convert_original(tmp_path / "m.pth.tar", tmp_path / "ck", vocab_path=scan_vocab(tmp_path / "v.json"))
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert manifest["version"] == 2 and set(manifest["files"]) == {"model.safetensors", "config.json",
                                                                   "vocab.json", "state.json"}
    with caplog.at_level(logging.WARNING, "itmatch.checkpoint"):
        load_checkpoint(tmp_path / "ck")
    assert not caplog.records  # verified in full: nothing to warn about


def test_convert_weight_norm_and_vsepp(tmp_path):
    src = tmp_path / "wn.pth.tar"
    fc, _, _ = save_original(src, scan_opt(precomp_enc_type="weight_norm"), weight_norm=True)
    convert_original(src, tmp_path / "wn", vocab_path=scan_vocab(tmp_path / "v.json"))
    got = load_checkpoint(tmp_path / "wn").model.image_encoder.fc.weight
    assert torch.allclose(got, fc.weight, atol=1e-6)
    vsepp = argparse.Namespace(data_name="f30k_precomp", vocab_path=str(tmp_path), margin=0.2, num_epochs=30,
                               batch_size=128, word_dim=12, embed_size=16, grad_clip=2.0, crop_size=224,
                               num_layers=1, learning_rate=2e-4, lr_update=15, max_violation=True, img_dim=20,
                               finetune=False, cnn_type="vgg19", use_restval=False, measure="cosine",
                               use_abs=False, no_imgnorm=False, reset_train=False, bi_gru=False, vocab_size=11)
    save_original(tmp_path / "v.pth.tar", vsepp)
    scan_vocab(tmp_path / "f30k_precomp_vocab.json")  # found through opt.vocab_path, as their scripts do
    with pytest.warns(ConversionWarning, match="epsilon"):
        convert_original(tmp_path / "v.pth.tar", tmp_path / "vk")
    assert load_checkpoint(tmp_path / "vk").config.model.arch == "vsepp"


def test_convert_errors(tmp_path, capsys):
    src = tmp_path / "m.pth.tar"
    save_original(src, scan_opt())
    with pytest.raises(CheckpointError, match="no vocabulary"):
        convert_original(src, tmp_path / "a")
    wrong = tmp_path / "small.json"
    wrong.write_text(json.dumps({"idx2word": {str(i): w for i, w in enumerate(SPECIALS)}}))
    with pytest.raises(CheckpointError, match="4 words but the word embedding has 11"):
        convert_original(src, tmp_path / "a", vocab_path=wrong)
    save_original(src, scan_opt(agg_func="Median"))
    with pytest.raises(CheckpointError, match="opt.agg_func='Median'"):
        convert_original(src, tmp_path / "a", vocab_path=scan_vocab(tmp_path / "v.json"))
    with pytest.raises(CheckpointError, match="a single file"):
        load_checkpoint(src)
    # the CLI verb: message, no traceback; --force to replace
    save_original(src, scan_opt())
    argv = ["convert", str(src), "--out", str(tmp_path / "cli"), "--vocab", str(tmp_path / "v.json")]
    assert main(argv) == 0 and "converted scan" in capsys.readouterr().out
    assert main(argv) == 2 and "already exists" in capsys.readouterr().err
    assert main([*argv, "--force"]) == 0


def test_malicious_pickle_is_refused_without_running(tmp_path, capsys):
    marker = tmp_path / "marker"
    src = tmp_path / "evil.pth.tar"
    save_original(src, scan_opt(), extra=Exploit(marker))
    assert not marker.exists()
    assert main(["convert", str(src), "--out", str(tmp_path / "x"), "--vocab",
                 str(scan_vocab(tmp_path / "v.json"))]) == 2
    err = capsys.readouterr().err
    assert "refused" in err and "'exec'" in err and "Traceback" not in err
    assert not marker.exists() and not (tmp_path / "x").exists()
    # the same object as a checkpoint's optimizer state: resume must refuse it
    torch.save({"state": {}, "param_groups": [], "x": Exploit(marker)}, tmp_path / OPTIMIZER)
    with pytest.raises(CheckpointError, match="refused"):
        safe_torch_load(tmp_path / OPTIMIZER)
    # a file that is no pickle at all (a CSV given to `convert`) is said to be no checkpoint, not "pickled objects"
    (tmp_path / "mine.csv").write_text("image,caption\na.jpg,a dog\n")
    assert main(["convert", str(tmp_path / "mine.csv"), "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert "not a torch checkpoint file" in err and "pickled" not in err
    # a blocked module or function is a pickled object, said as such (not "not a torch checkpoint file")
    import os

    torch.save({"f": os.system}, tmp_path / "system.pt")
    with pytest.raises(CheckpointError, match="carries pickled Python objects"):
        safe_torch_load(tmp_path / "system.pt")
    # a pickled Namespace is allowed only by the converter
    torch.save({"opt": argparse.Namespace(a=1)}, tmp_path / "ns.pt")
    with pytest.raises(CheckpointError, match="argparse.Namespace"):
        safe_torch_load(tmp_path / "ns.pt")
    assert not marker.exists()


def _checkpoint(tmp_path: Path) -> Path:
    from itmatch.config import Config
    from itmatch.models.registry import build_model

    cfg = Config()
    cfg.model.vocab_size, cfg.model.img_dim, cfg.model.embed_size, cfg.model.word_dim = 11, 8, 8, 4
    vocab = Vocab(WORDS)
    save_checkpoint(tmp_path / "ck", build_model(cfg.model), cfg, vocab, state={"epoch": 1})
    return tmp_path / "ck"


def test_damaged_checkpoint_is_refused_and_interrupted_replace_recovers(tmp_path):
    ck = _checkpoint(tmp_path)
    assert (ck / "manifest.json").is_file()
    weights = ck / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-8] + bytes(8))  # same size, different content
    with pytest.raises(CheckpointError, match="does not match the manifest"):
        load_checkpoint(ck)
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(ck)
    weights.write_bytes(data)
    load_checkpoint(ck)
    # killed between "old moved aside" and "new renamed in": the old one comes back
    ck.rename(tmp_path / ".ck.old")
    (tmp_path / ".ck.123.partial").mkdir()
    assert load_checkpoint(ck).state["epoch"] == 1
    assert not (tmp_path / ".ck.123.partial").exists()
    shutil.rmtree(ck)


def _swap_two_words(vocab_file: Path) -> None:
    data = json.loads(vocab_file.read_text())
    i2w = data["idx2word"]
    i2w["4"], i2w["5"] = i2w["5"], i2w["4"]
    data["word2idx"] = {w: int(i) for i, w in i2w.items()}
    vocab_file.write_text(json.dumps(data))


def test_edited_config_or_vocabulary_is_refused_naming_the_file(tmp_path, caplog):
    """The issue's cases: lambda_softmax edited in config.json, two words swapped in vocab.json (each
    loaded silently before, as another model); --trust-modified loads them with a one-line warning."""
    ck = _checkpoint(tmp_path)
    config_file, vocab_file = ck / "config.json", ck / "vocab.json"
    original_config, original_vocab = config_file.read_text(), vocab_file.read_text()
    config = json.loads(original_config)
    config["model"]["scan"]["lambda_softmax"] = 5.0  # (not 4: SCAN's i-t value would add the lambda warning)
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    with pytest.raises(CheckpointError, match="config.json does not match the manifest") as err:
        load_checkpoint(ck)
    assert err.value.path == config_file and "--trust-modified" in str(err.value)
    assert "--resume --set train.epochs=N" in str(err.value)  # the way to change training settings
    with caplog.at_level(logging.WARNING, "itmatch.checkpoint"):
        assert load_checkpoint(ck, trust_modified=True).config.model.scan.lambda_softmax == 5.0
    assert len(caplog.records) == 1 and "config.json modified" in caplog.records[0].getMessage()
    config_file.write_text(original_config)

    _swap_two_words(vocab_file)
    with pytest.raises(CheckpointError, match="vocab.json does not match the manifest"):
        load_checkpoint(ck)
    assert load_checkpoint(ck, trust_modified=True).vocab.idx2word[4] == WORDS[1]
    vocab_file.write_text(original_vocab)
    (ck / "state.json").write_text(json.dumps({"epoch": 7}))
    with pytest.raises(CheckpointError, match="state.json"):
        load_checkpoint(ck)
    (ck / "state.json").write_text("{}")
    config_file.write_text(original_config.replace("9.0", "4.0"))
    with pytest.raises(CheckpointError, match=r"\(also changed: state.json\)"):  # every changed file is named
        load_checkpoint(ck)


def test_checkpoints_of_older_versions_load_with_one_warning(tmp_path, caplog):
    ck = _checkpoint(tmp_path)
    manifest = json.loads((ck / "manifest.json").read_text())
    binary = {k: v for k, v in manifest["files"].items() if k.endswith((".safetensors", ".pt"))}
    (ck / "manifest.json").write_text(json.dumps({"version": 1, "files": binary}))  # as the previous version wrote
    with caplog.at_level(logging.WARNING, "itmatch.checkpoint"):
        assert load_checkpoint(ck).state["epoch"] == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"{ck}: written by an older itmatch: config.json, state.json, vocab.json not covered by its manifest, so "
        "edits to them cannot be detected"]
    weights = ck / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + bytes(8))
    with pytest.raises(CheckpointError, match="model.safetensors does not match"):  # what it covers is still checked
        load_checkpoint(ck)
    (ck / "manifest.json").unlink()  # older still: no manifest at all
    caplog.clear()
    with caplog.at_level(logging.WARNING, "itmatch.checkpoint"):
        load_checkpoint(ck)
    assert len(caplog.records) == 1 and "no manifest.json" in caplog.records[0].getMessage()


def test_the_same_weights_are_saved_as_the_same_bytes(tmp_path):
    """The weights' SHA-256 is their identity (manifest, search index): saving one model several times
    gives one file (safetensors wrote its metadata keys in a random order)."""
    ck = load_checkpoint(_checkpoint(tmp_path))
    digests = set()
    for i in range(8):
        save_checkpoint(tmp_path / f"copy{i}", ck.model, ck.config, ck.vocab)
        digests.add((tmp_path / f"copy{i}" / "model.safetensors").read_bytes())
    assert len(digests) == 1


def test_options_of_a_model_package_not_installed_here_are_ignored_with_a_warning(tmp_path, monkeypatch, caplog):
    """A checkpoint saved where another model package was installed (its options section is in config.json)
    loads where that package is absent: its own model never reads those options."""
    from dataclasses import dataclass

    from itmatch import config

    @dataclass
    class PluginOptions:
        depth: int = 3

    monkeypatch.setattr(config, "_OPTIONS", dict(config._OPTIONS))
    config.register_options("plugin")(PluginOptions)
    ck = _checkpoint(tmp_path)
    assert json.loads((ck / "config.json").read_text())["model"]["plugin"] == {"depth": 3}
    del config._OPTIONS["plugin"]  # the package is uninstalled
    config._model_class.cache_clear()
    with caplog.at_level(logging.WARNING, logger="itmatch.checkpoint"):
        loaded = load_checkpoint(ck)
    assert loaded.config.model.arch == "scan" and not hasattr(loaded.config.model, "plugin")
    assert "model.plugin" in caplog.text and "not installed here" in caplog.text
    monkeypatch.undo()
    config._model_class.cache_clear()
