"""Token-level telemetry of the expert cache (paper IV-D): per expert, tokens routed and served by tier.

The mechanism records every settled expert (mira.cache.cache); these cumulative figures feed
reports and `--stats-json`. (Policies keep their own sliding windows from the accesses they see.)
Lagged layers' tokens are recorded when the cache settles them after their step, with the tier the
policy reports then: a hit whose copy was still in flight when its layer ran was in fact read
zero-copy from the host store.
"""

from __future__ import annotations

import array

import numpy as np

from mira.cache.policy import Tier


class Telemetry:
    """counts[layer, expert] = (tokens routed, tokens served from HOT, from STAGE, from the host store)."""

    def __init__(self, num_layers: int, num_experts: int):
        self._columns = columns = 1 + len(Tier)  # tokens routed, then served by each tier
        self._flat = array.array("q", bytes(8 * num_layers * num_experts * columns))  # Python-speed `record`
        self._counts = np.frombuffer(self._flat, dtype=np.int64).reshape(num_layers, num_experts, columns)
        self._experts = num_experts
        self._lookups = [0] * len(Tier)  # (layer, expert) lookups by tier
        self.bytes_to_device = 0  # on-demand copies (misses admitted into a slot)
        self.copies = 0
        self.prefetch_bytes = 0  # staging's copies ahead of use
        self.prefetch_copies = 0

    @property
    def accesses(self) -> np.ndarray:
        """int64 [tiers]: (layer, expert) lookups served by each tier."""
        return np.array(self._lookups, dtype=np.int64)

    @property
    def counts(self) -> np.ndarray:
        """int64 [L, E, 1 + tiers]: tokens routed, then tokens served by each tier."""
        return self._counts

    def layer_misses(self) -> np.ndarray:
        """int64 [L, 2]: per layer, the tokens routed so far and those served from the host store."""
        return np.stack([self._counts[:, :, 0].sum(1), self._counts[:, :, 1 + Tier.MISS].sum(1)], axis=1)

    def record_layers(self, tokens: np.ndarray, tier: Tier) -> None:
        """Tokens routed per expert of every layer, int [L, E], all served from `tier` (one lookup
        per routed expert)."""
        self._counts[:, :, 0] += tokens
        self._counts[:, :, 1 + tier] += tokens
        self._lookups[tier] += int(np.count_nonzero(tokens))

    def record(self, layer_position: int, expert: int, tokens: int, tier: Tier) -> None:
        at = (layer_position * self._experts + expert) * self._columns
        self._flat[at] += tokens
        self._flat[at + 1 + tier] += tokens
        self._lookups[tier] += 1

    def record_copy(self, nbytes: int, prefetch: bool = False) -> None:
        if prefetch:
            self.prefetch_bytes += nbytes
            self.prefetch_copies += 1
        else:
            self.bytes_to_device += nbytes
            self.copies += 1

    def summary(self) -> dict:
        totals = self.counts.sum(axis=(0, 1))
        lookups = int(self.accesses.sum())
        return {
            "tokens_routed": int(totals[0]),
            "tokens_served": {tier.name.lower(): int(totals[1 + tier]) for tier in Tier},
            "lookups": {tier.name.lower(): int(self.accesses[tier]) for tier in Tier},
            "hit_rate": float(self.accesses[Tier.HOT] + self.accesses[Tier.STAGE]) / lookups if lookups else 0.0,
            "copies": self.copies,
            "bytes_to_device": self.bytes_to_device,
            "prefetch_copies": self.prefetch_copies,
            "prefetch_bytes": self.prefetch_bytes,
        }


