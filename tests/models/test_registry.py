"""The registry and the config sections: a model registers itself from its package, its options are checked
by the rules declared beside them, keys that moved still load, a head must declare its memory contract, and
no module outside the model packages names an arch or reads a model family's options."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from itmatch.config import ModelConfig, config_from_dict, new_model_config, parse_overrides
from itmatch.errors import ConfigError
from itmatch.models import registry
from itmatch.models.base import ImageEmb, Matcher, SimilarityHead, TextEmb
from itmatch.models.registry import (
    ARCHS,
    PAPER_ROWS,
    PRESETS,
    Arch,
    build_model,
    preset_config,
    register_arch,
    register_presets,
    resolve_config,
)

SRC = Path(__file__).resolve().parents[2] / "src" / "itmatch"
PACKAGES = {p.name for p in (SRC / "models").iterdir() if (p / "__init__.py").is_file()}


def test_every_arch_and_preset_comes_from_a_model_package():
    for name, family in ARCHS.items():
        assert type(family).__module__.split(".")[2] in PACKAGES, name
    assert {p["model"]["arch"] for p in PRESETS.values()} <= set(ARCHS)
    sections = {f.name for f in dataclasses.fields(new_model_config()) if dataclasses.is_dataclass(f.type)}
    assert {"scan", "oan", "mmca", "save", "sman", "meanpool"} <= sections


def test_every_preset_says_which_paper_row_it_reproduces():
    """`itmatch models` shows each preset's paper row or table, or says it is this toolkit's own (a `_coco` twin of
    a Flickr30K row, a baseline no paper reports)."""
    missing = sorted(set(PRESETS) - set(PAPER_ROWS))
    assert not missing, f"presets with no paper row (give their dict a \"paper\" key): {', '.join(missing)}"
    assert not [name for name in PRESETS if "paper" in PRESETS[name]]  # (kept out of the configs)
    for name in PRESETS:
        preset_config(name)  # every preset still resolves
    papers = ("SCAN Table", "OAN Table", "MMCA Table", "SAVE Table", "SMAN Table", "this toolkit's")
    assert not [f"{name}: {row}" for name, row in PAPER_ROWS.items() if not row.startswith(papers)]
    assert PAPER_ROWS["scan_t2i_avg"] == "SCAN Tables 1, 3: t-i AVG"
    assert PAPER_ROWS["scan_i2t_lse_coco"] == "SCAN Table 2 (MS-COCO): i-t LSE"
    assert PAPER_ROWS["scan_i2t_max"] == "SCAN Table 4: i-t MAX"
    frozen = ", CNN frozen (the paper trains it end to end)"  # (SAVE's rows are all end to end: section 3.5.3)
    assert PAPER_ROWS["save_asa_ms2_both"] == ("SAVE Table 1 (i-t AVG + t-i LSE averaged, footnote 1): "
                                               f"ASA + ms2{frozen}")
    assert PAPER_ROWS["save_nosa_t2i_lse"] == f"SAVE Tables 4, 6 (t-i LSE): no-SA{frozen}"
    assert PAPER_ROWS["save_dsa_ft"].startswith("SAVE Tables 4, 5 (i-t AVG): DSA, end to end as the paper trains it")
    # SAVE's MS-COCO rows: SCAN's COCO schedule and lambdas (they trained on Flickr30K's, i-t LSE with lambda 5)
    assert PAPER_ROWS["save_asa_ms2_both_coco"] == ("SAVE Table 2 (MS-COCO, i-t AVG + t-i LSE averaged, footnote 1): "
                                                    f"ASA + ms2{frozen}")
    assert PAPER_ROWS["save_asa_ms3_coco"].startswith("this toolkit's: save_asa_ms3 (i-t AVG)")  # (no COCO row)
    coco = preset_config("save_asa_ms2_both_coco")
    assert (coco.train.epochs, coco.train.lr, coco.train.lr_update) == (20, 5e-4, 10)
    assert (coco.model.scan.i2t_lambda_lse, coco.model.scan.lambda_lse, coco.model.direction) == (20.0, 6.0, "both")
    assert preset_config("save_asa_ms2_both").model.scan.i2t_lambda_lse == 5.0
    assert PAPER_ROWS["oan_no_intra_attn"] == "OAN Table 2: No intra-modal attention"
    assert PAPER_ROWS["sman_im"] == "SMAN Table III: SMAN-IM"
    assert PAPER_ROWS["mmca_alpha0"].startswith("MMCA Table 6: alpha = 0")
    # no paper prints these: SCAN's Table 4 ablates MAX / SUM on i-t only; SCAN's Table 2 has no MAX / SUM, no
    # Sum-Max; VSE++ on regions and mean pooling are baselines of this toolkit's
    ours = ["scan_t2i_max", "scan_t2i_sum", "scan_i2t_max_coco", "summax_t2i_coco", "vsepp", "vsepp_coco", "meanpool"]
    assert [PAPER_ROWS[name] for name in ours if not PAPER_ROWS[name].startswith("this toolkit's")] == []
    assert PAPER_ROWS["scan_i2t_max_coco"].endswith("with COCO's schedule and lambdas")


def test_a_presets_paper_row_is_registered_apart_from_its_config(monkeypatch):
    monkeypatch.setattr(registry, "PRESETS", {})
    monkeypatch.setattr(registry, "PAPER_ROWS", {})
    register_presets(lambda: {"a": {"model": {"arch": "vsepp"}, "paper": "X Table 9: a"}, "b": {"model": {}}})
    assert registry.PRESETS == {"a": {"model": {"arch": "vsepp"}}, "b": {"model": {}}}
    assert registry.PAPER_ROWS == {"a": "X Table 9: a"}
    assert resolve_config("a").model.arch == "vsepp"  # (an unknown key "paper" would be refused)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("oan.k_heads", 0, "model.oan.k_heads: 0 is out of range"),
    ("oan.intra", "max", "model.oan.intra: 'max' is not one of attention, mean, none"),
    ("sman.steps", 3, "model.sman.steps: 3 is out of range"),
    ("save.attention", "nl", "model.save.attention: 'nl' is not one of none, dsa, asa"),
    ("mmca.heads", 0, "model.mmca.heads: 0 is out of range"),
    ("scan.i2t_lambda_lse", 0.0, "model.scan.i2t_lambda_lse: 0.0 is out of range"),
])
def test_a_package_option_is_checked_by_the_rule_beside_it(key, value, message):
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        resolve_config(None, {"model": {section: {name: value}}})


def test_a_moved_key_loads_at_its_new_place():
    """SCAN's i-t lambdas lived in model.save before the packages (configs of older checkpoints, commands)."""
    cfg = config_from_dict({"model": {"arch": "save", "save": {"i2t_lambda_softmax": 3.0, "attention": "dsa"}}})
    assert cfg.model.scan.i2t_lambda_softmax == 3.0 and cfg.model.save.attention == "dsa"
    assert not hasattr(cfg.model.save, "i2t_lambda_softmax")
    with pytest.raises(ConfigError, match="both set"):
        config_from_dict({"model": {"save": {"i2t_lambda_lse": 3.0}, "scan": {"i2t_lambda_lse": 4.0}}})


