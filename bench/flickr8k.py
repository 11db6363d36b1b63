"""Train and evaluate every row of docs/results/flickr8k.csv on Flickr8K (224x224) features.

    python bench/flickr8k.py --row scan_t2i_avg        # one row (trains if RUN/best is absent)
    python bench/flickr8k.py                           # all rows, in order
    python bench/flickr8k.py --perturb scan_t2i_avg    # OAN's perturbation study (Table 1) of one model
    python bench/flickr8k.py --config gpu --row scan_i2t_lse   # the papers' schedules on a GPU (issue 24)
    python bench/flickr8k.py --config gpu --status     # every GPU row: evaluated, trained, training, missing
    python bench/flickr8k.py --config gpu --device cpu --row mmca_alpha0   # a paper schedule on this CPU (hours)

`--config cpu` (the default) is the CPU schedule of docs/results/flickr8k.csv; `--config gpu` trains each
preset with its paper's schedule (configs/flickr8k/gpu.yaml; docs/training.md, "The paper schedules") into
runs/flickr8k_gpu/ and writes docs/results/flickr8k_gpu.csv (the same columns plus the device). With
`--device cpu` a row of that table trains and evaluates on the CPU instead: the same schedule, only slower, and
its device column names the CPU.

Features come from `itmatch extract` (see README), which the bench runs itself for those a row reads that are
missing; every model uses configs/flickr8k/cpu.yaml on top of its preset (so OAN keeps its own Adam lr 5e-4 and
weight decay 1e-6; see docs/oan.md), except the SMAN rows, which use configs/flickr8k/sman_cpu.yaml (the same
schedule with Adam 5e-4, no L2; docs/sman.md), and the SAVE rows, which use configs/flickr8k/save_cpu.yaml (the
same schedule at lr 5e-4; docs/save.md).
SAVE rows that fuse scales read cached c3/c4 maps too: the first of them runs the multi-scale extraction
(`itmatch extract ... --scales c3,c4,c5`, about as long as the plain one) into DATA_MS; the fine-tuned
row reads the image files (data.images) and trains the backbone end to end (see docs/save.md for its cost).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from itmatch.engine.train import training_finished
from itmatch.errors import ItmatchError
from itmatch.pretrained import shipped

if TYPE_CHECKING:
    from itmatch.pretrained import Pretrained

ROOT = Path(__file__).resolve().parents[1]
SCHEDULE = "configs/flickr8k/cpu.yaml"
DATA = "runs/data/flickr8k_lite0"
DATA_MS = "runs/data/flickr8k_lite0_ms"  # + {split}_ims_c3.npy, {split}_ims_c4.npy (SAVE ms2/ms3/NL-ms2)
IMAGES = "../shared/data/flickr8k/images"
CAPTIONS = "../shared/data/flickr8k/Flickr8k.token.txt"
RESULTS = "docs/results/flickr8k.csv"
HISTORY = "docs/results/training/flickr8k.csv"  # every run's epochs: time, loss, dev rsum (from metrics.jsonl)
# OAN: full model with Eq. 12 / Eq. 11 negatives, then the Table 2 ablations
OAN_ROWS = ["oan", "oan_eq11", "oan_no_intra_neg", "oan_no_inter_attn", "oan_no_intra_attn", "oan_no_attn",
            "oan_bilstm"]
# SMAN (random words), SMAN with spaCy en_core_web_md vectors (in place of GloVe) and the ablations of
# the paper's Table III / V (the table reports mR = rsum / 6, rendered beside rsum)
SMAN_ROWS = ["sman", "sman_w2v_spacy", "sman_im", "sman_im_loc", "sman_sim", "sman_inter"]
MMCA_ROWS = ["mmca", "mmca_alpha0", "mmca_h512"]
# SAVE (docs/save.md): Table 4/5 analogue with the backbone frozen, then the best fine-tuned end to end
SAVE_ROWS = ["save_nosa", "save_dsa", "save_asa", "save_asa_ms2", "save_asa_ms3", "save_nl_ms2", "save_dsa_ft"]
SINGLE = ["meanpool", "vsepp", "summax_t2i", "scan_t2i_avg", "scan_i2t_avg", "scan_i2t_lse", *OAN_ROWS, *SMAN_ROWS,
          *MMCA_ROWS, *SAVE_ROWS]
# preset -> schedule override (SMAN: Adam 5e-4 without L2, docs/sman.md; SAVE: lr 5e-4, docs/save.md)
SCHEDULES = {**{row: "configs/flickr8k/sman_cpu.yaml" for row in SMAN_ROWS},
             **{row: "configs/flickr8k/save_cpu.yaml" for row in SAVE_ROWS}}
ENSEMBLES = {"scan_ensemble_t2i_avg+i2t_lse": ["scan_t2i_avg", "scan_i2t_lse"],
             "scan_ensemble_t2i_avg+i2t_lse_lr5e-4": ["scan_t2i_avg_lr5e-4", "scan_i2t_lse_lr5e-4"]}
# Two-stage rows (docs/mmca.md): the global i0.c0 stage's top-K re-ranked with the full score.
RERANK = {f"{p}_rerank{k}": (p, k) for p in MMCA_ROWS for k in (20, 50, 100)}
# Safe-pruned rows: the exhaustive metrics, scoring only the pairs |S - i0.c0| <= alpha leaves undecided.
PRUNED = {f"{p}_pruned": p for p in MMCA_ROWS}
# Per-preset training overrides on top of the schedule. MMCA keeps its paper hidden size (cpu.yaml's
# D = 512 is what mmca_h512 tests) and batch 64, scores only each item's 8 hardest i0.c0 negatives with
# the cross module in training (all B^2 = 4096 pairs: ~40 CPU-s and > 12 GB a step; with 8: 11 s, ~1.5 h
# an epoch; see docs/mmca.md), and selects the model on dev with the top-20 re-ranked (exhaustive dev
# scoring: ~3.3 CPU-hours an epoch).
# MMCA also trains at lr 5e-4 (paper: 2e-4): at 2e-4 this 2-epoch schedule makes global models such as
# VSE++ fall in the hardest-negative epoch (docs/training.md, the vsepp_lr5e-4 control).
_MMCA_CPU = ["train.batch_size=64", "model.mmca.train_negatives=8", "train.val_rerank=20", "train.lr=0.0005"]
OVERRIDES = {"mmca": ["model.embed_size=256", *_MMCA_CPU], "mmca_alpha0": ["model.embed_size=256", *_MMCA_CPU],
             "mmca_h512": ["model.embed_size=512", *_MMCA_CPU]}
# Fine-tuning (docs/save.md): the best frozen SAVE row on dev (save_dsa) continued for one hardest-negative epoch
# end to end from pixels, backbone at lr / 10; its control row continues the same checkpoint one epoch frozen,
# so that the two differ in the backbone's training only (not in the number of epochs).
CONTINUED = "save_dsa"
CONTINUE = [f"train.init_from=runs/flickr8k/{CONTINUED}/best", "train.epochs=1", "loss.warmup_epochs=0"]
OVERRIDES["save_dsa_ft"] = [f"data.images={IMAGES}", *CONTINUE]
PREREQUISITES = {"save_dsa_ft": CONTINUED, "save_dsa_frozen_more": CONTINUED}  # row -> the run it continues
# Control rows: a preset trained with one schedule change, to separate a model's gain from its schedule's.
# OAN trains at its paper's lr 5e-4, SCAN at 2e-4; with 2 epochs the higher lr alone may favour OAN.
# VSE++ (a global embedding, as MMCA's first stage) fell when its loss switched to the hardest negatives at 2e-4.
# The rest of the SCAN family at 5e-4 too: the paper's Table 1 ablation (and its ensemble) at the lr every
# later model trains with here, since 2e-4 undertrains all of them in two epochs (docs/scan.md).
LR5E4 = ["scan_t2i_avg", "vsepp", "summax_t2i", "scan_i2t_avg", "scan_i2t_lse"]
CONTROLS = {**{f"{p}_lr5e-4": (p, ["train.lr=0.0005"]) for p in LR5E4},
            # the seed alone: how far apart two runs of one configuration land (ASA's gamma stays ~0.02 in two
            # epochs, so save_asa is nearly save_nosa with other random numbers; docs/save.md)
            "save_nosa_seed1": ("save_nosa", ["train.seed=1"]),
            # ms3 fusing the raw EfficientNet maps (the preset standardises each scale first; docs/save.md)
            "save_asa_ms3_raw": ("save_asa_ms3", ["model.save.scale_norm=none"]),
            # SMAN's first CPU schedule, Adadelta lr 1.0 with the paper's weight decay: under the paper's clip 0.1
            # its steps are small (dev rsum 41.2 after the warm-up epoch, 27.5 after the hardest; docs/sman.md)
            "sman_adadelta": ("sman", ["train.optimizer=adadelta", "train.lr=1.0", "train.weight_decay=0.0005"]),
            # the seed alone for SMAN: how far apart two runs land, against which the Table III gaps are read
            "sman_seed1": ("sman", ["train.seed=1"]),
            # spaCy's vectors at the random init's scale: as loaded they are ~15x Xavier's per coordinate and
            # sman_w2v_spacy fell 58.7 rsum below random words (docs/sman.md)
            "sman_w2v_spacy_init": ("sman_w2v_spacy", ["model.word_vectors_scale=init"]),
            # save_dsa_ft's control: the same extra epoch with the backbone frozen (cached features)
            "save_dsa_frozen_more": (CONTINUED, CONTINUE)}
OVERRIDES.update({row: sets for row, (_, sets) in CONTROLS.items()})
PERTURB = ["scan_t2i_avg", "vsepp"]  # the two models of OAN's Table 1
# Mid-epoch saves of `last` (bit-for-bit resumable; docs/reliability.md): an epoch of the slow rows is hours
# of CPU, so a stopped run loses at most this many batches instead of the epoch.
CHECKPOINT_EVERY = 20


DATA_LITE2 = "runs/data/flickr8k_lite2"  # EfficientNet-Lite2 at 260 px: 9 x 9 cells (the higher-resolution rows)


def feature_views(data: str, count: int = 4) -> list[str]:
    """Directories of `count` augmented views of the training photos of `data` (a random crop and flip each,
    `itmatch extract --view K`), which the _views rows draw each caption's image from beside the photo
    (data.train_views; docs/training.md, "Augmented views")."""
    return [f"{data}_view{k}" for k in range(1, count + 1)]


def train_views(views: list[str]) -> str:
    return f"data.train_views={','.join(views)}"


LITE0_VIEWS, LITE2_VIEWS = feature_views(DATA), feature_views(DATA_LITE2)


@dataclass
class Profile:
    """One schedule's rows: how each is trained (schedule file, overrides, data) and where it is recorded."""

    name: str
    schedule: str  # the schedule file of a row that SCHEDULES does not name
    schedules: dict[str, str]  # preset -> its schedule file
    overrides: dict[str, list[str]]  # row -> --set overrides
    controls: dict[str, tuple[str, list[str]]]  # row -> (the preset it trains, its overrides)
    ensembles: dict[str, list[str]]
    rows: list[str]  # every row, in the order `--row` is not given
    runs: str  # run directories: RUNS/<row>
    results: str
    history: str
    checkpoint_every: int
    rerank: dict[str, tuple[str, int]] = field(default_factory=dict)
    pruned: dict[str, str] = field(default_factory=dict)
    prerequisites: dict[str, str] = field(default_factory=dict)  # row -> the run it continues
    prune: set[str] = field(default_factory=set)  # rows evaluated by safe pruning (exact metrics, fewer pairs)
    # row -> its candidate runs (also its `ensembles` entry, so that each is trained and its state shown): the row is
    # the pair of candidates with the best dev rsum, the only one evaluated on test (evaluate_dev_pairs, dev_pick)
    dev_picked: dict[str, list[str]] = field(default_factory=dict)
    perturb_prefix: str = "flickr8k"  # docs/results/perturb/<prefix>_<preset>.*
    device: bool = False  # rows record the device; the bench needs a CUDA device unless `on_cpu`
    on_cpu: bool = False  # --device cpu: the schedule's rows train and evaluate on the CPU


