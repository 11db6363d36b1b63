"""Data-parallel training, sharded evaluation and extraction under torch.distributed (docs/distributed.md):
2 CPU processes with gloo on 127.0.0.1 against one process with the same global batch.

The workers are real processes started the way torchrun starts them (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT in the environment), running the engine's own entry points. The presets used
here have no dropout and no batch-dependent layer (BatchNorm), without which equality is impossible."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from itmatch import distributed as dist
from itmatch.config import Config
from itmatch.engine.checkpoint import load_checkpoint
from itmatch.models.registry import resolve_config

SRC = str(Path(__file__).resolve().parents[1] / "src")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(code: str, *args: str, world: int = 2, timeout: float = 600) -> None:
    """Run `code` (with `args` in sys.argv) in `world` Python processes joined like torchrun joins them;
    fail with their output."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
        procs.append(subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out}"


def tiny_config(data: Path, **train) -> Config:
    # SCAN t-i: a pair head (the gathered loss takes its row-sharded path); no dropout anywhere
    return resolve_config("scan_t2i_avg", {
        "model": {"embed_size": 32, "word_dim": 32}, "data": {"path": str(data)},
        "train": {"epochs": 1, "batch_size": 16, "val_images": 20, "log_every": 5, "threads": 1,
                  "max_batches": 24, **train}})