def test_scan_options_of_older_configs_and_commands_load_in_model_scan():
    """SCAN's lambdas and raw-dot normalisation were ModelConfig's (model.lambda_softmax, ...) before they moved
    to model.scan: a checkpoint's config.json of then, and an old --set, still give the same model."""
    old = {"arch": "scan", "direction": "i2t", "lambda_softmax": 4.0, "lambda_lse": 5.0,
           "raw_feature_norm": "l2norm", "clip_slope": 0.0}
    sc = config_from_dict({"model": old}).model.scan
    assert (sc.lambda_softmax, sc.lambda_lse, sc.raw_feature_norm, sc.clip_slope) == (4.0, 5.0, "l2norm", 0.0)
    assert resolve_config("scan_t2i_avg", parse_overrides(["model.lambda_softmax=7"])).model.scan.lambda_softmax == 7
    head = build_model(resolve_config("scan_i2t_lse", {"model": {"raw_feature_norm": "l2norm",
                                                                 "vocab_size": 10, "img_dim": 8}}).model).head
    assert (head.lambda_softmax, head.lambda_lse, head.norm) == (4.0, 5.0, "l2norm")  # the preset's, and the old key's
    assert not {"lambda_softmax", "raw_feature_norm"} & {f.name for f in dataclasses.fields(ModelConfig)}