CPU = Profile("cpu", SCHEDULE, SCHEDULES, OVERRIDES, CONTROLS, ENSEMBLES,
              SINGLE + list(CONTROLS) + list(ENSEMBLES) + list(RERANK) + list(PRUNED), "runs/flickr8k", RESULTS,
              HISTORY, CHECKPOINT_EVERY, RERANK, PRUNED, PREREQUISITES)

# ---------------------------------------------------------------------------------------- the GPU schedule
# Every preset trains with its own paper's schedule (optimizer, lr, decay step, epochs, D), which the presets
# carry (`itmatch models`; docs/training.md lists them); the two files add only what is not the papers':
# one warm-up epoch on the sum over negatives where a model stalls without it (gpu.yaml: SCAN, Sum-Max, SAVE,
# OAN, all region-word attention heads, and SMAN: without it its Adam control sat at chance for five epochs and
# the paper's Adadelta below 52 dev rsum for twelve, docs/sman.md),
# none elsewhere (gpu_no_warmup.yaml: MMCA, meanpool, and VSE++, which stalls three epochs without it at D = 1024
# and then ends 8-12 rsum above its warm-up runs: docs/training.md), bucketed batches, model selection on dev rsum.
GPU_SCHEDULE = "configs/flickr8k/gpu.yaml"
GPU_NO_WARMUP = "configs/flickr8k/gpu_no_warmup.yaml"
GPU_RUNS = "runs/flickr8k_gpu"
SCAN_ROWS = ["scan_t2i_avg", "scan_t2i_lse", "scan_i2t_avg", "scan_i2t_lse"]
# (save_nosa is not trained on its own: it is SCAN i-t AVG on the grid cells, GPU_ENSEMBLES below)
# SAVE Tables 4-5 (i-t AVG), Table 4's t-i LSE rows, and Table 1's setting: its two Table 4 settings' scores, i-t AVG
# and t-i LSE, averaged (footnote 1), in one model (the presets' PAPER_SETTINGS; docs/save.md)
SAVE_GPU_ROWS = ["save_dsa", "save_asa", "save_asa_ms2", "save_asa_ms3", "save_nl_ms2", "save_dsa_ms2",
                 "save_dsa_t2i_lse", "save_asa_t2i_lse", "save_dsa_both", "save_asa_both", "save_asa_ms2_both",
                 "save_asa_ms3_both"]
GPU_SINGLE = ["meanpool", "vsepp", "summax_t2i", "summax_i2t", *SCAN_ROWS, *OAN_ROWS, *MMCA_ROWS, *SAVE_GPU_ROWS,
              *SMAN_ROWS]
GPU_SCHEDULES = {row: GPU_NO_WARMUP for row in ["meanpool", "vsepp", *MMCA_ROWS]}
# Members that are shipped models (src/itmatch/pretrained, by name), each with the row it was shipped from (its card's
# results row): that row's run is gone with a machine (runs/ is not kept), its fp16 weights are in the package
# (within 0.1 rsum of the run's, docs/training.md), so an ensemble reads them instead of training the row again
SHIPPED_MEMBERS = {name: package.card["results"]["name"] for name, package in shipped().items()}


def source_row(member: str) -> str:
    """The row a member's weights are of: a shipped member's row, else the member itself."""
    return SHIPPED_MEMBERS.get(member, member)


GPU_ENSEMBLES = {"scan_ensemble_t2i_avg+i2t_lse": ["scan_t2i_avg", "scan_i2t_lse"],
                 "scan_ensemble_t2i_avg+i2t_lse_seed1": ["scan_t2i_avg_seed1", "scan_i2t_lse_seed1"],
                 # the best single model's two seeds averaged (safe pruning holds for an ensemble too)
                 "mmca_alpha0_lite2_ensemble_seed0+seed1": ["mmca_alpha0_lite2", "mmca_alpha0_lite2_seed1"],
                 "mmca_alpha0_lite2_decay4_ensemble_seed0+seed1": ["mmca_alpha0_lite2_decay4",
                                                                   "mmca_alpha0_lite2_decay4_seed1"],
                 # ... and with their weights averaged: whether averaging one run's weights and averaging two runs'
                 # scores add up
                 "mmca_alpha0_lite2_decay4_ema_ensemble_seed0+seed1": ["mmca_alpha0_lite2_decay4_ema",
                                                                       "mmca_alpha0_lite2_decay4_ema_seed1"],
                 # across families: MMCA alpha = 0 (MiniLM text encoder; Lite2 cells) with VSE++ (GRU; Lite0 cells,
                 # each member reads its own features), seeds paired; Lite0's MMCA beside it (the backbone's share)
                 "ensemble_mmca_alpha0_lite2+vsepp": ["mmca_alpha0_lite2", "vsepp"],
                 "ensemble_mmca_alpha0_lite2+vsepp_seed1": ["mmca_alpha0_lite2_seed1", "vsepp_seed1"],
                 "ensemble_mmca_alpha0+vsepp_seed1": ["mmca_alpha0_seed1", "vsepp_seed1"],
                 "ensemble_mmca_alpha0_lite2+vsepp_2seeds": ["mmca_alpha0_lite2", "vsepp", "mmca_alpha0_lite2_seed1",
                                                             "vsepp_seed1"],
                 # the two best single models (SCAN i-t LSE, Lite0 cells, GPU; MMCA alpha = 0, Lite2 cells): the SCAN
                 # run comes back from a GPU session with device_session.py's fetch / take
                 "ensemble_mmca_alpha0_lite2+scan_i2t_lse": ["mmca_alpha0_lite2-flickr8k", "scan_i2t_lse"],
                 # SAVE without self-attention is SCAN on the grid cells: the same FC, head, lambdas and schedule, the
                 # same initial weights (tests/test_bench_gpu.py checks it), so its rows evaluate SCAN's runs rather
                 # than train one model twice on a GPU (the row's `model` column names the SCAN preset)
                 "save_nosa": ["scan_i2t_avg"], "save_nosa_t2i_lse": ["scan_t2i_lse"]}
