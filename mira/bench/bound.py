"""The physical bound on decode time (DESIGN.md 4), from the routing a run actually had.

A decode step at batch 1 cannot take less than max(HBM bytes / HBM bandwidth, PCIe bytes / PCIe
bandwidth). Here, summed over a run's decode steps:

- HBM bytes: the non-expert weights a step reads (all of them but the input embedding table, of
  which one row is read), the distinct experts it routes, and the KV cache of its context;
- PCIe bytes: Belady's optimum misses on the run's decode accesses with the same slot count,
  times the blob size. The cache may start the decode phase holding any experts (a free warm
  start: the first `slots` distinct experts in order of first use, which is an optimal start), so
  this is a lower bound on what any policy must move during decode.

Summing before taking the max gives a bound no larger than the sum of per-step bounds: still a
bound, slightly looser.

With a CPU that computes missed experts from host memory, the misses' bytes can be read over PCIe
and by the CPU at once: the hybrid bound divides them over the sum of both rates (the CPU's as
calibrated, mira.runtime.calibrate).
"""

from __future__ import annotations

import numpy as np

from mira.cache.belady import warm_belady_misses
from mira.kernels.machine import Machine, machine
from mira.store.trace import RoutingTrace


def decode_bound(trace: RoutingTrace, slots: int, blob_bytes: int, weight_bytes: int, kv_bytes_per_token: int,
                 figures: Machine | None = None, cpu_bytes_per_s: float | None = None) -> dict:
    """The bound for the decode steps of `trace` (one token per step, batch 1).

    Args:
        trace: the run's routing, with seq_id and is_prefill.
        slots: expert slots of the run.
        blob_bytes: bytes of one expert.
        weight_bytes: non-expert bytes one step reads.
        kv_bytes_per_token: KV-cache bytes of one token of context.
        figures: the machine's bandwidths; default the reference machine's (mira.kernels.machine).
        cpu_bytes_per_s: expert bytes the CPU computes per second; given, the hybrid bound too.

    Returns:
        decode steps, HBM and PCIe bytes, the bound in seconds (total and per step) and which
        side binds; with `cpu_bytes_per_s`, `hybrid_bound_s` and `hybrid_bound_tokens_per_s`.
    """
    if trace.seq_id is None or trace.is_prefill is None:
        raise ValueError("the trace needs seq_id and is_prefill")
    decode = ~trace.is_prefill
    steps = int(decode.sum())
    if steps == 0:
        raise ValueError("the trace has no decode steps")
    context = _positions(trace.seq_id) + 1  # [T] tokens of context each token attends to
    ids = np.sort(trace.topk_ids[decode], axis=-1)  # [S, L, K]
    experts = int((1 + (np.diff(ids, axis=-1) != 0).sum(-1)).sum())  # distinct experts per step and layer
    hbm = steps * weight_bytes + experts * blob_bytes + int(context[decode].sum()) * kv_bytes_per_token
    decode_trace = RoutingTrace(trace.topk_ids[decode], trace.num_experts)
    misses = warm_belady_misses(decode_trace.uid_sequence(), slots)
    pcie = misses * blob_bytes
    figures = figures or machine()
    hbm_s, pcie_s = hbm / figures.hbm_bytes_per_s, pcie / figures.pcie_bytes_per_s
    bound = {"decode_steps": steps, "hbm_bytes": hbm, "pcie_bytes": pcie, "belady_misses": misses,
             "bound_s": max(hbm_s, pcie_s), "bound_s_per_step": max(hbm_s, pcie_s) / steps,
             "bound_tokens_per_s": steps / max(hbm_s, pcie_s), "bound_by": "HBM" if hbm_s >= pcie_s else "PCIe"}
    if cpu_bytes_per_s:
        hybrid_s = max(hbm_s, pcie / (figures.pcie_bytes_per_s + cpu_bytes_per_s))
        bound.update(cpu_bytes_per_s=cpu_bytes_per_s, hybrid_bound_s=hybrid_s,
                     hybrid_bound_tokens_per_s=steps / hybrid_s)
    return bound


def _positions(seq_id: np.ndarray) -> np.ndarray:
    """Position of each token within its sequence (tokens of a sequence are consecutive)."""
    starts = np.r_[0, np.flatnonzero(np.diff(seq_id)) + 1]
    lengths = np.diff(np.r_[starts, len(seq_id)])
    return np.arange(len(seq_id)) - np.repeat(starts, lengths)
