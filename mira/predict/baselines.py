"""Expert predictors that need no training (paper IV-E; DESIGN.md 2.7), and the predictor interface.

Every predictor answers, at MoE layer i of a forward step, with scores over the E experts of layer
i+2: the runtime prefetches the top-k of them. The interface (`Predictor`) is two calls per layer,
both computed on the device with no host sync:

    observe(layer, top_k_index)                              every MoE layer, once its routing is known
    scores(layer, hidden, router_logits, top_k_index) -> [E]  source layers 0..L-3, for layer + 2

A decode step allocates nothing (DESIGN.md 2.5), so `scores` may return a view of a buffer of the
predictor's own that the next call for the same source layer overwrites: copy it to keep it.

- GateSpeculation: layer i+2's own router applied to layer i's MoE input; the experts its top-k
  would route the step's tokens to. The default predictor of a model without trained heads.
- Popularity: routed tokens per expert of layer i+2 in a profile trace; the same every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from torch import nn

from mira.kernels import DECODE_TOKENS


class Predictor(Protocol):
    num_layers: int  # L MoE layers; scores exist for source layers 0..L-3

    def observe(self, layer: int, top_k_index: torch.Tensor) -> None: ...

    def scores(self, layer: int, hidden: torch.Tensor, router_logits: torch.Tensor,
               top_k_index: torch.Tensor) -> torch.Tensor: ...


class RouterRule:
    """How one transformers router picks its experts, recomputed into buffers given by the caller.

    transformers' routers allocate a dozen temporaries per call; gate speculation runs one per
    source layer and decode step, so it redoes their arithmetic (transformers 5.x) with out=
    operations instead:

        logits  x W^T (+ b: gpt-oss) in the weight's dtype (DeepSeek keeps its router weight in fp32)
        choice  softmax(logits) in fp32: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2;
                sigmoid(logits) + e_score_correction_bias: DeepSeek-V3
        groups  only the best `topk_group` of `n_group` expert groups compete (DeepSeek-V2's
                group_limited_greedy ranks a group by its best choice, V3 by its best two)
        top-k   of the choice

    Raises:
        ValueError: a router whose selection this does not know (a family added without a rule).
    """

    def __init__(self, router: nn.Module):
        weight, top_k = getattr(router, "weight", None), getattr(router, "top_k", None)
        method = getattr(router, "topk_method", "greedy")
        known = method in ("greedy", "group_limited_greedy")
        if weight is None or weight.dim() != 2 or top_k is None or not known:
            raise ValueError(f"gate speculation knows the routers of Mixtral, Qwen2/3-MoE, OLMoE and DeepSeek-V2/V3, "
                             f"not {type(router).__name__}; add its rule to RouterRule or pass --prefetch off")
        self.weight = weight  # [E, H]
        linear_bias = getattr(router, "bias", None)
        self.linear_bias = linear_bias if isinstance(linear_bias, torch.Tensor) and linear_bias.shape == weight.shape[:1] \
            else None  # [E]: a bias of the router's linear layer (gpt-oss)
        self.top_k = top_k
        self.bias = getattr(router, "e_score_correction_bias", None)  # [E]: DeepSeek-V3's sigmoid routing
        grouped = (self.bias is not None or method == "group_limited_greedy") and hasattr(router, "num_group")
        self.groups = (router.num_group, router.topk_group) if grouped else None  # (n_group, topk_group)

    def route(self, hidden: torch.Tensor, ws: SpeculationWorkspace) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's softmax probabilities [T, E] (fp32) and choice [T, K] for hidden [T, H], in `ws`."""
        # T tokens, H hidden, E experts, K routed per token
        T = hidden.shape[0]
        x = hidden if hidden.dtype == self.weight.dtype else ws.x[:T].copy_(hidden)
        logits = ws.logits32[:T].copy_(torch.mm(x, self.weight.t(), out=ws.logits[:T]))  # [T, E] fp32
        if self.linear_bias is not None:
            logits.add_(self.linear_bias)
        probability = torch.softmax(logits, -1, out=ws.probability[:T])
        if self.bias is not None:
            choice = torch.sigmoid(logits, out=ws.choice[:T]).add_(self.bias)
        else:
            choice = ws.choice[:T].copy_(probability)
        if self.groups is not None:
            self._keep_best_groups(choice, ws)
        torch.topk(choice, self.top_k, out=(ws.top_values[:T], ws.top_index[:T]))
        return probability, ws.top_index[:T]

    def _keep_best_groups(self, choice: torch.Tensor, ws: SpeculationWorkspace) -> None:
        """Mask in `choice` [T, E] the experts outside the best groups as the router does: -inf, or 0 for
        probabilities."""
        # T tokens, G groups of E/G experts, B best groups kept
        T = choice.shape[0]
        groups, best = self.groups
        grouped = choice.view(T, groups, -1)  # [T, G, E/G]
        score = ws.group_score[:T]  # [T, G]
        if self.bias is not None:  # V3: the sum of a group's two best
            torch.sum(torch.topk(grouped, 2, -1, out=(ws.group_top2[:T], ws.group_top2_index[:T]))[0], -1, out=score)
        else:  # V2: a group's best
            torch.amax(grouped, -1, out=score)
        torch.topk(score, best, -1, out=(ws.group_best[:T], ws.group_index[:T]))  # [T, B]
        drop = ws.group_drop[:T].fill_(True).scatter_(1, ws.group_index[:T], False)  # [T, G]
        grouped.masked_fill_(drop[:, :, None], float("-inf") if self.bias is not None else 0.0)