# An ensemble chosen on dev, never on test: the cross-family rows above were fixed after two pairs' test scores had
# been seen (docs/training.md, "Ensembles across families and backbones"). Every pair of the best single model of each
# family is evaluated on the dev split (1k), and only the pair with the best dev rsum is evaluated on test; every
# pair's dev rsum is kept beside the row (RUNS/<row>.dev_pairs.json) and the row's model column names the pair.
GPU_DEV_PICKED = {"ensemble_dev_pick": ["scan_i2t_lse-flickr8k", "oan", "mmca_alpha0_lite2_decay6_ema_views4-flickr8k",
                                         "vsepp", "save_asa_ms3", "sman"],
                  # the same rule over the models a user loads by name: nothing to train, so any clean clone
                  # reproduces it on a CPU from the extracted features alone
                  "ensemble_dev_pick_shipped": ["mmca_alpha0_lite2_decay6_ema_views4-flickr8k",
                                                "mmca_alpha0_lite2_decay4_ema-flickr8k",
                                                "mmca_alpha0_lite2_decay4-flickr8k", "mmca_alpha0_lite2-flickr8k",
                                                "mmca_alpha0-flickr8k", "vsepp-flickr8k", "vsepp_seed1-flickr8k",
                                                "scan_i2t_lse-flickr8k",
                                                "oan_no_attn_lite2_decay6_ema_views4-flickr8k",
                                                "sman_im_lite2_decay14_ema_views4-flickr8k"]}
GPU_ENSEMBLES.update(GPU_DEV_PICKED)
# two seeds for the headline rows (the spread is stated beside them), and for each shipped pretrained model
HEADLINE = ["vsepp", "scan_t2i_avg", "scan_i2t_lse", "oan", "mmca", "mmca_alpha0", "save_dsa", "save_asa_ms3", "sman"]
# End to end (train.finetune_backbone): the converged frozen run continued from pixels for 10 epochs, the whole
# model at the frozen run's final lr (the preset's lr / 10; the CNN included, BatchNorm frozen), beside a control
# that continues the same checkpoint frozen for the same 10 epochs, so that the two differ in the CNN's training
# only; and the higher-resolution option: Lite2 (260 px, 9 x 9 cells) frozen, then fine-tuned the same way.
FINETUNED = ["vsepp", "scan_i2t_lse", "oan", "mmca", "save_dsa", "sman"]


def with_seeds(row: str, preset: str, overrides: list[str], seeds: tuple[int, ...] = (1,)
               ) -> dict[str, tuple[str, list[str]]]:
    """Control row `row` (`preset` with `overrides`) and its other seeds, `<row>_seed<N>` for each N of `seeds`."""
    return {row: (preset, overrides), **{f"{row}_seed{n}": (preset, [f"train.seed={n}", *overrides]) for n in seeds}}


def continue_from(row: str, preset: str) -> list[str]:
    """Overrides that continue GPU run `row` (of `preset`) for 10 epochs at the preset's decayed lr."""
    from itmatch.models.registry import preset_config

    lr = preset_config(preset).train.lr / 10
    return [f"train.init_from={GPU_RUNS}/{row}/best", "train.epochs=10", "train.lr_update=10", f"train.lr={lr:g}",
            "loss.warmup_epochs=0"]


