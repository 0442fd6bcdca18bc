"""How close an online policy can come to Belady: the best policy of a Markov chain of routing.

`mira simulate` sets each policy against Belady's optimum, which knows every future access. An online
policy knows only the past. This bounds what the past can buy when routing is a first-order Markov
chain per layer: the next token's expert set depends on the current one alone, with transition
probabilities fitted on a trace's calibration part (add-0.1 smoothed over every possible set). For
each layer and slot count c, the policy that minimises the expected blobs moved per token under
that chain (relative value iteration over (cache, current set) states; after each token it may
keep any c experts of its cache and the token's set) is replayed on the rest of the trace. It
starts from the static placement of the calibration part. Each layer keeps a fixed number of slots,
allocated from the chain's own expected costs, whereas Belady, static, LRU and mira share one pool.
The states number C(E, K) x C(E, c) per layer, which suits the 8-expert traces here, not 64 experts.

Two prices: inline, a miss's copy is its read, so an admission costs nothing more; lagged, an
admission crosses PCIe a second time (mira.bench.simulate). Blobs moved are reported against
Belady's (inline, one shared pool) and against the best of static, LRU and LFU, beside mira's.

The traces and splits are those of benchmarks/policies.py: the bundled model's held-out prompts
with the training-split trace as calibration, and the recorded Mixtral-8x7B-Instruct decode with its
first quarter as calibration. Writes benchmarks/results/online-optimum-real.json and a markdown
table beside it.

    python benchmarks/online_optimum.py
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np

from mira.bench.provenance import result_header
from mira.bench.simulate import simulate
from mira.store.files import write_json_atomic
from mira.store.trace import RoutingTrace

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TRACES = RESULTS / "traces"
SHARES = (0.10, 0.25, 0.50)
SMOOTHING = 0.1  # pseudo-count of every transition
ITERATIONS = 300  # of relative value iteration
BASELINES = ("static", "lru", "lfu")


class LayerChain:
    """One layer's routing as a first-order Markov chain over the sets of K experts it can pick,
    and the optimal caching policy for it at each slot count."""

    def __init__(self, calibration: list[frozenset], experts: int, top_k: int):
        self.sets = [frozenset(s) for s in itertools.combinations(range(experts), top_k)]
        self.index = {s: i for i, s in enumerate(self.sets)}
        counts = np.full((len(self.sets), len(self.sets)), SMOOTHING)
        for now, after in zip(calibration, calibration[1:]):
            counts[self.index[now], self.index[after]] += 1
        self.transitions = counts / counts.sum(axis=1, keepdims=True)  # [set now, set next]
        self.popular = np.argsort(-np.bincount([e for s in calibration for e in s], minlength=experts),
                                  kind="stable")
        self.experts = experts
        self._policies: dict[tuple[int, float], tuple[np.ndarray, list[frozenset], float]] = {}

    def policy(self, slots: int, admission: float) -> tuple[np.ndarray, list[frozenset], float]:
        """The optimal policy with `slots` slots when an admission costs `admission` blobs: (the cache
        kept after each (cache, set routed) state, [caches, sets]; the caches; the expected blobs per
        token under the chain). Memoised."""
        key = (slots, admission)
        if key not in self._policies:
            self._policies[key] = self._solve(slots, admission)
        return self._policies[key]

    def _solve(self, slots: int, admission: float) -> tuple[np.ndarray, list[frozenset], float]:
        caches = [frozenset(c) for c in itertools.combinations(range(self.experts), slots)]
        at = {c: i for i, c in enumerate(caches)}
        n = len(self.sets)
        misses = np.array([[len(s - c) for s in self.sets] for c in caches], dtype=float)  # [cache, set]
        kept, cost, starts = [], [], []  # every state's choices, flat: the cache kept and what admitting costs
        for c in caches:
            for s in self.sets:
                starts.append(len(kept))
                for keep in itertools.combinations(sorted(c | s), slots):
                    kept.append(at[frozenset(keep)])
                    cost.append(admission * len(set(keep) - c))
        kept, cost, starts = np.array(kept), np.array(cost), np.array(starts)
        column = np.repeat(np.tile(np.arange(n), len(caches)), np.diff(np.append(starts, len(kept))))
        value = np.zeros((len(caches), n))  # relative cost to go from (cache kept, set routed now)
        gain = 0.0
        for _ in range(ITERATIONS):
            best = np.minimum.reduceat(value[kept, column] + cost, starts).reshape(len(caches), n)
            step = (misses + best) @ self.transitions.T  # expected over the next set
            gain, value = step[0, 0], step - step[0, 0]
        totals = value[kept, column] + cost
        choice = np.array([kept[a + np.argmin(totals[a:b])] for a, b in zip(starts, np.append(starts[1:], len(kept)))])
        return choice.reshape(len(caches), n), caches, gain

    def replay(self, sets: list[frozenset], slots: int, admission: float) -> tuple[int, int]:
        """(misses, admissions) of the optimal policy on `sets`, from the calibration's static placement."""
        if slots == 0:
            return sum(len(s) for s in sets), 0
        choice, caches, _ = self.policy(slots, admission)
        cache = caches.index(frozenset(self.popular[:slots].tolist()))
        misses = admissions = 0
        for s in sets:
            misses += len(s - caches[cache])
            kept = choice[cache, self.index[s]]
            admissions += len(caches[kept] - caches[cache])
            cache = kept
        return misses, admissions


