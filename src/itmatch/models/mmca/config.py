"""MMCA's options, `model.mmca.*` (paper values, section 4.2 and Table 6, as defaults; docs/mmca.md)."""

from __future__ import annotations

from dataclasses import dataclass

from itmatch.config import option, register_options


@register_options("mmca")
@dataclass
class MMCAConfig:
    """MMCA (Wei et al. 2020) hyper-parameters."""

    text_model: str = "all-MiniLM-L6-v2"  # frozen BERT-like encoder: the packaged MiniLM or a local HF directory
    max_tokens: int = option(0, min=0)  # WordPiece tokens per caption incl. [CLS]/[SEP]; 0: the encoder's limit
    heads: int = option(16, min=1)  # both Transformer units
    ffn_dim: int = option(0, min=0)  # hidden size of the position-wise FFN; 0: embed_size (Eq. 4: W1, W2 are d x d)
    filters: int = option(256, min=1)  # 1-D CNN filters per window size (windows 1, 2, 3; Eq. 6)
    alpha: float = 0.2  # S = i0.c0 + alpha * i1.c1 (Table 6); 0: self-attention module only
    dropout: float = option(0.1, min=0, max=1)  # inside the two trainable Transformer units (paper silent; Vaswani)
    text_layernorm: bool = False  # Eq. 7's LayerNorm before the l2 norm of c0 and c1 (the text says l2 only)
    three_term: bool = True  # Eq. 15 (with hardest negatives); False: the usual two-term triplet loss
    # >0: in training the cross module scores only each item's h hardest negatives by i0.c0 (B(2h+2) pairs
    # a batch instead of B^2, a CPU budget option); 0: every pair of the batch (paper)
    train_negatives: int = option(0, min=0)
    # >0: in training, run the cross module's pairs in chunks of this many with activation checkpointing
    # (memory of one chunk instead of all B^2 pairs, ~1/3 more compute); 0: all at once
    pair_chunk: int = option(0, min=0)