FINETUNE = [f"data.images={IMAGES}", "train.finetune_backbone=true", "train.backbone_lr_scale=1.0"]
SHIPPED_SCAN = "scan_i2t_lse_d960"
# OAN's averaged ablation: the decay at its dev peak (after epoch 6 of 10) and the weights averaged over ~500 steps;
# the rows below vary only its features and views
OAN_ABLATION_EMA = ["train.lr_update=6", "train.epochs=10", "train.ema_decay=0.998"]
# SMAN on the best single model's recipe: Lite2's 9 x 9 cells (SMAN reads its grid in order and checks its size),
# their four views and the weights averaged over ~500 steps (OAN's 0.998 at the same batch of 128)
SMAN_LITE2_RECIPE = ["model.sman.regions=81", "train.ema_decay=0.998", train_views(LITE2_VIEWS)]
GPU_CONTROLS: dict[str, tuple[str, list[str]]] = {
    # attention that the papers' literal scales leave near uniform: both scale logits that lie in [0, 1] (l2-normalised
    # cosines), so one object's weight is at most e^lambda / (e^lambda + M - 1). OAN's lambda_TV = 0.9 over 49 cells
    # gives a perfectly matching region 4.9 % (uniform 2.0 %), SAVE's DSA (no lambda) makes every cell ~ the image's
    # mean (docs/oan.md, docs/save.md); each beside SCAN's own scales (9 t-i, 4 i-t)
    "oan_lambda_scan": ("oan", ["model.oan.lambda_tv=9", "model.oan.lambda_vt=4"]),
    "save_dsa_lambda9": ("save_dsa", ["model.save.dsa_lambda=9"]),
    # ms3 differs from ASA in two ways, c3/c4 added and every scale standardised per cell (scale_norm, which the
    # fused scales need: docs/save.md); ASA on c5 standardised alone tells which of the two a gain comes from
    "save_asa_layernorm": ("save_asa", ["model.save.scale_norm=layernorm"]),
    # ... and its own no-attention control: while gamma ~ 0, ASA on standardised c5 is the FC on standardised c5, so
    # no self-attention on the same standardised cells tells what the standardisation alone does (docs/save.md)
    "save_nosa_layernorm": ("save_nosa", ["model.save.scale_norm=layernorm"]),
    # ASA's theta / phi / g as Eq. 6-7 write them (W u, no bias) beside the non-local block's biased convolutions that
    # every SAVE preset keeps (docs/save.md): only theta's bias changes the attention, a learned prior over the cells.
    # On standardised c5, beside save_asa_layernorm: on raw c5 it collapsed as save_asa did (a GPU run stopped at
    # epoch 7, docs/save.md), which would say nothing about the bias
    "save_asa_layernorm_no_bias": ("save_asa", ["model.save.scale_norm=layernorm", "model.save.asa_bias=false"]),
    # save_asa (raw c5) collapsed onto all-alike scores in its first hardest-negative epoch on the GPU and did not
    # converge in 30 epochs (docs/save.md, "The GPU rows"): another seed tells whether that is the seed's
    "save_asa_seed1": ("save_asa", ["train.seed=1"]),
    # what collapses it is the gated branch gamma W_z a growing to ~29 cells' norm on raw c5 (docs/save.md, "How it
    # collapses"); SAGAN, which Eq. 8 follows for gamma, spectrally normalises theta, phi, g and W_z, which bounds it
    "save_asa_sn": ("save_asa", ["model.save.asa_spectral_norm=true"]),
    **{f"{p}_seed1": (p, ["train.seed=1"]) for p in HEADLINE},
    # the warm-up decision, measured again on converged runs (docs/training.md, "The paper schedules"): SCAN t-i
    # AVG stalled without it on the CPU; VSE++ at D = 1024 stalled too, but only for three epochs, and ended
    # 8-12 rsum higher without it (two seeds each), so it trains without; its warm-up runs stay as the control
    "scan_t2i_avg_no_warmup": ("scan_t2i_avg", ["loss.warmup_epochs=0"]),
    # SMAN as the paper trains it, hardest negatives from the first step: on the GPU (2026-11-28) it sat at the
    # all-alike loss for 12 epochs (dev rsum <= 51.6) and with Adam 5e-4 at chance for 5 (docs/sman.md)
    "sman_no_warmup": ("sman", ["loss.warmup_epochs=0"]),
    # the paper's 60 epochs take 18-23 min on an H200, over a session's 15 min of device time; the run stopped at
    # epoch 32 peaked at epoch 10 (dev rsum 246.1) and stayed on a 231-243 plateau at lr 0.05 (docs/sman.md, "On the
    # GPU with the warm-up epoch"): the lr decay moved to that peak, as for the best single model (docs/training.md)
    "sman_decay10": ("sman", ["train.lr_update=10", "train.epochs=14"]),
    # ... and its Table III ablations on that schedule, so that "SMAN > its ablations" compares one schedule. SMAN-IM
    # and SMAN-SIM are pair-independent (one product of per-item vectors): the CPU trains them, ~1 s a step on two
    # cores
    **{f"{p}_decay10": (p, ["train.lr_update=10", "train.epochs=14"])
       for p in ("sman_im", "sman_im_loc", "sman_sim", "sman_inter")},
    # ... and SMAN-IM (the fastest of them on the CPU, ~2 min an epoch on Lite0) on the best single model's recipe:
    # Lite2 cells and their four views, the weights averaged over ~500 steps (OAN's 0.998, the same batch of 128): how
    # far the recipe takes SMAN's one-step ablation towards m-CNN's 275.2 on the same schedule
    "sman_im_lite2_decay10_ema_views4": ("sman_im", ["train.lr_update=10", "train.epochs=14", *SMAN_LITE2_RECIPE]),
    # ... still rising at its last epoch (dev 273.3, 273.5, 274.9 over epochs 12-14): the averaged weights climb slowly
    # at Adadelta 0.05 (253.4 after epoch 9), so the decay moved four epochs later, the same four epochs after it
    # (a second seed: whether its +6.2 over m-CNN's 275.2 is the seed's)
    **with_seeds("sman_im_lite2_decay14_ema_views4", "sman_im",
                 ["train.lr_update=14", "train.epochs=18", *SMAN_LITE2_RECIPE]),
    # OAN's two pair-independent Table 2 ablations peaked early on the paper schedule (dev at epochs 6 and 8 of 24,
    # then 15-26 rsum down before the decay after epoch 15) while OAN held its peak (docs/oan.md): the decay moved to
    # each one's dev peak, 4 epochs after it, so that "OAN > its ablations" does not rest on a schedule that suits the
    # full model alone. Both are one product of per-item vectors: the CPU trains them
    **with_seeds("oan_no_attn_decay6", "oan_no_attn", ["train.lr_update=6", "train.epochs=10"]),
    "oan_no_inter_attn_decay8": ("oan_no_inter_attn", ["train.lr_update=8", "train.epochs=12"]),
    # weight averaging (train.ema_decay, as mmca_alpha0_lite2_decay4_ema) on a second model that the CPU trains fast:
    # the same horizon in epochs, two (~500 steps at OAN's batch of 128)
    # (second seeds of both: whether the +9.3 of seed 0 is the average's)
    **with_seeds("oan_no_attn_decay6_ema", "oan_no_attn", OAN_ABLATION_EMA),
    # ... trained on four augmented views of its Lite0 photos as well (as mmca_alpha0_lite2_decay4_ema_views4, the
    # same schedule as without them): whether the views' gain carries to another family and backbone
    "oan_no_attn_decay6_ema_views4": ("oan_no_attn", [*OAN_ABLATION_EMA, train_views(LITE0_VIEWS)]),
    # ... and on EfficientNet-Lite2's 9 x 9 cells and their views, the recipe of the best single model (Lite2 lifted
    # MMCA alpha = 0 by 13.5 test rsum over Lite0 on the paper schedule): whether OAN's ablation then clears m-CNN's
    # 275.2 on the CPU (two seeds)
    **with_seeds("oan_no_attn_lite2_decay6_ema_views4", "oan_no_attn", [*OAN_ABLATION_EMA, train_views(LITE2_VIEWS)]),
    # ... and on Lite2's cells without their views: which of the two (the backbone or the views) its +9.0 over
    # oan_no_attn_decay6_ema comes from
    **with_seeds("oan_no_attn_lite2_decay6_ema", "oan_no_attn", OAN_ABLATION_EMA),
    # ... and OAN itself by the same rule (its dev peak at epoch 10 of the paper schedule): the counterpart that makes
    # "OAN > its ablations" one rule against one rule (a GPU row: OAN's score is pair-dependent)
    "oan_decay10": ("oan", ["train.lr_update=10", "train.epochs=14"]),
    # averaging lifted oan_no_attn_decay6 by 9.3 test rsum, above OAN without it: OAN averaged the same way (a GPU row)
    # is the counterpart that keeps "OAN > its ablations" like against like
    "oan_decay10_ema": ("oan", ["train.lr_update=10", "train.epochs=14", "train.ema_decay=0.998"]),
    # ... and on the Lite2 recipe (cells and views) on which the averaged ablation cleared 275.2 on the CPU
    # (oan_no_attn_lite2_decay6_ema_views4, 280.7 and 277.0): whether OAN's attention adds to it (a GPU row)
    "oan_lite2_decay10_ema_views4": ("oan", ["train.lr_update=10", "train.epochs=14", "train.ema_decay=0.998",
                                             train_views(LITE2_VIEWS)]),
    **with_seeds("vsepp_warmup", "vsepp", ["loss.warmup_epochs=1"]),
    # the accelerator issue's precision check: the same schedule and seed in bf16 autocast beside the fp32 row (it
    # asks for at most 1 rsum lost; one pair cannot show that alone, two seeds of one model differ by more)
    **{f"{p}_bf16": (p, ["train.precision=bf16"]) for p in ("scan_t2i_avg", "scan_i2t_lse", "oan")},
    # SMAN's paper optimizer (Adadelta 0.05, clipping 0.1, now per coordinate) barely moved in the CPU schedule under
    # a total-norm clip (docs/sman.md): the CPU schedule's optimizer (Adam 5e-4, no L2, norm clip) beside it
    "sman_adam5e-4": ("sman", ["train.optimizer=adam", "train.lr=0.0005", "train.weight_decay=0.0",
                               "train.grad_clip_mode=norm"]),
    **{f"{p}_ft": (p, [*continue_from(p, p), *FINETUNE]) for p in FINETUNED},
    **{f"{p}_frozen_more": (p, continue_from(p, p)) for p in FINETUNED},
    "scan_i2t_lse_lite2": ("scan_i2t_lse", []),
    # the SCAN that ships (scan_i2t_lse-flickr8k, so that a user's search page draws attention maps with a model loaded
    # by name): the paper's D = 1024 weighs 20.7 MB in fp16 with the Flickr8K vocabulary, over the 20 MB of a shipped
    # model; D = 960 weighs 18.8 MB (python bench/pretrained_sizes.py). Beside scan_i2t_lse it says what that costs
    SHIPPED_SCAN: ("scan_i2t_lse", ["model.embed_size=960"]),
    # the same on the CPU's budget: MMCA alpha = 0 trains its schedule in about an hour and a half on two cores
    "mmca_alpha0_lite2": ("mmca_alpha0", []),
    "mmca_alpha0_lite2_seed1": ("mmca_alpha0", ["train.seed=1"]),
    # the best single model overfits Flickr8K's 6,000 frozen grids (dev peak at epoch 4 of 20, then down 17 rsum):
    # VSE∞'s size augmentation (each cell dropped with p = 0.2 at every step, docs/training.md) shows it another
    # view of each image every epoch; the same schedule otherwise
    "mmca_alpha0_lite2_regdrop": ("mmca_alpha0", ["train.region_dropout=0.2"]),
    # the same model with the schedule's lr decay moved to where its dev rsum peaked (epochs 4 and 5 of the two seeds
    # in the paper schedule, which decays after epoch 10, 15-16 dev rsum below the peak); 4 epochs after the decay.
    # A third seed: whether the best seed's 291.6, the best single model, is the schedule's or the seed's
    **with_seeds("mmca_alpha0_lite2_decay4", "mmca_alpha0", ["train.lr_update=4", "train.epochs=8"], seeds=(1, 2)),
    # ... with its weights averaged over the steps (train.ema_decay: a horizon of ~1,000 steps, two epochs of batch
    # 64): the two seeds' ensemble is 18-22 rsum above either seed, and an average of one run's weights is the cheap
    # kin of an ensemble (docs/training.md, "Weight averaging")
    # (a second seed: seed 0's +4.1 over the same seed without averaging is within the three seeds' spread, 5.8)
    **with_seeds("mmca_alpha0_lite2_decay4_ema", "mmca_alpha0",
                 ["train.lr_update=4", "train.epochs=8", "train.ema_decay=0.999"]),
    # ... the decay itself, chosen on dev (0.999 was two epochs' horizon, never tuned): a horizon of ~2,000 steps, four
    # epochs, so the average spans the lr decay after epoch 4
    "mmca_alpha0_lite2_decay4_ema9995": ("mmca_alpha0", ["train.lr_update=4", "train.epochs=8",
                                                         "train.ema_decay=0.9995"]),
    # ... trained on augmented views of the photos as well (data.train_views: each caption's image the photo or one of
    # four fixed random crops and flips of it, drawn anew each epoch; regdrop's cell dropout did not help, 280.5 vs
    # 283.4, but a crop is a view a frozen grid cannot make of itself)
    **with_seeds("mmca_alpha0_lite2_decay4_ema_views4", "mmca_alpha0",
                 ["train.lr_update=4", "train.epochs=8", "train.ema_decay=0.999", train_views(LITE2_VIEWS)]),
    # ... with the lr decay two epochs later and two epochs more, since the views rows' dev rsum still rose at epoch 8
    # (300.3, 301.4, 302.7 in epochs 6-8): more kinds of image may want longer at the full lr
    **with_seeds("mmca_alpha0_lite2_decay6_ema_views4", "mmca_alpha0",
                 ["train.lr_update=6", "train.epochs=10", "train.ema_decay=0.999", train_views(LITE2_VIEWS)]),
    # MMCA Tables 4/5's hidden size d = 512 (the paper's best is 256, the preset's) for that model and schedule
    # (a second seed: the first landed between d = 256's seeds, so one alone could not say whether d = 512 helps)
    **with_seeds("mmca_alpha0_lite2_decay4_d512", "mmca_alpha0",
                 ["model.embed_size=512", "train.lr_update=4", "train.epochs=8"]),
    "scan_i2t_lse_lite2_ft": ("scan_i2t_lse", [*continue_from("scan_i2t_lse_lite2", "scan_i2t_lse"), *FINETUNE,
                                               "model.backbone=lite2"]),
}
# MMCA: the paper's training (every pair of the batch through the cross module); dev and test metrics by safe
# pruning, exact and cheaper than all pairs (docs/mmca.md)
GPU_PRUNE = {row for row in [*MMCA_ROWS, *GPU_CONTROLS] if GPU_CONTROLS.get(row, (row,))[0] in MMCA_ROWS}
# an ensemble is pruned where an MMCA member would make exhaustive scoring take hours and every member's head
# bounds its score around a global cosine (VSE++: the cosine itself, bound 0)
GLOBAL_BOUND = {*MMCA_ROWS, "vsepp", "meanpool"}  # presets whose score is bounded around a global cosine
GPU_PRUNE |= {row for row, members in GPU_ENSEMBLES.items() if (rows := {source_row(m) for m in members}) & GPU_PRUNE
              and {GPU_CONTROLS.get(r, (r,))[0] for r in rows} <= GLOBAL_BOUND}
