"""Training-free predictors (paper IV-E): gate speculation against float64 arithmetic with the
model's own router weights; previous step and popularity against hand-worked cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import mira
from mira.predict.baselines import GateSpeculation, Popularity
from mira.runtime.experts import model_routers
from tiny_models import CONFIGS, FAMILIES


def test_gate_speculation_is_layer_i_plus_2s_router_on_layer_is_input(checkpoints):
    model = mira.load(checkpoints["mixtral"], device="cpu", progress=False)  # 3 MoE layers, top-2 of 8
    speculation = GateSpeculation(model_routers(model.hf_model), model.store.num_experts)
    assert speculation.routers == [layer.mlp.gate for layer in model.hf_model.model.layers]
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))  # [T, H]
    got = speculation.scores(0, hidden)

    weight = model.hf_model.model.layers[2].mlp.gate.weight.detach().double()  # [E, H] of layer 0 + 2
    probability = torch.softmax(hidden.double() @ weight.T, -1)  # [T, E]
    routed = torch.topk(probability, 2, dim=-1).indices  # [T, K]
    mass = torch.bincount(routed.reshape(-1), minlength=8).double() / routed.numel()
    expected = mass + probability.mean(0) / (2 * routed.numel())
    np.testing.assert_allclose(got.double().numpy(), expected.numpy(), atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_gate_speculation_chooses_what_every_familys_router_chooses(family):
    """RouterRule redoes each router's arithmetic out of place (softmax, or sigmoid plus the
    score-correction bias; DeepSeek's group limits): the scores follow from the router's own
    choice and logits, for a call within the buffers made once and for a larger one."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[family](), dtype=torch.float32).eval()
    router = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")][-1]
    experts = router.weight.shape[0]
    with torch.no_grad():
        router.weight.normal_()  # decisive, as in the tiny checkpoints
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.normal_(0.0, 0.1)
        speculation = GateSpeculation([router] * 3, experts, max_tokens=4)
        for tokens in (3, 9):
            hidden = torch.randn(tokens, 64)
            logits, _, chosen = router(hidden)  # [T, E], [T, K]
            mass = torch.bincount(chosen.reshape(-1), minlength=experts).double() / chosen.numel()
            expected = mass + torch.softmax(logits.double(), -1).mean(0) / (2 * chosen.numel())
            np.testing.assert_allclose(speculation.scores(0, hidden).double().numpy(), expected.numpy(), atol=1e-6)


def test_gate_speculation_bypasses_hooks_on_the_routers(checkpoints):
    model = mira.load(checkpoints["mixtral"], device="cpu", progress=False)
    calls = []
    router = model_routers(model.hf_model)[2]
    handle = router.register_forward_hook(lambda *args: calls.append(1))
    GateSpeculation(model_routers(model.hf_model), model.store.num_experts).scores(0, torch.randn(3, 64))
    handle.remove()
    assert calls == []


def test_popularity_ranks_by_the_profile_of_the_target_layer():
    counts = np.array([[9, 0, 0], [0, 9, 0], [1, 5, 4]])
    popularity = Popularity(counts)
    assert popularity.scores(0).tolist() == pytest.approx([0.1, 0.5, 0.4])
    popularity.observe(2, torch.tensor([[0, 0]]))  # fixed: observing changes nothing
    assert popularity.scores(0).tolist() == pytest.approx([0.1, 0.5, 0.4])


def _first_router(family: str, seed: int = 0):
    from mira.models.loader import router_of
    from mira.models.interface import uses_experts_interface
    from tiny_families import tiny_config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32)
    return next(router_of(module) for module in model.modules()
                if any(uses_experts_interface(type(child)) for child in module.children()))


def _offered(*families: str) -> list[str]:
    from mira.models.interface import moe_families

    offered = {family.model_type for family in moe_families()}
    return [family for family in families if family in offered]


@pytest.mark.parametrize("family", _offered("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"))
def test_speculation_is_trusted_where_it_picks_the_routers_own_experts(family):
    """gpt-oss's router adds a bias to its logits: the rule adds it too, and picks the same experts."""
    from mira.predict.baselines import speculates

    router = _first_router(family)
    if family == "gpt_oss":
        with torch.no_grad():
            router.bias.normal_(0.0, 3.0)  # large enough to change the choice if it were left out
    assert speculates(router)


@pytest.mark.parametrize("family", _offered("zaya", "hunyuan_v1_moe", "afmoe"))
def test_speculation_is_refused_where_the_router_has_no_rule(family):
    from mira.predict.baselines import speculates

    assert not speculates(_first_router(family))


def test_speculation_is_refused_where_the_router_selects_otherwise():
    """A router with the weight and top_k of a known rule whose choice differs (here: the lowest
    logits) is caught by the probe, not trusted by its attributes."""
    from mira.predict.baselines import speculates

    router = _first_router("mixtral").eval()
    assert speculates(router)
    own = router.forward
    router.forward = lambda hidden: own(-hidden)
    assert not speculates(router)
