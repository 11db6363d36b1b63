"""The perturbation study of OAN section 3 (Table 1): train one model configuration once per training-caption
perturbation, evaluate every run on the unperturbed test captions, and report R@1/5/10 with the change
against the unperturbed run, the prior of each part-of-speech class, a table and a bar chart.
Runs live in OUT/<perturbation>/ and are reused or resumed only when they were trained with the command's
settings (`run_differences`): docs/oan.md, 'The perturbation study'.
"""

from __future__ import annotations

import copy
import csv
import io
import json
import os
import sys
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from itmatch.config import Config, config_from_dict, flatten
from itmatch.data.perturb import (
    PERTURBATIONS,
    POS_CLASSES,
    CaptionPerturbation,
    Tagged,
    cached_tagger,
    prior_probabilities,
    tag_captions,
)
from itmatch.data.precomp import PrecompSplit, read_precomp
from itmatch.device import resolve
from itmatch.engine.checkpoint import load_checkpoint, read_checkpoint_config, read_run_config, read_state
from itmatch.engine.evaluate import evaluate_models
from itmatch.engine.stop import pass_stop_on, start_training_process, stop_on_signal
from itmatch.engine.train import train, training_finished
from itmatch.errors import CheckpointError, ConfigError, OverwriteError, TrainingStopped
from itmatch.io import write_json_atomic, write_text_atomic, write_with
from itmatch.models.registry import arch, read_pixels_for_finetuning

LABELS = {"original": "Original model", "shuffle": "Random shuffling", "numbers": "Drop numbers",
          "prepositions": "Drop prepositions", "verbs": "Drop verbs", "adjectives": "Drop adjectives/adverbs",
          "nouns": "Drop nouns"}
DIRECTIONS = ("text_to_image", "image_to_text")
KS = ("r1", "r5", "r10")
#: config keys that do not change what a run learns: its label, where and how fast it ran, how often it
#: logged or saved (a run trained on another device or with other threads is the same experiment), and where its
#: batches were built (train.resident, train.workers: the same batches either way)
UNCOMPARED = frozenset({"name", "train.threads", "train.log_every", "train.checkpoint_every", "train.device",
                        "train.backend", "train.resident", "train.workers"})
#: keys the trainer fills from the data when the command leaves them unset (0 or ""), beside the feature channel
#: counts each arch names (`Arch.feature_dims`): compared only when set
FILLED_FROM_DATA = frozenset({"model.vocab_size", "data.backbone"})
STUDY_FILE = "study.json"  # in each run directory: the perturbation and its seed (not part of the config)