GPU_OVERRIDES = {row: [*GPU_CONTROLS.get(row, (row, []))[1], *(["train.val_prune=true"] if row in GPU_PRUNE else [])]
                 for row in [*GPU_SINGLE, *GPU_CONTROLS]}
GPU_PREREQUISITES = {**{f"{p}_{kind}": p for p in FINETUNED for kind in ("ft", "frozen_more")},
                     "scan_i2t_lse_lite2_ft": "scan_i2t_lse_lite2"}
GPU = Profile("gpu", GPU_SCHEDULE, GPU_SCHEDULES, GPU_OVERRIDES, GPU_CONTROLS, GPU_ENSEMBLES,
              GPU_SINGLE + list(GPU_CONTROLS) + list(GPU_ENSEMBLES), GPU_RUNS, "docs/results/flickr8k_gpu.csv",
              "docs/results/training/flickr8k_gpu.csv", 100, prerequisites=GPU_PREREQUISITES,
              prune=GPU_PRUNE, perturb_prefix="flickr8k_gpu", device=True, dev_picked=GPU_DEV_PICKED)
PROFILES = {"cpu": CPU, "gpu": GPU}
DRY_RUN = False  # --dry-run: print the commands, run none


class MissingCheckpoint(RuntimeError):
    """A row's model checkpoint is not where the bench expects it after training."""


def base_preset(row: str, profile: Profile = CPU) -> str:
    """The preset a row trains: a control row's preset, else the row's own name (a shipped member's: its row's)."""
    row = source_row(row)
    return profile.controls.get(row, (row,))[0]


def checkpoint_of(member: str, profile: Profile) -> str:
    """What a row's evaluation reads for `member`: its run's best checkpoint, or a shipped model by name."""
    return member if member in SHIPPED_MEMBERS else f"{profile.runs}/{member}/best"


def shipped_package(member: str) -> Pretrained:
    """A shipped member's package (src/itmatch/pretrained/NAME: its weights, manifest and card)."""
    return shipped()[member]


def run(cmd: list[str], ranks: int = 1) -> None:
    """Run a command; `itmatch` is this interpreter's (whatever PATH says), under torchrun when ranks > 1."""
    print("+", *([f"torchrun x{ranks}"] if ranks > 1 else []), *cmd, flush=True)
    if DRY_RUN:
        return
    if cmd[0] == "itmatch":
        torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
        cmd = [sys.executable, *(torchrun if ranks > 1 else []), "-m", "itmatch", *cmd[1:]]
    with subprocess.Popen(cmd, cwd=ROOT) as proc:
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            # The Ctrl-C reached the command too (the terminal's process group), and a training saves where it is
            # before it ends (itmatch.engine.stop): wait for that rather than kill it as subprocess.run would.
            # A second Ctrl-C stops both at once
            print("waiting for it to save and end (Ctrl-C again: at once, without saving)", file=sys.stderr,
                  flush=True)
            proc.wait()
            raise
    if code:
        raise subprocess.CalledProcessError(code, cmd)


# the features a row may read: the file every split must have once they are complete, and the extractor's options
# that make them (the Lite0 grid, README's extraction; the c3/c4 stage maps beside a copy of the c5 grid; the Lite2
# grid)
FEATURES = {DATA: ("ims.npy", []), DATA_MS: ("ims_c3.npy", ["--scales", "c3,c4,c5"]),
            DATA_LITE2: ("ims.npy", ["--backbone", "lite2"]),
            **{v: ("ims.npy", [*backbone, "--view", str(k), "--splits", "train"])
               for views, backbone in ((LITE0_VIEWS, []), (LITE2_VIEWS, ["--backbone", "lite2"]))
               for k, v in enumerate(views, 1)}}


class MissingFeatures(RuntimeError):
    """A row's features are not here and neither are the photos and captions to extract them from."""


def ensure_features(data: str, profile: Profile = CPU) -> None:
    """Extract the FEATURES a row reads, once (resumable; skipped when complete), on a GPU in batches of 128
    (as the lent sessions' Lite0 extraction, scripts/device_session.py, which runs before the rows there: the bench
    then finds Lite0 complete), on a CPU in the extractor's own 8. Rows started side by side (a GPU session's
    driver) that read the same features take turns: one extracts, the others then find the features complete (the
    extractor itself does not guard a folder against a second writer). Features missing where the photos or the
    captions are missing too raise MissingFeatures, naming what is missing and the command that makes them."""
    if data not in FEATURES:
        return
    complete, options = FEATURES[data]
    batch = ["--batch-size", "128"] if profile.device and not profile.on_cpu else []
    extract = ["itmatch", "extract", IMAGES, CAPTIONS, "--out", data, *options, *batch]
    splits = ("train",) if "--view" in options else ("train", "dev", "test")  # (a view is of training photos only)
    with contextlib.nullcontext() if DRY_RUN else folder_lock(data, "extracted"):
        absent = [f"{split}_{complete}" for split in splits if not (ROOT / data / f"{split}_{complete}").exists()]
        if not absent:
            return
        sources = [p for p, there in ((IMAGES, (ROOT / IMAGES).is_dir()), (CAPTIONS, (ROOT / CAPTIONS).is_file()))
                   if not there]
        if sources and not DRY_RUN:
            raise MissingFeatures(
                f"{data} lacks {', '.join(absent)}, and the bench cannot extract them: {' and '.join(sources)} "
                f"(relative to {ROOT}) {'are' if len(sources) > 1 else 'is'} missing. Put the Flickr8K photos and "
                f"captions there and rerun (the bench then runs: {' '.join(extract)}), or copy features extracted "
                f"elsewhere into {data}")
        run(extract)


def schedule_of(member: str, profile: Profile) -> str:
    return profile.schedules.get(base_preset(member, profile), profile.schedule)


def features_dir(row: str, profile: Profile) -> str:
    """The features a trained row's run reads, by how the bench names its rows: SAVE's multi-scale cells (DATA_MS)
    where the row or its preset is named `_ms2`/`_ms3`, EfficientNet-Lite2's 9 x 9 cells (DATA_LITE2) where the row
    is named `_lite2`, else Lite0's 7 x 7 (DATA). A rule rather than a list of rows: a new row cannot read another
    backbone's features by being left off a list (a shipped member reads its row's)."""
    row = source_row(row)
    if any(re.search(r"_ms\d", name) for name in (row, base_preset(row, profile))):
        return DATA_MS
    return DATA_LITE2 if "_lite2" in row else DATA


def row_members(row: str, profile: Profile) -> tuple[list[str], list[str]]:
    """The runs a row evaluates (one, or an ensemble's members) and the features each reads (an ensemble's
    members may read different ones)."""
    preset = trained_row(row, profile)
    members = profile.ensembles.get(preset, [preset])
    return members, [features_dir(member, profile) for member in members]


def features_of(row: str, profile: Profile, members: list[str]) -> list[str]:
    """The features each of `members` (a row's runs, or some of them) reads when the row evaluates them."""
    data_of = dict(zip(*row_members(row, profile), strict=True))
    return [data_of[m] for m in members]


def without_checkpoint(members: list[str], profile: Profile) -> list[str]:
    """The runs among `members` that have no `best` checkpoint here (what a row's evaluation reads)."""
    return [m for m in members
            if m not in SHIPPED_MEMBERS and not (ROOT / checkpoint_of(m, profile) / "config.json").is_file()]


def finished_table_run(preset: str, profile: Profile) -> str | None:
    """The table's run of `preset` when it has trained all its epochs: a study's unperturbed reference where the
    study has none of its own (not merely with a `best`: on a GPU machine the row may be training beside the
    study). A study that began its own `original` keeps it (resumed if stopped): the reference of a study's table
    must not change with what else a machine holds (the GPU's VSE++ table is against its own)."""
    table_run = f"{profile.runs}/{preset}"
    from itmatch.analysis.perturb import STUDY_FILE, started

    own = ROOT / profile.runs / "perturb" / preset / "original"  # (with --original: only its evaluation cache)
    began_own = started(own) or (own / STUDY_FILE).is_file()
    return table_run if training_finished(ROOT / table_run) and not began_own else None