def assert_close_records(got: list[dict], expected: list[dict]) -> None:
    """The same lines, keys and values; floats (losses, averaged ranks) within 1e-5 relative."""
    assert [sorted(r) for r in got] == [sorted(r) for r in expected]
    for a, b in zip(got, expected, strict=True):
        for k, v in b.items():
            assert a[k] == (pytest.approx(v, rel=1e-5) if isinstance(v, float) else v), (k, a, b)


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run / "last").model.state_dict()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def records(run: Path) -> list[dict]:
    """metrics.jsonl flattened ("val.rsum": ...), without the timings."""
    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
        return out

    return [{k: v for k, v in flat(json.loads(line)).items() if not k.endswith("_seconds")}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_shard_bounds_cover_every_item_once():
    for n in (0, 1, 5, 16, 17):
        for world in (1, 2, 3):
            parts = [dist.shard_bounds(n, r, world) for r in range(world)]
            assert [i for a, b in parts for i in range(a, b)] == list(range(n))
            assert max(b - a for a, b in parts) - min(b - a for a, b in parts) <= 1


def test_single_process_helpers_are_no_ops():
    t = torch.arange(4.0, requires_grad=True)
    assert not dist.is_distributed() and dist.is_main() and dist.world_size() == 1
    assert dist.gather_rows(t) is t and dist.gather_objects(3) == [3] and dist.broadcast_object(5) == 5


# What the two ranks do, in one launch (starting Python with torch is the slow part on a busy machine):
# train with and without gathered negatives, train interrupted then resumed, evaluate sharded.
WORKER = """
import json, sys, torch
from itmatch.config import config_from_dict, Config
from itmatch import distributed
from itmatch.engine.checkpoint import load_checkpoint
from itmatch.engine.evaluate import evaluate_models, split_scores
from itmatch.engine.inputs import open_split
from itmatch.engine.train import train
from itmatch.errors import ConfigError

torch.set_num_threads(1)
job = json.loads(sys.argv[1])
assert distributed.init_from_env()
rank = distributed.rank()
for name in ("gather", "local"):
    train(config_from_dict(job[name]), job["out"] + "/" + name, progress=False)

summed, steps = distributed.sum_over_ranks, []
def interrupt_at_step_11(values):  # epoch 2, batch 5: `last` holds epoch 2, batch 4
    if len(values) == 3:  # (a step's all-reduce: its loss and the two stop signals' votes; an epoch's end: votes)
        steps.append(values)
    if len(steps) == 11:
        raise KeyboardInterrupt
    return summed(values)
distributed.sum_over_ranks = interrupt_at_step_11
try:
    train(config_from_dict(job["resume"]), job["out"] + "/resumed", progress=False)
    raise SystemExit("not interrupted")
except KeyboardInterrupt:
    pass
distributed.sum_over_ranks = summed
with open(job["out"] + f"/state{rank}.json", "w") as fh:  # what `last` held when the ranks stopped
    fh.write(open(job["out"] + "/resumed/last/state.json").read())
train(Config(), job["out"] + "/resumed", resume=True, progress=False)

import os, signal
from itmatch.errors import TrainingStopped
built = []
def sigterm_to_rank_1(caption, j):  # while rank 1 alone builds its 8 captions of step 9 (epoch 2, batch 3)
    built.append(j)
    if rank == 1 and len(built) == 8 * 8 + 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return caption
try:
    train(config_from_dict(job["resume"]), job["out"] + "/stopped", progress=False, transform=sigterm_to_rank_1)
    raise SystemExit("not stopped")
except TrainingStopped as exc:
    with open(job["out"] + f"/stopped{rank}.json", "w") as fh:  # what each rank said, and what `last` held
        json.dump({"signum": exc.signum, "message": exc.message,
                   "state": json.load(open(job["out"] + "/stopped/last/state.json"))}, fh)
train(Config(), job["out"] + "/stopped", resume=True, progress=False)
# a one-process run continued by two processes: rank 1 draws its own stream, not rank 0's saved one again
train(Config(), job["out"] + "/regrouped", resume=True, progress=False, resume_overrides={"train": {"epochs": 2}})

try:
    train(config_from_dict({**job["gather"], "train": {**job["gather"]["train"], "batch_size": 15}}),
          job["out"] + "/odd", progress=False)
except ConfigError as exc:
    with open(job["out"] + f"/odd{rank}.txt", "w") as fh:
        fh.write(str(exc))

# rank 1 is given 4x the budget, as a GPU with more free memory would size it: the ranks plan with the smallest
budget = job["budget"] * (1 + 3 * rank)
for ckpt_dir in job["eval"]:
    ckpt = load_checkpoint(ckpt_dir)
    split = open_split(ckpt.config, "test")
    scores = split_scores(ckpt.model.eval(), ckpt.vocab, split, budget, sharded=True)
    assert (scores is None) == (rank != 0)
    result = evaluate_models([(ckpt.model, ckpt.vocab)], split, budget_bytes=budget,
                             resume_dir=ckpt_dir + "/blocks")
    if rank == 0:
        torch.save(scores, ckpt_dir + "/sharded_scores.pt")
    with open(ckpt_dir + f"/result{rank}.json", "w") as fh:
        json.dump(result, fh)

from itmatch.data.captions import CaptionTable
from itmatch.features.extract import extract_precomp

table = CaptionTable(source="captions")
for name, caption, split in job["table"]:
    table.add(name, caption, split)
extract_precomp(job["images"], table, job["out"] + "/extracted", batch_size=1, progress=False,
                skip_bad_images=True, num_threads=1)

import time
from itmatch.retrieval import index as index_module
from itmatch.retrieval.index import build_index
read_parts = index_module._read_parts
def late_read_parts(*args):  # rank 1 reads the parts directory late: rank 0 must not write there before that
    if rank == 1:
        time.sleep(3)
    return read_parts(*args)
index_module._read_parts = late_read_parts
summary = build_index(job["photos"], job["checkpoint"], job["out"] + "/index", batch_size=1, chunk=4,
                      progress=False)
with open(job["out"] + f"/index_summary{rank}.json", "w") as fh:
    json.dump(summary, fh)
distributed.shutdown()
"""
BUDGET = 1e6  # small: SCAN scores the 40 test images x 200 captions in 10 blocks of 4 images


def eval_checkpoint(root: Path, data: Path, preset: str) -> Path:
    from itmatch.engine.checkpoint import save_checkpoint
    from itmatch.engine.train import prepare_data, seed_everything
    from itmatch.models.registry import build_model

    cfg = resolve_config(preset, {"model": {"embed_size": 32, "word_dim": 32}, "data": {"path": str(data)}})
    seed_everything(0)
    _, _, vocab = prepare_data(cfg, None)
    save_checkpoint(root / preset, build_model(cfg.model), cfg, vocab)
    return root / preset


def interrupted_scoring(ckpt_dir: Path, blocks: int) -> None:
    """Leave the first `blocks` score blocks in ckpt_dir/blocks, as a single-process evaluation with
    --resume-dir stopped after them would; the two ranks' evaluation then continues from them."""
    from itmatch.engine.evaluate import split_scores
    from itmatch.engine.inputs import open_split
    from itmatch.inference.score_cache import ScoreCache

    ckpt = load_checkpoint(ckpt_dir)
    model, calls = ckpt.model.eval(), []
    score = model.score

    def stop_after_blocks(img, txt):
        if len(calls) == blocks:
            raise KeyboardInterrupt
        calls.append(1)
        return score(img, txt)

    model.score = stop_after_blocks
    with pytest.raises(KeyboardInterrupt):
        split_scores(model, ckpt.vocab, open_split(ckpt.config, "test"), BUDGET, cache=ScoreCache(ckpt_dir / "blocks"))


def photo_folder(root: Path) -> tuple[Path, list[tuple[str, str, str]]]:
    """7 small photos (one of them truncated, in the second rank's share of train) and their captions."""
    from PIL import Image

    images = root / "photos"
    images.mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for i in range(7):
        name = f"p{i}.png"
        Image.fromarray(rng.integers(0, 255, (40 + 4 * i, 48, 3), dtype=np.uint8)).save(images / name)
        rows += [(name, f"photo {i} caption {c}", "train" if i < 5 else "dev") for c in range(5)]
    data = (images / "p3.png").read_bytes()
    (images / "p3.png").write_bytes(data[:len(data) // 2])
    return images, rows


@pytest.fixture(scope="module")
def runs(tiny_precomp, tiny_search_setup, tmp_path_factory) -> dict[str, Path]:
    """Single-process reference runs and the 2-rank runs of WORKER (about 10 s of CPU per rank)."""
    from itmatch.engine.train import train

    root = tmp_path_factory.mktemp("dist")
    torch.set_num_threads(1)
    out = {"single": root / "single", "straight": root / "straight"}
    train(tiny_config(tiny_precomp), out["single"], progress=False)
    resume_cfg = tiny_config(tiny_precomp, epochs=2, max_batches=6, checkpoint_every=4, gather_negatives=True)
    train(resume_cfg, out["straight"], progress=False)  # == 2 ranks uninterrupted (gather_negatives)
    job = {"out": str(root), "gather": tiny_config(tiny_precomp, gather_negatives=True).to_dict(),
           "local": tiny_config(tiny_precomp).to_dict(), "resume": resume_cfg.to_dict(), "budget": BUDGET,
           "eval": [str(eval_checkpoint(root, tiny_precomp, p)) for p in ("scan_t2i_avg", "vsepp")]}
    interrupted_scoring(root / "scan_t2i_avg", blocks=3)
    shutil.copytree(out["single"], root / "regrouped")  # (continued by the two ranks for a second epoch)
    images, rows = photo_folder(root)
    job.update(images=str(images), table=rows, photos=str(tiny_search_setup["photos"]),
               checkpoint=str(tiny_search_setup["checkpoint"]))
    run_ranks(WORKER, json.dumps(job))
    two_ranks = {k: root / k for k in ("gather", "local", "resumed", "stopped")}
    return {**tiny_search_setup, **out, **two_ranks, "root": root, "data": tiny_precomp, "table": rows}


def test_two_processes_with_gathered_negatives_equal_one_process(runs):
    """Hardest negatives over the global batch of 16 (8 per rank): the same parameters as one process
    with batches of 16, the same logged losses and the same validation."""
    assert max_diff(weights(runs["gather"]), weights(runs["single"])) <= 1e-6
    assert_close_records(records(runs["gather"]), records(runs["single"]))


def test_two_processes_without_gather_equal_the_mean_of_the_per_rank_losses(runs):
    """Without gather_negatives each rank's loss sees its own 8 pairs; DDP averages the gradients, so the
    run equals one process minimising the mean of the two half-batch losses (a reference loop here),
    and differs from the run on whole batches of 16."""
    from itmatch.data.datasets import PairDataset, collate_pairs
    from itmatch.engine.train import batch_loss, epoch_batches, make_optimizer, prepare_data, seed_everything
    from itmatch.models.registry import build_model

    cfg = tiny_config(runs["data"])
    seed_everything(cfg.train.seed)
    train_split, _, vocab = prepare_data(cfg, None)
    model = build_model(cfg.model)
    optimizer = make_optimizer(cfg, model, 0)
    dataset = PairDataset(train_split, vocab)
    for batch in epoch_batches(cfg, [], len(dataset), 0)[:cfg.train.max_batches]:
        halves = [collate_pairs([dataset[j] for j in batch[:8]]), collate_pairs([dataset[j] for j in batch[8:]])]
        loss = sum(batch_loss(model, h, cfg, cfg.loss.hardest) for h in halves) / 2
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
    assert max_diff(weights(runs["local"]), model.state_dict()) <= 1e-6
    assert max_diff(weights(runs["local"]), weights(runs["single"])) > 1e-4


def test_resume_in_two_processes_equals_an_uninterrupted_run(runs):
    """Both ranks stop in epoch 2 after a mid-epoch save (an interrupt raised at the same step in each);
    every rank then loads the same `last` and continues: the parameters and the log of an uninterrupted
    run."""
    for rank in (0, 1):
        state = json.loads((runs["root"] / f"state{rank}.json").read_text())
        assert (state["epoch"], state["batch"]) == (1, 4)
    assert max_diff(weights(runs["resumed"]), weights(runs["straight"])) <= 1e-6
    assert_close_records(records(runs["resumed"]), records(runs["straight"]))


def test_a_stop_signal_to_one_rank_stops_every_rank_at_the_same_step_and_resume_ends_as_the_uninterrupted_run(runs):
    """SIGTERM to rank 1 alone (`kill PID` of one worker) while it builds step 9's batch: both ranks learn of it in
    that step's all-reduce, save `last/` at that step together and end with the same TrainingStopped (rank 0 was
    sent nothing; had it trained on, it would have waited in its next all-reduce until the timeout). Resumed by
    the two ranks, the run ends as the uninterrupted run: its parameters and its log."""
    for rank in (0, 1):
        said = json.loads((runs["root"] / f"stopped{rank}.json").read_text())
        assert said["signum"] == signal.SIGTERM
        assert said["message"].startswith("stopped by SIGTERM at epoch 2, batch 3 of 6 (step 9); saved to ")
        assert (said["state"]["epoch"], said["state"]["batch"], said["state"]["step"]) == (1, 3, 9)
    assert max_diff(weights(runs["stopped"]), weights(runs["straight"])) <= 1e-6
    assert_close_records(records(runs["stopped"]), records(runs["straight"]))


def test_a_run_resumed_by_more_processes_gives_each_rank_its_own_random_stream(runs):
    """A run saved by one process resumed by two: the saved streams are rank 0's, and rank 1 is reseeded from the
    run's seed, its rank and the step, so the two ranks do not draw the same dropout masks from then on."""
    from itmatch.engine.checkpoint import load_trainer_state

    ranks = load_trainer_state(runs["root"] / "regrouped" / "last")["rng_ranks"]
    assert len(ranks) == 2 and not torch.equal(ranks[0]["torch"], ranks[1]["torch"])


def test_only_rank_0_writes_and_batch_size_must_split_evenly(runs):
    for name in ("gather", "local", "resumed", "stopped"):
        assert not [p for p in runs[name].iterdir() if p.name.endswith(".partial")]
    for rank in (0, 1):
        assert "not divisible by the 2 processes" in (runs["root"] / f"odd{rank}.txt").read_text()
    assert not (runs["root"] / "odd").exists()  # refused before anything was written


@pytest.mark.parametrize("preset", ["scan_t2i_avg", "vsepp"])
def test_sharded_evaluation_equals_single_process_exactly(runs, preset):
    """The ranks share the blocks of the single-process plan (SCAN, a small budget: many blocks) or the
    image rows of one product (VSE++): the assembled score matrix is bit-identical, and so the metrics,
    which every rank returns. SCAN's sharded evaluation continued from 3 blocks a single process had
    finished (--resume-dir) and removed them when complete. Rank 1 was given 4x the memory budget (as a GPU with
    more free memory sizes its own): the ranks plan with the smallest, so the plans still agree."""
    from itmatch.engine.evaluate import evaluate_models, split_scores
    from itmatch.engine.inputs import open_split

    ckpt = load_checkpoint(runs["root"] / preset)
    split = open_split(ckpt.config, "test")
    single = split_scores(ckpt.model.eval(), ckpt.vocab, split, BUDGET)
    assert torch.equal(torch.load(runs["root"] / preset / "sharded_scores.pt"), single)
    metrics = json.loads(json.dumps(evaluate_models([(ckpt.model, ckpt.vocab)], split, budget_bytes=BUDGET)))
    metrics.pop("eval_seconds")
    for rank in (0, 1):
        result = json.loads((runs["root"] / preset / f"result{rank}.json").read_text())
        result.pop("eval_seconds")
        resumed = result.pop("resumed", {}).get("blocks", 0)
        assert resumed == (3 if preset == "scan_t2i_avg" else 0)  # (VSE++: one product, nothing kept)
        assert result == metrics
    assert not (runs["root"] / preset / "blocks").exists()


def test_extraction_in_two_processes_equals_one_process(runs):
    """Each rank extracts its share (train: 3 + 2 images, the truncated one skipped in the second share;
    dev: 1 + 1), rank 0 merges: the arrays (batch size 1: the same kernels), ids, captions and manifest of
    a single-process extraction, and no shard directory left."""
    from itmatch.data.captions import CaptionTable
    from itmatch.data.precomp import read_precomp
    from itmatch.features.extract import extract_precomp

    images, table = runs["root"] / "photos", CaptionTable(source="captions")
    for name, caption, split in runs["table"]:
        table.add(name, caption, split)
    single, merged = runs["root"] / "extracted_single", runs["root"] / "extracted"
    meta = extract_precomp(images, table, single, batch_size=1, progress=False, skip_bad_images=True,
                           num_threads=1)
    assert sorted(p.name for p in merged.iterdir()) == sorted(p.name for p in single.iterdir())
    merged_meta = json.loads((merged / "meta.json").read_text())
    for split in ("train", "dev"):
        a, b = read_precomp(single, split), read_precomp(merged, split)
        assert np.array_equal(np.asarray(a.images), np.asarray(b.images))
        assert (a.ids, a.captions) == (b.ids, b.captions)
        keys = ("images", "captions", "listed_images", "features_sha256", "skipped", "fingerprint", "image_files",
                "captions_sha256")
        assert {k: merged_meta["splits"][split][k] for k in keys} == {k: meta["splits"][split][k] for k in keys}
    assert meta["splits"]["train"]["skipped"][0]["image_id"] == "p3.png"


def test_index_in_two_processes_equals_one_process(runs):
    """Each rank encodes half of the 12 photos into its own chunk files, rank 0 writes the index: the
    same manifest and arrays as a single-process index (batch size 1: the same backbone kernels)."""
    from itmatch.retrieval.index import build_index, load_index

    single = build_index(runs["photos"], runs["checkpoint"], runs["root"] / "index_single", batch_size=1,
                         progress=False)
    for rank in (0, 1):
        summary = json.loads((runs["root"] / f"index_summary{rank}.json").read_text())
        assert {k: v for k, v in summary.items() if k not in ("seconds", "index")} == \
               {k: v for k, v in single.items() if k not in ("seconds", "index")}
    a, b = load_index(runs["root"] / "index_single"), load_index(runs["root"] / "index")
    assert a.ids == b.ids and a.images == b.images
    assert np.array_equal(a.features(), b.features())
    assert torch.allclose(a.image_emb().regions, b.image_emb().regions, atol=1e-6)
    assert not (runs["root"] / "index" / "parts").exists() or not any((runs["root"] / "index" / "parts").iterdir())


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "itmatch", *args], env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_cli_train_and_evaluate_under_torchrun(tiny_precomp, tmp_path):
    out = tmp_path / "run"
    done = _torchrun("train", "--preset", "scan_t2i_avg", "--data", str(tiny_precomp), "--out", str(out),
                     "--set", "model.embed_size=32", "--set", "model.word_dim=32", "--set", "train.epochs=1",
                     "--set", "train.batch_size=16", "--set", "train.max_batches=2", "--set", "train.val_images=20",
                     "--set", "train.gather_negatives=true")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("best dev rsum") == 1  # rank 0 alone reports
    assert (out / "best").is_dir() and (out / "last").is_dir()
    assert not [p for p in out.iterdir() if p.name.endswith(".partial")]
    done = _torchrun("evaluate", str(out / "best"), "--split", "test", "--quiet", "--json", str(tmp_path / "m.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("rsum") == 1
    shutil.rmtree(out)


@pytest.mark.slow
def test_torchrun_sent_sigterm_saves_where_its_ranks_are_and_resumes(tiny_precomp, tmp_path):
    """`kill TORCHRUN_PID` (a scheduler's SIGTERM): torchrun's agent passes it on to each worker, once; the ranks
    agree on the step, save `last/` there and end, rank 0 alone saying so; `--resume` under torchrun trains on from
    that step. (Before, the workers died of it and the run lost everything since its last checkpoint.)"""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = tmp_path / "run"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "itmatch",
              "train", "--out", str(out)]
    agent = subprocess.Popen([*launch, "--preset", "scan_t2i_avg", "--data", str(tiny_precomp), "--set",
                              "model.embed_size=32", "--set", "model.word_dim=32", "--set", "train.epochs=20", "--set",
                              "train.batch_size=16", "--set", "train.val_images=20", "--set", "train.log_every=1"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count('"step"') >= 3):
            assert agent.poll() is None and time.monotonic() < deadline, "the training did not start its steps"
            time.sleep(0.2)
        agent.send_signal(signal.SIGTERM)
        stderr = agent.communicate(timeout=120)[1]
    finally:
        agent.kill()
    assert stderr.count("itmatch train: stopped by SIGTERM") == 1, stderr  # (rank 0 alone)
    assert "; the same command with --resume continues from there" in stderr
    state = json.loads((out / "last" / "state.json").read_text())
    assert state["step"] >= 3 and state["epoch"] < 20
    assert not [p for p in out.iterdir() if p.name.endswith(".partial")]
    done = subprocess.run([*launch, "--resume", "--set", f"train.epochs={state['epoch'] + 1}"], env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    trained = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in trained if "step" in r and "epoch" in r and "loss" in r]
    assert steps == list(range(1, steps[-1] + 1))  # every step once: none lost, none repeated
    assert trained[-1]["epoch"] == state["epoch"] + 1


class _MergeStopped(BaseException):
    """Stands for a kill of rank 0 inside the merge of the ranks' shares (nothing after it runs)."""


def _as_rank(monkeypatch, rank: int, world: int = 2) -> None:
    """Make this process rank `rank` of a torchrun group of `world` (no collectives: the ranks run one after
    the other, rank 0 last, so each share is complete when rank 0 merges them)."""
    monkeypatch.setattr(dist, "is_distributed", lambda: True)
    monkeypatch.setattr(dist, "init_from_env", lambda *a, **k: True)
    monkeypatch.setattr(dist, "rank", lambda: rank)
    monkeypatch.setattr(dist, "world_size", lambda: world)
    monkeypatch.setattr(dist, "barrier", lambda: None)
    monkeypatch.setattr(dist, "broadcast_object", lambda obj: obj)


def _photo(seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:48, 0:64]
    base = np.stack([xx * (seed + 1) * 3 % 256, yy * (seed + 2) * 5 % 256, (xx + yy) * 7 % 256], -1)
    return Image.fromarray(np.clip(base + rng.integers(-30, 30, base.shape), 0, 255).astype(np.uint8))


_RENAMES = ("arrays_filled", "after_c5", "after_c5_c3")


@pytest.mark.parametrize("stop", ["progress_written", "captions_removed", *_RENAMES])
@pytest.mark.parametrize("update", [False, True], ids=["first", "update"])
def test_extraction_merge_stopped_at_each_step_resumes_identically(tmp_path, monkeypatch, update, stop):
    """Rank 0 stopped inside `_merge_shards` (a first extraction or an update of a photo and a caption): right
    after it first wrote the split's progress file (before it removed the old captions and ids), after it
    removed them (no partial array yet), with every partial array filled, after the rename of the main array,
    after that of c3 too. The same command re-run then ends with the uninterrupted run's arrays and meta.json (`updated`
    included), not refused as another extraction's. The ranks run in this process one after the other."""
    from itmatch.data.captions import CaptionTable
    from itmatch.data.precomp import progress_path, read_precomp
    from itmatch.features import extract as e
    from itmatch.features import sharded as sharded_mod

    images = tmp_path / "images"
    images.mkdir()
    table = CaptionTable(source="captions")
    for i in range(5):
        _photo(i).save(images / f"im{i}.png")
        for c in range(5):
            table.add(f"im{i}.png", f"picture {i} caption {c}", "train")
    ref, out = tmp_path / "reference", tmp_path / "out"

    def sharded(target: Path) -> dict:
        for rank in (1, 0):
            with monkeypatch.context() as m:
                _as_rank(m, rank)
                meta = e.extract_precomp(images, table, target, batch_size=2, progress=False, scales="c3,c5",
                                         num_threads=1)
        return meta

    if update:
        sharded(ref)
        shutil.copytree(ref, out)
        _photo(43).save(images / "im3.png")
        table.captions[5 + 2] = "an edited caption of picture 1"
    expected = sharded(ref)["splits"]["train"]
    # (the merge, features/sharded.py, writes the split's progress file, fills its partial arrays and renames them)
    real_finish, real_write = sharded_mod.finish_array, sharded_mod.write_json_atomic
    real_memmap, renames = sharded_mod.open_memmap, []

    def finish(final, *args):
        if Path(final).parent == out and stop in _RENAMES:  # (not a share's own arrays)
            if len(renames) == _RENAMES.index(stop):
                raise _MergeStopped
            real_finish(final, *args)
            renames.append(final)
            if len(renames) == 2 and stop == "after_c5_c3":
                raise _MergeStopped
            return
        real_finish(final, *args)

    def write(path, obj):
        real_write(path, obj)
        if stop == "progress_written" and Path(path) == progress_path(out, "train") and dist.is_main() \
                and (out / ".shards-train" / "rank0-of-2" / "meta.json").exists():
            raise _MergeStopped

    def memmap(path, *args, **kwargs):
        if stop == "captions_removed" and Path(path).parent == out:
            assert not (out / "train_caps.txt").exists() and not (out / "train_ids.txt").exists()
            raise _MergeStopped
        return real_memmap(path, *args, **kwargs)

    monkeypatch.setattr(sharded_mod, "finish_array", finish)
    monkeypatch.setattr(sharded_mod, "write_json_atomic", write)
    monkeypatch.setattr(sharded_mod, "open_memmap", memmap)
    with pytest.raises(_MergeStopped):
        sharded(out)
    monkeypatch.undo()
    assert (out / ".shards-train").is_dir()
    got = sharded(out)["splits"]["train"]
    for name in ("train_ims.npy", "train_ims_c3.npy"):
        np.testing.assert_array_equal(np.load(out / name), np.load(ref / name), err_msg=name)
    skip = {"seconds_this_run", "images_per_second", "num_threads"}
    assert ({k: ({**v, "at": None} if k == "updated" else v) for k, v in got.items() if k not in skip}
            == {k: ({**v, "at": None} if k == "updated" else v) for k, v in expected.items() if k not in skip})
    if update:
        assert got["updated"]["image_files_changed"] == ["im3.png"]
        assert got["updated"]["captions_changed"] == ["im1.png"]
    assert read_precomp(out, "train", verify_checksum=True).captions == read_precomp(ref, "train").captions
    assert not list(out.glob("*.progress.json")) and not list(out.glob("*.partial"))
    assert not (out / ".shards-train").exists()


class _Stopped(Exception):
    """Stands for a single-process extraction stopped part-way (its progress file and partial array stay)."""


def test_extraction_under_torchrun_refuses_another_unfinished_extraction_before_any_share(tmp_path, monkeypatch):
    """An unfinished single-process extraction of other images in the output folder: a torchrun extraction of
    the same split refuses before any rank extracts its share (the merge would replace that extraction's progress
    file and partial array) and leaves both as they were; with `force` it discards them and runs."""
    from itmatch.data.captions import CaptionTable
    from itmatch.data.precomp import progress_path
    from itmatch.errors import OverwriteError
    from itmatch.features import extract as e
    from itmatch.features.progress import partial_path

    images, out = tmp_path / "images", tmp_path / "out"
    images.mkdir()
    other, table = CaptionTable(source="other"), CaptionTable(source="captions")
    for i in range(5):
        _photo(i).save(images / f"im{i}.png")
        for c in range(5):
            table.add(f"im{i}.png", f"picture {i} caption {c}", "train")
            if i < 4:
                other.add(f"im{i}.png", f"picture {i} caption {c}", "train")

    def stop(split, done, total):
        raise _Stopped

    with pytest.raises(_Stopped):
        e.extract_precomp(images, other, out, batch_size=2, progress=False, num_threads=1, on_batch=stop)
    progress, partial = progress_path(out, "train"), partial_path(out, "train")
    before = {p: p.read_bytes() for p in (progress, partial)}
    for rank in (1, 0):
        with monkeypatch.context() as m:
            _as_rank(m, rank)
            with pytest.raises(OverwriteError, match="unfinished extraction of split 'train'.*4 images"):
                e.extract_precomp(images, table, out, batch_size=2, progress=False, num_threads=1)
    assert {p: p.read_bytes() for p in before} == before and not (out / ".shards-train").exists()
    for rank in (1, 0):
        with monkeypatch.context() as m:
            _as_rank(m, rank)
            meta = e.extract_precomp(images, table, out, batch_size=2, progress=False, num_threads=1, force=True)
    assert meta["splits"]["train"]["images"] == 5 and not progress.exists() and not partial.exists()


@pytest.mark.parametrize("flag", [{"rerank": 5}, {"prune": True}])
def test_two_stage_evaluation_under_torchrun_is_refused_before_any_work(monkeypatch, tmp_path, flag):
    """--rerank and --prune score on rank 0 alone: the other processes would only wait, and give up after the
    group's timeout, ending a long evaluation. Refused before a checkpoint is read, with the way that works."""
    from itmatch.engine.evaluate import evaluate_run
    from itmatch.errors import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="rank 0 alone") as err:
        evaluate_run([tmp_path / "no such checkpoint"], json_path=tmp_path / "m.json", progress=False, device="cpu",
                     **flag)
    assert "one process" in err.value.hint and not (tmp_path / "m.json").exists()


def test_all_cores_under_torchrun_are_shared_among_the_ranks(monkeypatch):
    """threads 0 (all cores) under torchrun: torchrun sets OMP_NUM_THREADS=1 in every process, which left each
    rank one core; the ranks on this machine share its cores instead. A count given is kept; one process keeps
    torch's own count (0)."""
    cores = len(os.sched_getaffinity(0))
    assert dist.cpu_threads(0) == 0 and dist.cpu_threads(3) == 3
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert dist.cpu_threads(0) == max(1, cores // 2) and dist.cpu_threads(3) == 3


def test_the_collective_timeout_is_a_setting(monkeypatch):
    """Where rank 0 works alone for longer than 30 minutes (validation with train.val_rerank on a large dev
    split), the other ranks' wait is raised with ITMATCH_DIST_TIMEOUT_MINUTES; a value that is no number of
    minutes is refused by name."""
    from itmatch.errors import ConfigError

    assert dist.timeout_minutes() == 30.0
    monkeypatch.setenv(dist.TIMEOUT_ENV, "120")
    assert dist.timeout_minutes() == 120.0
    for bad in ("soon", "0", "-5", "inf", "nan"):
        monkeypatch.setenv(dist.TIMEOUT_ENV, bad)
        with pytest.raises(ConfigError, match=dist.TIMEOUT_ENV):
            dist.timeout_minutes()
