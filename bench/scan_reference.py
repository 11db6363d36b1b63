"""The public SCAN evaluation (Lee et al. 2018, github.com/kuanghuei/SCAN, model.py + evaluation.py),
re-written for the speed comparison of bench/perf.py and bench/gpu.py: the same math, done the way that code
does it.

- images and captions are cut into shards of 128; inside a shard, a Python loop over captions repeats the
  caption n_image times, builds the attended vectors explicitly (func_attention: two bmm) and takes the
  cosine with the query (xattn_score_t2i / xattn_score_i2t). Its cost is one loop step per caption per
  image shard, each step growing with the shard's images: time whole shards, not single images;
- the precision is a parameter (`dtype`). The fair baseline is the engine's own float32 (the default here):
  the same arithmetic, so a speed-up measures the method, not the precision. SCAN's evaluation.py itself holds
  the embeddings in float64 (encode_data fills `np.zeros(...)` arrays, float64 by default, and shard_xattn_*
  turns them into double tensors): `dtype=np.float64` reproduces that, a secondary figure (on a CPU the
  float64 loop is 1.5-2.6x slower than the float32 one, so it flatters the engine).
Only clipped_l2norm and the four poolings are kept (the configurations the benchmark times)."""

from __future__ import annotations

import numpy as np
import torch

EPS = 1e-8


def _l2norm(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x / (x.pow(2).sum(dim=dim, keepdim=True).sqrt() + EPS)


def _cosine(x1: torch.Tensor, x2: torch.Tensor, dim: int) -> torch.Tensor:
    w12 = (x1 * x2).sum(dim)
    w1, w2 = x1.norm(2, dim), x2.norm(2, dim)
    return w12 / (w1 * w2).clamp(min=EPS)


def _func_attention(query: torch.Tensor, context: torch.Tensor, smooth: float) -> torch.Tensor:
    """query [n, queryL, d], context [n, sourceL, d] -> attended context per query word [n, queryL, d]."""
    n, query_len = query.shape[:2]
    source_len = context.shape[1]
    attn = torch.bmm(context, query.transpose(1, 2))  # [n, sourceL, queryL]
    attn = torch.nn.functional.leaky_relu(attn, 0.1)
    attn = _l2norm(attn, 2)
    attn = attn.transpose(1, 2).contiguous().view(n * query_len, source_len)
    attn = torch.softmax(attn * smooth, dim=1).view(n, query_len, source_len)
    attn_t = attn.transpose(1, 2).contiguous()
    return torch.bmm(context.transpose(1, 2), attn_t).transpose(1, 2)  # [n, queryL, d]


def _pool(row_sim: torch.Tensor, pool: str, lambda_lse: float) -> torch.Tensor:
    if pool == "lse":
        return torch.log(row_sim.mul(lambda_lse).exp().sum(dim=1, keepdim=True)) / lambda_lse
    if pool == "max":
        return row_sim.max(dim=1, keepdim=True)[0]
    if pool == "sum":
        return row_sim.sum(dim=1, keepdim=True)
    return row_sim.mean(dim=1, keepdim=True)


def _xattn(images: torch.Tensor, captions: torch.Tensor, cap_lens: list[int], direction: str, pool: str,
           lambda_softmax: float, lambda_lse: float) -> torch.Tensor:
    n_image = images.shape[0]
    sims = []
    for i in range(captions.shape[0]):  # the per-caption loop of xattn_score_t2i / xattn_score_i2t
        cap_i_expand = captions[i, :cap_lens[i]].unsqueeze(0).contiguous().repeat(n_image, 1, 1)
        if direction == "t2i":
            wei = _func_attention(cap_i_expand, images, lambda_softmax)
            row_sim = _cosine(cap_i_expand, wei, 2)
        else:
            wei = _func_attention(images, cap_i_expand, lambda_softmax)
            row_sim = _cosine(images, wei, 2)
        sims.append(_pool(row_sim, pool, lambda_lse))
    return torch.cat(sims, 1)


@torch.no_grad()
def shard_xattn(images: np.ndarray, captions: np.ndarray, cap_lens: list[int], direction: str, pool: str,
                lambda_softmax: float, lambda_lse: float, shard_size: int = 128,
                dtype: type = np.float32) -> np.ndarray:
    """evaluation.shard_xattn_t2i / _i2t: the [n_images, n_captions] matrix, shard by shard, computed in `dtype`
    (float32: the engine's precision, the fair baseline; float64: as SCAN's encode_data arrays hold them)."""
    images, captions = images.astype(dtype), captions.astype(dtype)
    d = np.zeros((len(images), len(captions)), dtype=dtype)
    for i0 in range(0, len(images), shard_size):
        im = torch.from_numpy(images[i0:i0 + shard_size])
        for j0 in range(0, len(captions), shard_size):
            s = torch.from_numpy(captions[j0:j0 + shard_size])
            lens = cap_lens[j0:j0 + shard_size]
            d[i0:i0 + shard_size, j0:j0 + shard_size] = _xattn(im, s, lens, direction, pool, lambda_softmax,
                                                             lambda_lse).numpy()
    return d
