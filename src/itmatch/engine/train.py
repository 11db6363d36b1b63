"""Training loop: Adam (or Adadelta), step learning-rate schedule, gradient clipping, end-of-epoch validation
by dev rsum, best and last checkpoints, resume, a run directory with the resolved config and a metrics log.
A run killed at any moment continues with --resume to the same metrics, bit for bit on CPU; what `last` holds
and why that works: docs/reliability.md, guarantee 4 and "Crash safety in detail"."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import random
import shutil
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from itmatch import distributed as dist
from itmatch.config import MOVED_KEYS, Config, flatten, get_key, locate, update
from itmatch.data.datasets import (
    CaptionTransform,
    LengthBucketSampler,
    PairBatch,
    PairDataset,
    collate_captions,
    collate_pairs,
)
from itmatch.data.precomp import META_NAME, PrecompSplit
from itmatch.data.vocab import AnyVocab, RememberedVocab
from itmatch.device import Placement, machine_name, resolve
from itmatch.engine.augment import check_region_dropout, training_region_mask
from itmatch.engine.averaging import STATE_KEY as AVERAGE_KEY
from itmatch.engine.averaging import weight_average
from itmatch.engine.checkpoint import (
    MANIFEST,
    config_for_checkpoint,
    init_weights_from,
    load_checkpoint,
    load_optimizer_state,
    load_trainer_state,
    read_checkpoint_config,
    read_run_config,
    read_state,
    recover_checkpoint,
    save_checkpoint,
    verify_manifest,
)
from itmatch.engine.evaluate import evaluate_models
from itmatch.engine.inputs import data_backbone, fill_image_dims, open_split
from itmatch.engine.resident import resident_images
from itmatch.engine.stop import StopNow, ignore_stop_signals, stop_on_signal
from itmatch.engine.vocabulary import (
    apply_word_vectors,
    check_min_word_count,
    make_vocab,
    report_vocabulary,
    take_init_vocabulary,
)
from itmatch.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    OverwriteError,
    TrainingError,
    TrainingStopped,
)
from itmatch.io import write_json_atomic
from itmatch.models.base import Embeddings, Matcher, SimilarityHead, TextEmb
from itmatch.models.losses import triplet_loss
from itmatch.models.registry import (
    build_model,
    check_norm_switches,
    finetune_backbone,
    image_inputs,
    read_pixels_for_finetuning,
)

log = logging.getLogger("itmatch.train")
TEST_SPLITS = ("test", "testall")  # the splits results are reported on
_log = log  # (inside train(), `log` is the metrics file)


def learning_rate(cfg: Config, epoch: int) -> float:
    """lr0 * 0.1 ** (epoch // lr_update), the public SCAN code's step schedule."""
    return cfg.train.lr * 0.1 ** (epoch // max(1, cfg.train.lr_update))


OPTIMIZERS = {"adam": torch.optim.Adam, "adadelta": torch.optim.Adadelta}


def make_optimizer(cfg: Config, model: torch.nn.Module, epoch: int) -> torch.optim.Optimizer:
    """The configured optimizer over the trainable parameters (frozen ones, e.g. a pretrained text
    encoder, are left out); parameters named in `model.lr_scales` get their own group at lr * scale."""
    if cfg.train.optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown train.optimizer {cfg.train.optimizer!r}",
                          hint=f"choose one of {', '.join(OPTIMIZERS)}")
    # one group per prefix (role), not per scale value: a resume with another scale (backbone_lr_scale=1) keeps the
    # saved state's groups, where grouping by value merged the backbone's into the rest and the state did not fit
    groups: dict[str, list[torch.nn.Parameter]] = {}
    scales = getattr(model, "lr_scales", {})
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault(next((prefix for prefix in scales if name.startswith(prefix)), ""), []).append(p)
    lr = learning_rate(cfg, epoch)
    param_groups = [{"params": ps, "lr": lr * scales.get(role, 1.0), "lr_scale": scales.get(role, 1.0)}
                    for role, ps in groups.items()]
    return OPTIMIZERS[cfg.train.optimizer](param_groups, lr=lr, weight_decay=cfg.train.weight_decay)


def clip_gradients(parameters: Iterable[torch.nn.Parameter], limit: float, mode: str = "norm") -> None:
    """train.grad_clip: scale the gradients to a total l2 norm of at most `limit` ("norm"), or clamp each coordinate
    to [-limit, limit] ("value"). Over millions of parameters the two differ by orders of magnitude at one limit:
    SMAN's 0.1 as a total norm leaves ~3e-5 per coordinate, as a value at most 0.1 each (docs/sman.md)."""
    if mode == "value":
        torch.nn.utils.clip_grad_value_(parameters, limit)
    else:
        torch.nn.utils.clip_grad_norm_(parameters, limit)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Every global RNG a training step may draw from, as tensors and plain values (loadable with
    weights_only=True)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # dropout masks drawn on the GPU
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if not torch.cuda.is_available():
        return
    if "cuda" in state and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    else:  # a run resumed on another machine kind: the GPU generators start from the run's seed (the CPU
        # generator's, restored above), not from torch's fixed default, which every seed would share
        torch.cuda.manual_seed_all(torch.initial_seed())


def epoch_batches(cfg: Config, lengths: list[int], n_captions: int, epoch: int) -> list[list[int]]:
    """The caption indices of every batch of `epoch`, a function of (seed, epoch) only, so that a resumed
    run can skip exactly the batches it already did. Same order as a shuffling DataLoader with drop_last."""
    gen = torch.Generator()
    gen.manual_seed(cfg.train.seed * 1000 + epoch)
    if cfg.train.bucket_by_length:
        return list(LengthBucketSampler(lengths, cfg.train.batch_size, gen))
    order = torch.randperm(n_captions, generator=gen).tolist()
    bs = cfg.train.batch_size
    return [order[i:i + bs] for i in range(0, n_captions - bs + 1, bs)]


def shard_batches(batches: list[list[int]]) -> list[list[int]]:
    """This rank's contiguous slice of every global batch (all of it in a single process): the ranks'
    slices concatenated in rank order are the single-process batch."""
    out = []
    for batch in batches:
        start, stop = dist.shard_bounds(len(batch))
        out.append(batch[start:stop])
    return out


class EpochBatches(torch.utils.data.Sampler[list[tuple[int, int]]]):
    """The batch_sampler of a run's one DataLoader: set to each epoch's batches (`set`) before the epoch is
    iterated. It runs in the main process, so persistent workers get each epoch's batches from it; every item's
    key is (epoch, caption index), which seeds the augmentation of image files (PairDataset)."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[int, int]]] = []

    def set(self, epoch: int, batches: list[list[int]]) -> None:
        self.batches = [[(epoch, j) for j in batch] for batch in batches]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


def make_loader(dataset: PairDataset, sampler: EpochBatches, cfg: Config, placement: Placement,
                resident: bool = False) -> DataLoader:
    """The run's DataLoader: batches in `sampler`'s order, built in the main process (train.workers = 0) or by
    that many persistent worker processes (the same batches: nothing in an item depends on the process), in
    pinned memory for a GPU. With resident features the batches carry captions only (`collate_captions`).
    Its own generator: the loader draws nothing from the global RNGs (dropout's), with any worker count."""
    workers = cfg.train.workers
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_captions if resident else collate_pairs,
                      pin_memory=placement.is_cuda, num_workers=workers, persistent_workers=workers > 0,
                      worker_init_fn=ignore_stop_signals if workers > 0 else None,
                      generator=torch.Generator().manual_seed(cfg.train.seed))


def check_world(cfg: Config) -> None:
    """The global batch must split evenly across the ranks (equal shapes for the all-gathers)."""
    if cfg.train.batch_size % dist.world_size():
        raise ConfigError(f"train.batch_size {cfg.train.batch_size} is not divisible by the {dist.world_size()} "
                          f"processes", hint="the global batch is split evenly across the ranks: set "
                          "train.batch_size to a multiple of the process count")


def check_full_batch(cfg: Config, n_captions: int) -> None:
    """An epoch is n_captions // train.batch_size full batches (the partial last one is dropped, bucketed or not:
    `epoch_batches`; under torchrun the global batch is split across the ranks, so the count is the same), so a
    batch larger than the training split trains nothing: refused here rather than a run of zero steps that
    validates its untrained model and saves it as `best`."""
    batch = cfg.train.batch_size
    if batch <= n_captions:
        return
    where = f"the {n_captions} training captions of {cfg.data.path} (split {cfg.data.train_split!r})"
    world = dist.world_size()
    largest = n_captions - n_captions % world  # (a batch must split evenly across the ranks: check_world)
    if largest >= 2:
        ranks = f", a multiple of the {world} processes" if world > 1 else ""
        hint = f"--set train.batch_size=N with N <= {largest}{ranks} (each epoch is captions // N steps)"
    else:
        hint = f"a batch needs at least {max(2, world)} captions (one per process, and negatives): add training data"
    raise ConfigError(f"train.batch_size {batch} > {where}: no full batch (0 steps an epoch)", hint=hint)


E = TypeVar("E", bound=Embeddings)


def gather_embeddings(emb: E) -> E:
    """Every rank's embeddings (same item count on every rank) concatenated in rank order, extras
    included; captions are first padded to the longest padded length of any rank. Autograd-aware
    (see distributed.gather_rows)."""
    if not dist.is_distributed():
        return emb
    if isinstance(emb, TextEmb):
        emb = emb.padded_to(dist.max_over_ranks(int(emb.words.shape[1])))
    return emb.map_tensors(dist.gather_rows)


def batch_loss(model: Matcher, batch: PairBatch, cfg: Config, hardest: bool) -> torch.Tensor:
    """The loss of a (rank's share of a) batch. Distributed with train.gather_negatives, the captions (and
    images) of every rank are all-gathered and every rank computes the loss of the whole global batch,
    equal to the single-process loss: its gradient reaches this rank's embeddings summed over the ranks
    (W times this rank's share of the single-process gradient), and DDP's average over the W ranks then
    gives exactly the single-process gradient. Without it, each rank's loss sees its own share only and
    the averaged gradient is that of the mean of the per-rank losses (docs/distributed.md)."""
    img = model.encode_images(batch.images, training_region_mask(model, batch.images, cfg))
    txt = model.encode_texts(batch.text.tokens, batch.text.lengths)
    index = batch.image_index
    gather = cfg.train.gather_negatives and dist.is_distributed()
    if gather:
        txt, index = gather_embeddings(txt), dist.gather_rows(index)
    positives = index[:, None] == index[None, :] if cfg.loss.mask_same_image else None
    if not gather:
        return model.training_loss(img, txt, cfg.loss.margin, hardest, positives)
    if type(model.head).training_loss is SimilarityHead.training_loss:
        # The default loss is the triplet loss over the score matrix: score only this rank's images
        # against every caption ([local B, global B]) and gather the rows, W times less pair scoring
        # per rank than scoring the whole [global B, global B] matrix on every rank.
        scores = dist.gather_rows(model.score(img, txt))
        return triplet_loss(scores, cfg.loss.margin, hardest, positives)
    # A head with its own loss (OAN, SMAN, MMCA) may use more than the score matrix: give it everything.
    return model.training_loss(gather_embeddings(img), txt, cfg.loss.margin, hardest, positives)


class _LossStep(torch.nn.Module):
    """batch_loss as a forward(), which DistributedDataParallel needs (it hooks forward to reduce the
    gradients in backward)."""

    def __init__(self, model: Matcher, cfg: Config) -> None:
        super().__init__()
        self.model, self.cfg = model, cfg

    def forward(self, batch: PairBatch, hardest: bool) -> torch.Tensor:
        return batch_loss(self.model, batch, self.cfg, hardest)


def resolve_placement(cfg: Config, device: str | None = None, precision: str | None = None) -> Placement:
    """Where and in which precision `cfg` trains: train.device / train.precision, or the --device /
    --precision flags given instead (recorded in cfg, so config.json says where the run ran). Errors name
    the setting the value came from."""
    if device is not None:
        cfg.train.device = device
    if precision is not None:
        cfg.train.precision = precision
    try:
        return resolve(cfg.train.device, cfg.train.precision,
                       device_setting="--device" if device is not None else "train.device",
                       precision_setting="--precision" if precision is not None else "train.precision")
    except ConfigError as exc:
        if device is None and cfg.train.device.startswith("cuda"):  # a GPU schedule on a machine without one
            exc.hint = (f"{exc.hint}; this config is a GPU schedule: on a CPU-only machine train with the CPU "
                        "schedule (e.g. --config configs/flickr8k/cpu.yaml) or pass --device cpu")
        raise


def prepare_data(cfg: Config, vocab: AnyVocab | None) -> tuple[PrecompSplit, PrecompSplit, AnyVocab]:
    if not cfg.data.path:
        raise ConfigError("data.path is not set", hint="pass --data DIR (a precomp directory)")
    for key, use in (("train_split", "trained"), ("val_split", "selected")):
        # allowed (a dataset of one's own may have no dev split), but never silently
        if getattr(cfg.data, key) in TEST_SPLITS:
            log.warning("data.%s is %r: the model is %s on a test split, so its test figures are optimistic (a "
                        "results row needs a dev split for selection)", key, getattr(cfg.data, key), use)
    train = open_split(cfg, cfg.data.train_split, train=True)
    check_full_batch(cfg, len(train.training_captions))  # (before the dev split, the vocabulary and the model)
    val = open_split(cfg, cfg.data.val_split).head(cfg.train.val_images)
    if vocab is None:
        vocab = make_vocab(cfg, train.training_captions)
    cfg.model.vocab_size = len(vocab)
    found = data_backbone(cfg.data.path)
    if cfg.data.backbone and found and found != cfg.data.backbone and image_inputs(cfg.model) != ("pixels",):
        # (a resume with --data of another extraction: Lite0's and Lite2's cells are both 1280-d, so nothing else
        # would notice, and the run would go on training on features its weights were not trained on)
        raise DataError(f"the features in {cfg.data.path} were extracted with {found}, but the run's model reads "
                        f"{cfg.data.backbone} features (data.backbone)", path=Path(cfg.data.path) / META_NAME,
                        hint=f"give --data of an extraction with --backbone {cfg.data.backbone}; to train these "
                             f"weights on {found} features, start a new run with --set train.init_from=RUN/best")
    fill_image_dims(cfg, train)
    cfg.data.backbone = cfg.data.backbone or found
    return train, val, vocab


# the settings epoch_batches builds an epoch's batches from (with the training captions themselves), and
# max_batches, which cuts that list: a run stopped mid-epoch resumes past batches of the same list
BATCH_ORDER_KEYS = ("train.batch_size", "train.seed", "train.bucket_by_length", "train.max_batches")

# what `itmatch train --resume --set KEY=VALUE` may change: the schedule and where the data is; anything
# else (model, loss, data.vocab) made the checkpoint's weights and optimizer state what they are
RESUME_KEYS = ("train.", "data.path", "data.images")
# of those, the ones that made the optimizer state itself: its kind (Adam's moments are not Adadelta's) and
# which parameters it holds (a backbone that starts or stops training)
RESUME_FIXED_KEYS = ("train.optimizer", "train.finetune_backbone")
# and the ones best/ was chosen by: an epoch scored on more dev images, or re-ranked, has another scale of rsum; an
# averaged run's best/ epoch was chosen by its averaged weights
SELECTION_KEYS = ("train.val_images", "train.val_rerank", "train.val_prune", "train.ema_decay")


#: the data keys that are paths (data.* has settings too, e.g. data.min_word_count)
DATA_PATHS = ("data.path", "data.images", "data.vocab")


def _same_setting(key: str, a: Any, b: Any) -> bool:
    if key in DATA_PATHS and a and b:  # the same directory, however it is written
        return Path(a).resolve() == Path(b).resolve()
    return a == b


def apply_resume_overrides(cfg: Config, overrides: dict[str, Any]) -> list[str]:
    """Apply `--set` overrides given with --resume to the checkpoint's config and return the keys whose value
    changed. Only training settings and data locations may change (RESUME_KEYS); an override equal to the
    checkpoint's value is accepted whatever its key, so the command that started a run, re-run with --resume
    (as a job scheduler does), continues it."""
    wanted = update(copy.deepcopy(cfg), overrides)
    keys = [MOVED_KEYS.get(k, k) for k in flatten(overrides)]  # (an old key name is read at its new place)
    changed = [k for k in keys if not _same_setting(k, get_key(cfg, k), get_key(wanted, k))]
    _refuse_on_resume([k for k in changed if not k.startswith(RESUME_KEYS) or k in RESUME_FIXED_KEYS], cfg, wanted,
                      "the checkpoint has", "its weights and optimizer state were made with it",
                      "on --resume only train.* (e.g. train.epochs; not train.optimizer or train.finetune_backbone), "
                      "data.path and data.images can be changed; to change the model or its optimizer start a new "
                      "run from these weights with --set train.init_from=RUN/last")
    _refuse_on_resume([k for k in changed if k in SELECTION_KEYS], cfg, wanted, "the run has",
                      "its best/ epoch was chosen by the dev rsum it gives, which the later epochs would not be "
                      "compared with fairly",
                      "resume with the run's validation settings; to validate otherwise start a new run from these "
                      "weights with --set train.init_from=RUN/last")
    update(cfg, overrides)
    return changed


def _refuse_on_resume(keys: list[str], cfg: Config, wanted: Config, has: str, why: str, hint: str) -> None:
    """ConfigError naming each of `keys` with the value asked for (`wanted`) and the run's (`cfg`), and why it cannot
    change on resume; nothing when `keys` is empty."""
    if keys:
        raise ConfigError(f"{', '.join(f'{k}={get_key(wanted, k)!r}' for k in keys)}: cannot change when resuming "
                          f"({has} {', '.join(f'{k}={get_key(cfg, k)!r}' for k in keys)}); {why}", hint=hint)


def finished_run(run_dir: Path, overrides: dict[str, Any], trust_modified: bool = False) -> dict[str, Any] | None:
    """For `train --resume`: None when the run in `run_dir` has epochs left under the checkpoint's config with
    `overrides` applied; its result and a "note" saying so when it has trained exactly its epochs (resuming
    it loaded the data and the model to train nothing); a ConfigError when it has trained more than the
    epochs asked for. That is refused, not taken as finished: its `best`, `last` and log hold the later epochs
    too, and config.json would then claim fewer epochs than the weights have had. Reads the JSON files of `last`
    only (checked against its manifest) and rewrites the run's config.json as every resume does, so it answers in
    a moment."""
    last = run_dir / "last"
    checked = (last / MANIFEST).is_file()
    if checked:  # (one without a manifest is warned about once: below where the run is finished, else by the load)
        verify_manifest(last, trust_modified=trust_modified, files=("config.json", "state.json"))
    state = read_state(last)
    if "epoch" not in state:  # (a checkpoint of an older version: the full path handles it)
        return None
    cfg = read_checkpoint_config(last)
    apply_resume_overrides(cfg, overrides)  # (refused overrides are refused here, as they would be below)
    done, batch, epochs = int(state["epoch"]), int(state.get("batch", 0)), cfg.train.epochs
    if epochs > done:
        return None
    best = f"best dev rsum {state['best_rsum']:.1f} at epoch {state['best_epoch']}"
    if epochs == done and batch == 0:
        if not checked:
            verify_manifest(last, files=())  # (only its warning: the files cannot be checked)
        if dist.is_main():  # as every resume does: the run's config.json says what it was resumed with
            write_json_atomic(run_dir / "config.json", config_for_checkpoint(cfg, run_dir))
        return {"best_epoch": state["best_epoch"], "best_rsum": state["best_rsum"],
                "best": state.get("best_result", {}),
                "note": f"{run_dir} finished its {done} epochs ({best}); to train on: --resume --set "
                        f"train.epochs=N with N > {done}"}
    trained = f"{done} epochs" + (f" and {batch} batches of epoch {done + 1}" if batch else "")
    exc = ConfigError(f"{run_dir} has trained {trained} ({best}), more than train.epochs={epochs}: a run cannot "
                      f"be cut back, its checkpoints and metrics.jsonl hold every epoch trained",
                      hint=f"leave train.epochs as it is to use the run as it stands, --set train.epochs=N with "
                           f"N > {done} to train on, or train a {epochs}-epoch model in a new run (another --out)")
    locate(exc, getattr(overrides, "origins", {}), "train.epochs")
    raise exc


def training_finished(run_dir: str | Path) -> bool:
    """Whether the run in `run_dir` has trained all its epochs. Not merely whether it has `best/`: a run stopped
    in its second epoch has the first epoch's `best`, and reusing that reports a half-trained model. `last`
    records the epochs and batches done, the run's config.json (rewritten by every --resume) its epochs; a run
    from before `last` existed counts as finished when it has `best`."""
    run_dir = Path(run_dir)
    if not (run_dir / "last" / "state.json").is_file():
        return (run_dir / "best").is_dir()
    state = json.loads((run_dir / "last" / "state.json").read_text(encoding="utf-8"))
    epochs = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))["train"]["epochs"]
    return state["epoch"] >= epochs and state.get("batch", 0) == 0  # (older runs: no "batch")