def run_perturbation_study(cfg: Config, out: str | Path, perturbations: Sequence[str] = PERTURBATIONS, *,
                           split: str = "test", protocol: str = "1k", seed: int = 0, force: bool = False,
                           tag_cache: str | Path | None = None, progress: bool = True,
                           jobs: int = 1, original: str | Path | None = None, device: str | None = None,
                           precision: str | None = None) -> dict[str, Any]:
    """Train `cfg` on each perturbation of its training captions, evaluate on the unperturbed `split`,
    write OUT/perturb.{json,csv,md,png}; returns the JSON report. `original` is always included (the
    reference of the deltas). force: retrain runs that exist. tag_cache: where the POS tags of the training
    captions are cached (default OUT/cache; share one between studies of the same data). jobs: trainings at
    once, each in its own process (a GPU runs the seven small models of a study side by side; on a CPU they
    share its cores: train.threads 0 becomes the cores / jobs each). original: a finished run of `cfg` (a
    results table's run of the same preset and schedule) used as the unperturbed reference instead of training
    it again; its config is checked like a run of the study's, and its evaluation is cached in OUT/original.
    device / precision (the command's --device / --precision): where the trainings run and the runs are evaluated,
    a resumed run and one trained elsewhere included (else each run's own train.device / train.precision)."""
    unknown = [p for p in perturbations if p not in PERTURBATIONS]
    if unknown:
        raise ConfigError(f"unknown perturbation(s) {', '.join(unknown)}",
                          hint=f"choose from {', '.join(PERTURBATIONS)}")
    if jobs < 1:
        raise ConfigError(f"jobs must be at least 1, got {jobs}")
    kinds = ["original", *[p for p in dict.fromkeys(perturbations) if p != "original"]]
    if not cfg.data.path:
        raise ConfigError("data.path is not set", hint="pass --data DIR (a precomp directory)")
    out = Path(out)
    run_dirs = {kind: out / kind for kind in kinds}
    if original is not None:
        run_dirs["original"] = Path(original)
        if not training_finished(original):
            raise ConfigError(f"--original {original}: not a finished run (no best/ checkpoint, or epochs left)",
                              path=original, hint="finish its training first (itmatch train --out RUN --resume), "
                                                  "or leave --original out to train the reference in the study")
    for kind in kinds:  # before the tagging and the trainings: a mismatch is found in seconds, not hours
        if not force or run_dirs[kind] != out / kind:
            check_existing_run(run_dirs[kind], cfg, study_record(kind, seed))
    train_split = read_precomp(cfg.data.path, cfg.data.train_split)
    test_split = read_precomp(cfg.data.path, split)
    tag_dir = tag_cache or out / "cache"
    tagged = tag_captions(train_split.training_captions, cache_dir=tag_dir, progress=progress)
    priors = prior_probabilities(tagged)
    to_train = [kind for kind in kinds  # (a run stopped after an epoch has a `best`, but is not finished)
                if run_dirs[kind] == out / kind and (force or not training_finished(out / kind))]
    trainings = [_Training(_run_config(cfg, kind, jobs).to_dict(), out / kind, kind, seed, force,
                           resume=started(out / kind) and not force, device=device, precision=precision)
                 for kind in to_train]
    _train_all(trainings, train_split.training_captions, tagged, jobs, progress)
    rows = []
    for kind in kinds:
        transform = CaptionPerturbation(kind, train_split.training_captions, tagged, seed=seed)
        result, best_epoch = _evaluate(run_dirs[kind], out / kind, test_split, protocol, progress, device, precision)
        rows.append({"perturbation": kind, "label": LABELS[kind], "empty_captions": len(transform.empty),
                     "prior": priors.get(kind), "best_epoch": best_epoch, "rsum": result["rsum"],
                     **_run_facts(run_dirs[kind]), **{d: {k: result[d][k] for k in KS} for d in DIRECTIONS}})
    base = rows[0]
    for row in rows:
        for d in DIRECTIONS:
            for k in KS:
                delta = row[d][k] - base[d][k]
                row[d][f"{k}_delta"] = delta
                # (None against a reference recall of 0: no relative change to state; shown as "-")
                row[d][f"{k}_delta_pct"] = 100.0 * delta / base[d][k] if base[d][k] else None
    report = {"model": cfg.preset or cfg.model.arch, "data": cfg.data.path, "split": split, "protocol": protocol,
              "reference": str(run_dirs["original"]),
              "schedule": schedule_line(cfg), "train_captions": len(train_split.training_captions),
              "tagger": cached_tagger(train_split.training_captions, tag_dir), "priors": priors, "rows": rows}
    write_json_atomic(out / "perturb.json", report)
    write_text_atomic(out / "perturb.csv", to_csv(report))
    write_text_atomic(out / "perturb.md", to_markdown(report))
    write_with(out / "perturb.png", lambda tmp: plot(report, tmp))
    return report


@dataclass(frozen=True)
class _Training:
    """One perturbation's training: what a worker process needs besides the captions and their tags (the config
    as a dict: its model class is built at run time, so a spawned process rebuilds it from its own registry)."""
    config: dict[str, Any]
    run_dir: Path
    kind: str
    seed: int
    force: bool
    resume: bool
    device: str | None = None
    precision: str | None = None


