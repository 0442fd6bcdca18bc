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
