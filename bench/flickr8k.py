"""Train and evaluate every row of docs/results/flickr8k.csv on Flickr8K (224x224) features.

    python bench/flickr8k.py --row scan_t2i_avg        # one row (trains if RUN/best is absent)
    python bench/flickr8k.py                           # all rows, in order
    python bench/flickr8k.py --perturb scan_t2i_avg    # OAN's perturbation study (Table 1) of one model

Features come from `itmatch extract` (see README); every model uses configs/flickr8k/cpu.yaml on top of its
preset (so OAN keeps its own Adam lr 5e-4 and weight decay 1e-6; see docs/oan.md), except the SMAN rows,
which use configs/flickr8k/sman_cpu.yaml (the same schedule with Adam 5e-4, no L2; docs/sman.md), and the SAVE
rows, which use configs/flickr8k/save_cpu.yaml (the same schedule at lr 5e-4; docs/save.md).
SAVE rows that fuse scales read cached c3/c4 maps too: the first of them runs the multi-scale extraction
(`itmatch extract ... --scales c3,c4,c5`, about as long as the plain one) into DATA_MS; the fine-tuned
row reads the image files (data.images) and trains the backbone end to end (see docs/save.md for its cost).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

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
SINGLE = ["vsepp", "summax_t2i", "scan_t2i_avg", "scan_i2t_avg", "scan_i2t_lse", *OAN_ROWS, *SMAN_ROWS, *MMCA_ROWS,
          *SAVE_ROWS]
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
# rows whose model reads something else than DATA's {split}_ims.npy
ROW_DATA = {"save_asa_ms2": DATA_MS, "save_asa_ms3": DATA_MS, "save_nl_ms2": DATA_MS}
PERTURB = ["scan_t2i_avg", "vsepp"]  # the two models of OAN's Table 1
# Mid-epoch saves of `last` (bit-for-bit resumable; docs/reliability.md): an epoch of the slow rows is hours
# of CPU, so a stopped run loses at most this many batches instead of the epoch.
CHECKPOINT_EVERY = 20


def base_preset(row: str) -> str:
    """The preset a row trains: a control row's preset, else the row's own name."""
    return CONTROLS.get(row, (row,))[0]


def run(cmd: list[str], ranks: int = 1) -> None:
    """Run a command; `itmatch` is this interpreter's (whatever PATH says), under torchrun when ranks > 1."""
    print("+", *([f"torchrun x{ranks}"] if ranks > 1 else []), *cmd, flush=True)
    if cmd[0] == "itmatch":
        torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
        cmd = [sys.executable, *(torchrun if ranks > 1 else []), "-m", "itmatch", *cmd[1:]]
    subprocess.run(cmd, cwd=ROOT, check=True)


def ensure_multiscale() -> None:
    """Cache the c3/c4 stage maps beside a copy of the c5 grid (resumable; skipped once complete)."""
    if all((ROOT / DATA_MS / f"{split}_ims_c3.npy").exists() for split in ("train", "dev", "test")):
        return
    run(["itmatch", "extract", IMAGES, CAPTIONS, "--out", DATA_MS, "--scales", "c3,c4,c5"])


def training_finished(run: Path) -> bool:
    """Whether a run has trained all its epochs. Not merely `best`: a run stopped in its second epoch has the
    first epoch's `best`, and evaluating that would report a half-trained model. `last` records the epochs
    completed; a run directory from before `last` existed counts as finished when it has `best`."""
    if not (run / "last" / "state.json").exists():
        return (run / "best").exists()
    state = json.loads((run / "last" / "state.json").read_text())
    epochs = json.loads((run / "config.json").read_text())["train"]["epochs"]
    return state["epoch"] >= epochs and state.get("batch", 0) == 0  # (older runs: no "batch")


def run_row(row: str, threads: int, train_only: bool = False, eval_ranks: int = 1) -> None:
    preset, rerank = RERANK.get(row, (PRUNED.get(row, row), 0))
    scoring = (["--rerank", str(rerank)] if rerank else ["--prune"] if row in PRUNED
               # exhaustive scoring of a pair head takes hours (MMCA): a killed bench continues from finished blocks
               else ["--resume-dir", f"runs/eval_blocks/flickr8k/{row}"])
    members = ENSEMBLES.get(preset, [preset])
    data = ROW_DATA.get(base_preset(preset), DATA)
    if data == DATA_MS:
        ensure_multiscale()
    for member in members:
        if member in PREREQUISITES and not training_finished(ROOT / "runs/flickr8k" / PREREQUISITES[member]):
            run_row(PREREQUISITES[member], threads)  # the run this one continues
        out = f"runs/flickr8k/{member}"
        member_preset = base_preset(member)
        schedule = SCHEDULES.get(member_preset, SCHEDULE)
        check_run_matches(out, member_preset, schedule, OVERRIDES.get(member, []))
        if not training_finished(ROOT / out):
            resume = ["--resume"] if (ROOT / out / "last").exists() else []
            sets = [a for s in OVERRIDES.get(member, []) for a in ("--set", s)]
            run(["itmatch", "train", "--preset", member_preset, "--config", schedule,
                 "--data", data, "--out", out, "--force", "--set", f"train.threads={threads}",
                 "--set", f"train.checkpoint_every={CHECKPOINT_EVERY}", *sets, *resume])
        record_history(member)
    if train_only:
        return
    run(["itmatch", "evaluate", *[f"runs/flickr8k/{p}/best" for p in members], "--data", data,
         "--split", "test", "--protocol", "1k", "--results", RESULTS, "--name", row, "--dataset", "flickr8k",
         "--command", f"python bench/flickr8k.py --row {row}", "--force", "--quiet",
         "--json", f"runs/flickr8k/{row}.test.json", *(["--threads", str(threads)] if threads else []), *scoring],
        ranks=eval_ranks if "--resume-dir" in scoring else 1)  # (two-stage scoring runs on one process)


