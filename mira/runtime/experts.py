"""The module that stands in for transformers' Experts module (paper IV-A, DESIGN.md 1).

It has the same call signature, forward(hidden[T, H], top_k_index[T, K], top_k_weights[T, K]), and
computes the routed experts from blobs the cache provides. It holds no parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mira.cache.cache import ExpertCache

MoEFFN = Callable[..., torch.Tensor]  # mira.kernels.make_moe_ffn: (hidden, top_k_index, top_k_weights, blobs) -> [T, H]


class MiraExperts(nn.Module):
    def __init__(self, layer_position: int, cache: ExpertCache, ffn: MoEFFN, device: torch.device):
        super().__init__()
        self.layer_position = layer_position
        self.cache = cache
        self.ffn = ffn
        # preallocated: counting routed tokens per expert allocates nothing and needs no sync
        self._tokens = torch.zeros(cache.store.num_experts, dtype=torch.int64, device=device)  # [E]
        self._one = torch.ones(1, dtype=torch.int64, device=device)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        # T tokens, K routed per token, H hidden, E experts
        routed = top_k_index.reshape(-1)  # [T*K]
        per_expert = self._tokens.zero_().scatter_add_(0, routed, self._one.expand(routed.numel())).tolist()  # [E]
        # ^ the one host sync of this layer
        experts = [e for e, count in enumerate(per_expert) if count]  # ascending ids
        blobs = self.cache.fetch(self.layer_position, experts, [per_expert[e] for e in experts])
        return self.ffn(hidden_states, top_k_index, top_k_weights, blobs)  # [T, H]

    def extra_repr(self) -> str:
        return f"layer_position={self.layer_position}, ffn={type(self.ffn).__name__}"
