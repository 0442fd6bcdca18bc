"""The module that stands in for transformers' Experts module (paper IV-A, DESIGN.md 1).

It has the same call signature, forward(hidden[T, H], top_k_index[T, K], top_k_weights[T, K]), and
computes the routed experts from blobs the cache provides. It holds no parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mira.cache.cache import ExpertCache
from mira.store.layout import ExpertLayout

MoEFFN = Callable[..., torch.Tensor]  # (hidden, top_k_index, top_k_weights, blobs, layout, act) -> [T, H]


class MiraExperts(nn.Module):
    def __init__(self, layer_position: int, cache: ExpertCache, ffn: MoEFFN, layout: ExpertLayout, act: Callable):
        super().__init__()
        self.layer_position = layer_position
        self.cache = cache
        self.ffn = ffn
        self.layout = layout
        self.act = act

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        # T tokens, K routed per token, H hidden
        experts, tokens = torch.unique(top_k_index, return_counts=True)  # [n], [n] ascending ids
        experts, tokens = torch.stack([experts, tokens]).tolist()  # the one host sync of this layer
        blobs = self.cache.fetch(self.layer_position, experts, tokens)
        return self.ffn(hidden_states, top_k_index, top_k_weights, blobs, self.layout, self.act)  # [T, H]

    def extra_repr(self) -> str:
        return f"layer_position={self.layer_position}, scheme={self.layout.scheme}"