@contextmanager
def _resuming(run_dir: Path) -> Iterator[None]:
    """A `last` that cannot be read cannot be resumed: the error says what can continue the run instead."""
    try:
        yield
    except CheckpointError as exc:
        best = run_dir / "best"
        instead = (f"; or train on from {best} in a new run: --set train.init_from={best} --out NEW_RUN (its "
                   "weights; the optimizer state and the epoch count start over)") if best.is_dir() else ""
        raise CheckpointError(exc.message, path=exc.path, line=exc.line, hint=(exc.hint or "") + instead) from None


def adopt_newer_best(state: dict[str, Any], best: dict[str, Any]) -> None:
    """A run killed after an epoch saved best/ and before it saved last/ redoes that epoch from last/, whose state
    does not know that best/: take its rsum and epoch, so that the redone epoch (which on a GPU may score
    otherwise) replaces best/ only when it beats it, and the run reports the epoch best/ holds."""
    if int(best.get("best_epoch", -1)) > int(state.get("best_epoch", -1)):
        state.update({k: best[k] for k in ("best_rsum", "best_epoch", "best_result") if k in best})


def _saved_settings(run_dir: Path, overrides: dict[str, Any]) -> Config | None:
    """The config a run resumes with, as its config.json says (written at every start and resume) with the
    command's `overrides`, read before the checkpoint is: its device, precision and torchrun backend place the
    process before anything else runs. None for a run without one (the checks below say what is wrong), or with
    one that cannot be read beside a last/ checkpoint (whose own config the resume reads)."""
    if not (run_dir / "config.json").is_file():
        return None
    try:
        cfg = read_run_config(run_dir)
    except CheckpointError:
        if (run_dir / "last").exists():
            return None
        raise
    apply_resume_overrides(cfg, overrides)
    return cfg


