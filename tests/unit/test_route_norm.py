"""Recognising an Experts class that normalises each route's output before the weighted sum (Ergo's
form), and nothing else, by running its forward (mira.models.interface.route_norm_of)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from mira.errors import MiraError
from mira.models.interface import check_not_wrapped, is_experts_class, route_norm_of


class RouteScaled(MixtralExperts):
    """Ergo's form under other names: one row per route at unit weight, `route_scale`, then the sum."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        rows = hidden_states.repeat_interleave(top_k_index.shape[1], dim=0)
        ids = top_k_index.reshape(-1, 1)
        out = super().forward(rows, ids, torch.ones_like(ids, dtype=hidden_states.dtype))
        out = self.route_scale(out, ids.flatten()).view(*top_k_index.shape, -1)
        return (out * top_k_weights[..., None]).sum(1)


class NormAfterSum(MixtralExperts):
    """The norm of the weighted sum, not of each route: not Ergo's form."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = super().forward(hidden_states, top_k_index, top_k_weights)
        return self.post_norm(out, top_k_index[:, 0])


class OneWeightForAll(MixtralExperts):
    """Each route normalised, but with the first route's expert for every route."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        rows = hidden_states.repeat_interleave(top_k_index.shape[1], dim=0)
        ids = top_k_index.reshape(-1, 1)
        out = super().forward(rows, ids, torch.ones_like(ids, dtype=hidden_states.dtype))
        first = top_k_index[:, :1].expand_as(top_k_index).reshape(-1)
        return (self.norm(out, first).view(*top_k_index.shape, -1) * top_k_weights[..., None]).sum(1)


class TwoModules(RouteScaled):
    """Ergo's form with a second module of its own after it."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.extra(super().forward(hidden_states, top_k_index, top_k_weights), top_k_index[:, 0])


def test_the_route_norm_form_is_recognised_by_the_name_its_forward_reads():
    assert route_norm_of(RouteScaled) == "route_scale"
    assert is_experts_class(RouteScaled) and is_experts_class(MixtralExperts)
    check_not_wrapped(RouteScaled)
    assert route_norm_of(MixtralExperts) is None  # the interface class itself: nothing to normalise


@pytest.mark.parametrize("cls", [NormAfterSum, OneWeightForAll, TwoModules])
def test_any_other_wrapping_forward_is_refused(cls):
    assert route_norm_of(cls) is None and not is_experts_class(cls)
    with pytest.raises(MiraError, match=f"{cls.__name__} wraps the experts interface's MixtralExperts"):
        check_not_wrapped(cls)


def test_ergos_experts_are_recognised_and_their_norm_is_what_mira_computes():
    modeling = pytest.importorskip("transformers.models.ergo.modeling_ergo")
    assert route_norm_of(modeling.ErgoExperts) == "post_expert_norm"
    assert route_norm_of(modeling.ErgoExpertProjections) is None

