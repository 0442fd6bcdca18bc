"""`auto` residency: lagged on CUDA with the fused kernels, and for policies that never admit a
miss; and whether a model stages predicted experts (mira.runtime.residency)."""

import pytest
import torch

from mira.errors import MiraError
from mira.runtime.residency import lags, stages

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")
def _lags(residency="auto", *, admits_misses=True, under_budget=True, device=CUDA, fused_kernels=True):
    return lags(residency, admits_misses=admits_misses, under_budget=under_budget, device=device,
                fused_kernels=fused_kernels)


def test_auto_lags_on_cuda_with_the_fused_kernels():
    assert _lags()


def test_auto_stays_inline_on_the_cpu_for_policies_that_admit_misses():
    assert not _lags(device=CPU)


def test_policies_that_never_admit_a_miss_always_lag_under_a_budget():
    for device in (CUDA, CPU):
        assert _lags(admits_misses=False, device=device)


def test_nothing_lags_with_every_expert_resident_without_the_fused_kernels_or_when_told_inline():
    assert not _lags(under_budget=False, admits_misses=False)
    assert not _lags(fused_kernels=False) and _lags(fused_kernels=False, device=CPU, residency="lagged")
    assert not _lags(residency="inline", admits_misses=False)


def test_lagged_when_told_and_an_unknown_residency_is_refused():
    assert _lags(residency="lagged", device=CPU)
    with pytest.raises(MiraError, match="choose one of auto, lagged, inline"):
        _lags(residency="late")


@pytest.mark.parametrize("residency", ["auto", "inline", "lagged"])
def test_inline_models_stage_whenever_a_predictor_may_run(residency):
    assert stages("auto", residency, lagged=False, stage_slots=4)
    assert stages("gate", residency, lagged=False, stage_slots=4) and stages("trained", residency, False, 4)
    assert not stages("off", residency, lagged=False, stage_slots=4)
    assert not stages("gate", residency, lagged=False, stage_slots=0)  # no STAGE slots (LRU, static)


def test_lagged_models_stage_on_the_device_only_for_a_named_predictor_or_residency():
    assert stages("gate", "auto", lagged=True, stage_slots=4) and stages("trained", "auto", True, 4)
    assert not stages("auto", "auto", lagged=True, stage_slots=4)  # measured faster without
    assert stages("auto", "lagged", lagged=True, stage_slots=4)
    assert not stages("off", "lagged", lagged=True, stage_slots=4)
    assert not stages("gate", "lagged", lagged=True, stage_slots=0)