def _run_config(cfg: Config, kind: str, jobs: int) -> Config:
    run_cfg = copy.deepcopy(cfg)
    run_cfg.name = f"{cfg.name}-{kind}"
    if jobs > 1 and not cfg.train.threads:  # (threads do not change what a run learns: UNCOMPARED)
        run_cfg.train.threads = max(1, (os.cpu_count() or 1) // jobs)
    return run_cfg


def _train_one(training: _Training, captions: Sequence[str], tagged: Tagged, progress: bool,
               stop_signals: bool = True) -> None:
    transform = CaptionPerturbation(training.kind, captions, tagged, seed=training.seed)
    cfg = config_from_dict(training.config)
    # a resumed run keeps its own settings but saves as often as this command asks (a study continued session after
    # session loses at most that many batches); its threads stay: they change float sums, so resumes stay exact
    saving = {"train": {"checkpoint_every": cfg.train.checkpoint_every}} if training.resume else None
    # The record first: a run stopped before it ends is still checked against it (check_existing_run). A new run's
    # directory then holds that record and no config.json (or it would be resumed), so the trainer may write there;
    # a best/ alone (copied in by hand) still stops it
    run_dir = training.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / STUDY_FILE, study_record(training.kind, training.seed))
    new_run = not training.resume and not (run_dir / "best").exists()
    train(cfg, run_dir, resume=training.resume, force=training.force or new_run, transform=transform,
          progress=progress, resume_overrides=saving, device=training.device, precision=training.precision,
          stop_signals=stop_signals)


def _train_all(trainings: list[_Training], captions: Sequence[str], tagged: Tagged, jobs: int,
               progress: bool) -> None:
    """Every training, `jobs` at a time in spawned processes (in this one when jobs is 1, with progress bars).
    A failed training does not stop the others (each is resumable); the first failure is raised at the end."""
    def announce(training: _Training) -> None:
        if progress:
            print(f"[perturb] {training.kind}: training into {training.run_dir}"
                  + (" (resuming)" if training.resume else ""), flush=True)

    if jobs == 1 or len(trainings) <= 1:
        for training in trainings:
            announce(training)
            _train_one(training, captions, tagged, progress)
        return
    for training in trainings:
        announce(training)
    failures: list[tuple[str, BaseException]] = []
    stopped: list[str] = []
    not_started: list[str] = []
    # A stop signal to this process (a Ctrl-C reaches the workers too, which ignore it) is passed on to every
    # training process, which saves where it is and stops, as one training in this process does (engine/stop.py);
    # the trainings not yet started never start. A second signal stops them at once.
    with (stop_on_signal(announce=progress, on_signal=pass_stop_on,
                         what="every training saves where it is, then the study stops") as stop,
          ProcessPoolExecutor(max_workers=min(jobs, len(trainings)), mp_context=get_context("spawn"),
                              initializer=start_training_process) as pool):
        futures = {pool.submit(_train_one, t, captions, tagged, False): t.kind for t in trainings}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            if stop.requested:  # (a cancelled one is not running: it never will)
                not_started += [futures[f] for f in pending if f.cancel()]
                pending = {f for f in pending if not f.cancelled()}
            for future in done:
                kind = futures[future]
                try:
                    future.result()
                except TrainingStopped:
                    stopped.append(kind)
                    continue
                except BaseException as exc:  # (reported once every other training has ended)
                    failures.append((kind, exc))
                    continue
                if progress:
                    print(f"[perturb] {kind}: trained", flush=True)
    if stop.requested and not failures:
        saved = (f"{', '.join(sorted(stopped))} saved where they were (each in its run's last/)" if stopped
                 else "nothing to save")
        raise TrainingStopped(f"stopped by {stop.name}: {saved}"
                              + (f"; not started: {', '.join(sorted(not_started))}" if not_started else ""),
                              int(stop.signal or 0))
    if failures:  # (an ItmatchError comes back from its process with its whole message: the CLI prints it)
        print(f"[perturb] failed: {', '.join(kind for kind, _ in failures)}; the finished runs stay, a rerun "
              "resumes the others", file=sys.stderr, flush=True)
        raise failures[0][1]


