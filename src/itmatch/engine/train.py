"""Training loop: Adam, step learning-rate schedule, gradient clipping, end-of-epoch validation by dev
rsum, best and last checkpoints, resume, a run directory with the resolved config and a metrics log."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from itmatch.config import Config
from itmatch.data.datasets import CaptionTransform, LengthBucketSampler, PairDataset, collate_pairs
from itmatch.data.precomp import PrecompSplit
from itmatch.data.vocab import Vocab, build_vocab, tokenize
from itmatch.engine.checkpoint import load_checkpoint, load_optimizer_state, save_checkpoint
from itmatch.engine.evaluate import evaluate_models
from itmatch.engine.inputs import fill_image_dims, open_split
from itmatch.errors import ConfigError, OverwriteError
from itmatch.io import write_json_atomic
from itmatch.models.registry import build_model


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
    groups: dict[float, list[torch.nn.Parameter]] = {}
    scales = getattr(model, "lr_scales", {})
    for name, p in model.named_parameters():
        if p.requires_grad:
            scale = next((s for prefix, s in scales.items() if name.startswith(prefix)), 1.0)
            groups.setdefault(scale, []).append(p)
    lr = learning_rate(cfg, epoch)
    param_groups = [{"params": ps, "lr": lr * s, "lr_scale": s} for s, ps in groups.items()]
    return OPTIMIZERS[cfg.train.optimizer](param_groups, lr=lr, weight_decay=cfg.train.weight_decay)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def prepare_data(cfg: Config, vocab: Vocab | None) -> tuple[PrecompSplit, PrecompSplit, Vocab]:
    if not cfg.data.path:
        raise ConfigError("data.path is not set", hint="pass --data DIR (a precomp directory)")
    train = open_split(cfg, cfg.data.train_split, train=True)
    val = open_split(cfg, cfg.data.val_split).head(cfg.train.val_images)
    if vocab is None:
        vocab = Vocab.load(cfg.data.vocab) if cfg.data.vocab else build_vocab(train.captions)
    cfg.model.vocab_size = len(vocab)
    fill_image_dims(cfg, train)
    meta = Path(cfg.data.path) / "meta.json"
    if not cfg.data.backbone and meta.is_file():
        cfg.data.backbone = json.loads(meta.read_text(encoding="utf-8")).get("backbone", "")
    return train, val, vocab


def train(cfg: Config, run_dir: str | Path, *, resume: bool = False, force: bool = False,
          transform: CaptionTransform | None = None, progress: bool = True) -> dict[str, Any]:
    """Train `cfg` into `run_dir` (run_dir/best, run_dir/last, config.json, metrics.jsonl).
    Returns the best validation result."""
    run_dir = Path(run_dir)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    last = run_dir / "last"
    state: dict[str, Any] = {"epoch": 0, "step": 0, "best_rsum": -1.0, "best_epoch": -1}
    if resume:
        if not last.exists():
            raise OverwriteError("nothing to resume: no last checkpoint", path=last,
                                 hint="start a new run without --resume")
        ckpt = load_checkpoint(last)
        cfg, vocab, model, state = ckpt.config, ckpt.vocab, ckpt.model, ckpt.state
        train_split, val_split, vocab = prepare_data(cfg, vocab)
    else:
        if run_dir.exists() and any(run_dir.iterdir()) and not force:
            raise OverwriteError(f"run directory {run_dir} is not empty", path=run_dir,
                                 hint="pass --resume to continue it, --force to start over, or another --out")
        seed_everything(cfg.train.seed)
        train_split, val_split, vocab = prepare_data(cfg, None)
        model = build_model(cfg.model)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").write_text("", encoding="utf-8")
    write_json_atomic(run_dir / "config.json", cfg.to_dict())
    optimizer = make_optimizer(cfg, model, state["epoch"])
    if resume:
        load_optimizer_state(last, optimizer)

    loader_gen = torch.Generator()
    dataset = PairDataset(train_split, vocab, transform)
    lengths = [len(tokenize(c)) for c in train_split.captions] if cfg.train.bucket_by_length else []
    log = (run_dir / "metrics.jsonl").open("a", encoding="utf-8")
    best: dict[str, Any] = state.get("best_result", {})
    for epoch in range(state["epoch"], cfg.train.epochs):
        loader_gen.manual_seed(cfg.train.seed * 1000 + epoch)  # same batches on resume
        if cfg.train.bucket_by_length:
            sampler = LengthBucketSampler(lengths, cfg.train.batch_size, loader_gen)
            loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_pairs)
        else:
            loader = DataLoader(dataset, batch_size=cfg.train.batch_size, shuffle=True, drop_last=True,
                                collate_fn=collate_pairs, generator=loader_gen)
        lr = learning_rate(cfg, epoch)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        hardest = cfg.loss.hardest and epoch >= cfg.loss.warmup_epochs
        n_batches = len(loader) if cfg.train.max_batches <= 0 else min(len(loader), cfg.train.max_batches)
        model.train()
        bar = tqdm(total=n_batches, desc=f"epoch {epoch + 1}/{cfg.train.epochs}", disable=not progress)
        started, running = time.perf_counter(), 0.0
        for b, batch in enumerate(loader):
            if b >= n_batches:
                break
            img = model.encode_images(batch.images)
            txt = model.encode_texts(batch.text.tokens, batch.text.lengths)
            positives = None
            if cfg.loss.mask_same_image:
                positives = batch.image_index[:, None] == batch.image_index[None, :]
            loss = model.training_loss(img, txt, cfg.loss, hardest, positives)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.train.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            optimizer.step()
            state["step"] += 1
            running += loss.item()
            bar.set_postfix(loss=f"{loss.item():.2f}", lr=f"{lr:.1e}", hard=hardest)
            bar.update()
            if state["step"] % cfg.train.log_every == 0:
                log.write(json.dumps({"step": state["step"], "epoch": epoch, "loss": loss.item(), "lr": lr}) + "\n")
                log.flush()
        bar.close()
        train_seconds = time.perf_counter() - started
        model.eval()
        result = evaluate_models([(model, vocab)], val_split, "full")
        record = {"epoch": epoch + 1, "val_rsum": result["rsum"], "val": result, "lr": lr, "hardest": hardest,
                  "mean_loss": running / max(1, n_batches), "train_seconds": round(train_seconds, 1),
                  "batches": n_batches}
        log.write(json.dumps(record) + "\n")
        log.flush()
        if progress:
            tqdm.write(f"epoch {epoch + 1}: dev rsum {result['rsum']:.1f} "
                       f"(i2t R@1 {result['image_to_text']['r1']:.1f}, t2i R@1 {result['text_to_image']['r1']:.1f})"
                       f" loss {record['mean_loss']:.2f}, {train_seconds:.0f} s")
        state["epoch"] = epoch + 1
        if result["rsum"] > state["best_rsum"] or math.isnan(state["best_rsum"]):
            state.update(best_rsum=result["rsum"], best_epoch=epoch + 1)
            best = result
            state["best_result"] = best
            save_checkpoint(run_dir / "best", model, cfg, vocab, state=state)
        state["best_result"] = best
        save_checkpoint(last, model, cfg, vocab, optimizer, state)
    log.close()
    return {"best_epoch": state["best_epoch"], "best_rsum": state["best_rsum"], "best": best}