def test_a_head_without_its_memory_contract_is_refused():
    class Forgetful(SimilarityHead):
        def forward(self, img: ImageEmb, txt: TextEmb) -> torch.Tensor:
            return img.vector @ txt.vector.T

    with pytest.raises(TypeError, match="Forgetful does not declare its memory contract"):
        Matcher(nn.Identity(), nn.Identity(), Forgetful())

    class PairIndependent(Forgetful):
        bytes_per_cell = bytes_per_pair = 0.0

    assert Matcher(nn.Identity(), nn.Identity(), PairIndependent()).head.pair_independent


def test_an_arch_name_is_registered_once_and_an_unknown_one_is_named():
    class Again(Arch):
        name = "scan"

    with pytest.raises(ValueError, match="already registered"):
        register_arch(Again)
    mc = new_model_config()
    mc.arch, mc.img_dim, mc.vocab_size = "nope", 8, 8
    with pytest.raises(ConfigError, match="unknown model.arch 'nope'"):
        build_model(mc)


def _names_outside_model_packages() -> list[str]:
    """`x.arch == "name"` comparisons and reads of a family's options (`cfg.model.save...`, `mc.oan...`) in
    modules outside the model packages. engine/convert.py reads the original SCAN/VSE++ checkpoint files."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[0] == "models" and len(rel.parts) > 2 or rel == Path("engine/convert.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            holder = getattr(node, "value", None)
            reads_section = isinstance(node, ast.Attribute) and node.attr in PACKAGES
            if reads_section and isinstance(holder, ast.Attribute | ast.Name):
                inner = holder.attr if isinstance(holder, ast.Attribute) else holder.id
                if inner in ("model", "mc"):
                    found.append(f"{rel}:{node.lineno}: .{inner}.{node.attr}")
            if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "arch"
                    and any(isinstance(c, ast.Constant) for c in node.comparators)):
                found.append(f"{rel}:{node.lineno}: compares .arch with a name")
    return found


def test_the_core_names_no_arch():
    assert _names_outside_model_packages() == []


@pytest.mark.parametrize("preset, key", [("sman", "img_norm"), ("sman", "txt_norm"), ("oan", "img_norm"),
                                         ("mmca_alpha0", "txt_norm"), ("meanpool", "txt_norm")])
def test_a_norm_switch_the_model_would_ignore_is_refused_where_a_run_starts(preset, key, tiny_precomp, tmp_path):
    """model.img_norm / txt_norm off where the arch normalises as its paper does (it never reads them): a new run is
    refused before it writes anything, instead of training without the setting; a model built from such a config
    (a checkpoint written before the check) still builds."""
    from itmatch.engine.train import train
    from itmatch.models.registry import check_norm_switches, resolve_config

    cfg = resolve_config(preset, parse_overrides([f"model.{key}=false", f"data.path={tiny_precomp}"]))
    with pytest.raises(ConfigError, match=f"model.{key}=false does not apply to model.arch={cfg.model.arch}"):
        train(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
    check_norm_switches(resolve_config(preset).model)  # (the presets themselves pass)
    if preset != "mmca_alpha0":  # (MMCA's frozen text encoder loads for seconds: its own tests build it)
        cfg.model.vocab_size, cfg.model.img_dim = 20, 16
        build_model(cfg.model)
