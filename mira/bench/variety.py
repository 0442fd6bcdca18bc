"""How much a run's decode routing varies from step to step.

A budget only matters when the experts a step routes to change: a run whose every decode step
routes each layer to the experts of the step before misses only in its prompt, whatever the
policy, and measures the host path, not caching. That happened with the Qwen3-30B-A3B synthetic
preset (synthetic-routing-cpu.json), unnoticed until its lookups were counted; `mira bench` now
reports this figure per run and says when it is low.
"""

from __future__ import annotations

from math import comb

import numpy as np

from mira.store.trace import RoutingTrace

LOW = 0.5  # of the uniform expectation: below it a run's budgets hardly matter


def decode_route_changes(trace: RoutingTrace) -> dict:
    """The share of (decode step, MoE layer) pairs whose routed experts differ from the previous
    step's in the same sequence, and that share under uniform random routing, 1 - 1 / C(E, K).

    Raises:
        ValueError: the trace lacks seq_id or is_prefill.
    """
    if trace.seq_id is None or trace.is_prefill is None:
        raise ValueError("the trace needs seq_id and is_prefill")
    ids = np.sort(trace.topk_ids, axis=-1)  # [T, L, K]
    # pairs of consecutive tokens of one sequence whose second token is a decode step
    pairs = (trace.seq_id[1:] == trace.seq_id[:-1]) & ~trace.is_prefill[1:]  # [T-1]
    changed = (ids[1:] != ids[:-1]).any(axis=-1)[pairs]  # [pairs, L]
    uniform = 1 - 1 / comb(trace.num_experts, trace.top_k)
    value = float(changed.mean()) if changed.size else None
    return {"value": None if value is None else round(value, 3), "uniform": round(uniform, 3),
            "low": value is not None and value < LOW * uniform}
