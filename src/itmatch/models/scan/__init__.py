"""SCAN (Lee et al. 2018) and the baselines it compares against: VSE++ (a global embedding, cosine) and Sum-Max
(every word takes its best region, no attention). All three read region features through an FC layer and
captions through a (Bi)GRU (`models/encoders.py`); they differ in the head. docs/scan.md."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from itmatch.config import NORMS, POOLS, ModelConfig, option, register_options
from itmatch.errors import ConfigError
from itmatch.models.base import Matcher, SimilarityHead
from itmatch.models.encoders import RegionEncoder, RNNTextEncoder
from itmatch.models.registry import Arch, Preset, register_arch, register_presets
from itmatch.models.scan.global_cosine import GlobalCosineHead
from itmatch.models.scan.head import ScanHead, TwoWayScanHead
from itmatch.models.scan.summax import SumMaxHead

# SCAN supplementary: Flickr30K lr 2e-4 for 15 epochs then 2e-5 for 15; COCO 5e-4 for 10 then 5e-5 for 10.
F30K_SCHEDULE = {"epochs": 30, "lr": 2e-4, "lr_update": 15}
COCO_SCHEDULE = {"epochs": 20, "lr": 5e-4, "lr_update": 10}
# lambda_1 / lambda_2 of SCAN Table 1 (Flickr30K) and Table 2 (COCO).
SCAN_LAMBDAS = {
    ("f30k", "t2i"): {"lambda_softmax": 9.0, "lambda_lse": 6.0},
    ("f30k", "i2t"): {"lambda_softmax": 4.0, "lambda_lse": 5.0},
    ("coco", "t2i"): {"lambda_softmax": 9.0, "lambda_lse": 6.0},
    ("coco", "i2t"): {"lambda_softmax": 4.0, "lambda_lse": 20.0},
}


def _lambdas(dataset: str, direction: str) -> str:
    """`lambda_1 / lambda_2` of one of SCAN's rows as its tables print them ("9 / 6")."""
    values = SCAN_LAMBDAS[(dataset, direction)]
    return f"{values['lambda_softmax']:g} / {values['lambda_lse']:g}"


# The words of the other-direction warning below, read from SCAN_LAMBDAS so that the two cannot disagree.
LAMBDA_TABLES = (f"Table 1, Flickr30K: t-i {_lambdas('f30k', 't2i')}, i-t {_lambdas('f30k', 'i2t')}; "
                 f"Table 2, COCO: t-i {_lambdas('coco', 't2i')}, i-t {_lambdas('coco', 'i2t')}")
OWN_LAMBDAS = {d: _lambdas("f30k", d) + ("" if _lambdas("coco", d) == _lambdas("f30k", d)
                                          else f" (COCO: {_lambdas('coco', d)})") for d in ("t2i", "i2t")}


@register_options("scan", moved_from={"model.lambda_softmax": "lambda_softmax", "model.lambda_lse": "lambda_lse",
                                      "model.raw_feature_norm": "raw_feature_norm", "model.clip_slope": "clip_slope",
                                      "model.save.i2t_lambda_softmax": "i2t_lambda_softmax",
                                      "model.save.i2t_lambda_lse": "i2t_lambda_lse"})
@dataclass
class ScanConfig:
    """SCAN's attention head, also SAVE's: lambda_1 (inverse softmax temperature) and lambda_2 (LSE pooling) of
    the t-i head, or of a one-way model's only head (the scan_i2t_* presets set SCAN Table 1's i-t 4 / 5 there);
    the i-t head's lambdas of a model scoring both directions (model.direction=both, and SAVE in any direction);
    and the normalisation of the raw region-word dots. Configs written before these moved here (model.lambda_*,
    model.raw_feature_norm, model.clip_slope) still load."""

    lambda_softmax: float = option(9.0, above=0)  # lambda_1
    lambda_lse: float = option(6.0, above=0)  # lambda_2
    i2t_lambda_softmax: float = option(4.0, above=0)
    i2t_lambda_lse: float = option(5.0, above=0)
    # the i-t head's pooling in a model of both directions ("" = model.pool, which the t-i head takes): SCAN's
    # ensembles pair poolings (Flickr30K t-i AVG + i-t LSE), SAVE's Table 1 averages its Table 4 settings, i-t AVG
    # and t-i LSE (docs/save.md)
    i2t_pool: str = option("", choices=("", *POOLS))
    raw_feature_norm: str = option("clipped_l2norm", choices=NORMS)
    clip_slope: float = option(0.1, min=0, max=1)  # LeakyReLU slope of the "clipped" norms; 0 gives the paper's ReLU