class HybridTelemetry:
    """Per MoE layer, the calls whose misses the CPU shared: experts it computed whole, experts cut
    between it and the device (`cuts`, and `cut_shares`: the CPU's share of their units), tokens it
    computed, and the cost model's predicted seconds (the later of the two sides, and each side)
    against the measured ones: the CPU's side (hand-off to the worker through with its partial
    sum), the worker's own part of that (rows ready to partial sum written), and on CUDA the
    device's side (its table updates and kernel, timed on the stream) and the later of the two,
    when the layer's misses were all served. A CPU-served expert is also a miss in `Telemetry`:
    the policy saw it miss.

    Beside the layers, the decode jobs priced by a pace (`calibrated_cpu_s`), by kind: whole experts
    (1, 2, 3 or more) and the CPU's share of a cut in fifths, each with its calibrated and measured
    CPU side and the worker's own part of the latter (`jobs` in `summary`). A pace is one ratio for
    every job of its kind; where the ratio grows as the cut's share shrinks, the calibration misses
    a fixed cost of small jobs, in the worker's compute or in the wait before it."""

    CUT_BINS = 5  # the CPU's share of a cut, in fifths

    def __init__(self, num_layers: int):
        self.calls = [0] * num_layers
        self.experts = [0] * num_layers
        self.cuts = [0] * num_layers
        self.cut_shares = [0.0] * num_layers
        self.tokens = [0] * num_layers
        self.measured_s = [0.0] * num_layers
        self.compute_s = [0.0] * num_layers  # the worker's own time, rows ready to partial sum written
        self.predicted_s = [0.0] * num_layers  # over the calls that had a prediction
        self.predicted_cpu_s = [0.0] * num_layers
        self.predicted_calls = [0] * num_layers
        self.measured_with_prediction_s = [0.0] * num_layers  # the measured seconds of those calls
        # the device's side is timed in every call or in none (a CUDA run's, by HybridExperts)
        self.device_s = [0.0] * num_layers
        self.served_s = [0.0] * num_layers  # the later side
        self.device_calls = [0] * num_layers
        self.predicted_device_s = [0.0] * num_layers  # over the predicted calls
        self.served_with_prediction_s = [0.0] * num_layers  # the later side of the predicted calls
        # (whole experts up to 3, the cut's fifth or -1) -> [jobs, calibrated, measured, compute seconds]
        self.jobs: dict[tuple[int, int], list[float]] = {}

    def record(self, layer_position: int, experts: int, tokens: int, measured_s: float, compute_s: float,
               predicted: tuple[float, float, float] | None, cut_share: float = 0.0,
               device_s: float | None = None, calibrated_cpu_s: float = 0.0) -> None:
        """One call; `measured_s`: the CPU's side; `compute_s`: the worker's part of it; `predicted`:
        (the layer's misses served, the CPU's side, the device's side) in seconds, or None;
        `cut_share`: the CPU's share of the units of one more expert it computed in part (0: none);
        `device_s`: the device's side, or None where it was not timed; `calibrated_cpu_s`: the CPU's
        side as calibrated, for a decode job a pace learns from (0: none)."""
        if calibrated_cpu_s > 0:
            kind = (min(experts, 3), min(int(cut_share * self.CUT_BINS), self.CUT_BINS - 1) if cut_share > 0 else -1)
            job = self.jobs.setdefault(kind, [0, 0.0, 0.0, 0.0])
            job[0] += 1
            job[1] += calibrated_cpu_s
            job[2] += measured_s
            job[3] += compute_s
        self.calls[layer_position] += 1
        self.experts[layer_position] += experts
        self.cuts[layer_position] += cut_share > 0
        self.cut_shares[layer_position] += cut_share
        self.tokens[layer_position] += tokens
        self.measured_s[layer_position] += measured_s
        self.compute_s[layer_position] += compute_s
        if predicted is not None:
            self.predicted_s[layer_position] += predicted[0]
            self.predicted_cpu_s[layer_position] += predicted[1]
            self.predicted_calls[layer_position] += 1
            self.measured_with_prediction_s[layer_position] += measured_s
        if device_s is not None:
            served = max(measured_s, device_s)
            self.device_s[layer_position] += device_s
            self.served_s[layer_position] += served
            self.device_calls[layer_position] += 1
            if predicted is not None:
                self.predicted_device_s[layer_position] += predicted[2]
                self.served_with_prediction_s[layer_position] += served

    def summary(self) -> dict:
        """Totals, and per layer with calls the mean predicted and measured milliseconds per call
        (`predicted_over_measured`: the later side predicted over the CPU's side measured; with the
        device's side timed, `predicted_over_served`: over the later side measured)."""
        layers = []
        for layer, calls in enumerate(self.calls):
            if not calls:
                continue
            predicted = self.predicted_calls[layer]
            row = {"layer": layer, "calls": calls, "experts": self.experts[layer], "cuts": self.cuts[layer],
                   "tokens": self.tokens[layer],
                   "measured_ms": round(1e3 * self.measured_s[layer] / calls, 4),
                   "cpu_compute_ms": round(1e3 * self.compute_s[layer] / calls, 4)}
            if predicted:
                row["predicted_ms"] = round(1e3 * self.predicted_s[layer] / predicted, 4)
                row["predicted_cpu_ms"] = round(1e3 * self.predicted_cpu_s[layer] / predicted, 4)
                measured = self.measured_with_prediction_s[layer]
                row["predicted_over_measured"] = round(self.predicted_s[layer] / measured, 4) if measured else None
            timed = self.device_calls[layer]
            if timed:
                row["device_ms"] = round(1e3 * self.device_s[layer] / timed, 4)
                row["served_ms"] = round(1e3 * self.served_s[layer] / timed, 4)
                if predicted:
                    row["predicted_device_ms"] = round(1e3 * self.predicted_device_s[layer] / predicted, 4)
                    row["predicted_over_served"] = round(self.predicted_s[layer]
                                                         / self.served_with_prediction_s[layer], 4)
            layers.append(row)
        return {"calls": sum(self.calls), "experts": sum(self.experts), "cuts": sum(self.cuts),
                "cut_share": round(sum(self.cut_shares), 4), "tokens": sum(self.tokens), "layers": layers,
                "jobs": self._jobs()}

    def _jobs(self) -> list[dict]:
        """The paced decode jobs by kind, whole experts first, then by the cut's share."""
        rows = []
        for (experts, fifth), (count, calibrated, measured, compute) in sorted(self.jobs.items()):
            cut = f"{fifth / self.CUT_BINS:.1f}-{(fifth + 1) / self.CUT_BINS:.1f}" if fifth >= 0 else None
            rows.append({"whole_experts": f"{experts}+" if experts == 3 else str(experts), "cut_share": cut,
                         "jobs": int(count), "calibrated_ms": round(1e3 * calibrated / count, 4),
                         "measured_ms": round(1e3 * measured / count, 4), "compute_ms": round(1e3 * compute / count, 4),
                         "measured_over_calibrated": round(measured / calibrated, 4)})
        return rows
