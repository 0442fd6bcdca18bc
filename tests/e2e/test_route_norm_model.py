"""A model whose experts normalise each route's output with their own weights before the weighted
sum (Ergo's form), built from Mixtral's classes so that it runs with any transformers: Mira's logits
equal transformers' on the CPU, and on CUDA its greedy text is the CPU path's, steps replayed from
CUDA graphs under a budget that leaves experts in host memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.models.mixtral import modeling_mixtral

import mira
from mira.store.convert import convert
from tiny_families import VOCAB, family_checkpoint

GREEDY = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)


class ExpertRMSNorm(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(config.num_local_experts, config.hidden_size))
        self.eps = config.rms_norm_eps

    def forward(self, rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(rows.float(), (rows.shape[-1],), eps=self.eps) * self.weight[expert_ids]).to(rows.dtype)


def _route_normed(experts_class: type) -> type:
    class RouteNormed(experts_class):
        def __init__(self, config):
            super().__init__(config)
            self.route_norm = ExpertRMSNorm(config)

        def forward(self, hidden_states, top_k_index, top_k_weights):
            rows = hidden_states.repeat_interleave(top_k_index.shape[1], dim=0)
            ids = top_k_index.reshape(-1, 1)
            out = super().forward(rows, ids, hidden_states.new_ones(ids.shape))
            out = self.route_norm(out, ids.flatten()).view(*top_k_index.shape, -1)
            return (out * top_k_weights[..., None]).sum(1).to(hidden_states.dtype)

    # where the model's code finds its Experts class, under that class's name
    RouteNormed.__module__, RouteNormed.__name__, RouteNormed.__qualname__ = (
        experts_class.__module__, experts_class.__name__, experts_class.__qualname__)
    return RouteNormed


@pytest.fixture
def route_normed_mixtral(monkeypatch, tmp_path):
    """A tiny Mixtral checkpoint whose experts are wrapped so, every expert's norm weights its own."""
    monkeypatch.setattr(modeling_mixtral, "MixtralExperts", _route_normed(modeling_mixtral.MixtralExperts))
    checkpoint = family_checkpoint("mixtral", tmp_path / "ckpt")  # random experts and norms (".experts.")
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    norms = [p for name, p in reference.named_parameters() if name.endswith("experts.route_norm.weight")]
    assert norms and all(p.std() > 0 for p in norms)
    store = tmp_path / "store"
    convert(checkpoint, store, "int8-shared", progress=False)
    return checkpoint, store, reference


def test_mira_computes_the_route_normed_model_as_transformers_does(route_normed_mixtral, tmp_path):
    checkpoint, _, reference = route_normed_mixtral
    convert(checkpoint, tmp_path / "exact", "none", progress=False)
    model = mira.load(tmp_path / "exact", device="cpu", progress=False)
    ids = torch.randint(2, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (reference(ids).logits - model(ids).logits).abs().max().item() <= 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_under_a_budget_the_route_normed_model_replays_the_cpu_paths_text(route_normed_mixtral):
    _, store, _ = route_normed_mixtral
    prompt = torch.randint(2, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    expected = mira.load(store, device="cpu", progress=False).generate(prompt, **GREEDY)
    model = mira.load(store, device="cuda", dtype="float32", max_context=64, vram_budget="50%", prefetch="off",
                      residency="lagged", progress=False)
    got = model.generate(prompt, **GREEDY).cpu()
    stats = model.stats()
    assert torch.equal(got, expected)
    assert stats["cache"]["tokens_served"]["miss"] > 0
    assert stats["decode_steps_replayed"] == GREEDY["max_new_tokens"] - 2  # one warm-up, then captured