def scan_head(mc: ModelConfig, i2t_lambdas: tuple[float, float]) -> SimilarityHead:
    """SCAN's head in mc.direction (t-i with model.scan.lambda_*, i-t with `i2t_lambdas`); "both" averages the
    two (the i-t half pooled by model.scan.i2t_pool when set)."""
    sc = mc.scan

    def head(direction: str, lambdas: tuple[float, float], pool: str = mc.pool) -> ScanHead:
        return ScanHead(direction, pool, *lambdas, sc.raw_feature_norm, sc.clip_slope)

    t2i = (sc.lambda_softmax, sc.lambda_lse)
    if mc.direction == "both":
        return TwoWayScanHead(head("t2i", t2i), head("i2t", i2t_lambdas, sc.i2t_pool or mc.pool))
    if sc.i2t_pool:  # (a one-way model has one head: model.pool is its pooling)
        raise ConfigError(f"model.scan.i2t_pool={sc.i2t_pool!r} applies to a model of both directions only",
                          hint=f"set model.pool={sc.i2t_pool} for this {mc.direction} model, or model.direction=both")
    return head(mc.direction, t2i if mc.direction == "t2i" else i2t_lambdas)


def two_way_lambdas(mc: ModelConfig) -> tuple[float, float]:
    """model.scan.i2t_lambda_*: the i-t lambdas of a model that holds both directions'."""
    return mc.scan.i2t_lambda_softmax, mc.scan.i2t_lambda_lse


def region_rnn_matcher(mc: ModelConfig, head: SimilarityHead, is_global: bool = False) -> Matcher:
    """Region FC image side + (Bi)GRU text side, the encoders SCAN and its baselines share."""
    image = RegionEncoder(mc.img_dim, mc.embed_size, norm=mc.img_norm, pool=is_global)
    text = RNNTextEncoder(mc.vocab_size, mc.word_dim, mc.embed_size, num_layers=mc.text_layers,
                          bidirectional=mc.bidirectional, rnn=mc.text_rnn, norm=mc.txt_norm,
                          pool="last" if is_global else "none")
    return Matcher(image, text, head)


@register_arch
class VSEpp(Arch):
    """VSE++ (Faghri et al.): mean-pooled regions and the GRU's last state, cosine."""

    name = "vsepp"

    def build(self, mc: ModelConfig) -> Matcher:
        return region_rnn_matcher(mc, GlobalCosineHead(), is_global=True)


@register_arch
class SumMax(Arch):
    """Sum-Max alignment (SCAN Eq. 9-10)."""

    name = "summax"

    def build(self, mc: ModelConfig) -> Matcher:
        return region_rnn_matcher(mc, SumMaxHead(mc.direction))


@register_arch
class Scan(Arch):
    """Stacked Cross Attention, t-i, i-t or both (model.direction)."""

    name = "scan"

    def build(self, mc: ModelConfig) -> Matcher:
        one_way = (mc.scan.lambda_softmax, mc.scan.lambda_lse)
        for warning in other_directions_lambdas(mc):
            warnings.warn(warning, UserWarning, stacklevel=2)
        return region_rnn_matcher(mc, scan_head(mc, two_way_lambdas(mc) if mc.direction == "both" else one_way))


