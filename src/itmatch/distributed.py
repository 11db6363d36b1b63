"""Process groups for data-parallel runs under torchrun: initialisation from torchrun's environment, rank
helpers, contiguous shards, and gathers (an autograd-aware one for the global-batch loss, object gathers for
the evaluator, the trainer's RNG states and the indexer). In a single process everything is a no-op (rank 0 of
1, barriers and gathers return at once), so train/evaluate/extract call these helpers unconditionally. It knows
tensors, not models (engine/train.py gathers a model's embeddings). How each verb uses it: docs/distributed.md.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from itmatch.errors import ConfigError

BACKENDS = ("auto", "gloo", "nccl")


def env_world_size() -> int:
    """WORLD_SIZE as torchrun sets it (1 when not launched by torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer",
                          hint="launch with torchrun, or unset WORLD_SIZE") from None


#: minutes a rank waits in a collective before the group gives up (torch's gloo default); raise it where rank 0
#: works alone for longer, e.g. a training run validating with train.val_rerank / val_prune on a large dev split
TIMEOUT_ENV = "ITMATCH_DIST_TIMEOUT_MINUTES"
DEFAULT_TIMEOUT_MINUTES = 30.0


def timeout_minutes() -> float:
    """The collective timeout: $ITMATCH_DIST_TIMEOUT_MINUTES, else 30."""
    value = os.environ.get(TIMEOUT_ENV, "")
    if not value:
        return DEFAULT_TIMEOUT_MINUTES
    try:
        minutes = float(value)
    except ValueError:
        minutes = float("nan")
    if not minutes > 0 or minutes == float("inf"):
        raise ConfigError(f"{TIMEOUT_ENV}={value!r} is not a number of minutes > 0",
                          hint=f"e.g. {TIMEOUT_ENV}=120, or unset it for {DEFAULT_TIMEOUT_MINUTES:g}")
    return minutes


def cpu_threads(threads: int) -> int:
    """torch's intra-op threads for a `threads` setting whose 0 means all cores. Under torchrun 0 means this
    machine's cores shared among its processes: torchrun sets OMP_NUM_THREADS=1 in each (unless it was set),
    which left every rank one core. Elsewhere 0 stays 0 (torch's own count); any other value is kept."""
    if threads or env_world_size() <= 1:
        return threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def init_from_env(backend: str = "auto", device_type: str = "cpu") -> bool:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
    Returns True when running distributed (world size > 1). backend auto: NCCL when the tensors live on
    GPUs (`device_type` cuda), gloo for CPU tensors (NCCL cannot reduce them; evaluation, extraction and
    indexing exchange only host objects). Collectives time out after timeout_minutes(). Idempotent: a second
    call (evaluation inside training) reuses the group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    if env_world_size() <= 1:
        return False
    if backend not in BACKENDS:
        raise ConfigError(f"unknown train.backend {backend!r}", hint=f"choose one of {', '.join(BACKENDS)}")
    if not dist.is_available():
        raise ConfigError("this torch build has no torch.distributed", hint="run a single process")
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl":
        if device_type != "cuda" or not torch.cuda.is_available():
            raise ConfigError("train.backend nccl reduces GPU tensors, but this run keeps its tensors on the CPU",
                              hint="set train.backend=gloo (or auto)")
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes()))
    return dist.get_world_size() > 1


def shutdown(wait: bool = True) -> None:
    """Leave the process group (end of a torchrun command); `wait`: together with the other ranks."""
    if wait and is_distributed():
        dist.barrier()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    """Rank 0: the only process that writes logs, metrics, checkpoints and merged outputs."""
    return rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def device() -> torch.device:
    """The device of this rank's collectives: its GPU under NCCL, the CPU under gloo."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def shard_bounds(n: int, rank_: int | None = None, world: int | None = None) -> tuple[int, int]:
    """[start, stop) of `rank_`'s contiguous share of n items: the first n % world ranks get one more.
    Concatenating the shards in rank order gives back 0..n-1."""
    rank_ = rank() if rank_ is None else rank_
    world = world_size() if world is None else world
    base, extra = divmod(n, world)
    start = rank_ * base + min(rank_, extra)
    return start, start + base + (1 if rank_ < extra else 0)


class _GatherGrad(torch.autograd.Function):
    """All-gather along dim 0 (equal shapes on every rank) whose backward sums the gradient of the
    gathered tensor over all ranks and returns this rank's slice: rank r's rows receive
    sum_r' dL_r'/d(rows of r), as if every rank's loss had been computed on one machine."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.rows = tensor.shape[0]
        return _all_gather(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad)
        start = rank() * ctx.rows
        return grad[start:start + ctx.rows]


def gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `tensor` (same shape on all ranks) along dim 0, in rank order. Gradients
    flow back to the local part (summed over the ranks that used it); tensors without grad are plainly
    gathered."""
    if not is_distributed():
        return tensor
    if tensor.requires_grad:
        return _GatherGrad.apply(tensor)
    if tensor.dtype == torch.bool:  # (gloo has no bool all_gather)
        return gather_rows(tensor.to(torch.uint8)).bool()
    return _all_gather(tensor)


def _all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's `tensor` concatenated along dim 0 in rank order (no autograd)."""
    parts = [torch.empty_like(tensor) for _ in range(world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


def max_over_ranks(value: int) -> int:
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.long, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def sum_over_ranks(values: Sequence[float]) -> list[float]:
    """Each of `values` summed over the ranks, all in one all-reduce (float64): several figures a step cost one
    collective, and one host sync, instead of one each."""
    if not is_distributed():
        return [float(v) for v in values]
    t = torch.tensor(list(values), dtype=torch.float64, device=device())
    dist.all_reduce(t)
    return [float(v) for v in t.tolist()]


def gather_objects(obj: Any) -> list[Any] | None:
    """Every rank's picklable `obj` on rank 0 (in rank order); None on the other ranks."""
    if not is_distributed():
        return [obj]
    out: list[Any] | None = [None] * world_size() if is_main() else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (the others' argument is ignored)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
