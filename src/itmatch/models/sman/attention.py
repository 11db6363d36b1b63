"""Query-guided soft attention shared by SMAN's image side, text side and multi-modal head."""

from __future__ import annotations

import torch
from torch import nn


def masked_softmax(logits: torch.Tensor, mask: torch.Tensor, dim: int) -> torch.Tensor:
    """softmax over `dim` with masked-out entries at weight 0 (mask broadcasts against logits)."""
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=dim)


class GuidedAttention(nn.Module):
    """The two-layer attention perceptron of SMAN (after DAN): for items x_k and a query q,

        h_k = tanh(W x_k) * tanh(W_q q),   a_k = softmax_k(w_h . h_k)       (SMAN Eq. 5-6, 9-10, 13-14, 16-17)

    Split in two so that a pair-dependent query costs one batched matrix product: `keys(x)` =
    tanh(W x_k) * w_h is per item (computed once), `query(q)` = tanh(W_q q), and the logit is
    keys_k . query. The bias of w_h is left out: a constant logit shift is invisible to the softmax.
    """

    def __init__(self, in_dim: int, query_dim: int, hidden: int) -> None:
        super().__init__()
        self.w = nn.Linear(in_dim, hidden)
        self.w_q = nn.Linear(query_dim, hidden)
        self.w_h = nn.Linear(hidden, 1, bias=False)

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """[..., K, in_dim] -> [..., K, hidden]."""
        return torch.tanh(self.w(x)) * self.w_h.weight[0]

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """[..., query_dim] -> [..., hidden]."""
        return torch.tanh(self.w_q(q))

    def forward(self, x: torch.Tensor, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One query per item: x [B, K, in_dim], q [B, query_dim], mask [B, K] -> weights [B, K]."""
        logits = torch.bmm(self.keys(x), self.query(q).unsqueeze(-1)).squeeze(-1)
        return masked_softmax(logits, mask, dim=1)
