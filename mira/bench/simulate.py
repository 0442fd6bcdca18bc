"""Replay a routing trace through any cache policy and through Belady's optimum (`mira simulate`).

Paper IV-C and IV-D compare the HOT+STAGE rebalancer with LRU, LFU and static placement; this
module makes that comparison on any trace of DESIGN.md 5 without a GPU: every policy of
`mira.cache.policy` runs behind a small model of the slot mechanism (an expert-to-slot map that
checks the policy keeps its contract), and `belady` gives the bound of DESIGN.md 4. A miss costs
one expert blob over PCIe (the kernel reads it from the host store, or its copy into a slot is
the read), and so does a prefetch (paper IV-E: recorded predictions replayed with
`predictions=`, staged as the runtime stages them: mira.cache.staging). Under lagged residency the policy acts after the step, so an admission copies
a miss the kernel has already read: one more blob. So PCIe bytes = (misses + prefetches, plus
admissions when lagged) x expert bytes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np

from mira.cache.belady import warm_belady_misses
from mira.charts import save_png
from mira.cache.policy import Access, Policy, Popularity, Tier, make_policy
from mira.cache.config import CacheConfig
from mira.store.trace import RoutingTrace

POLICIES = ("mira", "lru", "lfu", "static", "on-demand", "belady")
RESIDENCY = ("inline", "lagged")  # when the policy acts: before each layer, or after each step
# The default expert: Mixtral-8x7B's in int8-shared (w1|w3 and w2 int8 [14336 x 4096] each, one bf16
# scale vector [4096]).
MIXTRAL_EXPERT_BYTES = 3 * 14336 * 4096 + 2 * 4096


class PolicyContractError(RuntimeError):
    """A policy answered something the mechanism cannot carry out (a bug in the policy)."""


def simulate(
    trace: RoutingTrace,
    policy: str,
    slots: int,
    stage_slots: int | None = None,
    expert_bytes: int = MIXTRAL_EXPERT_BYTES,
    bandwidth_gbps: float | None = None,
    config: CacheConfig = CacheConfig(),
    profile: RoutingTrace | None = None,
    check: bool = False,
    predictions: np.ndarray | None = None,
    residency: str = "inline",
) -> dict:
    """Replay `trace` through one policy with `slots` expert slots shared by all layers.

    Args:
        trace: the routing trace.
        policy: one of `POLICIES` (belady is the offline optimum).
        slots: expert slots.
        stage_slots: STAGE size of the mira policy (default: from `config`); other policies ignore it.
        expert_bytes: bytes of one expert blob, the PCIe cost of a miss.
        bandwidth_gbps: host-to-device bandwidth in GB/s (1e9 bytes per second); None: the reference
            machine's pinned copy rate (mira.kernels.machine).
        config: the cache configuration of the mira policy.
        profile: the trace whose routed-token counts choose the static placement and the mira
            policy's prior; None uses the replayed trace itself (an oracle profile, labelled so in
            the result).
        check: after every group, also check the policy's whole resident set and tier sizes
            against the mechanism (slower; the tests use it).
        predictions: int [T, L, P], the experts predicted for each (token, layer), best first, -1
            for none (`load_predictions`); as the runtime does (mira.cache.staging), the best one
            for layer l is staged at layer l - 2, once per step, into a stage row outside the
            policy's slots when it holds no slot; an access to it at layer l is then served from
            STAGE without a miss, and the policy still sees it. None: no prefetching. Belady
            ignores it.
        residency: "inline" (the policy places each expert before its layer: an admission is the
            miss's own copy) or "lagged" (the policy acts after the step: an admission is one more
            blob). The decisions are the same; Belady is the inline optimum either way.

    Returns:
        A JSON-ready dict: policy, slots, hot_slots, stage_slots, tokens, preloaded (static's and
        mira's placements are loaded with the model, before the first access, so they have no
        warm-up misses; lru, lfu and on-demand start empty; Belady starts from the best contents,
        so it bounds them all), accesses, hits, misses, hit_rate, miss_rate, hits_hot,
        hits_stage, copies (misses + prefetches issued, + admissions when lagged: every blob moved over
        PCIe), pcie_bytes,
        pcie_seconds_per_token, expert_bytes, bandwidth_gbps, residency; for the online policies also
        admissions, tokens_routed/_hot/_stage/_miss and, with predictions, prefetch counts
        (prefetch_issued, _used, _wasted, _admitted: staged experts the policy then admitted) and
        prefetch_bytes; for mira the
        config it ran with, for static the profile it used. Belady has no tiers: hot_slots and
        stage_slots are absent and all its hits count as hits_hot.

    Raises:
        ValueError: unknown policy, negative slots, a bad stage size, or a profile of another model.
        PolicyContractError: the policy broke its contract with the mechanism.
    """
    if slots < 0:
        raise ValueError(f"slots must be >= 0, got {slots}")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if residency not in RESIDENCY:
        raise ValueError(f"unknown residency {residency!r}; choose one of {', '.join(RESIDENCY)}")
    if policy == "belady":
        counts = _belady_counts(trace, slots)
        extra = {}
    else:
        if profile is not None:
            profile.check_profile_of(trace.num_layers, trace.num_experts, f"the trace {trace.source}")
        popularity = Popularity.of_trace(profile if profile is not None else trace)
        instance = make_policy(policy, slots, trace.num_uids, config, popularity, stage_slots)
        counts = replay(trace, instance, check=check, predictions=predictions)
        extra = {"hot_slots": instance.hot_slots, "stage_slots": instance.stage_slots}
        if policy == "mira":
            extra["config"] = dataclasses.asdict(config)
        if policy in ("static", "mira"):
            extra["profile"] = profile.source if profile is not None else "oracle: the replayed trace itself"
    copies = counts["misses"] + counts.get("prefetch_issued", 0)
    if residency == "lagged":
        copies += counts.get("admissions", 0)
    else:  # inline, an admission is its miss's own copy, but not that of an expert served from a stage row
        copies += counts.get("prefetch_admitted", 0)
    pcie_bytes = copies * expert_bytes
    if bandwidth_gbps is None:
        from mira.kernels.machine import machine  # here: mira.kernels loads torch, which `--help` need not

        bandwidth_gbps = machine().pcie_bytes_per_s / 1e9
    if "prefetch_issued" in counts:
        counts["prefetch_bytes"] = counts["prefetch_issued"] * expert_bytes
    return {
        "policy": policy,
        "slots": slots,
        **extra,
        "tokens": trace.num_tokens,
        **counts,
        "hit_rate": counts["hits"] / counts["accesses"],
        "miss_rate": counts["misses"] / counts["accesses"],
        "copies": copies,
        "pcie_bytes": pcie_bytes,
        "pcie_seconds_per_token": pcie_bytes / (bandwidth_gbps * 1e9) / trace.num_tokens,
        "expert_bytes": expert_bytes,
        "bandwidth_gbps": bandwidth_gbps,
        "residency": residency,
    }


PREDICTORS = ("gate", "trained", "previous", "popularity", "oracle")


def load_predictions(source: str, trace: RoutingTrace, heads: str | os.PathLike | None = None,
                     profile: RoutingTrace | None = None) -> np.ndarray:
    """What a predictor offers to STAGE at every token of a recorded trace, for `simulate(predictions=)`.

    A named predictor is computed from the features recorded beside the trace (`mira trace
    --features` writes T.features.npz next to T.npz), per forward step as the runtime does
    (mira.runtime.experts: the step's best min(E, tokens x K) experts for layer i+2, each token
    of a prompt step carrying its step's offer):
    gate (layer i+2's router on layer i's input, recorded while tracing), trained (the MixtureHeads
    in `heads`), previous (layer i+2's routing at the previous step), popularity (routed tokens
    per expert in `profile`), oracle (the experts layer i+2 then routed, by routed tokens, ties to the
    lower id: a perfect predictor of the routed set, yet not the best staging, since its first expert
    may be resident already).

    Args:
        source: one of `PREDICTORS`, or an .npz file holding `predictions`, int [T, L, P]: experts
            per (token, layer), best first, -1 for none.
        trace: the trace the predictions are for (loaded from T.npz; its `source` locates the features).
        heads: the heads file (`<store>/predictor/heads.safetensors`) for trained.
        profile: the trace whose routed-token counts rank popularity.

    Returns:
        int64 [T, L, P].

    Raises:
        MiraError: a missing or mismatched features, heads or predictions file, or a missing
            `heads` / `profile`, with the fix.
    """
    from mira.errors import MiraError

    if source not in PREDICTORS:
        try:
            archive = np.load(source, allow_pickle=False)
            if not isinstance(archive, np.lib.npyio.NpzFile):
                raise ValueError("a single .npy array, not an .npz archive")
            with archive:
                predictions = archive["predictions"]
        except (OSError, KeyError, ValueError) as error:
            raise MiraError(f"cannot read predictions from {source} ({error}); pass one of {', '.join(PREDICTORS)} "
                            "or an .npz with an int array 'predictions' [tokens, layers, P] (-1 for none)") from None
        needs = (f"the trace {trace.source} needs integers [{trace.num_tokens}, {trace.num_layers}, P] with P >= 1, "
                 f"each an expert id below {trace.num_experts} or -1 for none")
        if predictions.dtype.kind not in "iu" or predictions.ndim != 3 or predictions.shape[2] < 1 \
                or predictions.shape[:2] != trace.topk_ids.shape[:2]:
            raise MiraError(f"predictions in {source} are {predictions.dtype} {predictions.shape}; {needs}")
        if predictions.size and (predictions.min() < -1 or predictions.max() >= trace.num_experts):
            raise MiraError(f"predictions in {source} hold ids from {predictions.min()} to {predictions.max()}; {needs}")
        return predictions.astype(np.int64)

    from mira.predict.coverage import predictor_scores
    from mira.predict.features import FeatureSet, features_path

    features = FeatureSet.load(features_path(trace.source))
    features.check(trace)
    trained = popularity = None
    if source == "trained":
        if heads is None:
            raise MiraError("--predictions trained needs the heads: pass --heads <store>/predictor/heads.safetensors")
        from mira.predict.heads import load_heads

        trained, _ = load_heads(heads, features.fingerprint)
    if source == "popularity":
        if profile is None:
            raise MiraError("--predictions popularity ranks experts by a profile: pass --profile TRACE")
        profile.check_profile_of(trace.num_layers, trace.num_experts, f"the trace {trace.source}")
        popularity = profile.expert_counts().reshape(trace.num_layers, trace.num_experts)
    scores = predictor_scores(features, trained, popularity)["mixture" if source == "trained" else source]
    ranked = np.argsort(-scores, axis=-1, kind="stable")  # [S, L-2, E], ties to the lower id
    E = trace.num_experts
    predictions = np.full((trace.num_tokens, trace.num_layers, E), -1, dtype=np.int64)  # [T, L, E]
    for step, (start, tokens) in enumerate(zip(features.step_start[:-1], features.tokens)):
        offered = min(E, int(tokens) * trace.top_k)
        predictions[start:start + tokens, 2:, :offered] = ranked[step, :, :offered]
    return predictions


def _belady_counts(trace: RoutingTrace, slots: int) -> dict[str, int]:
    sequence = trace.uid_sequence()
    misses = warm_belady_misses(sequence, slots)
    hits = len(sequence) - misses
    preloaded = min(slots, len(np.unique(sequence)))  # its optimal start, as warm_belady_misses takes it
    return {
        "preloaded": preloaded, "accesses": len(sequence), "hits": hits, "misses": misses, "hits_hot": hits,
        "hits_stage": 0,
    }


def replay(trace: RoutingTrace, policy: Policy, check: bool = False,
           predictions: np.ndarray | None = None) -> dict[str, int]:
    """Drive `policy` through the trace's accesses behind a model of the slot mechanism.

    Steps are as the runtime runs them: a prompt's tokens (`is_prefill`, one `seq_id`) are one
    forward step, every other token one; `policy.end_step` comes once per step with its token
    count. The mechanism loads `policy.resident()` first (static placement), then for each access
    checks that the answer can be carried out: a hit is resident, a miss is not, an admission
    takes a free slot or the slot of a resident outside the current group, and an admission is a
    miss. With predictions, staging is modelled as `simulate` says.

    Args:
        trace: the routing trace.
        policy: a fresh policy.
        check: also compare the whole resident set and the HOT/STAGE sizes after every group.
        predictions: int [T, L, P] experts predicted per (token, layer), -1 for none (see simulate).

    Returns:
        Counts: preloaded (residents loaded before the first access, not counted as misses),
        accesses, hits, misses, hits_hot, hits_stage, admissions, tokens_routed, tokens_hot,
        tokens_stage, tokens_miss, and with predictions prefetch_issued, _used and _wasted.

    Raises:
        PolicyContractError: the first broken rule, named.
    """
    if predictions is not None and predictions.shape[:2] != trace.topk_ids.shape[:2]:
        raise ValueError(f"predictions of shape {predictions.shape} do not match the trace's "
                         f"{trace.num_tokens} tokens x {trace.num_layers} layers")
    mechanism = _Slots(policy)
    counts = dict.fromkeys(("accesses", "hits", "misses", "hits_hot", "hits_stage", "admissions"), 0)
    counts["preloaded"] = len(mechanism.slot_of)
    prefetch = dict.fromkeys(("issued", "used", "admitted"), 0)
    tokens = [0, 0, 0]  # served from HOT, STAGE, MISS
    last_layer = trace.num_layers - 1
    E = trace.num_experts
    step_ends = _last_token_of_step(trace)
    staged: dict[int, int | None] = {}  # target layer -> the uid staged for it in this step (None: nothing copied)
    used: set[int] = set()  # target layers whose staged expert was routed in this step
    step_start = 0  # first token of the current step
    for group in trace.accesses():
        policy.begin_group()
        mechanism.begin_group()
        for uid, routed in group.experts:
            answer = policy.access(uid, routed)
            mechanism.carry_out(uid, answer)
            from_stage = uid == staged.get(group.layer) and answer.tier is Tier.MISS
            tier = Tier.STAGE if from_stage else answer.tier
            if from_stage and group.layer not in used:
                used.add(group.layer)
                prefetch["used"] += 1
            prefetch["admitted"] += from_stage and answer.admit  # copied again: the staged copy was not a slot's
            tokens[tier] += routed
            counts["accesses"] += 1
            counts["admissions"] += answer.admit
            counts["misses" if tier is Tier.MISS else "hits"] += 1
            counts["hits_hot"] += tier is Tier.HOT
            counts["hits_stage"] += tier is Tier.STAGE
        target = group.layer + 2
        if predictions is not None and target <= last_layer and target not in staged:  # once per step
            best = int(predictions[group.token, target, 0])
            uid = target * E + best if best >= 0 else None
            staged[target] = uid if uid is not None and policy.tier_of(uid) is Tier.MISS else None
            prefetch["issued"] += staged[target] is not None
        if step_ends[group.token] and group.layer == last_layer:
            policy.end_step(group.token + 1 - step_start)
            step_start = group.token + 1
            staged.clear()
            used.clear()
        if check:
            mechanism.check_all()
    counts.update(tokens_routed=sum(tokens), tokens_hot=tokens[0], tokens_stage=tokens[1], tokens_miss=tokens[2])
    if predictions is not None:
        counts.update(prefetch_issued=prefetch["issued"], prefetch_used=prefetch["used"],
                      prefetch_wasted=prefetch["issued"] - prefetch["used"], prefetch_admitted=prefetch["admitted"])
    return counts


def _last_token_of_step(trace: RoutingTrace) -> np.ndarray:
    """bool [T]: whether each token closes a forward step of the runtime.

    A sequence's prompt tokens (`is_prefill`, same `seq_id`) went through the model in one step;
    every other token is a step of its own. A trace without `is_prefill` is all one-token steps.
    """
    ends = np.ones(trace.num_tokens, dtype=bool)
    if trace.is_prefill is not None:
        seq = trace.seq_id if trace.seq_id is not None else np.zeros(trace.num_tokens, dtype=np.int32)
        same_prompt = trace.is_prefill[:-1] & trace.is_prefill[1:] & (seq[:-1] == seq[1:])
        ends[:-1] = ~same_prompt
    return ends


class _Slots:
    """The expert-to-slot map of the mechanism, checking every answer of the policy against it."""

    def __init__(self, policy: Policy):
        self._policy = policy
        placed = sorted(policy.resident())
        if len(placed) > policy.capacity:
            raise PolicyContractError(f"{policy.name}: starts with {len(placed)} residents in {policy.capacity} slots")
        self.slot_of = {uid: slot for slot, uid in enumerate(placed)}
        self._free = list(range(policy.capacity - 1, len(placed) - 1, -1))
        self._group: set[int] = set()

    def begin_group(self) -> None:
        self._group = set()

    def carry_out(self, uid: int, answer: Access) -> None:
        """Serve `uid` as the policy answered, admitting it if asked."""
        self._group.add(uid)
        name = self._policy.name
        resident = uid in self.slot_of
        if resident != (answer.tier is not Tier.MISS):
            raise PolicyContractError(f"{name}: answered {answer.tier.name} for uid {uid}, resident={resident}")
        if not answer.admit:
            return
        if resident:
            raise PolicyContractError(f"{name}: admits uid {uid}, which already holds a slot")
        self.slot_of[uid] = self._take_slot(answer.evict, name)

    def _take_slot(self, evict: int | None, name: str) -> int:
        if evict is None:
            if not self._free:
                raise PolicyContractError(f"{name}: admits into a free slot, but all {self._policy.capacity} are taken")
            return self._free.pop()
        if evict not in self.slot_of:
            raise PolicyContractError(f"{name}: evicts uid {evict}, which holds no slot")
        if evict in self._group:
            raise PolicyContractError(f"{name}: evicts uid {evict}, accessed in the current group")
        return self.slot_of.pop(evict)

    def check_all(self) -> None:
        """The policy's resident set is the map's, and HOT and STAGE fit their sizes."""
        policy = self._policy
        if policy.resident() != set(self.slot_of):
            raise PolicyContractError(f"{policy.name}: resident() differs from the slots it was told to fill")
        tiers = [policy.tier_of(uid) for uid in self.slot_of]
        if tiers.count(Tier.HOT) > policy.hot_slots or tiers.count(Tier.STAGE) > policy.stage_slots:
            raise PolicyContractError(
                f"{policy.name}: {tiers.count(Tier.HOT)} HOT and {tiers.count(Tier.STAGE)} STAGE residents exceed "
                f"{policy.hot_slots} and {policy.stage_slots} slots"
            )


def sweep(
    trace: RoutingTrace,
    slot_counts: Sequence[int],
    policies: Sequence[str] = POLICIES,
    **options,
) -> list[dict]:
    """`simulate` for every policy at every slot count.

    Args:
        trace: the routing trace.
        slot_counts: expert slot counts to try.
        policies: policy names from `POLICIES`.
        **options: passed on to `simulate` (stage_slots, expert_bytes, bandwidth_gbps, config, profile).

    Returns:
        One result per (slot count, policy), slot counts outermost, in the order given.
    """
    return [simulate(trace, policy, slots, **options) for slots in slot_counts for policy in policies]


def format_table(results: Sequence[dict]) -> str:
    """A plain-text table of simulation results, one row each.

    PCIe bytes count misses and prefetches (and admissions, lagged). The last column divides each
    policy's PCIe bytes by Belady's at the same slot count, where the results include Belady's.

    Args:
        results: dicts returned by `simulate` or `sweep`.

    Returns:
        The table, lines joined by newlines, without a trailing newline.
    """
    bound = {row["slots"]: row["misses"] for row in results if row["policy"] == "belady"}
    header = ("policy", "residency", "slots", "hot", "stage", "accesses", "hit rate", "misses", "HOT hits",
              "STAGE hits", "admissions", "prefetches", "PCIe GB", "PCIe ms/token", "x Belady")
    rows = [header]
    for row in results:
        rows.append((
            row["policy"],
            row["residency"] if row["policy"] != "belady" else "-",
            str(row["slots"]),
            str(row.get("hot_slots", "-")),
            str(row.get("stage_slots", "-")),
            str(row["accesses"]),
            f"{row['hit_rate']:.4f}",
            str(row["misses"]),
            str(row["hits_hot"]),
            str(row["hits_stage"]),
            str(row.get("admissions", "-")),
            str(row.get("prefetch_issued", "-")),
            f"{row['pcie_bytes'] / 1e9:.2f}",
            f"{row['pcie_seconds_per_token'] * 1e3:.3f}",
            _times(row["copies"], bound.get(row["slots"])),
        ))
    widths = [max(len(line[column]) for line in rows) for column in range(len(header))]
    return "\n".join("  ".join(_align(line, widths)) for line in rows)


def _times(copies: int, best: int | None) -> str:
    """`copies` as a multiple of Belady's `best`: "-" without Belady's row, "inf" where Belady copies
    nothing and the policy does."""
    if best is None:
        return "-"
    if best == 0:
        return "1.00" if copies == 0 else "inf"
    return f"{copies / best:.2f}"


def _align(cells: Sequence[str], widths: Sequence[int]) -> list[str]:
    """The first cell padded on the right (names), the others on the left (numbers)."""
    return [cells[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(cells[1:], widths[1:])]


def plot_sweep(results: Sequence[dict], path: str, title: str = "") -> None:
    """Write a PNG of miss rate against slot count, one line per policy (matplotlib, imported here).

    Args:
        results: dicts returned by `sweep`.
        path: the PNG file to write.
        title: a title for the figure, e.g. the trace's name and whether its routing is real.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(6, 4))
    for policy in dict.fromkeys(row["policy"] for row in results):
        points = sorted((row["slots"], row["miss_rate"]) for row in results if row["policy"] == policy)
        axes.plot([slots for slots, _ in points], [rate for _, rate in points], marker="o", label=policy)
    axes.set_xlabel("expert slots")
    axes.set_ylabel("miss rate (accesses served from the host)")
    axes.set_ylim(bottom=0)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    save_png(figure, path, dpi=120)
    pyplot.close(figure)
