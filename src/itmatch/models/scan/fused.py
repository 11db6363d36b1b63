"""SCAN's t-i head at evaluation in one Triton kernel (issue 23): from a block's raw region-word dots, the
attention logits, the softmax over regions, the attended dot, the Gram product alpha^T G alpha, the cosine and
the pooling over words, without the block's intermediate buffers. ScanHead.forward uses it on CUDA when
autograd is off; everywhere else, and whenever it cannot, the plain head runs unchanged. docs/gpu.md,
"The fused SCAN t-i kernel". ITMATCH_FUSED=0 turns it off."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from itmatch.models.base import EPS, ImageEmb, TextEmb

ENV = "ITMATCH_FUSED"  # "0" turns the kernel off
#: raw_feature_norm values the kernel computes ("softmax", over words, stays with the plain head)
NORMS = ("clipped_l2norm", "l2norm", "clipped", "no_norm")
POOL_CODES = {"avg": 0, "lse": 1, "max": 2, "sum": 3}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # of the dots and the Gram matrices
MAX_REGIONS = 128  # padded region axis of a tile (its Gram tile is MAX_REGIONS^2)
MAX_TILE = 16384  # padded regions x padded words of one caption, at most (the tile lives in registers)
#: regions x words cells a program takes (whole captions), per tl.dot precision: the largest tiles that ptxas
#: (sm_90a, triton 3.9) compiles without register spills at 8 warps; chosen from `ptxas -v`, not timed
TILE = {"ieee": 4096, "tf32x3": 8192, "tf32": 8192}

_override: bool | None = None  # switched(); None: the environment decides
_broken: str | None = None  # why the kernel was turned off for this process (it failed to compile or run)
_triton: dict[str, Any] = {}  # the import, once: {"module": triton} or {"missing": reason}
_kernels: dict[bool, Any] = {}  # interpreted? -> the jitted kernel
launches = 0  # kernel launches in this process (the bench checks that its fused rows used the kernel)


@contextlib.contextmanager
def switched(on: bool) -> Iterator[None]:
    """Within the block, use the kernel where it can run (True) or never (False), whatever ITMATCH_FUSED says."""
    global _override
    previous, _override = _override, on
    try:
        yield
    finally:
        _override = previous


def enabled() -> bool:
    return _override if _override is not None else os.environ.get(ENV, "1").strip() != "0"


def triton_missing() -> str | None:
    """None when triton (>= 3.0) imports; else why not. Imported on first use, not with itmatch."""
    if not _triton:
        try:
            import triton
        except Exception as e:  # ImportError, or an installed triton that fails to load
            _triton["missing"] = f"triton is not importable ({type(e).__name__}: {e})"
        else:
            major = int(triton.__version__.split(".")[0])
            if major < 3:
                _triton["missing"] = f"triton {triton.__version__} is older than 3.0"
            else:
                _triton["module"] = triton
    return _triton.get("missing")


def interpreted() -> bool:
    """TRITON_INTERPRET=1: triton runs kernels on CPU tensors with numpy (how the CPU tests run this one)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip() not in ("", "0")


def kernel() -> Any:
    """The jitted kernel (interpreted under TRITON_INTERPRET=1, which triton reads when a kernel is jitted)."""
    missing = triton_missing()
    if missing:
        raise RuntimeError(missing)
    key = interpreted()
    if key not in _kernels:
        from itmatch.models.scan.fused_kernel import scan_t2i_kernel

        _kernels[key] = _triton["module"].jit(scan_t2i_kernel)
    return _kernels[key]


def device_supported(s: torch.Tensor) -> bool:
    """Compiled kernels run on CUDA tensors (the CPU tests patch this to run the interpreter through the head)."""
    return s.is_cuda


def unusable_reason(norm: str, pool: str, s: torch.Tensor, gram: torch.Tensor, words: torch.Tensor) -> str | None:
    """None when the kernel can score this t-i block of dots s [n, k, m, L]; else why the plain head must."""
    if not enabled():
        return f"{ENV}=0" if _override is None else "switched off"
    if _broken:
        return _broken
    if not device_supported(s):
        return f"the block is on {s.device.type}, not CUDA"
    if torch.is_grad_enabled() and (s.requires_grad or gram.requires_grad or words.requires_grad):
        return "autograd is on (training keeps the plain head)"
    if norm not in NORMS:
        return f"raw_feature_norm {norm!r} is not fused"
    if pool not in POOL_CODES:
        return f"pool {pool!r} is not fused"
    if gram.device != s.device or words.device != s.device:
        return f"the block's tensors are on {s.device}, {gram.device} and {words.device}"
    if s.dtype not in DTYPES or gram.dtype not in DTYPES or words.dtype not in DTYPES:
        return f"dtype {s.dtype}/{gram.dtype}/{words.dtype} is not fused"
    n, k, m, length = s.shape
    if s.numel() == 0:
        return "an empty block"
    regions, words_pow2 = _pow2(k, 16), _pow2(length)
    if regions > MAX_REGIONS or regions * words_pow2 > MAX_TILE:
        return f"{k} regions x {length} words is larger than a tile"
    return triton_missing()


def _pow2(x: int, least: int = 1) -> int:
    return max(least, 1 << max(0, x - 1).bit_length())


