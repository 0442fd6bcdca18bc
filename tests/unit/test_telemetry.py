"""The cache's token-level telemetry, per layer: hand-worked counts."""

import numpy as np

from mira.cache.policy import Tier
from mira.cache.telemetry import Telemetry


def test_layer_misses_counts_each_layers_routed_tokens_and_those_from_the_host_store():
    telemetry = Telemetry(num_layers=2, num_experts=3)
    telemetry.record(0, 1, 4, Tier.HOT)
    telemetry.record(0, 2, 3, Tier.MISS)
    telemetry.record(1, 0, 5, Tier.STAGE)
    telemetry.record_layers(np.array([[1, 0, 2], [0, 6, 0]]), Tier.MISS)
    assert telemetry.layer_misses().tolist() == [[4 + 3 + 1 + 2, 3 + 1 + 2], [5 + 6, 6]]
