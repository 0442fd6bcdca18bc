"""Expert predictors that need no training (paper IV-E; DESIGN.md 2.7), and the predictor interface.

Every predictor answers, at MoE layer i of a forward step, with scores over the E experts of layer
i+2: the runtime prefetches the top-k of them. The interface (`Predictor`) is two calls per layer,
both computed on the device with no host sync:

    observe(layer, top_k_index)                              every MoE layer, once its routing is known
    scores(layer, hidden, router_logits, top_k_index) -> [E]  source layers 0..L-3, for layer + 2

- GateSpeculation: layer i+2's own router applied to layer i's MoE input; the experts its top-k
  would route the step's tokens to. The default predictor of a model without trained heads.
- PreviousStep: the routing of layer i+2 at the previous step.
- Popularity: routed tokens per expert of layer i+2 in a profile trace; the same every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from torch import nn

from mira.predict.features import RoutingHistory, routed_mass


class Predictor(Protocol):
    num_layers: int  # L MoE layers; scores exist for source layers 0..L-3

    def observe(self, layer: int, top_k_index: torch.Tensor) -> None: ...

    def scores(self, layer: int, hidden: torch.Tensor, router_logits: torch.Tensor,
               top_k_index: torch.Tensor) -> torch.Tensor: ...


def model_routers(hf_model: nn.Module) -> list[nn.Module]:
    """The router of every MoE layer of a model Mira has bound, in MoE layer order.

    In every supported family the router is the sibling `gate` of the experts module; it maps
    hidden [T, H] to (router_logits [T, E], weights [T, K], indices [T, K]).

    Args:
        hf_model: `MiraModel.hf_model`.

    Returns:
        One module per MoE layer position.
    """
    from mira.runtime.experts import MiraExperts

    routers = {}
    for module in hf_model.modules():
        for child in module.children():
            if isinstance(child, MiraExperts):
                routers[child.layer_position] = module.gate
    return [routers[position] for position in sorted(routers)]


class GateSpeculation:
    """Layer i+2's router applied to layer i's MoE input, token by token (paper IV-E's baseline).

    The score of an expert is the share of the step's routed slots that layer i+2's router would
    give it if its input were layer i's, plus the mean router probability (softmax of the logits)
    scaled below one slot's share, so that ties in the routed share go to the likelier expert.
    The routers are called through `forward`, not `__call__`, so hooks on them never see these calls.

    Args:
        routers: the router of each MoE layer, in order (`model_routers`).
        num_experts: E.
    """

    def __init__(self, routers: Sequence[nn.Module], num_experts: int):
        self.routers = list(routers)
        self.num_layers = len(self.routers)
        self.num_experts = num_experts

    @classmethod
    def from_model(cls, model) -> GateSpeculation:
        """Gate speculation with the routers of a `MiraModel`."""
        return cls(model_routers(model.hf_model), model.store.num_experts)

    def observe(self, layer: int, top_k_index: torch.Tensor) -> None:
        """Nothing to remember: gate speculation looks at the current step only."""

    def scores(self, layer: int, hidden: torch.Tensor, router_logits: torch.Tensor | None = None,
               top_k_index: torch.Tensor | None = None) -> torch.Tensor:
        """Scores of layer+2's experts; no host sync.

        T tokens, H hidden, E experts, K routed per token.

        Args:
            layer: source MoE layer position, 0..L-3.
            hidden: [T, H] the MoE input of `layer` (what its experts module receives).
            router_logits, top_k_index: unused (the interface's other features).

        Returns:
            float32 [E].
        """
        with torch.no_grad():
            logits, _, indices = self.routers[layer + 2].forward(hidden)  # [T, E], [T, K]
            slots = indices.numel()
            probability = logits.float().softmax(-1).mean(0)  # [E]
            return routed_mass(indices, self.num_experts) + probability / (2 * slots)  # [E]


class PreviousStep:
    """The routed mass of layer i+2 at the previous step (zeros before the first step).

    Args:
        num_layers: L.
        num_experts: E.
        device: where the state lives.
    """

    def __init__(self, num_layers: int, num_experts: int, device: torch.device | str):
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.history = RoutingHistory(num_layers, num_experts, 1, device)

    def observe(self, layer: int, top_k_index: torch.Tensor) -> None:
        """Remember the routing [T, K] of `layer` in this step."""
        self.history.observe(layer, routed_mass(top_k_index, self.num_experts))

    def scores(self, layer: int, hidden: torch.Tensor | None = None, router_logits: torch.Tensor | None = None,
               top_k_index: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [E]: the mass of layer+2 at the previous step (a view of a reused buffer)."""
        return self.history.recent(layer + 2)


class Popularity:
    """Routed tokens per expert of layer i+2 in a profile: the same ranking at every step.

    Args:
        counts: int [L, E] routed slots per MoE layer and expert (e.g. from training traces).
        device: where the scores live.
    """

    def __init__(self, counts: np.ndarray, device: torch.device | str = "cpu"):
        counts = torch.as_tensor(np.asarray(counts, dtype=np.float32), device=device)  # [L, E]
        self.num_layers, self.num_experts = counts.shape
        self._share = counts / counts.sum(-1, keepdim=True).clamp_min(1)  # [L, E]

    def observe(self, layer: int, top_k_index: torch.Tensor) -> None:
        """Nothing to remember: the profile is fixed."""

    def scores(self, layer: int, hidden: torch.Tensor | None = None, router_logits: torch.Tensor | None = None,
               top_k_index: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [E]: the share of layer+2's routed slots each expert had in the profile."""
        return self._share[layer + 2]