def train(cfg: Config, run_dir: str | Path, *, resume: bool = False, force: bool = False,
          transform: CaptionTransform | None = None, progress: bool = True, device: str | None = None,
          precision: str | None = None, resume_overrides: dict[str, Any] | None = None,
          trust_modified: bool = False, stop_signals: bool = True) -> dict[str, Any]:
    """Train `cfg` into `run_dir` (run_dir/best, run_dir/last, config.json, metrics.jsonl).
    Returns the best validation result. `device` / `precision` override train.device / train.precision
    (also when resuming: a run may continue on another device; docs/gpu.md).

    With `resume`, `cfg` is replaced by the checkpoint's config, to which `resume_overrides` (a nested dict
    as from `parse_overrides`; train.* and data locations only) are applied, e.g. {"train": {"epochs": 30}}.
    `trust_modified` loads checkpoints (`last`, train.init_from) whose files differ from their manifest.
    `stop_signals`: a SIGINT or SIGTERM while it trains saves where it is and raises `TrainingStopped`
    (engine/stop.py), under torchrun on every rank at the same step; off, they end the process as they always did.
    Resuming a run that has trained all its epochs trains nothing: its result then holds a "note" saying so and
    how to train on (logged too; the CLI prints it).

    Under torchrun (docs/distributed.md) every rank runs this with the same arguments: the model is
    wrapped in DistributedDataParallel, every global batch is split across the ranks, validation is
    sharded, and only rank 0 writes to `run_dir`."""
    run_dir = Path(run_dir)
    if resume:  # the run's own settings say where, in what precision and over which backend it trains
        cfg = _saved_settings(run_dir, resume_overrides or {}) or cfg
    placement = resolve_placement(cfg, device, precision)  # (before any work)
    distributed = dist.init_from_env(cfg.train.backend, placement.device.type)
    main = dist.is_main()
    progress = progress and main
    last = run_dir / "last"
    metrics_path = run_dir / "metrics.jsonl"
    state: dict[str, Any] = {"epoch": 0, "batch": 0, "running_loss": 0.0, "step": 0, "best_rsum": -1.0,
                             "best_epoch": -1, "log_bytes": 0}
    if main:
        recover_checkpoint(last)
    dist.barrier()
    if resume and not last.exists():
        saved = run_dir / "config.json"
        if not saved.is_file():
            raise OverwriteError("nothing to resume: no last checkpoint", path=last,
                                 hint="start a new run without --resume")
        best = run_dir / "best"
        if best.exists():  # (last/ deleted by hand, or a run of an older itmatch): restarting would delete it
            raise OverwriteError(f"{run_dir} has a best/ checkpoint but no last/: it cannot be resumed (last/ holds "
                                 "the optimizer state and how far the run got)", path=last,
                                 hint=f"train on from its best weights in a new run: --set train.init_from={best} "
                                      "--out NEW_RUN; or start this run over with --force (without --resume), "
                                      "which deletes best/")
        # Killed before its first checkpoint: start the same run again from its saved config (`cfg` and
        # `placement` are already its own, above).
        resume, force = False, True
    if resume:  # a finished run says so before its weights and data are loaded
        with _resuming(run_dir):
            finished = finished_run(run_dir, resume_overrides or {}, trust_modified)
        if finished is not None:  # (its "note" says so: the CLI prints it in place of its closing line)
            _log.info(finished["note"])
            return finished
    check_world(cfg)  # (before anything is written)
    header = ""
    if resume:
        with _resuming(run_dir):
            ckpt = load_checkpoint(last, trust_modified=trust_modified)
        cfg, vocab, model, state = ckpt.config, ckpt.vocab, ckpt.model, {**state, **ckpt.state}
        adopt_newer_best(state, read_state(run_dir / "best"))
        changed = apply_resume_overrides(cfg, resume_overrides or {})
        check_region_dropout(cfg, model)  # (train.region_dropout may be set on --resume)
        reordering = [key for key in BATCH_ORDER_KEYS if key in changed]
        if reordering and state["batch"]:
            # the epoch's batch list is rebuilt with the new setting and its first `batch` entries skipped as
            # done: they are not the captions already seen, so some would be used twice in the epoch, others never
            raise ConfigError(f"{run_dir} stopped in the middle of epoch {state['epoch'] + 1} (batch "
                              f"{state['batch']}): {', '.join(reordering)} changes an epoch's list of batches "
                              "(their order or number), so it changes only at an epoch's end",
                              hint=f"resume without changing {', '.join(reordering)}; change it on a run that "
                                   "stopped at an epoch's end (train.checkpoint_every=0 saves only there)")
        if "data.path" not in changed:
            ckpt.data_path()  # where it looked, if the data is not where the checkpoint says
        if changed:  # the run's log says from which step on its settings differ
            header = json.dumps({"resumed_at_step": state["step"], "overrides": {
                k: get_key(cfg, k) for k in changed}}) + "\n"
        placement = resolve_placement(cfg, device, precision)
        check_world(cfg)
        train_split, val_split, vocab = prepare_data(cfg, vocab)
    else:
        # (temp files of a write killed before config.json existed do not make a run)
        in_use = run_dir.exists() and any(not p.name.endswith(".partial") for p in run_dir.iterdir())
        if in_use and not force:
            raise OverwriteError(f"run directory {run_dir} is not empty", path=run_dir,
                                 hint="pass --resume to continue it, --force to start over, or another --out")
        check_min_word_count(cfg)
        check_norm_switches(cfg.model)
        dist.barrier()  # every rank has looked at run_dir before rank 0 changes it
        seed_everything(cfg.train.seed)
        # a run started from another's weights keeps that run's vocabulary (its word embedding rows)
        init = (load_checkpoint(cfg.train.init_from, expect_arch=cfg.model.arch, trust_modified=trust_modified)
                if cfg.train.init_from else None)
        if init is not None:
            take_init_vocabulary(cfg, init.vocab)
        read_pixels_for_finetuning(cfg)
        train_split, val_split, vocab = prepare_data(cfg, init.vocab if init else None)
        model = build_model(cfg.model)
        check_region_dropout(cfg, model)
        if cfg.train.val_prune and (cfg.train.val_rerank or model.head.score_bound is None):
            raise ConfigError("train.val_prune needs a head with a score bound (MMCA) and no train.val_rerank",
                              hint="drop train.val_prune, or train.val_rerank")
        if cfg.train.val_rerank and not model.has_global_embedding:  # (else found by the first validation, an
            # epoch in, with the run directory already written)
            raise ConfigError(f"train.val_rerank needs a model with a global embedding for its first stage; "
                              f"{cfg.model.arch} has none", hint="drop train.val_rerank (validation scores every "
                                                                 "pair), or train a model that pools (VSE++, MMCA)")
        if cfg.model.word_vectors:  # the found / missing counts are also kept in the run's log
            counts = apply_word_vectors(model, vocab, cfg.model.word_vectors, cfg.model.word_vectors_scale)
            header = json.dumps({"word_vectors": cfg.model.word_vectors, **counts}) + "\n"
        if init is not None:  # after the word vectors: the checkpoint's trained embedding wins
            header += json.dumps(init_weights_from(model, init)) + "\n"
        if main:  # (the other ranks' log is nowhere: nothing to count, nothing to say twice)
            header += json.dumps(report_vocabulary(cfg, vocab, train_split.training_captions, progress)) + "\n"
        if dist.rank() > 0:  # same initial weights on every rank (above), its own dropout masks from here
            seed_everything((cfg.train.seed + dist.rank()) % 2**32)
        if main:
            run_dir.mkdir(parents=True, exist_ok=True)
            for old in (last, run_dir / "best"):  # --force: a later --resume must never find the old state
                if old.exists():
                    shutil.rmtree(old)
    finetune_backbone(cfg, model)  # (a resumed run's model is built frozen, like any loaded checkpoint)
    if main:
        # first: --resume can restart from it (data paths from run_dir, as in a checkpoint: from any directory)
        write_json_atomic(run_dir / "config.json", config_for_checkpoint(cfg, run_dir))
    threads = dist.cpu_threads(cfg.train.threads)  # (0 under torchrun: the cores shared among the ranks)
    if threads:  # the thread count changes float summation order: part of the config
        torch.set_num_threads(threads)
    # the machines the run trained on, in order (a run resumed elsewhere lists both): what its checkpoints say
    state["devices"] = list(dict.fromkeys([*state.get("devices", []), machine_name(placement.device)]))
    model.to(placement.device)  # (before the optimizer: its state follows the parameters' device)
    optimizer = make_optimizer(cfg, model, state["epoch"])
    average = weight_average(cfg, model)  # (None unless train.ema_decay)
    scaler = placement.grad_scaler()  # fp16 only; otherwise a no-op
    if resume:
        load_optimizer_state(last, optimizer)
        trainer = load_trainer_state(last)
        if average is not None and AVERAGE_KEY in trainer:
            average.load_state_dict(trainer[AVERAGE_KEY])
        if scaler.is_enabled() and "scaler" in trainer:
            scaler.load_state_dict(trainer["scaler"])
        ranks = trainer.get("rng_ranks", [])
        if len(ranks) == dist.world_size() and distributed:
            set_rng_state(ranks[dist.rank()])
        elif "rng" in trainer:  # (rank 0's streams: a run saved by another number of processes)
            set_rng_state(trainer["rng"])
            if dist.rank() > 0:  # each other rank its own dropout masks, not rank 0's again; not the ones a new
                # run's rank draws from (seed + rank) either, which this run's first steps may have drawn
                seed_everything(hash((cfg.train.seed, dist.rank(), state["step"])) % 2**32)
    # metrics.jsonl as it was when `last` was saved: lines written after it are written again below.
    # (Checkpoints of older versions have no log_bytes: their log is kept as it is.)
    if main and (not resume or "log_bytes" in ckpt.state):
        with open(metrics_path, "a+b") as fh:
            keep = int(state["log_bytes"]) if resume else 0
            if fh.seek(0, os.SEEK_END) > keep:  # never extend (a log the user removed stays short)
                fh.truncate(keep)

    resident, why = resident_images(cfg.train.resident, train_split.images, placement.device)
    _log.info("training features: %s", why)  # (once per run; `log` is the metrics file below)
    if progress:  # (the CLI configures no logging handler: say it where the epoch lines go)
        tqdm.write(f"training features: {why}")
    dataset = PairDataset(train_split, vocab, transform, read_images=resident is None)
    val_vocab = RememberedVocab(vocab)  # every epoch validates on the same dev captions: each is tokenized once a run
    sampler = EpochBatches()
    loader = make_loader(dataset, sampler, cfg, placement, resident=resident is not None)
    # WordPiece counts the captions it cuts to the encoder's limit as it encodes them, the training captions once a
    # run (PairDataset keeps their ids): an epoch reports those it encoded first, all of them in the first epoch
    truncated_before = getattr(vocab, "truncated", 0)
    # (before the loader's workers start: they inherit the encoded captions)
    lengths = [len(dataset.caption_ids(j)) for j in range(len(dataset))] if cfg.train.bucket_by_length else []
    # only rank 0 writes the log; the other ranks write the same lines nowhere
    log = metrics_path.open("a", encoding="utf-8") if main else open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
    log.write(header)  # a new run's first line (pretrained word vector counts), a resumed run's new settings

    step: torch.nn.Module = _LossStep(model, cfg)
    if distributed:
        from torch.nn.parallel import DistributedDataParallel

        # find_unused_parameters: some configurations leave parameters out of the loss (e.g. a one-step SMAN)
        device_ids = [placement.device.index] if placement.is_cuda else None
        step = DistributedDataParallel(step.to(placement.device), device_ids=device_ids,
                                       find_unused_parameters=True)

    def save_last() -> None:
        ranks = dist.gather_objects(rng_state())  # (a collective: every rank calls save_last)
        if not main:
            return
        log.flush()
        os.fsync(log.fileno())
        state["log_bytes"] = metrics_path.stat().st_size
        trainer = {"rng": rng_state(), **({"rng_ranks": ranks} if distributed else {}),
                   **({"scaler": scaler.state_dict()} if scaler.is_enabled() else {}),
                   **({AVERAGE_KEY: average.state_dict()} if average is not None else {})}
        save_checkpoint(last, model, cfg, vocab, optimizer, state, trainer=trainer)

    def save_within_epoch(batch: int, running_loss: float, seconds: float, cpu_seconds: float) -> None:
        """last/ at `batch` of the epoch in progress (a periodic save, or a stop's): --resume goes on from there."""
        state.update(batch=batch, running_loss=running_loss, epoch_seconds=seconds, epoch_cpu_seconds=cpu_seconds)
        save_last()

    def stopped(where: str) -> TrainingStopped:
        """The stop's exception, once every rank is past rank 0's save (torchrun's agent stops the other workers as
        soon as one ends: none may end before the save)."""
        dist.barrier()
        return TrainingStopped(f"stopped by {stop.name} {where}; saved to {last}", int(stop.decided or 0),
                               resume=f"itmatch train --out {run_dir} --resume")

    best: dict[str, Any] = state.get("best_result", {})
    # a stop signal is honoured between steps, after a save (engine/stop.py); under torchrun at the same step on
    # every rank, the first where any rank was asked (`stop.agree`)
    with stop_on_signal(enabled=stop_signals, announce=progress, shared=distributed) as stop:
        for epoch in range(state["epoch"], cfg.train.epochs):
            batches = epoch_batches(cfg, lengths, len(dataset), epoch)
            n_batches = len(batches) if cfg.train.max_batches <= 0 else min(len(batches), cfg.train.max_batches)
            first = int(state["batch"])  # > 0 when resuming mid-epoch
            sampler.set(epoch, shard_batches(batches[first:n_batches]))
            if first == 0:
                # The DataLoader of earlier versions drew its base seed from the global torch RNG when each epoch's
                # iteration began. That draw is kept at the epoch's start, so runs (dropout masks) are the same as
                # before; a run resumed mid-epoch already has it in its saved RNG state.
                torch.empty((), dtype=torch.int64).random_()
            lr = learning_rate(cfg, epoch)
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
            hardest = cfg.loss.hardest and epoch >= cfg.loss.warmup_epochs
            model.train()
            bar = tqdm(total=n_batches, initial=first, desc=f"epoch {epoch + 1}/{cfg.train.epochs}",
                       disable=not progress)
            # the epoch's time so far: a run resumed mid-epoch adds what it did before it stopped
            running = float(state["running_loss"])
            started = time.perf_counter() - float(state.get("epoch_seconds", 0.0))
            started_cpu = time.process_time() - float(state.get("epoch_cpu_seconds", 0.0))
            for b, batch in enumerate(loader, start=first):
                batch = batch.to(placement.device, non_blocking=True)
                if resident is not None:  # the images gathered by image_index, on the device
                    batch = resident.fill(batch)
                with placement.arithmetic():  # (fp32: no autocast at all)
                    loss = step(batch, hardest)
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()  # (scale, unscale_, step, update: plain calls unless fp16)
                if cfg.train.grad_clip > 0:
                    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                    clip_gradients(model.parameters(), cfg.train.grad_clip, cfg.train.grad_clip_mode)
                scaler.step(optimizer)
                scaler.update()
                if average is not None:
                    average.update_parameters(model)
                state["step"] += 1
                value, = stop.agree(loss.item())  # the loss whose gradient the ranks averaged, and their stop
                if not math.isfinite(value):  # stop before anything is saved: its step wrote NaN into the weights
                    lower = f"train.lr={cfg.train.lr / 10:g}"
                    again = (f"train on from its last checkpoint with a lower learning rate: itmatch train --out "
                             f"{run_dir} --resume --set {lower}" if last.exists() else
                             f"start it again with a lower learning rate ({lower}, with --force)")
                    raise TrainingError(
                        f"the loss is {value} at epoch {epoch + 1}, batch {b + 1} (step {state['step']}): training "
                        "diverged; nothing was saved after it", path=run_dir,
                        hint=f"{again}; or clip the gradients (train.grad_clip, e.g. 2)")
                running += value
                bar.set_postfix(loss=f"{value:.2f}", lr=f"{lr:.1e}", hard=hardest)
                bar.update()
                if state["step"] % cfg.train.log_every == 0:
                    log.write(json.dumps({"step": state["step"], "epoch": epoch, "loss": value, "lr": lr}) + "\n")
                    log.flush()
                every = cfg.train.checkpoint_every
                if (every > 0 and (b + 1) % every == 0 and b + 1 < n_batches) or stop.requested:
                    save_within_epoch(b + 1, running, time.perf_counter() - started, time.process_time() - started_cpu)
                if stop.requested:  # (a run saved at its epoch's last batch validates that epoch when resumed)
                    bar.close()  # (the CLI's last line comes after the bar, not inside it)
                    raise stopped(f"at epoch {epoch + 1}, batch {b + 1} of {n_batches} (step {state['step']})")
            bar.close()
            train_seconds, train_cpu_seconds = time.perf_counter() - started, time.process_time() - started_cpu
            kept = model if average is None else average.module  # the weights validated, and saved as best/
            kept.eval()
            truncated = getattr(vocab, "truncated", 0) - truncated_before
            try:
                with stop.interruptible():  # (cut short by a stop: it changes nothing, and a resumed run runs it again)
                    result = evaluate_models([(kept, val_vocab)], val_split, "full", rerank=cfg.train.val_rerank,
                                             prune=cfg.train.val_prune, precision=cfg.train.precision)
            except StopNow:  # (in one process only: a shared request never cuts a validation short)
                save_within_epoch(n_batches, running, train_seconds, train_cpu_seconds)
                raise stopped(f"at epoch {epoch + 1}, in its validation") from None
            truncated_before = getattr(vocab, "truncated", 0)  # (the validation's captions are not training's)
            record = {"epoch": epoch + 1, "val_rsum": result["rsum"], "val": result, "lr": lr, "hardest": hardest,
                      "mean_loss": running / max(1, n_batches), "train_seconds": round(train_seconds, 1),
                      "train_cpu_seconds": round(train_cpu_seconds, 1),  # this process; == wall on a free core
                      "batches": n_batches,
                      # when the validation ended (Unix time; named as timings are): two epochs' difference is an
                      # epoch's whole wall time, its training, validation (val.eval_seconds) and saves together
                      "ended_at_seconds": round(time.time(), 1)}
            if truncated:
                record["truncated_captions"] = truncated
                if progress:
                    tqdm.write(f"epoch {epoch + 1}: {truncated} captions longer than the text encoder's "
                               f"{vocab.max_length} tokens were truncated")
            log.write(json.dumps(record) + "\n")
            log.flush()
            if progress:
                tqdm.write(f"epoch {epoch + 1}: dev rsum {result['rsum']:.1f} "
                           f"(i2t R@1 {result['image_to_text']['r1']:.1f}, t2i R@1 {result['text_to_image']['r1']:.1f})"
                           f" loss {record['mean_loss']:.2f}, {train_seconds:.0f} s training + "
                           f"{result['eval_seconds']:.0f} s validation")
            state.update(epoch=epoch + 1, batch=0, running_loss=0.0, epoch_seconds=0.0, epoch_cpu_seconds=0.0)
            if result["rsum"] > state["best_rsum"] or math.isnan(state["best_rsum"]):
                state.update(best_rsum=result["rsum"], best_epoch=epoch + 1)
                best = result
                state["best_result"] = best
                if main:
                    save_checkpoint(run_dir / "best", kept, cfg, vocab, state=state)
            state["best_result"] = best
            save_last()
            stop.agree()  # (torchrun: whether any rank was asked during the validation or its saves)
            if stop.requested and epoch + 1 < cfg.train.epochs:  # (asked during the validation or its saves)
                raise stopped(f"after epoch {epoch + 1}")
    log.close()
    return {"best_epoch": state["best_epoch"], "best_rsum": state["best_rsum"], "best": best}