def layer_sets(trace: RoutingTrace, layer: int) -> list[frozenset]:
    return [frozenset(int(e) for e in row) for row in trace.topk_ids[:, layer]]


def allocate(expected: list[list[float]], slots: int) -> list[int]:
    """Slots per layer minimising the summed expected blobs per token (`expected[layer][c]`), one slot
    at a time to the layer it saves most in (the expected costs fall ever less steeply in c)."""
    per_layer = [0] * len(expected)
    for _ in range(slots):
        layer = max((l for l in range(len(expected)) if per_layer[l] + 1 < len(expected[l])),
                    key=lambda l: expected[l][per_layer[l]] - expected[l][per_layer[l] + 1])
        per_layer[layer] += 1
    return per_layer


def case(name: str, trace: RoutingTrace, calibration: RoutingTrace) -> dict:
    experts, top_k, layers = trace.num_experts, trace.top_k, trace.num_layers
    chains = [LayerChain(layer_sets(calibration, l), experts, top_k) for l in range(layers)]
    rows = []
    for share in SHARES:
        slots = round(share * trace.num_uids)
        row = {"share": share, "slots": slots}
        runs = {"belady": simulate(trace, "belady", slots)["copies"]}
        runs |= {p: simulate(trace, p, slots, profile=calibration)["copies"] for p in BASELINES}
        runs["mira-lagged"] = simulate(trace, "mira", slots, profile=calibration, residency="lagged")["copies"]
        runs["mira-inline"] = simulate(trace, "mira", slots, profile=calibration, residency="inline")["copies"]
        for pricing, admission in (("inline", 0.0), ("lagged", 1.0)):
            expected = [[chain.policy(c, admission)[2] if c else float(top_k) for c in range(experts + 1)]
                        for chain in chains]
            per_layer = allocate(expected, slots)
            moved = [chain.replay(layer_sets(trace, l), c, admission) for l, (chain, c) in
                     enumerate(zip(chains, per_layer))]
            misses, admissions = sum(m for m, _ in moved), sum(a for _, a in moved)
            runs[f"markov-{pricing}"] = misses + admission * admissions
            row[f"markov_{pricing}_admissions"] = admissions
            row[f"markov_{pricing}_slots_per_layer"] = per_layer
        best = min(runs[p] for p in BASELINES)
        row["blobs"] = runs
        row["over_belady"] = {k: round(v / runs["belady"], 3) for k, v in runs.items()}
        row["over_best_baseline"] = {k: round(v / best, 3) for k, v in runs.items()}
        rows.append(row)
        print(f"{name}, {slots} slots: " + ", ".join(f"{k} {v / runs['belady']:.2f}x" for k, v in runs.items()),
              flush=True)
    return {"name": name, "tokens": trace.num_tokens, "calibration_tokens": calibration.num_tokens, "rows": rows}


def table(cases: list[dict]) -> str:
    names = ("markov-inline", "markov-lagged", "mira-inline", "mira-lagged", "static", "lru", "lfu")
    lines = ["| trace | slots | " + " | ".join(names) + " |", "| --- | ---: |" + " ---: |" * len(names)]
    for c in cases:
        for row in c["rows"]:
            lines.append(f"| {c['name']} | {row['slots']} | "
                         + " | ".join(f"{row['over_belady'][n]:.2f}" for n in names) + " |")
    return "\n".join(lines)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    training = RoutingTrace.load(TRACES / "profile-train.npz")
    held_out = RoutingTrace.load(TRACES / "heldout.npz")
    mixtral = RoutingTrace.load(TRACES / "mixtral-8x7b-instruct-decode.npz")
    quarter = mixtral.num_tokens // 4
    cases = [case("mira-tiny-moe held-out (calibration: training trace)", held_out, training),
             case("Mixtral-8x7B-Instruct, last 3/4 (calibration: first 1/4)",
                  mixtral.tokens(quarter, mixtral.num_tokens), mixtral.tokens(0, quarter))]
    text = table(cases)
    print("\nblobs moved over Belady's (inline, one shared pool):\n" + text)
    write_json_atomic(RESULTS / "online-optimum-real.json", {
        **result_header(" ".join(["python", "benchmarks/online_optimum.py", *sys.argv[1:]])),
        "setup": {"shares_of_experts": SHARES, "smoothing": SMOOTHING, "iterations": ITERATIONS,
                  "held_out": ["traces/heldout.npz", "traces/mixtral-8x7b-instruct-decode.npz (last 3/4)"]},
        "cases": cases})
    (RESULTS / "online-optimum-real.md").write_text(
        "Blobs moved over Belady's (inline, one shared pool) replaying real routing (`python "
        "benchmarks/online_optimum.py`, from online-optimum-real.json). markov: the optimal policy of a "
        "first-order Markov chain fitted on the calibration part, each layer with a fixed number of slots; "
        "inline prices an admission at nothing, lagged at one more blob.\n\n" + text + "\n")
    print("wrote benchmarks/results/online-optimum-real.json and online-optimum-real.md")


if __name__ == "__main__":
    main()
