"""`auto` residency: lagged where it measured faster, inline where it did not (mira.runtime.residency).
The blob sizes are the int8-shared experts of the three shapes the H200 benches ran."""

import pytest
import torch

from mira.errors import MiraError
from mira.runtime.residency import lags

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")
QWEN3, DEEPSEEK, MIXTRAL = 4_722_688, 8_654_848, 176_168_960  # bytes: 86 us, 157 us, 3.2 ms at 55 GB/s


def _lags(residency="auto", prefetch="auto", *, admits_misses=True, stage_slots=4, under_budget=True, device=CUDA,
          fused_kernels=True, blob_bytes=QWEN3):
    return lags(residency, prefetch, admits_misses=admits_misses, stage_slots=stage_slots,
                under_budget=under_budget, device=device, fused_kernels=fused_kernels, blob_bytes=blob_bytes)


def test_auto_lags_small_experts_on_cuda_and_keeps_large_ones_inline():
    assert _lags(blob_bytes=QWEN3) and _lags(blob_bytes=DEEPSEEK)
    assert not _lags(blob_bytes=MIXTRAL)
    assert _lags(blob_bytes=55_000_000) and not _lags(blob_bytes=55_000_001)  # 1 ms at 55 GB/s, the threshold
    assert _lags(prefetch="off", stage_slots=0, blob_bytes=QWEN3) and not _lags(prefetch="off", blob_bytes=MIXTRAL)


def test_auto_stays_inline_when_a_predictor_is_named_or_on_the_cpu():
    assert not _lags(prefetch="gate") and not _lags(prefetch="trained")
    assert _lags(prefetch="gate", stage_slots=0)  # a policy without STAGE slots stages nothing: no predictor
    assert not _lags(device=CPU, blob_bytes=QWEN3)


def test_policies_that_never_admit_a_miss_always_lag_under_a_budget():
    for device, blob_bytes in ((CUDA, MIXTRAL), (CPU, QWEN3)):
        assert _lags(admits_misses=False, stage_slots=0, device=device, blob_bytes=blob_bytes)


def test_nothing_lags_with_every_expert_resident_without_the_fused_kernels_or_when_told_inline():
    assert not _lags(under_budget=False, admits_misses=False)
    assert not _lags(fused_kernels=False) and _lags(fused_kernels=False, device=CPU, residency="lagged")
    assert not _lags(residency="inline", admits_misses=False)


def test_lagged_when_told_also_with_a_predictor_and_an_unknown_residency_is_refused():
    assert _lags(residency="lagged", blob_bytes=MIXTRAL)
    assert _lags(residency="lagged", prefetch="gate", blob_bytes=MIXTRAL)  # staged on the device
    assert not _lags(prefetch="gate")  # "auto" keeps a named predictor inline
    with pytest.raises(MiraError, match="choose one of auto, lagged, inline"):
        _lags(residency="late")
