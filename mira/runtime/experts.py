"""The module that stands in for transformers' Experts module (paper IV-A, DESIGN.md 1).

It has the same call signature, forward(hidden[T, H], top_k_index[T, K], top_k_weights[T, K]), and
computes the routed experts from blobs the cache provides. It holds no parameters. With a
predictor it also stages the experts predicted for two MoE layers on (paper IV-E).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mira.cache.cache import ExpertCache
from mira.predict.baselines import Predictor

MoEFFN = Callable[..., torch.Tensor]  # mira.kernels.make_moe_ffn: (hidden, top_k_index, top_k_weights, blobs) -> [T, H]


class MiraExperts(nn.Module):
    """One MoE layer's experts, served by `cache` and computed by `ffn`.

    Args:
        layer_position: this layer's index among MoE layers.
        cache: the expert cache shared by all layers.
        ffn: the expert FFN kernel (chosen once for the device).
        device: where the layer runs.
        predictor: predicts the experts of layer_position + 2 from this layer's state (None: no prefetch).
        router: this layer's router, whose logits the predictor may use.
    """

    def __init__(self, layer_position: int, cache: ExpertCache, ffn: MoEFFN, device: torch.device,
                 predictor: Predictor | None = None, router: nn.Module | None = None):
        super().__init__()
        self.layer_position = layer_position
        self.cache = cache
        self.ffn = ffn
        self.predictor = predictor
        self._predicts = predictor is not None and layer_position + 2 < predictor.num_layers
        self._router_logits: torch.Tensor | None = None
        if self._predicts and router is not None:
            router.register_forward_hook(self._keep_router_logits)
        # preallocated: counting routed tokens per expert allocates nothing and needs no sync
        self._tokens = torch.zeros(cache.store.num_experts, dtype=torch.int64, device=device)  # [E]
        self._one = torch.ones(1, dtype=torch.int64, device=device)

    def _keep_router_logits(self, module, args, output) -> None:
        self._router_logits = output[0]  # [T, E]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        # T tokens, K routed per token, H hidden, E experts
        E, p = self._tokens.shape[0], self.layer_position
        routed = top_k_index.reshape(-1)  # [T*K]
        per_expert = self._tokens.zero_().scatter_add_(0, routed, self._one.expand(routed.numel()))  # [E]
        if self.predictor is not None:
            self.predictor.observe(p, top_k_index)
        predicted: list[int] = []
        if self._predicts:
            scores = self.predictor.scores(p, hidden_states, self._router_logits, top_k_index)  # [E] of layer p+2
            staged = scores.topk(min(E, routed.numel())).indices  # as many as this step routes per layer
            host = torch.cat([per_expert, staged]).tolist()  # the one host sync of this layer
            per_expert, predicted = host[:E], host[E:]
        else:
            per_expert = per_expert.tolist()  # the one host sync of this layer
        experts = [e for e, count in enumerate(per_expert) if count]  # ascending ids
        blobs = self.cache.fetch(p, experts, [per_expert[e] for e in experts])
        if predicted:
            self.cache.stage(p + 2, predicted)  # copies overlap this layer's and the next one's compute
        out = self.ffn(hidden_states, top_k_index, top_k_weights, blobs)  # [T, H]
        self.cache.after_layer(p, experts)
        return out

    def extra_repr(self) -> str:
        return f"layer_position={self.layer_position}, ffn={type(self.ffn).__name__}"