def evaluation_command(row: str, profile: Profile, threads: int, record: list[str], members: list[str] | None = None,
                       split: str = "test") -> list[str]:
    """`itmatch evaluate` of a row's `split` as its results row is made, writing what `record` says; `members`: a
    subset of the row's runs (a dev-picked row's pair) instead of all of them."""
    every = row_members(row, profile)[0]
    members = members or every
    datas = features_of(row, profile, members)
    rerank = profile.rerank.get(row, (row, 0))[1]
    pruned = (row in profile.pruned or row in profile.prune if members == every  # (a subset: the rule of GPU_PRUNE)
              else bool({source_row(m) for m in members} & profile.prune)
              and {base_preset(m, profile) for m in members} <= GLOBAL_BOUND)
    # where a killed exhaustive evaluation keeps its finished blocks: one folder per row, split and member set
    blocks = row if members == every and split == "test" else f"{row}.{split}.{'+'.join(members)}"
    scoring = (["--rerank", str(rerank)] if rerank else ["--prune"] if pruned
               # exhaustive scoring of a pair head takes hours (MMCA): a killed bench continues from finished blocks
               else ["--resume-dir", f"runs/eval_blocks/{Path(profile.runs).name}/{blocks}"])
    data_args = ["--data", datas[0]] if len(set(datas)) == 1 else [a for d in datas for a in ("--data", d)]
    return ["itmatch", "evaluate", *[checkpoint_of(p, profile) for p in members], *data_args, "--split", split,
            "--protocol", "1k", "--quiet", *record, *(["--threads", str(threads)] if threads else []), *scoring,
            *on_cpu(profile)]