# settings a run may differ in from its row: filled from the data, or how (not what) it was trained
_RUN_ONLY = {"model.vocab_size", "model.img_dim", "model.save.c3_dim", "model.save.c4_dim", "train.threads",
             "train.checkpoint_every"}


def check_run_matches(out: str, preset: str, schedule: str, sets: list[str]) -> None:
    """Stop if an existing run (which the bench would resume, or evaluate as it is) was trained with other
    settings than its row has now, e.g. a run started before a preset changed. Settings the run's config
    does not record (it predates them) cannot be compared and are skipped."""
    from itmatch.config import load_yaml, parse_overrides
    from itmatch.models.registry import resolve_config

    saved = ROOT / out / "config.json"
    if not saved.is_file():
        return
    now = flatten(resolve_config(preset, load_yaml(ROOT / schedule), parse_overrides(sets)).to_dict())
    then = flatten(json.loads(saved.read_text(encoding="utf-8")))
    differ = [f"{k}={then[k]!r} (row: {now[k]!r})" for k in sorted(set(now) & set(then))
              if k.split(".")[0] in ("model", "loss", "train") and k not in _RUN_ONLY and now[k] != then[k]]
    if differ:
        sys.exit(f"{out} was trained with other settings than row {preset} now has: {', '.join(differ)}.\n"
                 f"  fix: move {out} aside (e.g. into runs/flickr8k/old/) and run the row again")


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}"""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def record_history(run: str) -> None:
    """Copy the epochs of runs/flickr8k/<run>/metrics.jsonl into HISTORY (replacing the run's earlier lines)."""
    from itmatch.engine.results import history_rows, replace_history

    metrics = ROOT / "runs" / "flickr8k" / run / "metrics.jsonl"
    if metrics.is_file():
        replace_history(ROOT / HISTORY, run, history_rows(run, metrics))


def run_perturb(preset: str, threads: int) -> None:
    """All seven trainings of the study (resumable), then the table and chart copied to docs/results/."""
    out = f"runs/flickr8k/perturb/{preset}"
    run(["itmatch", "analyze", "perturb", "--preset", preset, "--config", SCHEDULE, "--out", out,
         "--split", "test", "--protocol", "1k", "--tag-cache", "runs/flickr8k/perturb/cache",
         "--set", f"train.threads={threads}", "--quiet"])
    for ext in ("md", "csv", "png"):
        shutil.copyfile(ROOT / out / f"perturb.{ext}", ROOT / f"docs/results/perturb/flickr8k_{preset}.{ext}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row", action="append",
                        choices=SINGLE + list(CONTROLS) + list(ENSEMBLES) + list(RERANK) + list(PRUNED),
                        help="rows to produce")
    parser.add_argument("--perturb", action="append", choices=PERTURB, help="run the perturbation study of a model")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per training (0: all)")
    parser.add_argument("--history", action="store_true",
                        help=f"only copy the trained runs' epochs into {HISTORY} (no training, no evaluation)")
    parser.add_argument("--eval-ranks", type=int, default=1,
                        help="processes (torchrun) sharing an exhaustive test evaluation, each with --threads "
                             "threads; the blocks are those of one process, so a run may resume with another count")
    parser.add_argument("--train-only", action="store_true",
                        help="train (or finish training) the rows' models, do not evaluate them")
    args = parser.parse_args()
    if args.history:
        for row in args.row or SINGLE + list(CONTROLS):
            record_history(row)
        run([sys.executable, "scripts/render_results.py"])
        return 0
    if args.perturb:
        for preset in args.perturb:
            run_perturb(preset, args.threads)
        return 0
    for row in args.row or SINGLE + list(CONTROLS) + list(ENSEMBLES) + list(RERANK) + list(PRUNED):
        run_row(row, args.threads, args.train_only, args.eval_ranks)
    run([sys.executable, "scripts/render_results.py"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
