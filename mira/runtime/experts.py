"""The module that stands in for transformers' Experts module (paper IV-A, DESIGN.md 1).

It has the same call signature, forward(hidden[T, H], top_k_index[T, K], top_k_weights[T, K]), and
computes the routed experts through the cache's address tables. It holds no parameters. With a
predictor it also stages the expert predicted for two MoE layers on (paper IV-E).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mira.cache.cache import ExpertCache
from mira.kernels import DECODE_TOKENS
from mira.models.loader import router_of
from mira.predict.baselines import Predictor
from mira.runtime.graph_share import GraphShare
from mira.runtime.hybrid import HybridExperts

MoEFFN = Callable[..., torch.Tensor]  # mira.kernels.make_moe_ffn: (hidden, top_k_index, top_k_weights, blobs) -> [T, H]


class MiraExperts(nn.Module):
    """One MoE layer's experts, served by `cache` and computed by `ffn`.

    Every call counts its routed tokens per expert on the device and computes from the cache's
    address table for this layer (mira.cache.tables), which holds a readable address for every
    expert: its slot row, or its blob in the host store. Inline, the call first settles its counts
    with the policy (`ExpertCache.settle_layer`: one host sync, before the kernel); lagged, decode
    calls leave them to `ExpertCache.settle` after the step and do no host sync at all, so the
    step can be replayed from a CUDA graph. Larger calls (prefill) always settle inline, after the
    lagged counts of earlier steps. With a predictor, a call stages its best prediction for
    layer_position + 2 on the device (mira.cache.staging).
    With `hybrid`, an inline call hands some of its misses to the CPU worker, which computes them
    while the kernel computes the rest, and adds the CPU's partial sum into the output
    (mira.runtime.hybrid). With `graph_share`, a lagged decode call does the same with no host
    sync: the device chooses the CPU's misses and the CPU lanes compute them (mira.runtime.graph_share).

    With `route_norm` (Ergo's per-expert norm), every route is a row of its own through all of the
    above at unit weight, and the family's norm of each row comes before the routing-weighted sum
    (new tensors: such a decode call allocates, and its output is its own).

    A decode call (at most `DECODE_TOKENS` tokens) allocates no device memory: the predicted expert
    and the output live in buffers this layer owns. The output is a view of this layer's own
    buffer, valid until this layer's next call: transformers' MoE blocks (Mixtral, Qwen2/3-MoE,
    OLMoE, DeepSeek-V2/V3 in 5.x) add it to the residual or the shared experts' output, into a new
    tensor, at once, and one buffer per layer means no layer's call overwrites another's output.

    Args:
        layer_position: this layer's index among MoE layers.
        cache: the expert cache shared by all layers.
        ffn: the expert FFN kernel (chosen once for the device).
        device: where the layer runs.
        predictor: predicts the experts of layer_position + 2 from this layer's state (None: no prefetch).
        router: this layer's router, whose logits the predictor may use.
        lagged: leave decode calls' counts to the cache's settle after the step.
        hybrid: the CPU's share of the misses (inline only; the FFN must add zero for absent experts).
        graph_share: the CPU lanes' share of decode calls' misses (lagged only; the FFN must add
            zero for absent experts).
        route_norm: the family's norm of each route's output, called as norm(rows [R, H], expert_ids [R]).

    Raises:
        ValueError: lagged on CUDA under a budget with an FFN that cannot read the pinned host
            store (the reference FFN: only the fused kernels read blobs by address), lagged with
            hybrid, or graph_share without lagged.
    """

    def __init__(self, layer_position: int, cache: ExpertCache, ffn: MoEFFN, device: torch.device,
                 predictor: Predictor | None = None, router: nn.Module | None = None, lagged: bool = False,
                 hybrid: HybridExperts | None = None, graph_share: GraphShare | None = None,
                 route_norm: nn.Module | None = None):
        super().__init__()
        device = torch.device(device)
        if lagged and hybrid is not None:
            raise ValueError("the CPU's share of the misses needs them before the kernel: pass lagged=False")
        if graph_share is not None and not lagged:
            raise ValueError("the CPU lanes' share is chosen on the device for lagged decode calls: pass lagged=True")
        if lagged and device.type == "cuda" and not hasattr(ffn, "forward_bases") and not cache.all_resident:
            raise ValueError(f"lagged residency on CUDA needs the fused kernels, which read missed experts "
                             f"from the pinned host store; {type(ffn).__name__} cannot: pass lagged=False")
        self.layer_position = layer_position
        self.cache = cache
        self.ffn = ffn
        self.predictor = predictor
        self.lagged = lagged
        self.hybrid = hybrid
        self.graph_share = graph_share
        self.route_norm = route_norm
        self._predicts = predictor is not None and layer_position + 2 < predictor.num_layers
        self._router_logits: torch.Tensor | None = None
        if self._predicts and router is not None:
            router.register_forward_hook(self._keep_router_logits)
        self._pending = cache.tables.pending[layer_position]  # [E], a view of the cache's counters
        self._bases = cache.tables.tables[layer_position]  # [E] addresses, for the fused kernels
        self._rows = cache.tables.rows[layer_position]  # E blobs, for the reference FFN
        self._limits = cache.tables.limits[layer_position]  # [E] units each expert's kernel computes (cuts)
        self._fused = hasattr(ffn, "forward_bases")
        self._one = torch.ones(1, dtype=torch.int64, device=device)
        self._best = torch.zeros(1, dtype=torch.int64, device=device)  # the expert staged for layer_position + 2
        self._best_score = torch.empty(1, device=device)
        self._out: torch.Tensor | None = None  # [DECODE_TOKENS, H], made by the first call in its dtype
        self._staging = cache.device_staging() if predictor is not None else None

    def _keep_router_logits(self, module, args, output) -> None:
        self._router_logits = output[0]  # [T, E]

    @property
    def host_free(self) -> bool:
        """Whether this layer's decode calls do no host sync (lagged)."""
        return self.lagged

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        # T tokens, K routed per token, H hidden, E experts
        tokens, top_k = top_k_index.shape
        rows = tokens * top_k if self.route_norm is not None else tokens
        decode = rows <= DECODE_TOKENS
        if self.lagged and not decode:
            self.cache.settle()  # earlier lagged steps' counts go to the policy before this call's
        routed = top_k_index.reshape(-1)  # [T*K]
        self._pending.scatter_add_(0, routed, self._one.expand(routed.numel()))  # [E]
        if self._staging is not None:
            self._stage(hidden_states, top_k_index)
        if self.route_norm is None:
            out = self._experts(hidden_states, top_k_index, top_k_weights, decode)
        else:  # each route a row of its own [T*K, H], normalised, then weighted and summed
            routes = routed[:, None]  # [T*K, 1]
            out = self._experts(hidden_states.repeat_interleave(top_k, 0), routes,
                                torch.ones_like(routes, dtype=top_k_weights.dtype), decode)
            normed = self.route_norm(out, routed).view(tokens, top_k, -1)  # [T, K, H]
            out = (normed * top_k_weights[..., None]).sum(1).to(hidden_states.dtype)
        if self._staging is not None:
            self._staging.after_layer(self.layer_position)
        return out

    def _experts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 decode: bool) -> torch.Tensor:
        """The routed experts' weighted sum per row [T, H], its misses shared with the CPU where it takes some."""
        share = None
        if not (self.lagged and decode):
            if self.hybrid is not None:  # ahead of the settle's waits for the copies of experts it admits
                self.hybrid.copy_rows(hidden_states, top_k_index, top_k_weights)
            settled = self.cache.settle_layer(self.layer_position)
            if self.hybrid is not None:
                share = self.hybrid.start(self.layer_position, hidden_states, top_k_index, top_k_weights, *settled)
        if share is None and self.lagged and decode and self.graph_share is not None \
                and self.graph_share.takes(self.layer_position, hidden_states, top_k_weights):
            out = self._shared_on_device(hidden_states, top_k_index, top_k_weights)
        elif share is None:
            out = self._kernel(hidden_states, top_k_index, top_k_weights)
        else:
            try:
                out = self._kernel(hidden_states, top_k_index, top_k_weights)
            except BaseException:
                self.hybrid.abandon(share)  # the table whole again, the worker's job accounted for
                raise
            out = self.hybrid.finish(share, out)
        return out

    def _kernel(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                bases: torch.Tensor | None = None, rows: list | None = None) -> torch.Tensor:
        """The layer's routed experts from the address table, or from `bases` (the fused kernels) or
        `rows` (the reference) where given (hidden experts add zero, a cut one its units below its limit)."""
        out = self._output(hidden)
        limits = self._limits if self.hybrid is not None and self.hybrid.may_cut(hidden.shape[0]) else None
        if self._fused:
            bases = self._bases if bases is None else bases
            return self.ffn.forward_bases(hidden, top_k_index, top_k_weights, bases, out=out, limits=limits)
        rows = self._rows if rows is None else rows
        return self.ffn(hidden, top_k_index, top_k_weights, rows, out=out, limits=limits)

    def _shared_on_device(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
        """A lagged decode call with the CPU lanes: the device chooses their misses, the kernel
        computes the rest from a table without them, and their sums are added (no host sync on CUDA)."""
        share, p = self.graph_share, self.layer_position
        bases = share.post(p, hidden, top_k_index, top_k_weights)
        if self._fused:
            out = self._kernel(hidden, top_k_index, top_k_weights, bases=bases)
        else:
            out = self._kernel(hidden, top_k_index, top_k_weights, rows=share.rows(p))
        return share.collect(out)

    def _stage(self, hidden: torch.Tensor, top_k_index: torch.Tensor) -> None:
        """Before this layer's kernel: the predictor's best expert of layer_position + 2 (a device
        tensor, never read back) goes to the cache's staging."""
        p = self.layer_position
        self.predictor.observe(p, top_k_index)
        best = None
        if self._predicts:
            scores = self.predictor.scores(p, hidden, self._router_logits, top_k_index)  # [E] of layer p+2
            torch.topk(scores, 1, out=(self._best_score, self._best))
            best = self._best
        self._staging.before_layer(p, best)

    def _output(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """This layer's output buffer [T, H] for a decode call; None (the kernel allocates) for a larger one."""
        tokens = hidden.shape[0]
        if tokens > DECODE_TOKENS:
            return None
        if self._out is None or self._out.dtype != hidden.dtype:
            self._out = torch.empty(DECODE_TOKENS, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
        return self._out[:tokens]

    def extra_repr(self) -> str:
        hybrid = f", cpu_experts={self.hybrid.mode}" if self.hybrid is not None else \
            ", cpu_experts=graph" if self.graph_share is not None else ""
        return f"layer_position={self.layer_position}, ffn={type(self.ffn).__name__}, lagged={self.lagged}{hybrid}"


def model_routers(hf_model: nn.Module) -> list[nn.Module]:
    """The router of every MoE layer of a model Mira has bound, in MoE layer order.

    The router is the sibling `gate` (or `router`) of the experts module (mira.models.loader.router_of);
    it maps hidden [T, H] to (router_logits [T, E], weights [T, K], indices [T, K]).

    Args:
        hf_model: `MiraModel.hf_model`.

    Returns:
        One module per MoE layer position.
    """
    routers = {}
    for module in hf_model.modules():
        for child in module.children():
            if isinstance(child, MiraExperts):
                routers[child.layer_position] = router_of(module)
    return [routers[position] for position in sorted(routers)]
