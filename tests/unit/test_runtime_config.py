"""`resolve_setup`, `default_dtype` and `resolve`: every "auto" of a RuntimeConfig decided, from plain facts, by hand-worked cases."""

import pytest

from mira.cache.config import CacheConfig
from mira.errors import MiraError
from mira.runtime.threads import usable_cpus
from mira.runtime.config import (CPU_BF16_EXPERT_WEIGHTS, DEFAULT_MAX_CONTEXT, STAGING_ROWS, Decisions, Facts,
                                 PrefetchConfig, RuntimeConfig, default_dtype, resolve, resolve_setup)


def _facts(**changes) -> Facts:
    facts = dict(device_type="cuda", capacity=40, total_experts=96, fused_kernels=True, admits_misses=True,
                 stage_slots=8, has_heads=False)
    return Facts(**{**facts, **changes})


def _decide(residency="auto", prefetch="off", policy="mira", cpu_experts="auto", **facts) -> Decisions:
    config = RuntimeConfig().with_overrides(residency=residency, prefetch=prefetch, policy=policy,
                                            cpu_experts=cpu_experts)
    return resolve(config, _facts(**facts))


def test_setup_defaults_follow_the_device_and_the_model():
    cuda = resolve_setup(RuntimeConfig(), cuda_available=True, model_positions=32768)
    assert (cuda.device, cuda.max_context) == ("cuda", 4096)
    cpu = resolve_setup(RuntimeConfig(), cuda_available=False, model_positions=512)
    assert (cpu.device, cpu.max_context) == ("cpu", 512)
    assert resolve_setup(RuntimeConfig(), cuda_available=False, model_positions=None).max_context == DEFAULT_MAX_CONTEXT
    chosen = resolve_setup(RuntimeConfig(device="cpu", max_context=100), cuda_available=True, model_positions=512)
    assert (chosen.device, chosen.max_context) == ("cpu", 100)
    with pytest.raises(MiraError, match="beyond the 512 positions"):
        resolve_setup(RuntimeConfig(max_context=513), cuda_available=False, model_positions=512)


def test_the_default_dtype_is_bf16_but_for_small_experts_on_the_cpu():
    assert default_dtype("cuda", 1) == default_dtype("cuda:1", 1) == "bfloat16"
    assert default_dtype("cpu", CPU_BF16_EXPERT_WEIGHTS) == "bfloat16"
    assert default_dtype("cpu", CPU_BF16_EXPERT_WEIGHTS - 1) == default_dtype("cpu:0", 1) == "float32"


def test_auto_residency_lags_on_cuda_with_the_fused_kernels_and_not_on_the_cpu():
    assert _decide().lagged
    assert not _decide(device_type="cpu").lagged
    assert not _decide(fused_kernels=False).lagged and _decide(fused_kernels=False, device_type="cpu",
                                                               residency="lagged").lagged


def test_policies_that_never_admit_a_miss_lag_under_a_budget_on_either_device():
    assert _decide(policy="static", admits_misses=False, device_type="cpu").lagged
    assert _decide(policy="on-demand", admits_misses=False).lagged
    assert not _decide(policy="static", admits_misses=False, residency="inline").lagged


def test_every_expert_fitting_makes_a_static_placement_lagged_and_never_staged():
    assert _decide(capacity=96, prefetch="gate", residency="inline") == Decisions("static", True, None, 96)


@pytest.mark.parametrize("residency", ["auto", "inline"])
def test_inline_models_stage_whenever_a_predictor_may_run(residency):
    inline = dict(residency=residency, device_type="cpu")
    assert _decide(prefetch="auto", **inline).predictor == "gate"
    assert _decide(prefetch="auto", has_heads=True, **inline).predictor == "trained"
    assert _decide(prefetch="off", **inline).predictor is None
    assert _decide(prefetch="auto", stage_slots=0, **inline).predictor is None  # LRU, static: no STAGE
    for policy in ("lru", "static"):
        with pytest.raises(MiraError, match=f"and the {policy} policy has none; pass --policy mira"):
            _decide(prefetch="gate", policy=policy, stage_slots=0, **inline)
    assert _decide(prefetch="gate", **inline).policy_slots == 40 - STAGING_ROWS  # staging keeps its rows


def test_lagged_models_stage_on_the_device_only_for_a_named_predictor_or_residency():
    assert _decide(prefetch="auto").predictor is None  # measured faster without
    assert _decide(prefetch="gate") == Decisions("mira", True, "gate", 40 - STAGING_ROWS)
    assert _decide(prefetch="auto", residency="lagged", has_heads=True).predictor == "trained"
    with pytest.raises(MiraError, match="no trained predictor heads"):
        _decide(prefetch="trained")


def test_routers_gate_speculation_cannot_recompute_get_no_staging_unless_asked():
    inline = dict(residency="inline", device_type="cpu", speculates=False)
    assert _decide(prefetch="auto", **inline).predictor is None
    assert _decide(prefetch="auto", has_heads=True, **inline) == Decisions("mira", False, None, 40)
    with pytest.raises(MiraError, match="--prefetch off"):
        _decide(prefetch="gate", **inline)
    with pytest.raises(MiraError, match="--prefetch off"):
        _decide(prefetch="trained", has_heads=True, **inline)
    assert _decide(prefetch="gate", capacity=96, speculates=False).predictor is None  # all resident: nothing staged


