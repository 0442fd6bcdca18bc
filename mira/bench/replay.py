"""Real routing at real shapes: a model whose MoE layers route as a recorded trace did (`mira bench --routing`).

A synthetic model's random routers have no locality, so no residency policy can be judged on
them. Replaying a trace (DESIGN.md 5) gives every MoE layer the experts the trace's token chose
at that layer, so timings, PCIe bytes and every policy run on real routing at the model's shapes.
The router still runs (its weights of the routed experts are kept), and nothing else changes.

The trace's rows are read in order: a forward step of S new positions takes the next S rows
(every sequence of a batch the same ones); a step of more than one position (a prompt) starts
again at `start`, so every prompt replays the same rows. The rows live on the device and each step
copies its own into a buffer the layers read, so replaying adds no host sync and a decode step can
still be captured and replayed as a CUDA graph. Predictors that read hidden states or router
logits (gate speculation, trained heads) see the model's own states, which the trace did not
come from: their predictions mean nothing here.

T tokens of a step, L MoE layers, K experts per token.
"""

from __future__ import annotations

import torch

from mira.errors import MiraError
from mira.models.loader import routed_per_token
from mira.store.trace import RoutingTrace
from mira.runtime.engine import MiraModel, step_inputs
from mira.runtime.experts import MiraExperts


class RoutingReplay:
    """Makes a Mira model's MoE layers route as `trace` did.

    Args:
        trace: the recorded routing; its layers, experts per layer and top-k must be the model's.
        model: the model to replay into.
        start: the row every prompt starts from.

    Raises:
        MiraError: the trace's layer, expert or top-k count differs from the model's.
    """

    def __init__(self, trace: RoutingTrace, model: MiraModel, start: int = 0):
        layers = [m for m in model.hf_model.modules() if isinstance(m, MiraExperts)]
        store = model.store
        top_k = _top_k(model.hf_model.config)
        if (trace.num_layers, trace.num_experts, trace.top_k) != (store.num_layers, store.num_experts, top_k):
            raise MiraError(f"the trace {trace.source} routes {trace.num_layers} MoE layers x {trace.num_experts} "
                            f"experts, top-{trace.top_k}, but the model has {store.num_layers} x "
                            f"{store.num_experts}, top-{top_k}; replay a trace of a model of the same shape")
        self.trace = trace
        self.start = start
        self._cursor = start
        device = model.device
        self._rows = torch.from_numpy(trace.topk_ids.astype("int64")).to(device)  # [N, L, K]
        self._decode = torch.empty(trace.num_layers, 1, trace.top_k, dtype=torch.int64, device=device)  # [L, 1, K]
        self._step: torch.Tensor = self._decode  # [L, T, K]: what this step's layers read
        model.hf_model.register_forward_pre_hook(self._before_step, with_kwargs=True)
        for layer in layers:
            layer.register_forward_pre_hook(self._route)

    def _before_step(self, module, args, kwargs) -> None:
        inputs = step_inputs(args, kwargs)
        batch, positions = inputs.shape[0], inputs.shape[1]
        if positions > 1:
            self._cursor = self.start
        end = self._cursor + positions
        if end > self.trace.num_tokens:
            raise MiraError(f"the trace {self.trace.source} has {self.trace.num_tokens} tokens; this run needs "
                            f"{end}: replay a longer trace, or generate fewer tokens")
        rows = self._rows[self._cursor:end]  # [S, L, K]
        self._cursor = end
        if positions == 1 and batch == 1:
            self._decode.copy_(rows.transpose(0, 1))  # device to device: no host sync
            self._step = self._decode
        else:
            self._step = rows.repeat(batch, 1, 1).transpose(0, 1)  # [L, B*S, K], sequences in batch order

    def _route(self, module, args):
        hidden, _, weights = args
        return hidden, self._step[module.layer_position], weights  # [T, K] from the trace


def _top_k(config) -> int:
    top_k = routed_per_token(config)
    if top_k is None:
        raise MiraError(f"cannot tell how many experts a token routes to in a {config.model_type} model")
    return top_k