def other_directions_lambdas(mc: ModelConfig) -> list[str]:
    """A sentence for each head of a SCAN model that scores with the other direction's lambdas of SCAN's tables
    (lambda_1; lambda_2 too where the head pools by LSE). A one-way model's only head reads model.scan.lambda_*,
    as the public code's one flag, so a preset turned around by --set model.direction keeps its direction's
    values (and a model of both directions gives its t-i half what an i-t preset put there)."""
    sc = mc.scan
    heads = ([("t2i", "", sc.lambda_softmax, sc.lambda_lse, mc.pool),
              ("i2t", "i2t_", sc.i2t_lambda_softmax, sc.i2t_lambda_lse, sc.i2t_pool or mc.pool)]
             if mc.direction == "both" else [(mc.direction, "", sc.lambda_softmax, sc.lambda_lse, mc.pool)])
    said = []
    for direction, prefix, softmax, lse, pool in heads:
        def values(key: str, mine: bool, direction: str = direction) -> set[float]:
            return {v[key] for (_, d), v in SCAN_LAMBDAS.items() if (d == direction) == mine}

        def foreign(key: str, value: float) -> bool:
            return value in values(key, False) and value not in values(key, True)

        if foreign("lambda_softmax", softmax) or (pool == "lse" and foreign("lambda_lse", lse)):
            names = f"{prefix}lambda_softmax" + (f" / {prefix}lambda_lse" if pool == "lse" else "")
            shown = f"{softmax:g}" + (f" / {lse:g}" if pool == "lse" else "")
            said.append(f"SCAN's {direction} head scores with model.scan.{names} = {shown}, the other direction's "
                        f"values in SCAN's tables ({LAMBDA_TABLES}); use a scan_{direction}_* preset, or set "
                        f"model.scan.{prefix}lambda_softmax / {prefix}lambda_lse to {OWN_LAMBDAS[direction]}")
    return said


# (direction, pool) -> the tables of SCAN's Flickr30K rows (MAX / SUM: Table 4 ablates them on i-t only); its
# MS-COCO Table 2 reports every AVG and LSE row
F30K_TABLES = {("t2i", "avg"): "Tables 1, 3", ("t2i", "lse"): "Table 1", ("i2t", "avg"): "Tables 1, 3-5",
               ("i2t", "lse"): "Table 1", ("i2t", "max"): "Table 4", ("i2t", "sum"): "Table 4"}


def paper_row(row: str, tables: str, dataset: str, coco: str = "schedule") -> str:
    """What a preset of SCAN's family reproduces: `row` of SCAN's Flickr30K `tables` ("": a row of this toolkit's),
    and as a `_coco` twin, the same with COCO's `coco`."""
    if dataset == "f30k":
        return f"SCAN {tables}: {row}" if tables else f"this toolkit's: {row}"
    return f"this toolkit's: {f'SCAN {tables} ' if tables else ''}{row} with COCO's {coco}"


@register_presets
def scan_presets() -> dict[str, Preset]:
    """vsepp, summax_{t2i,i2t}, scan_{t2i,i2t}_{avg,lse,max,sum} (MAX / SUM: SCAN Table 4), each with the
    Flickr30K schedule and a `_coco` twin with COCO's schedule and lambdas."""
    presets: dict[str, dict[str, Any]] = {}
    for dataset, schedule in (("f30k", F30K_SCHEDULE), ("coco", COCO_SCHEDULE)):
        suffix = "" if dataset == "f30k" else "_coco"
        presets[f"vsepp{suffix}"] = {
            "model": {"arch": "vsepp", "bidirectional": False}, "train": schedule,
            "paper": paper_row("VSE++ on SCAN's regions (SCAN quotes VSE++'s own figures)", "", dataset)}
        for direction in ("t2i", "i2t"):
            way = {"t2i": "t-i", "i2t": "i-t"}[direction]
            presets[f"summax_{direction}{suffix}"] = {
                "model": {"arch": "summax", "direction": direction}, "train": schedule,
                "paper": paper_row(f"Sum-Max {way}", "Table 3", dataset)}
            for pool in ("avg", "lse", "max", "sum"):
                row, tables = f"{way} {pool.upper()}", F30K_TABLES.get((direction, pool), "")
                if not tables:
                    row = f"SCAN {row} (Table 4 ablates {pool.upper()} on i-t only)"
                presets[f"scan_{direction}_{pool}{suffix}"] = {
                    "model": {"arch": "scan", "direction": direction, "pool": pool,
                              "scan": dict(SCAN_LAMBDAS[(dataset, direction)])},
                    "train": schedule,
                    "paper": (f"SCAN Table 2 (MS-COCO): {row}" if suffix and pool in ("avg", "lse")
                              else paper_row(row, tables, dataset, "schedule and lambdas"))}
    return presets