def test_a_looped_model_gets_no_staging_unless_asked_and_then_a_refusal():
    inline = dict(residency="inline", device_type="cpu", runs_once=False)
    assert _decide(prefetch="auto", has_heads=True, **inline) == Decisions("mira", False, None, 40)
    assert _decide(prefetch="auto", has_heads=True, residency="inline", device_type="cpu").predictor == "trained"
    for prefetch in ("gate", "trained"):
        with pytest.raises(MiraError, match="looped core.*--prefetch off"):
            _decide(prefetch=prefetch, has_heads=True, **inline)


def test_overrides_reach_the_nested_settings_and_unknown_names_are_refused():
    config = RuntimeConfig().with_overrides(policy="lru", prefetch="gate", heads="h.safetensors", residency="inline",
                                            cuda_graphs=False, vram_budget="25%")
    assert config.cache == CacheConfig(policy="lru") and config.prefetch == PrefetchConfig("gate", "h.safetensors")
    assert (config.residency.mode, config.graphs.enabled, config.vram_budget) == ("inline", False, "25%")
    with pytest.raises(MiraError, match="unknown setting polcy"):
        RuntimeConfig().with_overrides(polcy="lru")


@pytest.mark.parametrize("settings, message", [
    (dict(policy="fifo"), "unknown policy 'fifo'"), (dict(residency="late"), "choose one of auto, lagged, inline"),
    (dict(quant="int3"), "unknown quant"), (dict(vram_budget=0), "not a positive number of bytes"),
    (dict(vram_budget="150%"), "or a share like 25%"), (dict(max_context=0), "not a positive number of tokens"),
    (dict(vram_budget="lots"), "cannot read the size 'lots'; write it like 24GiB, .*, or a share of the experts like 25%"),
    (dict(cpu_experts="some"), "unknown cpu_experts 'some'; choose one of auto, off, all, split"),
    (dict(cpu_threads=0), "--cpu-threads 0 is not a positive"), (dict(cpu_threads=-2), "--cpu-threads -2"),
    (dict(cpu_threads=1.5), "--cpu-threads 1.5"),
    (dict(cpu_threads=len(usable_cpus()) + 1), f"would share {len(usable_cpus())} CPUs"),
    (dict(cpu_experts="all", residency="lagged"), "pass --residency inline"),
    (dict(cpu_experts="split", residency="lagged"), "--cpu-experts split needs each layer's misses"),
])
def test_bad_settings_are_refused_with_the_fix(settings, message):
    with pytest.raises(MiraError, match=message):
        RuntimeConfig().with_overrides(**settings)


def test_the_cpu_takes_misses_with_all_and_where_the_calibration_says_it_pays_and_layers_then_run_inline():
    assert _decide(cpu_experts="all") == Decisions("mira", False, None, 40, "all")  # auto residency: inline
    assert _decide(cpu_experts="all", device_type="cpu", policy="on-demand", admits_misses=False).cpu_experts == "all"
    assert not _decide(cpu_experts="all", device_type="cpu", policy="on-demand", admits_misses=False).lagged
    assert _decide(cpu_pays=True) == Decisions("mira", False, None, 40, "split", share_review=True)
    assert _decide(cpu_pays=False) == Decisions("mira", True, None, 40, None)  # auto off: lagged as before
    assert _decide(cpu_pays=True, residency="lagged") == Decisions("mira", True, None, 40, None)  # lagged by name
    assert _decide(cpu_pays=True, residency="inline").cpu_experts == "split"
    assert _decide(cpu_pays=True, device_type="cpu").cpu_experts is None  # on the CPU both sides are the same cores
    assert _decide(cpu_pays=True, cpu_experts="off") == Decisions("mira", True, None, 40, None)
    assert _decide(cpu_pays=False, cpu_experts="split") == Decisions("mira", False, None, 40, "split")  # rule ignored
    assert _decide(cpu_experts="split", capacity=96).cpu_experts is None  # all resident: no misses
    with pytest.raises(MiraError, match="pass --cpu-experts all"):
        _decide(cpu_experts="split", device_type="cpu")
    assert _decide(cpu_experts="all", capacity=96).cpu_experts is None  # all resident: no misses
    assert _decide(cpu_experts="all", prefetch="gate") == Decisions("mira", False, "gate", 40 - STAGING_ROWS, "all")


def test_only_autos_share_under_auto_residency_with_fused_kernels_is_judged_again_in_decoding():
    assert _decide(cpu_pays=True).share_review
    assert not _decide(cpu_pays=True, residency="inline").share_review  # inline by name stays inline
    assert not _decide(cpu_experts="split").share_review  # the split by name, regardless of the rule
    assert not _decide(cpu_experts="all").share_review
    assert not _decide(cpu_pays=True, fused_kernels=False).share_review  # lagged could not read misses


def test_generates_defaults_take_the_cpu_where_it_pays_and_then_stage_nothing():
    default = RuntimeConfig()  # what `mira generate` runs with no flags
    assert (default.hybrid.mode, default.prefetch.mode, default.residency.mode) == ("auto", "auto", "auto")
    assert resolve(default, _facts(cpu_pays=True)) == Decisions("mira", False, None, 40, "split", share_review=True)
    assert resolve(default, _facts(cpu_pays=False)) == Decisions("mira", True, None, 40, None)
    # staging named, or inline by name without a CPU share, as before
    assert _decide(cpu_pays=True, prefetch="gate") == Decisions("mira", False, "gate", 40 - STAGING_ROWS, "split",
                                                                share_review=True)
    assert _decide(residency="inline", prefetch="auto", cpu_experts="off") == Decisions(
        "mira", False, "gate", 40 - STAGING_ROWS, None)
    assert _decide(residency="inline", prefetch="auto", cpu_pays=True).predictor is None
