"""The module that stands in for transformers' Experts module (paper IV-A, DESIGN.md 1).

It has the same call signature, forward(hidden[T, H], top_k_index[T, K], top_k_weights[T, K]), and
computes the routed experts from blobs the cache provides. It holds no parameters. With a
predictor it also stages the experts predicted for two MoE layers on (paper IV-E).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from mira.cache.cache import ExpertCache
from mira.kernels import DECODE_TOKENS
from mira.kernels.addresses import AddressTable
from mira.models.loader import router_of
from mira.predict.baselines import Predictor

MoEFFN = Callable[..., torch.Tensor]  # mira.kernels.make_moe_ffn: (hidden, top_k_index, top_k_weights, blobs) -> [T, H]


class MiraExperts(nn.Module):
    """One MoE layer's experts, served by `cache` and computed by `ffn`.

    A decode call (at most `DECODE_TOKENS` tokens; with the fused kernels also at most their
    `decode_max_pairs` routed pairs) allocates no device memory and syncs with the host once: the
    routed-token counts, the predicted experts, the kernels' address table and the output live in
    buffers this layer owns. A layer whose experts are all resident for good (every expert fits
    the budget) does not sync at all: its address table is fixed, nothing is decided on the host,
    and its telemetry is counted on the device (`Telemetry.device_counters`). Nor does a lagged
    layer's decode call (mira.cache.lagged): it adds its routed tokens to the cache's counters on
    the device and computes from its address table, which always holds a readable address for
    every expert (slot row or pinned host blob); `ExpertCache.settle` takes the counts to the
    policy after the step. A lagged layer with a predictor also stages its best prediction for
    layer_position + 2 without the host (mira.cache.staging). The output is a view of this layer's
    own buffer, valid until this layer's next call: transformers' MoE blocks (Mixtral,
    Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3 in 5.x) add it to the residual or the shared experts'
    output, into a new tensor, at once, and one buffer per layer means no layer's call overwrites
    another layer's output. Larger calls (prefill) return a tensor of their own; a lagged layer
    serves them inline, after settling.

    Args:
        layer_position: this layer's index among MoE layers.
        cache: the expert cache shared by all layers.
        ffn: the expert FFN kernel (chosen once for the device).
        device: where the layer runs.
        predictor: predicts the experts of layer_position + 2 from this layer's state (None: no prefetch).
        router: this layer's router, whose logits the predictor may use.
        lagged: decode under lagged residency instead of asking the cache on every call.

    Raises:
        ValueError: lagged on CUDA with an FFN that cannot read the pinned host store (the
            reference FFN: only the fused kernels take an address table).
    """

    def __init__(self, layer_position: int, cache: ExpertCache, ffn: MoEFFN, device: torch.device,
                 predictor: Predictor | None = None, router: nn.Module | None = None, lagged: bool = False):
        super().__init__()
        self.layer_position = layer_position
        self.cache = cache
        self.ffn = ffn
        self.predictor = predictor
        self._predicts = predictor is not None and layer_position + 2 < predictor.num_layers
        self._router_logits: torch.Tensor | None = None
        if self._predicts and router is not None:
            router.register_forward_hook(self._keep_router_logits)
        E = cache.store.num_experts
        # routed tokens per expert [E], then the experts to stage for layer_position + 2: one read-back
        self._readback = torch.zeros(2 * E, dtype=torch.int64, device=device)
        self._tokens = self._readback[:E]  # [E]
        self._staged_scores = torch.empty(E, device=device)
        self._one = torch.ones(1, dtype=torch.int64, device=device)
        self._out: torch.Tensor | None = None  # [DECODE_TOKENS, H], made by the first call in its dtype
        # the fused kernels read a device address table: kept here rather than built from the blobs per call
        self._table = AddressTable(E, device) if hasattr(ffn, "forward_bases") else None
        self._compute = self._compute_from_table if self._table is not None else self._compute_from_blobs
        self._device = torch.device(device)
        self._fixed: tuple[list[torch.Tensor], torch.Tensor] | None = None  # (rows, address table [E])
        self._may_be_fixed = predictor is None  # the fixed path does not stage
        self._lagged = lagged
        self._staging = None
        if lagged:
            if self._device.type == "cuda" and self._table is None:
                raise ValueError(f"lagged residency on CUDA needs the fused kernels, which read missed experts "
                                 f"from the pinned host store; {type(ffn).__name__} cannot: pass lagged=False")
            residency = cache.lagged_residency()
            self._pending = residency.pending[layer_position]  # [E], a view: settled for all layers at once
            self._bases = residency.tables[layer_position]  # [E]
            self._rows = residency.rows[layer_position]  # E blobs, rewritten in place by the cache
            if predictor is not None:
                self._staging = cache.lagged_staging()

    def _keep_router_logits(self, module, args, output) -> None:
        self._router_logits = output[0]  # [T, E]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        # T tokens, K routed per token, H hidden, E experts
        if self._may_be_fixed:
            self._fix()
        if self._fixed is not None:
            return self._forward_fixed(hidden_states, top_k_index, top_k_weights)
        if self._lagged:
            if hidden_states.shape[0] <= DECODE_TOKENS:
                return self._forward_lagged(hidden_states, top_k_index, top_k_weights)
            self.cache.settle()  # the counts of earlier lagged calls go to the policy before this call's
        E, p = self._tokens.shape[0], self.layer_position
        routed = top_k_index.reshape(-1)  # [T*K]
        self._tokens.zero_().scatter_add_(0, routed, self._one.expand(routed.numel()))  # [E]
        if self.predictor is not None:
            self.predictor.observe(p, top_k_index)
        staged = 0
        if self._predicts:
            scores = self.predictor.scores(p, hidden_states, self._router_logits, top_k_index)  # [E] of layer p+2
            staged = min(E, routed.numel())  # as many as this step routes per layer
            torch.topk(scores, staged, out=(self._staged_scores[:staged], self._readback[E : E + staged]))
        host = self._readback[: E + staged].tolist()  # the one host sync of this layer
        per_expert, predicted = host[:E], host[E:]
        experts = [e for e, count in enumerate(per_expert) if count]  # ascending ids
        blobs = self.cache.fetch(p, experts, [per_expert[e] for e in experts])
        if predicted:
            self.cache.stage(p + 2, predicted)  # copies overlap this layer's and the next one's compute
        out = self._compute(hidden_states, top_k_index, top_k_weights, blobs, experts)  # [T, H]
        self.cache.after_layer(p, experts)
        return out

    @property
    def host_free(self) -> bool:
        """Whether this layer's next decode call does no host sync: true for a layer whose experts
        are all resident for good once its first call has fixed them (that call copies its address
        table from the host), and for a lagged layer that no first call will fix."""
        if self._may_be_fixed:
            return self._lagged and not self.cache.resident_for_good(self.layer_position)
        return self._fixed is not None or self._lagged

    @property
    def becomes_host_free(self) -> bool:
        """Whether this layer's decode calls do no host sync from its second call on (fixed or lagged)."""
        if self._may_be_fixed:
            return self._lagged or self.cache.resident_for_good(self.layer_position)
        return self.host_free

    def _fix(self) -> None:
        """On the first call: if every expert of this layer is resident for good, keep their rows and
        address table and count on the device from now on."""
        self._may_be_fixed = False
        rows = self.cache.fixed_rows(self.layer_position)
        if rows is None:
            return
        table = torch.tensor([row.data_ptr() for row in rows], dtype=torch.int64).to(self._device)  # [E]
        self._fixed = (rows, table)
        self._routed, self._lookups = self.cache.telemetry.device_counters(self.layer_position, self._device)
        self._seen = torch.zeros_like(self._tokens)

    def _forward_fixed(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
        """Every expert resident for good: count on the device and compute; no host sync."""
        routed = top_k_index.reshape(-1)  # [T*K]
        self._tokens.zero_().scatter_add_(0, routed, self._one.expand(routed.numel()))  # [E]
        self._routed.add_(self._tokens)
        self._lookups.add_(torch.clamp(self._tokens, max=1, out=self._seen))
        rows, table = self._fixed
        if self._table is not None:
            return self.ffn.forward_bases(hidden, top_k_index, top_k_weights, table, out=self._output(hidden))
        return self.ffn(hidden, top_k_index, top_k_weights, rows, out=self._output(hidden))

    def _forward_lagged(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
        """Lagged residency: count on the device, stage the prediction for two layers on, compute
        from the table; no host sync, no cache call."""
        routed = top_k_index.reshape(-1)  # [T*K]
        self._pending.scatter_add_(0, routed, self._one.expand(routed.numel()))  # [E]
        if self._staging is not None:
            self._stage(hidden, top_k_index)
        if self._table is not None:
            out = self.ffn.forward_bases(hidden, top_k_index, top_k_weights, self._bases, out=self._output(hidden))
        else:
            out = self.ffn(hidden, top_k_index, top_k_weights, self._rows, out=self._output(hidden))
        if self._staging is not None:
            self._staging.after_layer(self.layer_position)
        return out

    def _stage(self, hidden: torch.Tensor, top_k_index: torch.Tensor) -> None:
        """Lagged staging before this layer's kernel: the predictor's best expert of layer_position + 2
        (a device tensor, never read back) goes to the cache's LaggedStaging."""
        p, E = self.layer_position, self._tokens.shape[0]
        self.predictor.observe(p, top_k_index)
        best = None
        if self._predicts:
            scores = self.predictor.scores(p, hidden, self._router_logits, top_k_index)  # [E] of layer p+2
            best = self._readback[E : E + 1]  # [1], this layer's buffer
            torch.topk(scores, 1, out=(self._staged_scores[:1], best))
        self._staging.before_layer(p, best)

    def _compute_from_table(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                            blobs: Sequence[torch.Tensor | None], experts: list[int]) -> torch.Tensor:
        bases = self._table.fill(blobs, experts)  # [E] int64 on the device
        return self.ffn.forward_bases(hidden, top_k_index, top_k_weights, bases, out=self._output(hidden))

    def _compute_from_blobs(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                            blobs: Sequence[torch.Tensor | None], experts: list[int]) -> torch.Tensor:
        return self.ffn(hidden, top_k_index, top_k_weights, blobs, out=self._output(hidden))

    def _output(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """This layer's output buffer [T, H] for a decode call; None (the kernel allocates) for a larger one."""
        tokens = hidden.shape[0]
        if tokens > DECODE_TOKENS:
            return None
        if self._out is None or self._out.dtype != hidden.dtype:
            self._out = torch.empty(DECODE_TOKENS, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
        return self._out[:tokens]

    def extra_repr(self) -> str:
        return f"layer_position={self.layer_position}, ffn={type(self.ffn).__name__}, lagged={self._lagged}"


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