def _same_value(key: str, stored: Any, wanted: Any) -> bool:
    if key in ("data.path", "data.images") and stored and wanted:  # the same folder, however it is written
        return Path(stored).resolve() == Path(wanted).resolve()
    return stored == wanted


def run_differences(stored: Config, wanted: Config) -> dict[str, tuple[Any, Any]]:
    """Dotted config key -> (run's value, command's value) where a run's config (as its checkpoint is read:
    `read_checkpoint_config`) differs from the one a command would train, leaving out UNCOMPARED keys and the
    keys filled from the data (FILLED_FROM_DATA, the arch's feature dims) that the command leaves unset."""
    old, new = flatten(stored.to_dict()), flatten(wanted.to_dict())
    filled = FILLED_FROM_DATA | set(arch(wanted.model).feature_dims(wanted.model).values())
    return {key: (old.get(key), new.get(key)) for key in sorted(old.keys() | new.keys())
            if key not in UNCOMPARED and not (key in filled and not new.get(key))
            and not _same_value(key, old.get(key), new.get(key))}


def study_record(kind: str, seed: int) -> dict[str, Any]:
    """What a run's STUDY_FILE records besides its config: the perturbation, and the seed where it changes the
    captions (shuffle's order; the other perturbations drop the same words whatever the seed)."""
    return {"perturbation": kind, **({"seed": seed} if kind == "shuffle" else {})}


def started(run_dir: Path) -> bool:
    """Whether a training of `run_dir` has begun: it saved its config (the trainer resumes it from last/, or from
    that config when it was stopped before its first checkpoint)."""
    return (run_dir / "last").exists() or (run_dir / "config.json").is_file()


def check_existing_run(run_dir: Path, cfg: Config, study: dict[str, Any]) -> None:
    """Refuse to reuse (best/) or resume (last/, or the run's own config.json when it stopped before its first
    checkpoint) a run of `run_dir` trained with other settings than `cfg` or another perturbation seed
    (OverwriteError naming the keys); nothing to check when there is no run. The run's config is read as its
    checkpoint is loaded: its data paths, stored from the checkpoint's directory, resolved from there, and keys
    of older versions read by their current names."""
    for state in ("best", "last", "."):  # what the study would reuse, else what it would resume
        saved = run_dir / state / "config.json"
        if saved.is_file():
            break
    else:
        return
    wanted = copy.deepcopy(cfg)
    read_pixels_for_finetuning(wanted)  # what the trainer sets before it saves the config
    try:  # (the run's own config.json stores its data paths as the trainer restarts from it: read_run_config)
        stored = read_checkpoint_config(saved.parent) if state != "." else read_run_config(run_dir)
    except CheckpointError as exc:
        raise ConfigError(f"cannot read the run's config ({exc.message})", path=saved,
                          hint=_retrain_hint(run_dir)) from None
    differ = run_differences(stored, wanted)
    recorded = _read_study(run_dir / STUDY_FILE)
    if recorded is not None:
        differ |= {f"study.{key}": (recorded[key], value) for key, value in study.items()
                   if key in recorded and recorded[key] != value}
    if differ:
        shown = ", ".join(f"{key} (run: {old!r}, now: {new!r})" for key, (old, new) in differ.items())
        which = {"best": "best", "last": "last", ".": "started"}[state]
        raise OverwriteError(f"the {which} run in {run_dir} was trained with other settings: {shown}",
                             path=saved, hint=_retrain_hint(run_dir))


def _retrain_hint(run_dir: Path) -> str:
    """How to get past a run the study cannot use: that run alone, or the whole study (--force retrains every run)."""
    return (f"delete {run_dir} to retrain that run with these settings (--force retrains every run of the study), "
            "or write the study to another --out")


def _read_study(path: Path) -> dict[str, Any] | None:
    """A run's recorded perturbation and seed; None when it has none (runs of earlier versions) or it is
    unreadable (then only the config is compared)."""
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return recorded if isinstance(recorded, dict) else None