def speculates(router: nn.Module, tokens: int = 16) -> bool:
    """Whether `RouterRule` picks this router's own experts: its rule is known and, on `tokens`
    random states, it chooses the experts the router itself returns (its last output, [T, K]).
    A family whose router selects otherwise then gets no gate speculation instead of wrong guesses."""
    try:
        rule = RouterRule(router)
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(tokens, rule.weight.shape[1], generator=generator).to(rule.weight.device, rule.weight.dtype)
        with torch.no_grad():
            _, chosen = rule.route(hidden, SpeculationWorkspace(rule, tokens, hidden.device))
            output = router(hidden)
    except Exception:  # an unknown rule, or a router that needs more than the hidden states
        return False
    own = output[-1] if isinstance(output, tuple) else None
    if not isinstance(own, torch.Tensor) or own.shape != chosen.shape:
        return False
    return torch.equal(chosen.sort(dim=-1).values, own.sort(dim=-1).values)


class SpeculationWorkspace:
    """The temporaries of gate speculation for up to `tokens` tokens: made once for decode steps,
    per call for larger ones.

    T tokens, H hidden, E experts, K routed per token, G expert groups, B best groups kept.
    """

    def __init__(self, rule: RouterRule, tokens: int, device: torch.device):
        E, H = rule.weight.shape
        K, f32, i64 = rule.top_k, torch.float32, torch.int64
        groups, best = rule.groups or (1, 1)
        self.tokens = tokens
        self.x = torch.empty(tokens, H, dtype=rule.weight.dtype, device=device)  # hidden in the router's dtype
        self.logits = torch.empty(tokens, E, dtype=rule.weight.dtype, device=device)
        self.logits32, self.probability, self.choice = (torch.empty(tokens, E, dtype=f32, device=device)
                                                        for _ in range(3))
        self.top_values = torch.empty(tokens, K, dtype=f32, device=device)
        self.top_index = torch.empty(tokens, K, dtype=i64, device=device)
        self.group_top2 = torch.empty(tokens, groups, 2, dtype=f32, device=device)
        self.group_top2_index = torch.empty(tokens, groups, 2, dtype=i64, device=device)
        self.group_score = torch.empty(tokens, groups, dtype=f32, device=device)
        self.group_best = torch.empty(tokens, best, dtype=f32, device=device)
        self.group_index = torch.empty(tokens, best, dtype=i64, device=device)
        self.group_drop = torch.empty(tokens, groups, dtype=torch.bool, device=device)
        self.counts = torch.empty(E, dtype=f32, device=device)
        self.mean = torch.empty(E, dtype=f32, device=device)
        self.one = torch.ones(1, dtype=f32, device=device)


class GateSpeculation:
    """Layer i+2's router applied to layer i's MoE input, token by token (paper IV-E's baseline).

    The score of an expert is the share of the step's routed slots that layer i+2's router would
    give it if its input were layer i's, plus the mean router probability (softmax of the logits)
    scaled below one slot's share, so that ties in the routed share go to the likelier expert.
    The routers' arithmetic is redone by `RouterRule` into buffers made once, so a decode step of
    up to `max_tokens` tokens allocates nothing; the router modules are never called, so hooks on
    them never see these calls.

    Args:
        routers: the router of each MoE layer, in order (`mira.runtime.experts.model_routers`); they share their shapes.
        num_experts: E.
        max_tokens: the most tokens a call serves from the buffers made once.
    """

    def __init__(self, routers: Sequence[nn.Module], num_experts: int, max_tokens: int = DECODE_TOKENS):
        self.routers = list(routers)
        self.num_layers = len(self.routers)
        self.num_experts = num_experts
        self._rules = [RouterRule(router) for router in self.routers]
        device = self._rules[0].weight.device
        self._workspace = SpeculationWorkspace(self._rules[0], max_tokens, device)
        self._scores = torch.zeros(self.num_layers, num_experts, device=device)  # [L, E]: one row per source layer

    def observe(self, layer: int, top_k_index: torch.Tensor) -> None:
        """Nothing to remember: gate speculation looks at the current step only."""

    def scores(self, layer: int, hidden: torch.Tensor, router_logits: torch.Tensor | None = None,
               top_k_index: torch.Tensor | None = None) -> torch.Tensor:
        """Scores of layer+2's experts; no host sync, and no allocation for up to `max_tokens` tokens.

        T tokens, H hidden, E experts, K routed per token.

        Args:
            layer: source MoE layer position, 0..L-3.
            hidden: [T, H] the MoE input of `layer` (what its experts module receives).
            router_logits, top_k_index: unused (the interface's other features).

        Returns:
            float32 [E], a view of this layer's row of a buffer that the next call for `layer` overwrites.
        """
        rule = self._rules[layer + 2]
        tokens = hidden.shape[0]
        ws = self._workspace if tokens <= self._workspace.tokens else SpeculationWorkspace(rule, tokens, hidden.device)
        with torch.no_grad():
            probability, chosen = rule.route(hidden, ws)  # [T, E], [T, K]
            slots = chosen.numel()
            mass = ws.counts.zero_().scatter_add_(0, chosen.reshape(-1), ws.one.expand(slots)).div_(slots)  # [E]
            mean = torch.mean(probability, 0, out=ws.mean)  # [E]
            return torch.add(mass, mean, alpha=1 / (2 * slots), out=self._scores[layer])


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