def weights_digest(member: str, profile: Profile) -> str:
    """The sha256 of a run's evaluated weights, as best/manifest.json records it (a shipped member's: its package's
    manifest; "" when it does not)."""
    folder = shipped_package(member).path if member in SHIPPED_MEMBERS else ROOT / checkpoint_of(member, profile)
    manifest = folder / "manifest.json"
    try:
        return json.loads(manifest.read_text(encoding="utf-8"))["files"]["model.safetensors"]["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def dev_pair_rsums(row: str, profile: Profile) -> tuple[Path, dict[str, Any]]:
    """RUNS/<row>.dev_pairs.json: per pair ("a+b") evaluated so far, its dev rsum and the digests of the weights it
    was of ({} before the first)."""
    picks = ROOT / profile.runs / f"{row}.dev_pairs.json"
    return picks, json.loads(picks.read_text(encoding="utf-8")) if picks.is_file() else {}


def current_dev_rsums(row: str, profile: Profile) -> dict[str, float]:
    """The dev rsum of each pair whose record is of its members' weights as they are now (a member retrained or
    replaced since makes its pairs' records stale: they are evaluated again)."""
    _, recorded = dev_pair_rsums(row, profile)
    return {key: entry["rsum"] for key, entry in recorded.items() if isinstance(entry, dict)
            and entry.get("weights") == {m: weights_digest(m, profile) for m in key.split("+")}}


def evaluate_dev_pairs(row: str, profile: Profile, threads: int) -> None:
    """Every pair of a dev-picked row's candidates evaluated on the dev split, once for the weights they have: their
    rsums are kept in RUNS/<row>.dev_pairs.json (written after each pair, atomically), so a killed bench goes on
    with the pairs left."""
    from itmatch.io import write_json_atomic

    picks, recorded = dev_pair_rsums(row, profile)
    current = current_dev_rsums(row, profile)
    for pair in itertools.combinations(profile.dev_picked[row], 2):
        key = "+".join(pair)
        if key in current:
            continue
        result = f"{profile.runs}/{row}.dev.{key}.json"
        run(evaluation_command(row, profile, threads, ["--json", result, "--force"], members=list(pair), split="dev"))
        if not DRY_RUN:
            recorded[key] = {"rsum": json.loads((ROOT / result).read_text(encoding="utf-8"))["rsum"],
                             "weights": {m: weights_digest(m, profile) for m in pair}}
            write_json_atomic(picks, recorded)


def dev_pick(row: str, profile: Profile) -> list[str] | None:
    """The pair of a dev-picked row's candidates whose ensemble has the best dev rsum (on a tie the first in the
    candidates' order), from RUNS/<row>.dev_pairs.json; None while a pair has no dev rsum there of its members'
    current weights."""
    dev_rsum = current_dev_rsums(row, profile)
    pairs = ["+".join(pair) for pair in itertools.combinations(profile.dev_picked[row], 2)]
    if any(key not in dev_rsum for key in pairs):
        return None
    return max(pairs, key=lambda key: (dev_rsum[key], -pairs.index(key))).split("+")


def evaluated_members(row: str, profile: Profile) -> list[str]:
    """The runs a row's test evaluation averages: its members, or a dev-picked row's pair (an exit naming the command
    that evaluates its dev pairs, while some are not)."""
    if row not in profile.dev_picked:
        return row_members(row, profile)[0]
    pair = dev_pick(row, profile)
    if pair is None:
        if DRY_RUN:  # (a dry run evaluates no pair: the first pair stands for the pick)
            return list(profile.dev_picked[row][:2])
        sys.exit(f"row {row}: not every pair of its candidates has a dev rsum in {profile.runs}/{row}.dev_pairs.json; "
                 f"run the row first (python bench/flickr8k.py --config {profile.name} --row {row})")
    return pair


def run_row(row: str, threads: int, train_only: bool = False, eval_ranks: int = 1, profile: Profile = CPU) -> None:
    members, datas = row_members(row, profile)
    views = [str(v) for m in members for v in train_views_of(m, profile)]
    for member_data in dict.fromkeys([*datas, *views]):
        ensure_features(member_data, profile)
    for member, member_data in zip(members, datas, strict=True):
        if member in SHIPPED_MEMBERS:  # (trained once, its row in the table: nothing to train)
            continue
        before = profile.prerequisites.get(member)
        if before and not training_finished(ROOT / profile.runs / before):
            run_row(before, threads, train_only=True, profile=profile)  # the run this one continues
        out = f"{profile.runs}/{member}"
        member_preset = base_preset(member, profile)
        schedule = schedule_of(member, profile)
        check_run_matches(out, member_preset, schedule, profile.overrides.get(member, []))
        # One trainer per run folder: rows side by side may share a member (a row and its ensemble, a run and the
        # row that continues it), and the second's --force would wipe the first's checkpoints under it
        with contextlib.nullcontext() if DRY_RUN else run_lock(member, profile):
            if not training_finished(ROOT / out):  # (again inside the lock: the other may have finished it)
                resume = ["--resume"] if (ROOT / out / "last").exists() else []
                sets = [a for s in profile.overrides.get(member, []) for a in ("--set", s)]
                run(["itmatch", "train", "--preset", member_preset, "--config", schedule,
                     "--data", member_data, "--out", out, "--force", "--set", f"train.threads={threads}",
                     "--set", f"train.checkpoint_every={profile.checkpoint_every}", *sets, *resume,
                     *on_cpu(profile)])
        record_history(member, profile)
    if train_only:
        return
    missing = [] if DRY_RUN else without_checkpoint(members, profile)
    if missing:
        raise MissingCheckpoint(f"row {row}: no checkpoint at {', '.join(f'{profile.runs}/{m}/best' for m in missing)} "
                                f"although training finished; move the run directory aside and run the row again")
    command = row_command(row, profile, threads)
    result_json = f"{profile.runs}/{row}.test.json"
    # (--force: a row evaluated again, or a bench killed after the JSON and before the row, replaces its own JSON)
    record = (["--json", result_json, "--force"] if profile.device  # (the row, with the device, is written below)
              else ["--results", profile.results, "--name", row, "--dataset", "flickr8k", "--command", command,
                    "--force", "--json", result_json])
    if row in profile.dev_picked:
        evaluate_dev_pairs(row, profile, threads)
    members = evaluated_members(row, profile)
    evaluate = evaluation_command(row, profile, threads, record, members=members)
    run(evaluate, ranks=eval_ranks if "--resume-dir" in evaluate else 1)  # (two-stage scoring runs on one process)
    if profile.device and not DRY_RUN:
        write_device_row(row, "+".join(base_preset(m, profile) for m in members), ROOT / result_json, command, profile,
                         threads, members)


@contextlib.contextmanager
def folder_lock(folder: str, doing: str) -> Iterator[None]:
    """A lock on `folder` (a file `.<name>.lock` beside it, under ROOT) held while it is `doing` (being trained,
    extracted): a second bench, or a row beside it, says so and waits."""
    from filelock import FileLock, Timeout

    path = ROOT / Path(folder).with_name(f".{Path(folder).name}.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"{folder} is being {doing} by another process; waiting for it", flush=True)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def run_lock(member: str, profile: Profile) -> contextlib.AbstractContextManager[None]:
    """The lock on RUNS/<member> held while the run trains."""
    return folder_lock(f"{profile.runs}/{member}", "trained")


def on_cpu(profile: Profile) -> list[str]:
    """The flag that moves a command of a schedule whose file asks for CUDA onto the CPU (--device cpu)."""
    return ["--device", "cpu"] if profile.on_cpu else []


def runs_on_cpu(profile: Profile) -> bool:
    """Whether the profile's trainings and evaluations run on the CPU: --device cpu, or the CPU schedule (device
    'auto') where torch sees no GPU."""
    import torch

    return profile.on_cpu or (not profile.device and not torch.cuda.is_available())


def thread_count(threads: int) -> int:
    """The torch threads a training or evaluation of the bench uses on the CPU: --threads, or for 0 (all cores)
    torch's default here, which the bench's `itmatch` processes (the same machine and environment) get too."""
    import torch

    return threads or torch.get_num_threads()


def row_command(row: str, profile: Profile, threads: int) -> str:
    """The command a results row records, to be rerun as it is: on the CPU with the number of threads it ran with
    (the thread count changes float summation order, so a row is reproduced bit for bit only with the same count;
    --threads 0 is recorded as the count it meant here, since "all cores" is another count on another machine).
    A GPU row's command has no --threads: its arithmetic runs on the GPU."""
    return " ".join(["python bench/flickr8k.py", *(["--config gpu"] if profile.device else []), *on_cpu(profile),
                     "--row", row, *(["--threads", str(thread_count(threads))] if runs_on_cpu(profile) else [])])


def device_name(profile: Profile, threads: int, trained: Sequence[str] = ()) -> str:
    """What a row of the device table ran on: the GPU's name, or the CPU's model and the threads it used; and the
    machines its models trained on (`trained`) where one is not that machine (a run fetched from a GPU session and
    evaluated here)."""
    import torch

    from itmatch.device import machine_name

    if profile.on_cpu:
        n = thread_count(threads)
        machine = machine_name(torch.device("cpu"))
        evaluated = f"{machine}, {n} thread{'s' if n != 1 else ''}"
    else:
        evaluated = machine = machine_name(torch.device("cuda", 0))
    if all(device == machine for device in trained):
        return evaluated
    return f"{evaluated}; trained on {' + '.join(trained)}"


def trained_on(members: Sequence[str], profile: Profile) -> list[str]:
    """The machines the members' evaluated checkpoints trained on, in order (best/state.json; runs from before they
    were recorded add none)."""
    from itmatch.engine.checkpoint import read_state

    machines = [d for m in members for d in
                ([f"{shipped_package(m).card['results'].get('device', '?')} (shipped fp16)"] if m in SHIPPED_MEMBERS
                 else read_state(ROOT / profile.runs / m / "best").get("devices", []))]
    return list(dict.fromkeys(machines))


def write_device_row(row: str, model: str, result_json: Path, command: str, profile: Profile,
                     threads: int = 0, members: Sequence[str] = ()) -> None:
    """Add the row with where it ran (device_name) to the profile's results CSV, replacing the row of that name;
    the replaced row's machine is said when it was another (a GPU row evaluated again on a CPU)."""
    from itmatch.engine.results import read_rows, result_row, upsert_row

    result = json.loads(result_json.read_text(encoding="utf-8"))
    device = device_name(profile, threads, trained_on(members, profile))
    results = ROOT / profile.results
    before = next((r for r in read_rows(results) if r["name"] == row), None)
    upsert_row(results, result_row(row, model, "flickr8k", result, command, device=device), force=True)
    print(f"row {row!r} written to {profile.results}", flush=True)
    if before is not None and before.get("device") != device:
        print(f"  (it replaces the row from {before.get('device')}: rsum {before.get('rsum')}; git diff "
              f"{profile.results} shows both)", flush=True)


def require_cuda() -> None:
    """The GPU schedule takes hours per row on a CPU: stop before any work when no CUDA device is visible."""
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/flickr8k.py --config gpu: no CUDA device is visible to torch "
                 f"(torch {torch.__version__}, built with CUDA {torch.version.cuda or 'none'}).\n"
                 "  hint: use the CPU schedule (--config cpu, the default), run these schedules on the CPU anyway "
                 "(--device cpu: hours per row), or run on a machine with a GPU and a CUDA build of torch")


def row_status(row: str, profile: Profile) -> str:
    """Where a row stands: evaluated (its rsum), trained and not evaluated, training (epoch e of E), started
    without a checkpoint yet, not started, or a finished training whose checkpoint is missing."""
    from itmatch.engine.results import read_rows

    done = {r["name"]: r for r in read_rows(ROOT / profile.results)}
    if row in done:
        return f"evaluated: rsum {done[row]['rsum']} ({done[row].get('device') or 'cpu'})"
    preset = trained_row(row, profile)
    return "not evaluated; " + "; ".join(f"{member}: {member_state(member, done, profile)}"
                                         for member in profile.ensembles.get(preset, [preset]))


def member_state(member: str, done: dict[str, dict], profile: Profile) -> str:
    """run_state of an ensemble's member, which says so where the member's own row is in the table but its run is
    not here (trained on another machine, or gone with a machine): the row would train it again; a shipped member
    says whose weights it holds."""
    if member in SHIPPED_MEMBERS:
        row = shipped_package(member).card["results"]
        return f"shipped model (fp16 weights of row {row['name']}, rsum {row['rsum']})"
    state = run_state(ROOT / profile.runs / member)
    if state == "not started" and member in done:
        return (f"no run here, although its row is evaluated (rsum {done[member]['rsum']}, "
                f"{done[member].get('device') or 'cpu'}): the row trains it again")
    return state


def run_state(run_dir: Path) -> str:
    """trained, training (epoch e of E done), started without a checkpoint yet, not started, or a finished
    training whose checkpoint is missing."""
    if training_finished(run_dir):
        return "trained" if (run_dir / "best" / "config.json").is_file() else f"CHECKPOINT MISSING ({run_dir / 'best'})"
    if (run_dir / "last" / "state.json").is_file():
        state = json.loads((run_dir / "last" / "state.json").read_text())
        epochs = json.loads((run_dir / "config.json").read_text())["train"]["epochs"]
        return f"training, epoch {state['epoch']} of {epochs} done"
    if (run_dir / "config.json").is_file():  # (the trainer writes its first checkpoint after a few batches)
        return "started, no checkpoint yet"
    return "not started"


def study_status(preset: str, profile: Profile) -> str:
    """Where a perturbation study stands: each perturbation's training (the reference: the table's run when it is
    finished, as run_perturb passes it), and whether its table is in docs/results/perturb/."""
    from itmatch.data.perturb import PERTURBATIONS

    study = ROOT / profile.runs / "perturb" / preset
    table = Path(f"docs/results/perturb/{profile.perturb_prefix}_{preset}.md")
    table_run = finished_table_run(preset, profile)
    states = [f"original: the {preset} row's run" if kind == "original" and table_run
              else f"{kind}: {run_state(study / kind)}" for kind in PERTURBATIONS]
    if not (ROOT / table).is_file():
        return "no table yet; " + "; ".join(states)
    # (a study trained on a lent GPU leaves its table here and its runs there: seven "not started" would mislead)
    gone = not table_run and not any((study / kind).exists() for kind in PERTURBATIONS)
    return f"table in {table}; " + ("its runs are not on this machine" if gone else "; ".join(states))


# settings a run may differ in from its row: filled from the data, or how (not what) it was trained
_RUN_ONLY = {"model.vocab_size", "model.img_dim", "model.save.c3_dim", "model.save.c4_dim", "train.threads",
             "train.checkpoint_every", "train.device"}


def unread_settings(config: dict) -> set[str]:
    """Keys of a flattened config that its model does not read. An i-t SAVE model reads its lambdas from
    model.scan.i2t_lambda_* (model.scan.lambda_* are its t-i ones): SAVE runs trained before both directions'
    lambdas were kept hold the i-t values in model.lambda_* (now model.scan.lambda_*) as well, without any
    difference in the model."""
    if config.get("model.arch") == "save" and config.get("model.direction") == "i2t":
        return {"model.scan.lambda_softmax", "model.scan.lambda_lse"}
    return set()


def check_run_matches(out: str, preset: str, schedule: str, sets: list[str]) -> None:
    """Stop if an existing run (which the bench would resume, or evaluate as it is) was trained with other
    settings than its row has now, e.g. a run started before a preset changed. Settings the run's config
    does not record (it predates them) cannot be compared and are skipped."""
    from itmatch.config import MOVED_KEYS, flatten

    saved = ROOT / out / "config.json"
    if not saved.is_file():
        return
    now = flatten(row_config(preset, schedule, sets).to_dict())
    # (a key that moved since the run was trained is compared at its new place)
    then = {MOVED_KEYS.get(k, k): v for k, v in flatten(json.loads(saved.read_text(encoding="utf-8"))).items()}
    ignored = _RUN_ONLY | unread_settings(now)
    differ = [f"{k}={then[k]!r} (row: {now[k]!r})" for k in sorted(set(now) & set(then))
              if k.split(".")[0] in ("model", "loss", "train") and k not in ignored and now[k] != then[k]]
    if differ:
        sys.exit(f"{out} was trained with other settings than row {preset} now has: {', '.join(differ)}.\n"
                 f"  fix: move {out} aside (e.g. into runs/flickr8k/old/) and run the row again")


def train_views_of(member: str, profile: Profile) -> list[Path]:
    """The view directories member `member` trains on (its resolved data.train_views; none for a shipped model)."""
    from itmatch.data.views import view_roots

    if member in SHIPPED_MEMBERS:
        return []
    config = row_config(base_preset(member, profile), schedule_of(member, profile), profile.overrides.get(member, []))
    return view_roots(config.data.train_views)


def row_config(preset: str, schedule: str, sets: list[str]):
    """The config a row's training resolves to (preset <- schedule file <- overrides)."""
    from itmatch.config import load_yaml, parse_overrides
    from itmatch.models.registry import resolve_config

    return resolve_config(preset, load_yaml(ROOT / schedule), parse_overrides(sets))


def trained_row(row: str, profile: Profile) -> str:
    """The row whose training a row evaluates: a re-ranked or pruned row's exhaustive row, else itself."""
    return profile.rerank.get(row, (profile.pruned.get(row, row), 0))[0]


def check_rows_resolve(profile: Profile) -> None:
    """Resolve every trained row's config (unknown keys, bad values stop here, before any training)."""
    trained = {m for row in profile.rows for m in profile.ensembles.get(trained_row(row, profile),
                                                                         [trained_row(row, profile)])
               if m not in SHIPPED_MEMBERS}
    for member in sorted(trained):
        row_config(base_preset(member, profile), schedule_of(member, profile), profile.overrides.get(member, []))


def record_history(run: str, profile: Profile = CPU) -> None:
    """Copy the epochs of RUNS/<run>/metrics.jsonl into the profile's history (replacing the run's earlier lines)."""
    from itmatch.engine.results import history_rows, replace_history

    metrics = ROOT / profile.runs / run / "metrics.jsonl"
    if metrics.is_file() and not DRY_RUN:
        replace_history(ROOT / profile.history, run, history_rows(run, metrics))


def run_perturb(preset: str, threads: int, profile: Profile = CPU, jobs: int = 1) -> None:
    """The study's trainings (resumable), `jobs` at once, then the table and chart copied to docs/results/. The
    unperturbed reference is the table's run of the preset when it has finished and the study has no `original` of
    its own (finished_table_run; the study checks that its settings are the study's): six trainings; else the study
    trains it too, seven."""
    out = f"{profile.runs}/perturb/{preset}"
    ensure_features(DATA, profile)  # (the schedule files' data.path, which the study's trainings read)
    table_run = finished_table_run(preset, profile)
    original = ["--original", table_run] if table_run else []
    run(["itmatch", "analyze", "perturb", "--preset", preset, "--config", schedule_of(preset, profile), "--out", out,
         "--split", "test", "--protocol", "1k", "--tag-cache", tag_cache(profile), "--jobs", str(jobs),
         "--set", f"train.threads={threads}", "--set", f"train.checkpoint_every={profile.checkpoint_every}",
         "--quiet", *original, *on_cpu(profile)])
    for ext in ("md", "csv", "png"):
        if not DRY_RUN:
            shutil.copyfile(ROOT / out / f"perturb.{ext}",
                            ROOT / f"docs/results/perturb/{profile.perturb_prefix}_{preset}.{ext}")


def recall_figure(rows: list[str], threads: int, profile: Profile = CPU) -> None:
    """The recall curves of evaluated rows side by side, docs/results/recall/<table>.png (`itmatch analyze recall`
    of their test JSONs). A row evaluated before evaluations recorded the curve is evaluated again, into its JSON
    only (the same scores on the CPU; its table row stays as it is), its features extracted first where missing;
    one without a checkpoint here stops the figure, naming it."""
    jsons = [f"{profile.runs}/{row}.test.json" for row in rows]  # (as the commands, run in ROOT, name them)
    for row, result_json in zip(rows, jsons, strict=True):
        path = ROOT / result_json
        if not (path.is_file() and "recall_curve" in json.loads(path.read_text(encoding="utf-8"))):
            members = evaluated_members(row, profile)
            absent = [] if DRY_RUN else without_checkpoint(members, profile)
            if absent:
                sys.exit(f"row {row}: no recall curve in {result_json} and no checkpoint of {', '.join(absent)} "
                         f"here to evaluate; leave the row out, or bring its JSON or run here")
            training = [] if DRY_RUN else [m for m in members if m not in SHIPPED_MEMBERS
                                           and not training_finished(ROOT / profile.runs / m)]
            if training:  # (its best/ is an epoch's on the way, not the row's model)
                sys.exit(f"row {row}: {', '.join(training)} has epochs left to train; finish the row first "
                         f"(python bench/flickr8k.py --config {profile.name} --row {row}), or leave it out")
            for data in dict.fromkeys(features_of(row, profile, members)):
                ensure_features(data, profile)  # (a fresh machine has the runs brought back, not the features)
            run(evaluation_command(row, profile, threads, ["--json", result_json, "--force"], members=members))
    figure = f"docs/results/recall/{Path(profile.results).stem}.png"
    (ROOT / figure).parent.mkdir(parents=True, exist_ok=True)
    run(["itmatch", "analyze", "recall", *jsons, "--labels", *rows, "--out", figure, "--force"])


def tag_cache(profile: Profile) -> str:
    """Where the studies of a profile keep the POS tags of the training captions (one cache for all of them;
    device_session.py carries it to a GPU machine, which has no spaCy)."""
    return f"{profile.runs}/perturb/cache"


def parse_arguments(argv: list[str] | None = None) -> tuple[argparse.Namespace, Profile]:
    """The command line and the profile it runs, checked (a usage error for a row --config does not have)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(PROFILES), default="cpu",
                        help="cpu: the CPU schedule (docs/results/flickr8k.csv, default); gpu: the papers' schedules "
                             "(docs/results/flickr8k_gpu.csv; needs a CUDA device)")
    parser.add_argument("--row", action="append", metavar="ROW",
                        help="rows to produce (default: every row of --config; --status lists them)")
    parser.add_argument("--perturb", action="append", choices=PERTURB, help="run the perturbation study of a model")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per training (0: all)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="with --perturb: trainings of the study at once, each in its own process (default 1)")
    parser.add_argument("--history", action="store_true",
                        help="only copy the trained runs' epochs into the history CSV (no training, no evaluation)")
    parser.add_argument("--status", action="store_true",
                        help="list every row and study of --config (or those --row and --perturb name) with where "
                             "it stands (evaluated, trained, training, not started, checkpoint missing); runs nothing")
    parser.add_argument("--dry-run", action="store_true",
                        help="check that every row's config resolves and print the commands; runs nothing")
    parser.add_argument("--eval-ranks", type=int, default=1,
                        help="processes (torchrun) sharing an exhaustive test evaluation, each with --threads "
                             "threads; the blocks are those of one process, so a run may resume with another count")
    parser.add_argument("--recall", action="store_true",
                        help="draw the --row rows' recall curves (R@1 ... R@100) into docs/results/recall/<table>.png, "
                             "evaluating again a row whose test JSON has no curve yet (its table row is kept)")
    parser.add_argument("--train-only", action="store_true",
                        help="train (or finish training) the rows' models, do not evaluate them")
    parser.add_argument("--device", choices=["cpu"],
                        help="with --config gpu: train and evaluate its rows on the CPU (the same schedules, hours "
                             "per row; the rows' device column names the CPU)")
    args = parser.parse_args(argv)
    profile = PROFILES[args.config]
    if args.device and not profile.device:
        parser.error(f"--device {args.device} is for --config gpu; the CPU schedule runs where torch's 'auto' puts it")
    if args.device == "cpu":
        profile = replace(profile, on_cpu=True)
    unknown = [r for r in args.row or [] if r not in profile.rows]
    if unknown:
        parser.error(f"unknown row(s) for --config {profile.name}: {', '.join(unknown)} (see --status)")
    if args.recall and not args.row:
        parser.error("--recall draws the rows named with --row (e.g. --row vsepp --row mmca_alpha0)")
    return args, profile


def main() -> int:
    global DRY_RUN
    args, profile = parse_arguments()
    rows = args.row or profile.rows
    if args.status:  # the rows and studies named, or every one
        named = bool(args.row or args.perturb)
        for row in (args.row or []) if named else profile.rows:
            print(f"{row}: {row_status(row, profile)}")
        for preset in (args.perturb or []) if named else PERTURB:
            print(f"perturb {preset}: {study_status(preset, profile)}")
        return 0
    if args.history:
        for row in args.row or [r for r in profile.rows if r not in profile.ensembles]:
            record_history(row, profile)
        run([sys.executable, "scripts/render_results.py"])
        return 0
    DRY_RUN = args.dry_run
    if profile.device and not profile.on_cpu and not DRY_RUN:
        require_cuda()  # before any work
    check_rows_resolve(profile)
    if args.recall:
        recall_figure(rows, args.threads, profile)
        return 0
    if args.perturb:
        for preset in args.perturb:
            try:
                run_perturb(preset, args.threads, profile, args.jobs)
            except MissingFeatures as exc:
                sys.exit(f"perturb {preset}: {exc}")
        return 0
    failed = []
    for row in rows:
        try:
            run_row(row, args.threads, args.train_only, args.eval_ranks, profile)
        # (SystemExit: a row's own refusal, e.g. a run trained with other settings; ItmatchError: e.g. a results CSV's
        # header): reported at the end, the rows after it still run and the pages are still rendered
        except (subprocess.CalledProcessError, MissingCheckpoint, MissingFeatures, SystemExit, ItmatchError) as exc:
            print(f"row {row} FAILED: {exc}", file=sys.stderr, flush=True)
            failed.append(row)
    run([sys.executable, "scripts/render_results.py"])
    if failed:
        print(f"{len(failed)} row(s) failed: {', '.join(failed)} (rerun them with --row; --status shows where they "
              "stand)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
