"""A decode step reuses buffers instead of allocating (DESIGN.md 2.5), and reusing them never
changes a result: every layer's output equals the float64 reference FFN, and one layer's call
never overwrites another layer's output. Allocations are counted on the CPU by `NewTensors`
(tests/e2e/test_gpu.py counts them on the GPU)."""

from __future__ import annotations

import pytest
import torch

import mira
from allocations import NewTensors
from host_reads import host_reads
from mira.kernels import DECODE_TOKENS
from mira.kernels import make_moe_ffn
from mira.predict.baselines import GateSpeculation
from mira.runtime.experts import model_routers
from mira.predict.heads import HeadConfig, PredictorHeads, TrainedPredictor
from mira.runtime import engine
from mira.runtime.experts import MiraExperts
from tiny_models import mixtral_layer_call, mixtral_layer_reference

E, K, H = 8, 2, 64  # the tiny Mixtral: top-2 of 8 experts, hidden 64, 3 MoE layers


@pytest.fixture(scope="module")
def mixtral(checkpoints):
    return mira.load(checkpoints["mixtral"], device="cpu", progress=False)  # int8-shared, experts read in place


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_layer_outputs_are_right_and_never_overwritten_by_another_layer(mixtral, backend):
    ffn = make_moe_ffn("cpu", mixtral.store.layout, "silu", backend=backend, num_experts=E)
    layers = [MiraExperts(p, mixtral.cache, ffn, torch.device("cpu")) for p in range(2)]
    first = [mixtral_layer_call(seed, tokens=2) for seed in (0, 1)]
    outputs = [layer(*args) for layer, args in zip(layers, first)]
    kept = [out.clone() for out in outputs]
    second = mixtral_layer_call(2, tokens=3)
    again = layers[0](*second)  # layer 0's next call reuses its buffer...
    assert again.data_ptr() == outputs[0].data_ptr()
    assert torch.equal(outputs[1], kept[1])  # ...and leaves layer 1's output alone
    for layer, args, out in [(0, first[0], kept[0]), (1, first[1], kept[1]), (0, second, again)]:
        expected = mixtral_layer_reference(mixtral.store, layer, *args)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    prefill = mixtral_layer_call(3, tokens=DECODE_TOKENS + 1)
    big = layers[1](*prefill)  # larger than a decode step: a tensor of its own
    assert big.data_ptr() != outputs[1].data_ptr() and torch.equal(outputs[1], kept[1])
    expected = mixtral_layer_reference(mixtral.store, 1, *prefill)
    torch.testing.assert_close(big.double(), expected, rtol=1e-5, atol=1e-5)


def test_gate_speculation_and_trained_heads_allocate_nothing_in_decode(mixtral):
    speculation = GateSpeculation(model_routers(mixtral.hf_model), mixtral.store.num_experts)
    heads = PredictorHeads(HeadConfig(num_layers=3, num_experts=E, top_k=K, hidden_size=H, history_window=2)).eval()
    trained = TrainedPredictor(heads, speculation, "cpu")
    hidden, index, _ = mixtral_layer_call(0, tokens=4)
    logits = torch.randn(4, E)
    trained.observe(2, index)
    with NewTensors() as new:
        for predictor in (speculation, trained):
            predictor.observe(0, index)
            distribution = predictor.scores(0, hidden, logits, index)  # the last: the trained heads
    assert new.ops == []
    with NewTensors() as new:  # a prompt longer than a decode step allocates its own workspace
        speculation.scores(0, torch.randn(DECODE_TOKENS + 1, H))
    assert new.ops
    assert distribution.shape == (E,) and torch.allclose(distribution.sum(), torch.ones(()))


