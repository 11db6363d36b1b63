"""The Triton kernel behind models/scan/fused.py (imported only where triton is importable; fused.py compiles
it, or interprets it under TRITON_INTERPRET=1). docs/gpu.md, "The fused SCAN t-i kernel"."""

from __future__ import annotations

import triton.language as tl

# POOL codes (fused.POOL_CODES)
AVG, LSE, MAX, SUM = 0, 1, 2, 3


def scan_t2i_kernel(s_ptr, gram_ptr, real_ptr, enorm_ptr, len_ptr, out_ptr,
                    K, M, L,
                    s_si, s_sk, s_sm, s_sl, g_si, g_sk, g_sj, r_si, r_sk, e_sm, e_sl, o_si, o_sm,
                    slope, lam1, lam2, eps,
                    CLIP: tl.constexpr, L2: tl.constexpr, SCALE_S: tl.constexpr, POOL: tl.constexpr,
                    KP: tl.constexpr, MT: tl.constexpr, LP: tl.constexpr, PRECISION: tl.constexpr):
    """scores[i, j] of image i and the MT captions j of this program's tile, from the raw dots s[i, :, j, :]
    (regions k < K, words l < L), in float32 whatever s's dtype:

    x = LeakyReLU_slope(s) (CLIP) or s; logits = lam1 * x / (||x||_words + eps) (L2), lam1 * x, or lam1 * s
    (SCALE_S: no_norm); -inf on padded regions; alpha = softmax over regions; dot = sum_k alpha s;
    sq = alpha^T G alpha; rel = dot / max(|e| * sqrt(max(sq, eps^2)), eps); pooled over the caption's words.
    Exactly ScanHead's t2i arithmetic (attention_logits, attended_relevance, masked_pool)."""
    img = tl.program_id(0).to(tl.int64)  # int64: a block's s may hold more than 2^31 cells
    rk = tl.arange(0, KP)
    rj = tl.program_id(1) * MT + tl.arange(0, MT)
    rl = tl.arange(0, LP)
    k_in, j_in, l_in = rk < K, rj < M, rl < L
    real = tl.load(real_ptr + img * r_si + rk * r_sk, mask=k_in, other=0) != 0  # [KP] real regions

    # the tile of raw dots [KP, MT, LP] (0 outside the block: those lanes never reach an output)
    offs = img * s_si + rk[:, None, None] * s_sk + rj[None, :, None].to(tl.int64) * s_sm + rl[None, None, :] * s_sl
    inside = k_in[:, None, None] & j_in[None, :, None] & l_in[None, None, :]
    s = tl.load(s_ptr + offs, mask=inside, other=0.0).to(tl.float32)

    # attention_logits: padded words hold s = 0, so they add nothing to the norm over words (as in the head)
    x = s
    if CLIP:
        x = tl.where(s > 0, s, s * slope)
    if L2:
        logits = x * (lam1 / (tl.sqrt(tl.sum(x * x, axis=2)) + eps))[:, :, None]
    elif SCALE_S:
        logits = s * lam1
    else:
        logits = x * lam1
    logits = tl.where(real[:, None, None], logits, float("-inf"))

    # the softmax over regions (axis 0), then the attended vector's dot with the word and its squared norm
    top = tl.max(logits, axis=0)
    p = tl.exp(logits - top[None, :, :])
    alpha = p / tl.sum(p, axis=0)[None, :, :]
    dot = tl.sum(alpha * s, axis=0)  # [MT, LP]
    g_offs = img * g_si + rk[:, None] * g_sk + rk[None, :] * g_sj
    gram = tl.load(gram_ptr + g_offs, mask=k_in[:, None] & k_in[None, :], other=0.0).to(tl.float32)
    g_alpha = tl.dot(gram, tl.reshape(alpha, (KP, MT * LP)), input_precision=PRECISION)
    sq = tl.sum(tl.reshape(g_alpha, (KP, MT, LP)) * alpha, axis=0)  # alpha^T G alpha, [MT, LP]
    e_norm = tl.load(enorm_ptr + rj[:, None].to(tl.int64) * e_sm + rl[None, :] * e_sl,
                     mask=j_in[:, None] & l_in[None, :], other=0.0)
    rel = dot / tl.maximum(e_norm * tl.sqrt(tl.maximum(sq, eps * eps)), eps)

    # masked_pool over the caption's real words
    n_words = tl.load(len_ptr + rj, mask=j_in, other=0)
    word = (rl[None, :] < n_words[:, None]) & l_in[None, :]
    if POOL == 0:  # avg
        count = tl.sum(word.to(tl.float32), axis=1)
        score = tl.sum(tl.where(word, rel, 0.0), axis=1) / tl.maximum(count, 1.0)
    elif POOL == 1:  # lse: log(sum exp(lam2 rel)) / lam2; -inf for a caption without words (torch.logsumexp's)
        v = tl.where(word, rel * lam2, float("-inf"))
        top_v = tl.max(v, axis=1)
        shift = tl.where(top_v == float("-inf"), 0.0, top_v)
        score = (shift + tl.log(tl.sum(tl.exp(v - shift[:, None]), axis=1))) / lam2
    elif POOL == 2:  # max
        score = tl.max(tl.where(word, rel, float("-inf")), axis=1)
    else:  # sum
        score = tl.sum(tl.where(word, rel, 0.0), axis=1)
    tl.store(out_ptr + img * o_si + rj * o_sm, score, mask=j_in)
