"""Where the tensors live and in which precision the arithmetic runs: one setting for every verb.

`--device auto|cpu|cuda|cuda:N` and `--precision fp32|bf16|fp16` (config `train.device` / `train.precision`,
`itmatch.load(path, device=...)`) are resolved here, once, before any work: a device or precision this machine
cannot run is a ConfigError naming the setting and what the machine offers. Precision is autocast, never a cast
of the weights; fp32, the default, is exact. What each setting does and allows: docs/gpu.md.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from itmatch.distributed import env_world_size, local_rank
from itmatch.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda", "cuda:N")
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: torch.OutOfMemoryError (torch >= 2.5); torch.cuda's older name otherwise
OutOfMemoryError: type[BaseException] = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def machine_name(device: torch.device) -> str:
    """The machine a device is, in words: the GPU's name ("NVIDIA H100 80GB HBM3"), or "CPU " and the processor's
    model ("CPU AMD EPYC 7B13"); what a run records as where it trained."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    from pathlib import Path

    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.is_file() else [])
             if line.startswith("model name")]
    return f"{device.type.upper()} {names[0] if names else platform.processor() or 'unknown'}"


def available_devices() -> str:
    """What this machine offers, in words (for error messages)."""
    if not torch.cuda.is_available():
        return "this torch sees no GPU (torch.cuda.is_available() is False): only cpu"
    names = ", ".join(f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(torch.cuda.device_count()))
    return f"cpu, {names}"


def resolve_device(spec: str | torch.device | None = "auto", setting: str = "--device") -> torch.device:
    """`auto` (the GPU when torch sees one, else the CPU), `cpu`, `cuda` (this process's GPU: LOCAL_RANK's
    under torchrun, else the first), `cuda:N`. A device torch cannot use raises ConfigError naming
    `setting` (the flag or config key the value came from) and the devices available."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    kind, _, index = spec.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ConfigError(f"{setting} {spec!r} is not a device", hint=f"choose one of {', '.join(DEVICES)}")
    torchrun, local = env_world_size() > 1, local_rank()
    if index and torchrun and int(index) != local:
        # (every rank would name the same GPU: NCCL refuses a GPU shared by two ranks, or waits forever)
        raise ConfigError(f"{setting} {spec} under torchrun: this process is local rank {local}, whose GPU is "
                          f"cuda:{local}", hint=f"use {setting} cuda: each rank takes the GPU of its LOCAL_RANK "
                                             "(limit the GPUs with CUDA_VISIBLE_DEVICES)")
    if not torch.cuda.is_available():
        raise ConfigError(f"{setting} {spec}: {available_devices()}",
                          hint=f"use {setting} cpu (or auto), or install a CUDA build of torch on a GPU machine")
    n = int(index) if index else local
    count = torch.cuda.device_count()
    if n >= count:
        hint = (f"start at most {count} processes a machine (torchrun --nproc_per_node {count}): each takes the GPU "
                "of its LOCAL_RANK" if not index and torchrun
                else f"use cuda:0 .. cuda:{count - 1}, or cuda (this process's GPU)")
        raise ConfigError(f"{setting} {spec}: there is no GPU {n}; torch sees {count} ({available_devices()})",
                          hint=hint)
    return torch.device("cuda", n)


def check_precision(precision: str, device: torch.device, setting: str = "--precision") -> torch.dtype:
    """The autocast dtype of `precision` on `device` (float32: no autocast); ConfigError when `device`
    cannot run it."""
    if precision not in PRECISIONS:
        raise ConfigError(f"{setting} {precision!r} is not a precision",
                          hint=f"choose one of {', '.join(PRECISIONS)}")
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(f"{setting} fp16 needs a CUDA device, this run is on {device}",
                          hint="use fp32 (exact) or bf16 on the CPU, or --device cuda on a GPU machine")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"{setting} bf16: {torch.cuda.get_device_name(device)} has no bfloat16 support",
                          hint="use fp16 (with its gradient scaler) or fp32 on this GPU")
    return PRECISIONS[precision]


@dataclass(frozen=True)
class Placement:
    """A resolved device and precision: where tensors go and how the arithmetic runs."""

    device: torch.device
    precision: str = "fp32"

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def arithmetic(self) -> contextlib.AbstractContextManager:
        """The precision's arithmetic for a block of work: bf16/fp16 autocast to that dtype; fp32 no autocast at
        all, and on a GPU TensorFloat-32 off in cuBLAS and cuDNN (exact_fp32), so fp32 is exact everywhere."""
        if self.precision != "fp32":
            return torch.autocast(self.device.type, dtype=PRECISIONS[self.precision])
        return exact_fp32() if self.is_cuda else contextlib.nullcontext()

    def grad_scaler(self) -> torch.amp.GradScaler:
        """A loss scaler, enabled for fp16 only (bf16 has fp32's exponent range and needs none)."""
        return torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")


# exact_fp32 scopes open now in this process, and the TF32 flags they found on entering the first
_exact_lock = threading.Lock()
_exact_open = 0
_tf32_before: tuple[bool, bool] = (False, True)


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """Within the block float32 matrix products and cuDNN's convolutions and RNNs run in IEEE float32, not
    TensorFloat-32. PyTorch lets cuDNN use TF32 by default (torch.backends.cudnn.allow_tf32 is True), which rounds
    the GRU's and the CNN's inputs to 10-bit mantissas: with those defaults an H200 gave SCAN scores more than 1e-4
    from the CPU's (docs/gpu.md; not yet re-run with them off). The flags are process-wide, so the scopes are
    counted: the first to open switches TF32 off and the last to close restores what it found, which keeps
    concurrent scopes (the server's threads) exact throughout."""
    global _exact_open, _tf32_before
    with _exact_lock:
        if _exact_open == 0:
            _tf32_before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        _exact_open += 1
    try:
        yield
    finally:
        with _exact_lock:
            _exact_open -= 1
            if _exact_open == 0:
                torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = _tf32_before


def resolve(device: str | torch.device | None = "auto", precision: str = "fp32", *,
            device_setting: str = "--device", precision_setting: str = "--precision") -> Placement:
    """Both settings checked together (before any work): see resolve_device and check_precision."""
    where = resolve_device(device, device_setting)
    check_precision(precision, where, precision_setting)
    return Placement(where, precision)


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of a module's parameters (or buffers); the CPU for a module with neither."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def to_device(value: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Tensors inside `value` (a tensor, dict, list or tuple of them, others left alone) moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, dict):
        return {k: to_device(v, device, non_blocking) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_device(v, device, non_blocking) for v in value)
    return value


def free_memory(device: torch.device) -> int | None:
    """Bytes the device has free now (CUDA: the driver's count); None for the CPU (the user's budget rules)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


#: of the free GPU memory a block plan may use: the rest is headroom for the allocator's fragmentation and
#: the encoder's cached activations
DEVICE_MEMORY_FRACTION = 0.8


def release_cached_memory(device: torch.device) -> None:
    """Give the caching allocator's free blocks back (after an out-of-memory error, before a retry)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def default_device(device: str | torch.device) -> Iterator[None]:
    """Within the block, factory functions called without `device=` create their tensors on `device`. A
    test runs CPU models under `default_device("meta")`: a tensor created without its inputs' device then
    lands on the meta device and mixing it with the CPU tensors fails, as a CPU tensor would on a GPU."""
    previous = torch.get_default_device()
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(previous)
