"""The fused SCAN t-i kernel (models/scan/fused.py, docs/gpu.md "The fused SCAN t-i kernel") against the plain
head it replaces at evaluation: on the CPU through Triton's interpreter (test_interpreted_*: run by
test_the_kernel_in_triton_s_interpreter in a child process with TRITON_INTERPRET=1, which triton must see before
it is imported; the dev extra installs triton, skipped where it is missing), on a GPU compiled (marked `cuda`);
and when ScanHead.forward may use it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from itmatch.models.base import ImageEmb, TextEmb, length_mask, masked_pool
from itmatch.models.region_word import region_word_dots
from itmatch.models.scan import fused
from itmatch.models.scan.head import ScanHead, attended_relevance

ROOT = Path(__file__).resolve().parents[3]
MISSING = fused.triton_missing()
#: the interpreted checks run only in the child process that test_the_kernel_in_triton_s_interpreter starts
interpreted = pytest.mark.skipif(not fused.interpreted() or MISSING is not None,
                                 reason=f"needs triton: {MISSING}" if MISSING else "interpreter checks: run (with "
                                        "TRITON_INTERPRET=1) by test_the_kernel_in_triton_s_interpreter")
NO_GPU = ("needs a CUDA GPU (torch sees none)" if not torch.cuda.is_available()
          else f"needs triton: {MISSING}" if MISSING else "")


def block(n=3, k=36, m=11, length=13, d=32, seed=0, device="cpu"):
    """Unit regions / words as Matcher.encode_* leaves them: zero on padded regions (image 1 has 30 real ones,
    image 2 five) and beyond each caption's length (caption 0 fills the block, the others are shorter)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, k, dtype=torch.bool)
    if n > 1:
        mask[1, 30:] = False
    if n > 2:
        mask[2, 5:] = False
    lengths = torch.randint(1, length + 1, (m,), generator=g)
    lengths[0] = length
    shared = torch.randn(d, generator=g)  # a common direction: dots well away from 0, as in a trained model
    regions = F.normalize(torch.randn(n, k, d, generator=g) + shared, dim=-1) * mask[..., None]
    words = F.normalize(torch.randn(m, length, d, generator=g) + shared, dim=-1)
    words = words * length_mask(lengths, length)[..., None]
    return (ImageEmb(regions=regions.to(device), mask=mask.to(device)),
            TextEmb(words=words.to(device), lengths=lengths.to(device)))


def plain(head: ScanHead, img: ImageEmb, txt: TextEmb) -> torch.Tensor:
    with fused.switched(False), torch.no_grad():
        return head(head.prepare_images(img), txt)


def plain_from_dots(head: ScanHead, img: ImageEmb, txt: TextEmb, s: torch.Tensor) -> torch.Tensor:
    """The plain head's float32 arithmetic (exact, no TF32) from given dots s: what the kernel computes."""
    previous, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        with torch.no_grad():
            rel = attended_relevance(s.float().clone(), txt.mask, img.mask, img.extras["gram"], txt.words, head.norm,
                                     head.clip_slope, head.lambda_softmax)
            return masked_pool(rel, txt.mask[None], 2, head.pool, head.lambda_lse)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def kernel_scores(head: ScanHead, img: ImageEmb, txt: TextEmb, s: torch.Tensor | None = None) -> torch.Tensor:
    img = head.prepare_images(img)
    s = region_word_dots(img, txt) if s is None else s
    return fused.t2i_scores(s, img.mask, img.extras["gram"], txt.words.norm(dim=-1), txt.lengths, head.norm,
                            head.clip_slope, head.lambda_softmax, head.pool, head.lambda_lse)


@pytest.fixture
def kernel_on(monkeypatch):
    """As a fresh process: not turned off by an earlier failure."""
    monkeypatch.setattr(fused, "_broken", None)


# -- on the CPU, interpreted --------------------------------------------------------------------------------------