@pytest.mark.parametrize("predictor", ["gate", "trained"])
def test_a_decode_step_allocates_nothing_inside_the_experts_but_the_kernel(checkpoints, predictor):
    """The whole model runs one decode step under a budget with STAGE slots and prefetching; only
    what the experts modules do outside their kernel is counted (the reference FFN allocates)."""
    probe = mira.load(checkpoints["mixtral"], device="cpu", vram_budget=1 << 30, progress=False)
    budget = probe.plan.reserve_bytes + 12 * probe.store.blob_bytes
    model = mira.load(checkpoints["mixtral"], device="cpu", vram_budget=budget, prefetch="gate", progress=False)
    experts = sorted((m for m in model.hf_model.modules() if isinstance(m, MiraExperts)),
                     key=lambda m: m.layer_position)
    if predictor == "trained":
        heads = PredictorHeads(HeadConfig(num_layers=3, num_experts=E, top_k=K, hidden_size=H)).eval()
        trained = TrainedPredictor(heads, GateSpeculation(model_routers(model.hf_model), model.store.num_experts), "cpu")
        for module in experts:
            module.predictor = trained
    new = NewTensors()
    new.counting = False
    for module in experts:
        module.ffn = _paused(new, module.ffn)  # the reference FFN allocates, as does staging's CPU path
        module.register_forward_pre_hook(lambda *args: setattr(new, "counting", True))
        module.register_forward_hook(lambda *args: setattr(new, "counting", False))
    staging, staged = model.cache.staging, []
    stage = _paused(new, staging.before_layer)
    staging.before_layer = lambda layer, expert: (staged.append(expert is not None), stage(layer, expert))
    staging.after_layer = _paused(new, staging.after_layer)
    prompt = torch.randint(2, 320, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        prefill = model(prompt, use_cache=True)
        step = prefill.logits[:, -1:].argmax(-1)
        staged.clear()
        with new:
            model(step, past_key_values=prefill.past_key_values, use_cache=True)
    assert staged == [True, False, False]  # layer 0 staged for layer 2; layers 1 and 2 have nothing two on
    assert new.ops == []


def _paused(new: NewTensors, ffn):
    def call(*args, **kwargs):
        with new.paused():
            return ffn(*args, **kwargs)

    return call


@pytest.mark.parametrize(("slots", "resident"), [(24, True), (12, False)])  # every expert resident; half
def test_a_layer_with_every_expert_resident_reads_nothing_back_and_is_counted_once_per_step(
        stores, monkeypatch, slots, resident):
    # the fused kernels (in the interpreter): the reference FFN reads the routing on the host itself
    monkeypatch.setattr(engine, "make_moe_ffn", lambda *args, **kwargs: make_moe_ffn(*args, **kwargs, backend="triton"))
    store = stores["mixtral", "int8-shared"]
    probe = mira.load(store, device="cpu", vram_budget=1 << 30, progress=False)
    budget = probe.plan.reserve_bytes + slots * probe.store.blob_bytes
    # under a budget, the inline mode (tests/e2e/test_lagged_residency.py has the lagged one)
    model = mira.load(store, device="cpu", vram_budget=budget, prefetch="off", residency="inline", progress=False)
    monkeypatch.undo()
    layers = [m for m in model.hf_model.modules() if isinstance(m, MiraExperts)]
    calls = [mixtral_layer_call(seed, tokens=1) for seed in range(3)]
    outputs, per_step = [], []
    for args in calls:  # one decode step: every layer once, then the settle after the step
        reads = host_reads(monkeypatch)
        outputs.append([layer(*args).clone() for layer in layers])
        monkeypatch.undo()
        per_step.append(len(reads))
        model.cache.settle()
    assert per_step == ([0] * 3 if resident else [len(layers)] * 3), per_step  # inline: one read-back per call
    for args, per_layer in zip(calls, outputs):
        for position, got in enumerate(per_layer):
            expected = mixtral_layer_reference(model.store, position, *args)
            torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    stats = model.stats()["cache"]
    routed = 3 * len(layers) * K  # 3 steps of one token, K distinct experts per layer
    assert stats["tokens_routed"] == routed
    if resident:
        assert stats["tokens_served"]["hot"] == routed and stats["lookups"] == {"hot": routed, "stage": 0, "miss": 0}
