"""One gating for every MoE layer: a family whose layers gate with different constants is refused
(mira.models.spec.refuse_per_layer_gating), since Mira computes one gating per model."""

import pytest
from torch import nn

from mira.errors import MiraError
from mira.models.spec import refuse_per_layer_gating


class _Experts(nn.Module):
    """Stands in for an Experts module with a clamped SwiGLU's constants."""

    def __init__(self, limit: float | None, alpha: float = 1.702):
        super().__init__()
        self.limit, self.alpha = limit, alpha


def test_layers_that_gate_alike_pass_and_per_layer_limits_are_refused_naming_them():
    refuse_per_layer_gating({1: _Experts(7.0), 2: _Experts(7.0), 3: _Experts(7.0)})
    refuse_per_layer_gating({0: nn.Module(), 1: nn.Module()})  # no constants at all
    with pytest.raises(MiraError, match=r"layer 1: alpha=1.702, limit=None; layer 2: alpha=1.702, limit=7.0"):
        refuse_per_layer_gating({2: _Experts(7.0), 1: _Experts(None)}, "ling")
    with pytest.raises(MiraError, match="^ling gates its MoE layers with different constants"):
        refuse_per_layer_gating({1: _Experts(7.0), 2: _Experts(7.0, alpha=1.0)}, "ling")