@pytest.mark.skipif(MISSING is not None, reason=f"the kernel's CPU checks run in Triton's interpreter: {MISSING}")
@pytest.mark.skipif(fused.interpreted(), reason="this is the interpreter's process")
def test_the_kernel_in_triton_s_interpreter():
    """Triton's interpreter runs kernels on CPU tensors with numpy; it must be on before triton is imported, so
    the test_interpreted_* checks run in a child pytest with TRITON_INTERPRET=1."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
                           "-k", "test_interpreted_"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " skipped" not in done.stdout, done.stdout[-3000:]


@interpreted
@pytest.mark.parametrize("pool", ["avg", "lse", "max", "sum"])
@pytest.mark.parametrize("norm", fused.NORMS)
def test_interpreted_kernel_gives_the_plain_heads_scores(kernel_on, norm, pool):
    head = ScanHead("t2i", pool, 9.0, 6.0, norm, 0.1)
    img, txt = block()
    expected = plain(head, img, txt)
    got = kernel_scores(head, img, txt)
    assert got.shape == expected.shape == (3, 11) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@interpreted
@pytest.mark.parametrize(("n", "k", "m", "length"), [(2, 5, 3, 1), (2, 49, 20, 70), (1, 36, 1, 7), (4, 16, 37, 16)])
def test_interpreted_odd_shapes_few_regions_long_captions_partial_tiles(kernel_on, n, k, m, length):
    """5 regions (the region tile is padded to 16), 49 (to 64), one-word captions, 70 words (one caption a
    tile), caption counts that leave a tile partly empty."""
    for pool in ("avg", "lse"):
        head = ScanHead("t2i", pool, 9.0, 6.0)
        img, txt = block(n, k, m, length, seed=k)
        torch.testing.assert_close(kernel_scores(head, img, txt), plain(head, img, txt), atol=1e-5, rtol=0)


@interpreted
def test_interpreted_half_precision_dots_and_strided_blocks(kernel_on):
    """Dots in bfloat16 (a bf16 GEMM's) give the plain float32 head's scores from the same rounded dots; a
    non-contiguous block (a slice of a larger one) is read through its strides."""
    head = ScanHead("t2i", "lse", 9.0, 6.0)
    img, txt = block()
    img = head.prepare_images(img)
    s16 = region_word_dots(img, txt).bfloat16()
    expected = plain_from_dots(head, img, txt, s16)
    torch.testing.assert_close(kernel_scores(head, img, txt, s16), expected, atol=1e-5, rtol=0)
    wide = region_word_dots(img, TextEmb(words=torch.cat([txt.words, txt.words]), lengths=txt.lengths.repeat(2)))
    strided = wide[:, :, 11:]  # the second copy of the captions: a view with the first one's stride
    assert not strided.is_contiguous()
    torch.testing.assert_close(kernel_scores(head, img, txt, strided), plain(head, img, txt), atol=1e-5, rtol=0)


@interpreted
def test_interpreted_degenerate_items_give_what_the_plain_head_gives(kernel_on):
    """An image without a real region (NaN: a softmax over nothing, in both) and a caption without words
    (avg 0, lse -inf, in both)."""
    img, txt = block(n=2, m=4)
    img.mask[1] = False
    img.regions[1] = 0
    txt.lengths[2] = 0
    txt.words[2] = 0
    for pool in ("avg", "lse"):
        head = ScanHead("t2i", pool, 9.0, 6.0)
        got, expected = kernel_scores(head, img, txt), plain(head, img, txt)
        words = txt.lengths > 0  # (a caption without words pools nothing: 0 / -inf, not NaN)
        assert got[1, words].isnan().all() and expected[1, words].isnan().all()
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0, equal_nan=True)


@interpreted
def test_interpreted_scan_head_forward_uses_the_kernel_when_it_may(kernel_on, monkeypatch):
    """Through ScanHead.forward (its device check let through to the CPU): the kernel is called for t-i without
    autograd and gives the plain head's scores; with ITMATCH_FUSED=0, for i-t and in training it is not called."""
    monkeypatch.setattr(fused, "device_supported", lambda s: True)
    calls = []
    real = fused.t2i_scores
    monkeypatch.setattr(fused, "t2i_scores", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    head = ScanHead("t2i", "avg", 9.0, 6.0)
    img, txt = block()
    expected = plain(head, img, txt)
    with torch.no_grad():
        got = head(head.prepare_images(img), txt)
    assert len(calls) == 1
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    monkeypatch.setenv(fused.ENV, "0")
    with torch.no_grad():
        assert torch.equal(head(head.prepare_images(img), txt), expected)
    monkeypatch.delenv(fused.ENV)
    with torch.no_grad():
        i2t = ScanHead("i2t", "avg", 4.0, 5.0)
        i2t(i2t.prepare_images(img), i2t.prepare_texts(txt))
    regions = img.regions.clone().requires_grad_()
    training = head(head.prepare_images(ImageEmb(regions=regions, mask=img.mask)), txt)
    training.sum().backward()
    assert len(calls) == 1 and regions.grad is not None


@pytest.mark.skipif(MISSING is not None, reason=f"needs triton: {MISSING}")
@pytest.mark.skipif(fused.interpreted(), reason="compiles, so not in the interpreter's process")
@pytest.mark.parametrize(("dots", "precision", "regions", "words", "norm", "pool"), [
    ("fp32", "ieee", 36, 12, "clipped_l2norm", "avg"), ("fp32", "ieee", 36, 80, "l2norm", "lse"),
    ("fp32", "tf32x3", 36, 40, "clipped", "max"), ("bf16", "tf32x3", 36, 12, "clipped_l2norm", "lse"),
    ("fp16", "tf32x3", 100, 16, "no_norm", "sum"), ("bf16", "tf32x3", 5, 1, "clipped_l2norm", "avg")])
def test_the_kernel_compiles_for_an_h100_without_one(dots, precision, regions, words, norm, pool):
    """Triton compiles for a target it is told (here sm_90, the H100) down to a cubin with its own ptxas, GPU
    or not: every kind of tile, dtype and constexpr branch the head can launch builds."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from itmatch.models.scan.fused_kernel import scan_t2i_kernel

    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as e:
        pytest.skip(f"this triton has no NVIDIA backend ({e})")
    kp, mt, lp, warps = fused.tiles(regions, words, 5000, precision)
    pointers = {"s_ptr": f"*{dots}", "gram_ptr": "*fp32", "real_ptr": "*i8", "enorm_ptr": "*fp32", "len_ptr": "*i32",
                "out_ptr": "*fp32"}
    floats = ("slope", "lam1", "lam2", "eps")
    constants = {"CLIP": norm in ("clipped_l2norm", "clipped"), "L2": norm in ("clipped_l2norm", "l2norm"),
                 "SCALE_S": norm == "no_norm", "POOL": fused.POOL_CODES[pool], "KP": kp, "MT": mt, "LP": lp,
                 "PRECISION": precision}
    fn = triton.jit(scan_t2i_kernel)
    signature = {a: pointers.get(a) or ("fp32" if a in floats else "constexpr" if a in constants else "i32")
                 for a in fn.arg_names}
    signature["s_si"] = "i64"  # a block of more than 2^31 cells
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constants), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "enable_fp_fusion": True})
    assert compiled.asm["cubin"] and ".target sm_90" in compiled.asm["ptx"]


# -- when the head may use it (no triton needed) ------------------------------------------------------------------

def test_the_plain_head_runs_wherever_the_kernel_may_not(monkeypatch):
    monkeypatch.setattr(fused, "_broken", None)
    img, txt = block()
    head = ScanHead("t2i", "avg", 9.0, 6.0)
    img = head.prepare_images(img)
    s, gram = region_word_dots(img, txt), img.extras["gram"]

    def reason(norm="clipped_l2norm", pool="avg", s=s, words=txt.words):
        return fused.unusable_reason(norm, pool, s, gram, words)

    assert reason() == "the block is on cpu, not CUDA"
    monkeypatch.setattr(fused, "device_supported", lambda s: True)
    monkeypatch.setattr(fused, "triton_missing", lambda: None)
    assert reason() is None
    assert reason(norm="softmax") == "raw_feature_norm 'softmax' is not fused"
    assert reason(s=s.double()).startswith("dtype torch.float64")
    assert reason(s=torch.zeros(1, 36, 1, 300)) == "36 regions x 300 words is larger than a tile"
    assert reason(s=torch.zeros(1, 200, 1, 4)) == "200 regions x 4 words is larger than a tile"
    words = txt.words.clone().requires_grad_()
    assert reason(words=words).startswith("autograd is on")
    with torch.no_grad():
        assert reason(words=words) is None
    with fused.switched(False):
        assert reason() == "switched off"
    monkeypatch.setenv(fused.ENV, "0")
    assert reason() == "ITMATCH_FUSED=0"
    with fused.switched(True):
        assert reason() is None


def test_a_kernel_that_fails_turns_itself_off_with_a_warning(monkeypatch):
    monkeypatch.setattr(fused, "_broken", None)
    monkeypatch.setattr(fused, "device_supported", lambda s: True)
    monkeypatch.setattr(fused, "triton_missing", lambda: None)

    def broken(*args, **kwargs):
        raise RuntimeError("no such PTX version")

    monkeypatch.setattr(fused, "t2i_scores", broken)
    head = ScanHead("t2i", "lse", 9.0, 6.0)
    img, txt = block()
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="no such PTX version"):
        got = head(head.prepare_images(img), txt)
    torch.testing.assert_close(got, plain(head, img, txt), atol=0, rtol=0)
    assert "no such PTX version" in fused.unusable_reason("clipped_l2norm", "avg", torch.zeros(1, 1, 1, 1),
                                                          torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))


# -- on a GPU, compiled ---------------------------------------------------------------------------------------------

#: largest |kernel - float32 head| end to end per mode: the issue's 1e-3 for TF32 (its input rounding costs ~2e-5
#: on this block, simulated); bf16 autocast rounds the dots themselves to bfloat16 (the GEMM's output), which
#: alone costs up to ~1e-3 here (simulated on the CPU: 8e-4 - 1e-3), so 2e-3 (docs/gpu.md)
BOUND = {"fp32": 1e-5, "tf32": 1e-3, "bf16": 2e-3}


def f30k_block(seed=0):
    """A Flickr30K-shaped block: 64 images x 36 regions x 1024-d (some with padded regions) vs 500 captions
    of up to 40 words."""
    return block(n=64, k=36, m=500, length=40, d=1024, seed=seed, device="cuda")


@pytest.mark.cuda
@pytest.mark.skipif(bool(NO_GPU), reason=str(NO_GPU))
@pytest.mark.parametrize("pool", ["avg", "lse"])
@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16"])
def test_on_the_gpu_the_kernel_matches_the_float32_head(pool, mode, monkeypatch):
    """fp32: the kernel is the float32 head (1e-5). TF32 / bf16 autocast: the kernel gives the exact float32 head's
    scores from this mode's dots (1e-5), and is within BOUND[mode] of the float32 head end to end."""
    monkeypatch.setattr(fused, "_broken", None)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    head = ScanHead("t2i", pool, 9.0, 6.0).cuda()
    img, txt = f30k_block()
    img = head.prepare_images(img)
    reference = plain(head, img, txt)  # float32, no TF32
    torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=mode == "bf16"):
        s = region_word_dots(img, txt)
        assert fused.unusable_reason(head.norm, head.pool, s, img.extras["gram"], txt.words) is None
        got = head(img, txt)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, plain_from_dots(head, img, txt, s), atol=1e-5, rtol=0)
    assert (got - reference).abs().max().item() <= BOUND[mode]