def schedule_line(cfg: Config) -> str:
    """What every run of a study trained with, in one line of its report (e.g. "D = 1024, 30 epochs, batch 128,
    adam lr 0.0002 (x 0.1 after 15 epochs), warm-up 0 epochs")."""
    t = cfg.train
    return (f"D = {cfg.model.embed_size}, {t.epochs} epochs, batch {t.batch_size}, {t.optimizer} lr {t.lr:g} "
            f"(x 0.1 after {t.lr_update} epochs), warm-up {cfg.loss.warmup_epochs} epochs")


def _run_facts(run_dir: Path) -> dict[str, Any]:
    """Where and how long a row's run trained, from the checkpoint the row evaluates (best/): its schedule's
    epochs, the machines it trained on (runs before they were recorded: its train.device setting) and its best dev
    rsum; a study's rows may come from different machines (the reference from a results table, a resumed run)."""
    stored, state = read_checkpoint_config(run_dir / "best"), read_state(run_dir / "best")
    return {"epochs": stored.train.epochs, "trained_on": " + ".join(state.get("devices") or [stored.train.device]),
            "dev_rsum": state.get("best_rsum")}


def _evaluate(run_dir: Path, cache_dir: Path, split: PrecompSplit, protocol: str, progress: bool,
              device: str | None = None, precision: str | None = None) -> tuple[dict[str, Any], Any]:
    """Test metrics of run_dir/best on the unperturbed split, cached in cache_dir with the checkpoint they are of
    (where its weights are, their size and time), so re-running the study only evaluates new runs, and the cache of
    OUT/original never answers for another checkpoint (a study's own reference, then a table's run as --original)."""
    cache = cache_dir / f"eval_{split.split}_{protocol}.json"
    weights = (run_dir / "best" / "model.safetensors").resolve()
    checkpoint = {"weights": str(weights), "bytes": weights.stat().st_size, "mtime_ns": weights.stat().st_mtime_ns}
    if cache.is_file():
        try:
            cached = json.loads(cache.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            cached = {}  # (a damaged cache is evaluated again, and rewritten)
        cached = cached if isinstance(cached, dict) else {}
        if cached.get("checkpoint") == checkpoint and cached.get("n_captions") == len(split.captions):
            return cached["result"], cached["best_epoch"]
    ckpt = load_checkpoint(run_dir / "best")
    # evaluated where and as it trained, unless the command says where (a GPU study's runs read on a CPU)
    where = resolve(device or ckpt.config.train.device, precision or ckpt.config.train.precision,
                    device_setting="--device" if device else "train.device",
                    precision_setting="--precision" if precision else "train.precision")
    result = evaluate_models([(ckpt.model.to(where.device), ckpt.vocab)], split, protocol, progress=progress,
                             precision=where.precision)
    best_epoch = ckpt.state.get("best_epoch")
    cache_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(cache, {"checkpoint": checkpoint, "n_captions": len(split.captions), "best_epoch": best_epoch,
                              "result": result})
    return result, best_epoch


def _shown(value: Any, missing: str = "-", spec: str = "") -> str:
    """A cell of the report: the value formatted by `spec`, or `missing` for one a run did not record."""
    return missing if value is None else format(value, spec)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def to_csv(report: dict[str, Any]) -> str:
    """One line per perturbation: both directions' R@K, delta and delta %, then its run's test rsum, best dev epoch,
    epochs and device setting."""
    buf = io.StringIO()
    header = ["perturbation", "prior", "empty_captions"]
    columns = [(d, f"{k}{suffix}") for d in DIRECTIONS for k in KS for suffix in ("", "_delta", "_delta_pct")]
    header += [f"{d}_{c}" for d, c in columns] + ["rsum", "best_epoch", "epochs", "trained_on"]
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    for row in report["rows"]:
        line = [row["perturbation"], _shown(row["prior"], "", ".4f"), row["empty_captions"]]
        line += [_shown(row[d][c], "", ".2f") for d, c in columns]
        line += [_shown(row.get("rsum"), "", ".2f"),
                 *(_shown(row.get(key), "") for key in ("best_epoch", "epochs", "trained_on"))]
        writer.writerow(line)
    return buf.getvalue()


def to_markdown(report: dict[str, Any]) -> str:
    """Table 1's layout, text-to-image then image-to-text, then the priors."""
    parts = [f"# Perturbation study: {report['model']}\n",
             f"Trained on perturbed training captions ({report['train_captions']} of them), evaluated on the "
             f"unperturbed `{report['split']}` split ({report['protocol']} protocol). Cells: R@K (Δ, Δ%).\n"]
    if report.get("schedule"):  # (reports written before it was recorded have none)
        parts.append(f"Every run: {report['schedule']}; each evaluated at its best dev epoch (Runs, below).\n")
    if report.get("reference"):  # (which run the deltas are against: the study's own, or a table's via --original)
        parts.append(f"Δ against the unperturbed reference `{report['reference']}`.\n")
    for d in DIRECTIONS:
        parts.append(f"\n## {d.replace('_', ' ')}\n")
        parts.append("| perturbation | R@1 | R@5 | R@10 | captions left without a word |")
        parts.append("|---|---|---|---|---|")
        for row in report["rows"]:
            cells = [f"{row[d][k]:.1f} ({row[d][k + '_delta']:+.1f}, {_percent(row[d][k + '_delta_pct'])})" for k in KS]
            parts.append(f"| {row['label']} | {' | '.join(cells)} | {row['empty_captions']} |")
    if all("rsum" in row for row in report["rows"]):
        parts.append("\n## Runs\n\n| perturbation | test rsum | best dev rsum | at epoch | of | trained on |")
        parts.append("|---|---|---|---|---|---|")
        for row in report["rows"]:
            parts.append(f"| {row['label']} | {row['rsum']:.1f} | {_shown(row['dev_rsum'], spec='.1f')} | "
                         f"{_shown(row['best_epoch'])} | {row['epochs']} | {row['trained_on']} |")
    parts.append("\n## Prior probability that a training caption contains the class\n")
    if report.get("tagger"):  # (the parts of speech dropped above are this tagger's; older reports lack it)
        parts.append(f"Penn tags of the training captions by spaCy's `{report['tagger']}`.\n")
    parts.append("| class | Penn tags | prior |")
    parts.append("|---|---|---|")
    for name, tags in POS_CLASSES.items():
        parts.append(f"| {name} | {', '.join(tags)} | {100 * report['priors'][name]:.1f}% |")
    parts.append("\nCaptions left without a word are kept (the model sees only <start>, any punctuation, <end>).\n")
    return "\n".join(parts)


def plot(report: dict[str, Any], path: Path) -> None:
    """Grouped bars of Δ% of text-to-image R@1/5/10 per perturbation, with the class priors beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if r["perturbation"] != "original"]
    fig, (ax, ax_prior) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1.3]})
    width = 0.26
    for i, k in enumerate(KS):
        values = [r["text_to_image"][f"{k}_delta_pct"] or 0.0 for r in rows]  # (no bar where it is undefined)
        ax.bar([x + (i - 1) * width for x in range(len(rows))], values, width, label=f"R@{k[1:]}")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [r["label"].replace("Drop ", "drop\n").replace("Random ", "random\n")
                                     for r in rows], fontsize=8)
    ax.set_ylabel("Δ% vs original (text→image)")
    ax.set_title(f"{report['model']}: trained on perturbed captions")
    ax.legend(fontsize=8)
    names = list(POS_CLASSES)
    ax_prior.bar(range(len(names)), [100 * report["priors"][n] for n in names], color="grey")
    ax_prior.set_xticks(range(len(names)), names, rotation=30, fontsize=8)
    ax_prior.set_ylabel("% of training captions")
    ax_prior.set_title("class prior")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    plt.close(fig)