def gram_precision(s: torch.Tensor) -> str:
    """tl.dot's input precision for alpha^T G alpha: exact float32 ("ieee") when the block is float32 without
    TF32; on the tensor cores at ~float32 accuracy ("tf32x3") when the run is already TF32 or half precision."""
    strict = s.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    return "ieee" if strict else "tf32x3"


def t2i_scores(s: torch.Tensor, region_mask: torch.Tensor, gram: torch.Tensor, word_norms: torch.Tensor,
               lengths: torch.Tensor, norm: str = "clipped_l2norm", clip_slope: float = 0.1,
               lambda_softmax: float = 9.0, pool: str = "avg", lambda_lse: float = 6.0,
               precision: str | None = None) -> torch.Tensor:
    """ScanHead t2i scores [n, m] (float32) of a block from its raw dots s [n, k, m, L] (any of DTYPES, any
    strides), the images' region mask [n, k] and Gram matrices [n, k, k], the words' norms [m, L] and the
    captions' lengths [m], with the head's padding rules: -inf logits on padded regions, padded words (s = 0)
    in the norm over words but not in the pooling. No checks beyond the shapes: see unusable_reason."""
    n, k, m, length = s.shape
    if region_mask.shape != (n, k) or gram.shape != (n, k, k) or word_norms.shape != (m, length) or \
            lengths.shape != (m,):
        raise ValueError(f"shapes do not match the dots {tuple(s.shape)}: mask {tuple(region_mask.shape)}, gram "
                         f"{tuple(gram.shape)}, word norms {tuple(word_norms.shape)}, lengths {tuple(lengths.shape)}")
    if norm not in NORMS or pool not in POOL_CODES:
        raise ValueError(f"the kernel computes raw_feature_norm in {NORMS} and pool in {tuple(POOL_CODES)}, "
                         f"not {norm!r} / {pool!r}")
    global launches
    precision = precision or gram_precision(s)
    kp, mt, lp, warps = tiles(k, length, m, precision)
    real = region_mask.to(torch.int8)
    word_norms = word_norms.float()
    lengths = lengths.to(device=s.device, dtype=torch.int32).contiguous()
    out = torch.empty((n, m), device=s.device, dtype=torch.float32)
    launches += 1
    # triton launches on the current CUDA device: make it the block's (a rank's cuda:N without set_device)
    with torch.cuda.device(s.device) if s.is_cuda else contextlib.nullcontext():
        kernel()[(n, -(-m // mt))](
            s, gram, real, word_norms, lengths, out, k, m, length,
            *s.stride(), *gram.stride(), *real.stride(), *word_norms.stride(), *out.stride(),
            float(clip_slope), float(lambda_softmax), float(lambda_lse), EPS,
            CLIP=norm in ("clipped_l2norm", "clipped"), L2=norm in ("clipped_l2norm", "l2norm"),
            SCALE_S=norm == "no_norm", POOL=POOL_CODES[pool], KP=kp, MT=mt, LP=lp, PRECISION=precision,
            num_warps=warps, enable_fp_fusion=True)  # (fused multiply-adds, as nvcc compiles torch's kernels)
    return out


def tiles(k: int, length: int, m: int, precision: str) -> tuple[int, int, int, int]:
    """(padded regions, captions per program, padded words, warps) of a block's programs: regions and words
    padded to powers of two (tl.dot: at least 16 regions and 16 columns), as many whole captions as TILE
    allows, 8 warps from 2048 cells on and 16 above 8192 (fewer spill)."""
    kp, lp = _pow2(k, 16), _pow2(length)
    mt = min(max(1, TILE.get(precision, 8192) // (kp * lp)), _pow2(m))
    mt = max(mt, _pow2(-(-16 // lp)))
    cells = kp * mt * lp
    return kp, mt, lp, 16 if cells > 8192 else 8 if cells >= 2048 else 4


def head_scores(head: Any, s: torch.Tensor, img: ImageEmb, txt: TextEmb) -> torch.Tensor | None:
    """What ScanHead.forward (t2i) returns for the block of dots s, from the kernel; None when the plain head
    must compute it (unusable_reason, or the kernel failed: then it stays off for this process, with a warning)."""
    global _broken
    gram = img.extras["gram"]
    if unusable_reason(head.norm, head.pool, s, gram, txt.words) is not None:
        return None
    try:
        scores = t2i_scores(s, img.mask, gram, txt.words.norm(dim=-1), txt.lengths, head.norm, head.clip_slope,
                            head.lambda_softmax, head.pool, head.lambda_lse)
    except torch.OutOfMemoryError:
        raise  # the evaluator's retry halves the block
    except Exception as e:  # a triton or driver that cannot compile or run it: the plain head, from now on
        _broken = f"the fused kernel failed ({type(e).__name__}: {e}); the plain head is used"
        warnings.warn(_broken, RuntimeWarning, stacklevel=2)
        return None
    return scores.to(_plain_dtype(s, gram, txt.words))


def _plain_dtype(s: torch.Tensor, gram: torch.Tensor, words: torch.Tensor) -> torch.dtype:
    """The dtype the plain head's scores have: float32 under autocast (its softmax runs in float32), else the
    promotion of its inputs' (bfloat16 throughout for a bfloat16 model)."""
    try:
        autocast = torch.is_autocast_enabled(s.device.type)
    except TypeError:  # torch < 2.4: no device argument (CUDA's)
        autocast = torch.is_autocast_enabled()
    if autocast:
        return torch.float32
    return torch.promote_types(torch.promote_types(s.dtype, gram.dtype), words.dtype)
