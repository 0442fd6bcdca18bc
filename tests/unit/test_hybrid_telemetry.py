"""The hybrid's per-layer telemetry (mira.cache.telemetry.HybridTelemetry) on hand-worked calls."""

import pytest

from mira.cache.telemetry import HybridTelemetry


def test_the_later_side_is_what_the_prediction_is_held_against_where_the_device_side_was_timed():
    """Layer 1, two calls: the CPU's side 3 ms and 2 ms, the device's 2 ms and 4 ms; so the later
    sides are 3 and 4 ms. Predicted (later, CPU, device) (3.5, 3.5, 3) and (3.5, 2, 3.5): the later
    side predicted over the later side measured is 7 / 7 = 1, over the CPU's side alone 7 / 5."""
    telemetry = HybridTelemetry(num_layers=2)
    telemetry.record(1, experts=1, tokens=1, measured_s=3e-3, compute_s=2.5e-3, predicted=(3.5e-3, 3.5e-3, 3e-3),
                     device_s=2e-3)
    telemetry.record(1, experts=0, tokens=1, measured_s=2e-3, compute_s=1.5e-3, predicted=(3.5e-3, 2e-3, 3.5e-3),
                     cut_share=0.5, device_s=4e-3)
    summary = telemetry.summary()
    assert summary["calls"] == 2 and summary["cuts"] == 1 and summary["cut_share"] == 0.5
    (layer,) = summary["layers"]
    assert layer["layer"] == 1 and layer["measured_ms"] == pytest.approx(2.5)
    assert layer["device_ms"] == pytest.approx(3.0) and layer["served_ms"] == pytest.approx(3.5)
    assert layer["predicted_device_ms"] == pytest.approx(3.25)
    assert layer["predicted_over_served"] == pytest.approx(1.0)
    assert layer["predicted_over_measured"] == pytest.approx(1.4)


def test_without_a_timed_device_side_there_is_no_later_side():
    telemetry = HybridTelemetry(num_layers=1)
    telemetry.record(0, experts=2, tokens=2, measured_s=1e-3, compute_s=1e-3, predicted=None)
    (layer,) = telemetry.summary()["layers"]
    assert not {"device_ms", "served_ms", "predicted_ms", "predicted_over_served"} & layer.keys()


def test_paced_jobs_are_grouped_by_kind_with_their_calibrated_and_measured_cpu_side():
    """Five paced jobs and one that no pace learnt from: two of one whole expert (3 ms calibrated,
    3.6 and 4.2 measured: 1.3x), a cut alone at 13% of the units (1 against 2.5 ms), one at half (2
    against 2.4 ms) and four whole experts (12 against 13.2 ms); the unpaced job is left out. Each
    job's worker computed for all but 0.4 ms of its CPU side."""
    telemetry = HybridTelemetry(num_layers=2)
    calls = [(0, 1, 0.0, 3.6e-3, 3e-3), (1, 1, 0.0, 4.2e-3, 3e-3), (0, 0, 0.13, 2.5e-3, 1e-3),
             (1, 0, 0.5, 2.4e-3, 2e-3), (0, 4, 0.0, 13.2e-3, 12e-3), (1, 2, 0.0, 9e-3, 0.0)]
    for layer, experts, cut_share, measured, calibrated in calls:
        telemetry.record(layer, experts=experts, tokens=1, measured_s=measured, compute_s=measured - 0.4e-3,
                         predicted=None, cut_share=cut_share, calibrated_cpu_s=calibrated)
    rows = [(job["whole_experts"], job["cut_share"], job["jobs"], job["calibrated_ms"], job["measured_ms"],
             job["measured_over_calibrated"], job["compute_ms"]) for job in telemetry.summary()["jobs"]]
    assert rows == [("0", "0.0-0.2", 1, 1.0, 2.5, 2.5, 2.1), ("0", "0.4-0.6", 1, 2.0, 2.4, 1.2, 2.0),
                    ("1", None, 2, 3.0, 3.9, 1.3, 3.5), ("3+", None, 1, 12.0, 13.2, 1.1, 12.8)]
