"""What a model runs with, and the one place where every "auto" becomes a decision.

`RuntimeConfig` holds the user's choices, with None or "auto" wherever Mira should decide. Pure
functions decide: `resolve_setup` before the store is opened (device, context), `default_dtype` once
the experts' size is known, and `resolve` once the budget's slot count is (policy, residency,
staging). None touches a device or a file, so each is tested on its own; `mira.runtime.engine`
gathers the facts and applies them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mira.cache.budget import parse_size
from mira.cache.config import POLICIES, STAGING_ROWS, CacheConfig
from mira.errors import MiraError
from mira.runtime.threads import usable_cpus
from mira.store.schemes import SCHEMES

PREFETCH = ("auto", "trained", "gate", "off")
RESIDENCY = ("auto", "lagged", "inline")
CPU_EXPERTS = ("auto", "off", "all", "split", "graph")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MAX_CONTEXT = 4096
CPU_BF16_EXPERT_WEIGHTS = 1 << 20  # experts of at least this many weights: a CPU-only run computes in bf16


@dataclass(frozen=True)
class PrefetchConfig:
    """Staging the experts predicted for layer i+2 while layer i runs (paper IV-E).

    mode: "trained" (heads from `mira train-predictor`), "gate" (layer i+2's router applied to
        layer i's input), "auto" (trained when there are heads, else gate) or "off".
    heads: a file of trained heads to use instead of the store's own.
    """

    mode: str = "auto"
    heads: str | None = None


@dataclass(frozen=True)
class ResidencyConfig:
    """When the policy meets a decode layer under a budget.

    mode: "lagged" (after the step: no host sync, missed experts read from pinned memory by the
        kernel, an admitted miss crosses PCIe twice), "inline" (before each layer: one host sync,
        a miss crosses once) or "auto" (see `resolve`).
    deferred: on CUDA a step's settle waits for the next step's start, so the host does generate's
        work on the logits while the step's kernels run; False: right after the step's launch,
        waiting for its kernels (an A/B for `mira bench`).
    """

    mode: str = "auto"
    deferred: bool = True


@dataclass(frozen=True)
class HybridConfig:
    """Missed experts computed on the CPU, from the host store, while the others cross PCIe.

    mode: "auto" (the default: on CUDA under a budget, the calibrated cost model splits each
        layer's misses between the CPU and PCIe, and turns itself off where that would not pay for
        running layers inline (mira.cache.costmodel.cpu_pays), or once the first decode steps have
        measured it not paying (mira.cache.costmodel.share_keeps); on the CPU, off: both sides would
        be the same cores), "split" (auto's split on CUDA wherever there are misses, even where the
        rule judges it does not pay), "all" (every miss the policy leaves in host memory goes to
        the CPU), "graph" (lagged decode steps replayed from CUDA graphs, each layer's share chosen
        on the device for CPU lanes: mira.runtime.graph_share) or "off".
    threads: the CPU worker's compute threads; None: the caller's torch threads less one, at least 1.
    lanes: with "graph", the experts the CPU computes at once, on threads / lanes threads each;
        None: on CUDA one or two, whichever load prices the faster (mira.runtime.graph_share.fastest).
    device_pace: splits price the device's side at the pace decoding measures (on CUDA), as they
        price the CPU's; False: at its calibration (an A/B for `mira bench`).
    """

    mode: str = "auto"
    threads: int | None = None
    lanes: int | None = None
    device_pace: bool = True


@dataclass(frozen=True)
class GraphConfig:
    """enabled: on CUDA, replay decode steps in which no MoE layer needs the host from CUDA graphs.
    ahead: where steps replay, decode one sequence with the next step launched before the host
        reads the last token (mira.runtime.run_ahead); False: transformers' own loop, which reads
        each token first (an A/B for `mira bench`).
    """

    enabled: bool = True
    ahead: bool = True


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and how a model runs; None means "let Mira decide".

    device: "cuda", "cuda:N" or "cpu"; None: CUDA when present.
    dtype: compute dtype of the non-expert weights and activations; None: `default_dtype`.
    vram_budget: bytes of device memory for weights, KV cache, workspaces and expert slots (an int,
        or a size such as "24GiB"), or a share of all experts to give slots beyond the rest ("25%");
        None: free memory less a margin on CUDA, and no slots on the CPU (experts are read in place).
    max_context: tokens of KV cache; None: the model's positions, at most DEFAULT_MAX_CONTEXT.
    quant: expert scheme; None: the store's own, or int8-shared when converting.
    profile: a routing trace (`mira trace`) whose counts place static's experts and give the mira
        policy its prior.
    """

    device: str | None = None
    dtype: str | None = None
    vram_budget: int | str | None = None
    max_context: int | None = None
    quant: str | None = None
    profile: str | None = None
    progress: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    residency: ResidencyConfig = field(default_factory=ResidencyConfig)
    graphs: GraphConfig = field(default_factory=GraphConfig)
    hybrid: HybridConfig = field(default_factory=HybridConfig)

    def __post_init__(self) -> None:
        choices = {"quant": (self.quant, (None, *SCHEMES)), "policy": (self.cache.policy, POLICIES),
                   "prefetch": (self.prefetch.mode, PREFETCH), "residency": (self.residency.mode, RESIDENCY),
                   "dtype": (self.dtype, (None, *DTYPES)), "cpu_experts": (self.hybrid.mode, CPU_EXPERTS)}
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise MiraError(f"unknown {name} {value!r}; choose one of {', '.join(a for a in allowed if a)}")
        budget = self.vram_budget
        if isinstance(budget, str) and budget_share(budget) is None and not budget.strip().endswith("%"):
            try:  # a size such as "24GiB", as --vram-budget takes it
                budget = parse_size(budget)
            except MiraError as error:
                raise MiraError(f"{error}, or a share of the experts like 25%") from None
            object.__setattr__(self, "vram_budget", budget)
        if budget is not None and not (isinstance(budget, str) and budget_share(budget) is not None) and (
                isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
            raise MiraError(f"the VRAM budget {budget!r} is not a positive number of bytes or a share like 25%; "
                            "pass --vram-budget like 12GiB or 25%")
        if self.max_context is not None and (isinstance(self.max_context, bool)
                                             or not isinstance(self.max_context, int) or self.max_context < 1):
            raise MiraError(f"--max-context {self.max_context} is not a positive number of tokens; pass at least 1 "
                            "(the prompt plus the new tokens must fit)")
        switches = {"progress": self.progress, "cuda_graphs": self.graphs.enabled, "decode_ahead": self.graphs.ahead,
                    "deferred_settle": self.residency.deferred, "device_pace": self.hybrid.device_pace}
        for name, value in switches.items():
            if not isinstance(value, bool):
                raise MiraError(f"{name} {value!r} is not a bool; pass True or False")
        threads = self.hybrid.threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise MiraError(f"--cpu-threads {threads} is not a positive number of threads; pass 1 or more")
        if threads is not None and threads > (cpus := len(usable_cpus())):  # as the CLI's parser refuses it
            raise MiraError(f"--cpu-threads {threads} would share {cpus} CPUs and wait on each other; pass at most "
                            f"{cpus}")
        lanes = self.hybrid.lanes
        if lanes is not None and (isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1):
            raise MiraError(f"--cpu-lanes {lanes} is not a positive number of lanes; pass 1 or more")
        if self.hybrid.mode == "graph" and self.residency.mode == "inline":
            raise MiraError("--cpu-experts graph chooses the CPU's misses inside lagged decode steps; pass "
                            "--residency lagged (or auto), or on CUDA --cpu-experts split for the inline share")
        if self.hybrid.mode in ("all", "split") and self.residency.mode == "lagged":
            raise MiraError(f"--cpu-experts {self.hybrid.mode} needs each layer's misses before its kernel, which "
                            "lagged residency settles only after the step; pass --residency inline (or auto), or "
                            "--cpu-experts off")

    def with_overrides(self, **overrides) -> RuntimeConfig:
        """This configuration with `mira.load`'s keyword names applied: the fields above, and
        policy, prefetch (a mode), heads, residency (a mode), cuda_graphs, cpu_experts (a mode),
        cpu_threads, cpu_lanes, device_pace, deferred_settle and decode_ahead for the nested ones.

        Raises:
            MiraError: a name that is not a setting.
        """
        nested = {"policy": ("cache", "policy"), "prefetch": ("prefetch", "mode"), "heads": ("prefetch", "heads"),
                  "residency": ("residency", "mode"), "cuda_graphs": ("graphs", "enabled"),
                  "cpu_experts": ("hybrid", "mode"), "cpu_threads": ("hybrid", "threads"),
                  "cpu_lanes": ("hybrid", "lanes"),
                  "device_pace": ("hybrid", "device_pace"), "deferred_settle": ("residency", "deferred"),
                  "decode_ahead": ("graphs", "ahead")}
        flat = {f.name for f in dataclasses.fields(self)} - {"cache", "prefetch", "residency", "graphs", "hybrid"}
        unknown = sorted(set(overrides) - flat - set(nested))
        if unknown:
            raise MiraError(f"unknown setting {', '.join(unknown)}; choose from {', '.join(sorted(flat | set(nested)))}")
        config = self
        for name, value in overrides.items():
            if name in nested:
                part, attribute = nested[name]
                try:
                    value = dataclasses.replace(getattr(config, part), **{attribute: value})
                except ValueError as error:  # the cache's own checks
                    raise MiraError(str(error)) from None
                name = part
            config = dataclasses.replace(config, **{name: value})
        return config


def budget_share(text: str) -> float | None:
    """The share of all experts a budget like "25%" asks slots for, or None if it is not a share."""
    try:
        share = float(text.strip().removesuffix("%")) / 100 if text.strip().endswith("%") else None
    except ValueError:
        return None
    return share if share is not None and 0 < share <= 1 else None


@dataclass(frozen=True)
class Setup:
    """What `resolve_setup` decides before the store is opened (so a bad setting is refused before
    a conversion)."""

    device: str
    max_context: int


def resolve_setup(config: RuntimeConfig, *, cuda_available: bool, model_positions: int | None) -> Setup:
    """Device and context: CUDA when present; the model's positions up to DEFAULT_MAX_CONTEXT.

    Raises:
        MiraError: an explicit max_context beyond the model's positions.
    """
    device = config.device or ("cuda" if cuda_available else "cpu")
    positions = model_positions or 1 << 30
    if config.max_context is not None and config.max_context > positions:
        raise MiraError(f"--max-context {config.max_context} is beyond the {positions} positions this model was made "
                        f"for; pass --max-context {positions} or less")
    return Setup(device, config.max_context or min(DEFAULT_MAX_CONTEXT, positions))


def default_dtype(device: str, expert_weights: int) -> str:
    """The compute dtype where none is asked for: bf16 on CUDA and, on the CPU, for experts of at
    least CPU_BF16_EXPERT_WEIGHTS, whose products then dominate a step and go through the CPU executor
    reading the quantized bytes once (mira.kernels.CpuMoEFFN); float32 for smaller experts, where it
    costs little and computes exactly what the store holds (the reference). By weights, not bytes,
    so that every scheme of one checkpoint computes in the same dtype."""
    on_cpu = device.split(":")[0] == "cpu"  # "cpu" or "cpu:0"
    return "float32" if on_cpu and expert_weights < CPU_BF16_EXPERT_WEIGHTS else "bfloat16"


@dataclass(frozen=True)
class Facts:
    """What `resolve` needs to know about the machine, the model and the budget.

    device_type: "cuda" or "cpu".
    capacity: expert slots the budget gives.
    total_experts: experts over all MoE layers.
    fused_kernels: the expert FFN reads blobs by address (so misses can be read in place on CUDA).
    admits_misses: the configured policy admits missed experts into slots (mira.cache.policy).
    stage_slots: STAGE slots the configured policy would keep at `capacity`.
    has_heads: trained predictor heads are at hand (beside the store, or given).
    speculates: gate speculation recomputes the model's routers (mira.predict.baselines.speculates);
        both predictors need it.
    runs_once: every MoE layer runs once a forward (not so in a looped model's core); staging two
        layers ahead needs it.
    cpu_pays: by the calibrated cost model, a CPU share pays for running layers inline
        (mira.cache.costmodel.cpu_pays; False where nothing was calibrated).
    """

    device_type: str
    capacity: int
    total_experts: int
    fused_kernels: bool
    admits_misses: bool
    stage_slots: int
    has_heads: bool
    speculates: bool = True
    runs_once: bool = True
    cpu_pays: bool = False


@dataclass(frozen=True)
class Decisions:
    """policy: the policy that runs (static, placing every expert, when all fit).
    lagged: decode layers under the budget meet the cache after the step (mira.cache.tables).
    predictor: "trained", "gate", or None for no staging.
    policy_slots: slots the policy manages (staging keeps STAGING_ROWS of the capacity).
    cpu_experts: which misses the CPU computes: "all", "split" (by the cost model), "graph" (CPU
        lanes, chosen on the device in lagged decode calls) or None (none).
    share_review: auto's split, where lagged residency could run without it: decoding judges the
        share again at the paces it measures, and drops it for lagged residency where it keeps not
        paying (mira.runtime.engine.MiraModel).
    """

    policy: str
    lagged: bool
    predictor: str | None
    policy_slots: int
    cpu_experts: str | None = None
    share_review: bool = False


def resolve(config: RuntimeConfig, facts: Facts) -> Decisions:
    """Every "auto" of the cache, residency and prefetch settings, decided.

    Every expert fitting, all are resident for good and layers lag: they only count their tokens.
    Under a budget, residency "auto" lags on CUDA whenever the fused kernels can read missed experts
    from pinned memory (no host sync, so decode steps replay as CUDA graphs), and on the CPU only
    for policies that never admit a miss, which lose nothing by it. Staging
    needs STAGE slots and a predictor; lagged, "auto" prefetching stages only when residency is
    "lagged" by name, since under "auto" residency decoding measured faster without it, only
    for routers gate speculation recomputes, and only where each MoE layer runs once a forward.

    Missed experts go to the CPU with cpu_experts "all" or "split", and with "auto" on CUDA where
    the calibration says the CPU pays, unless residency is "lagged" by name. A layer must then know
    its misses before its kernel, so residency is inline (the CPU's share outweighs the host sync), and
    "auto" prefetching does not stage beside auto's CPU share (inline staging measured no gain).
    Under "auto" residency, auto's share is judged again once decoding has measured its paces.
    With cpu_experts "graph" the device chooses the CPU's misses inside decode steps, which lag.

    Raises:
        MiraError: prefetch "gate" or "trained" without STAGE slots, for routers gate speculation
            does not recompute, or for a looped model; "trained" where there are no heads;
            cpu_experts "split" off CUDA; "graph" on CUDA without the fused kernels.
    """
    if facts.capacity >= facts.total_experts:  # all resident for good: nothing to decide inside a step
        return Decisions("static", True, None, facts.capacity)
    mode = config.residency.mode
    cpu_experts = _cpu_experts(config, facts)
    possible = facts.device_type == "cpu" or facts.fused_kernels
    if cpu_experts == "graph" and not possible:
        raise MiraError("--cpu-experts graph needs lagged residency, which on CUDA needs the fused kernels; "
                        "pass --cpu-experts split (or auto)")
    lagged = possible and mode != "inline" and (cpu_experts == "graph" or cpu_experts is None and (
        mode == "lagged" or not facts.admits_misses or facts.device_type == "cuda"))
    prefetch = config.prefetch.mode
    if prefetch in ("gate", "trained") and facts.stage_slots == 0:
        policy = config.cache.policy
        lacking, fix = (f"the {policy} policy has none", "pass --policy mira") if policy != "mira" else \
            ("a budget of one slot leaves none", "pass a larger --vram-budget")
        raise MiraError(f"--prefetch {prefetch} stages experts through the mira policy's STAGE slots, and {lacking}; "
                        f"{fix}, or leave out --prefetch")
    stages = facts.stage_slots > 0 and prefetch != "off" and (
        prefetch != "auto" or mode == "lagged" or (not lagged and cpu_experts != "split"))
    if stages and not facts.speculates:
        if prefetch != "auto":
            raise MiraError(f"--prefetch {prefetch} needs gate speculation, which does not recompute this model's "
                            "routers; pass --prefetch off (or auto)")
        stages = False
    if stages and not facts.runs_once:
        if prefetch != "auto":
            raise MiraError(f"--prefetch {prefetch} stages experts two layers ahead, which needs each MoE layer to run "
                            "once a forward, and this model runs a looped core of layers several times; pass "
                            "--prefetch off (or auto)")
        stages = False
    if stages and prefetch == "trained" and not facts.has_heads:
        raise MiraError("the store has no trained predictor heads; run `mira train-predictor` with this --model and "
                        "--quant, or pass --prefetch gate (mira bench --heads and mira.load(heads=) take them from a "
                        "file)")
    predictor = ("trained" if prefetch == "trained" or (prefetch == "auto" and facts.has_heads) else "gate") \
        if stages else None
    slots = facts.capacity - STAGING_ROWS if stages else facts.capacity
    review = cpu_experts == "split" and config.hybrid.mode == "auto" and mode == "auto" and possible
    return Decisions(config.cache.policy, lagged, predictor, slots, cpu_experts, review)


def refuse_split_off_cuda(mode: str, device_type: str) -> None:
    """Raises MiraError for cpu_experts "split" on a device other than CUDA, naming the fix."""
    if mode == "split" and device_type != "cuda":
        raise MiraError("--cpu-experts split weighs the CPU against PCIe, and on the CPU both sides would be the same "
                        "cores; pass --cpu-experts all (or auto, which stays off there)")


def _cpu_experts(config: RuntimeConfig, facts: Facts) -> str | None:
    """`Decisions.cpu_experts` under a budget (see `resolve`)."""
    mode = config.hybrid.mode
    if mode in ("all", "graph"):
        return mode
    refuse_split_off_cuda(mode, facts.device_type)
    if mode == "split" or (mode == "auto" and facts.device_type == "cuda" and facts.cpu_pays
                           and config.residency.mode != "lagged"):
        return "split"
    return None
