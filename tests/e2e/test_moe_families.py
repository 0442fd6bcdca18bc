"""Every MoE family Mira runs through transformers' experts interface, against transformers' own
forward on the same tiny random checkpoint (fp32, CPU; configs from each family's config class).

- `none`: Mira's logits equal transformers' (max abs difference <= 1e-4) and 20 greedy tokens are
  the same.
- `int8-shared`: every dequantized weight lies within half a quantization step of the original,
  and Mira computes exactly the quantized model: its logits equal transformers' with the
  dequantized weights put back into the family's own Experts modules (<= 1e-4).
- For the families gated with SiLU, each MoE layer's quantization error is within the bound
  derived in tests/e2e/test_families.py (biases are stored exactly and change nothing in it).

The README's list of families is the families run here whose cases all pass (tools/families_doc.py).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import mira
from mira.errors import MiraError
from mira.kernels import glu_of
from mira.kernels.reference import moe_ffn_reference
from mira.models.interface import is_experts_class
from mira.models.kvcache import kv_values_per_token
from mira.models.registry import adapter_for
from mira.models.spec import GluForm
from mira.runtime.tracing import RoutingRecorder
from mira.store.convert import convert
from mira.store.quant import dequantize_expert
from mira.store.store import ExpertStore
from tiny_families import CASES, OFFERED, VOCAB, family_checkpoint

SILU_LIPSCHITZ = 1.0999
GREEDY = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="session")
def family_store(tmp_path_factory):
    """(family, scheme) -> (checkpoint, store), made on first use."""
    root = tmp_path_factory.mktemp("families")
    made: dict = {}

    def get(family: str, scheme: str) -> tuple[Path, Path]:
        if family not in made:
            made[family] = family_checkpoint(family, root / family)
        if (family, scheme) not in made:
            made[family, scheme] = root / f"{family}-{scheme}"
            convert(made[family], made[family, scheme], scheme, progress=False)
        return made[family], made[family, scheme]

    return get


@pytest.fixture(scope="session")
def family_reference():
    """checkpoint -> transformers' fp32 model of it, loaded once (tests copy it before changing it)."""
    loaded: dict = {}

    def get(checkpoint: Path):
        if checkpoint not in loaded:
            loaded[checkpoint] = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        return loaded[checkpoint]

    return get


def _experts_modules(model) -> list:
    return [m for m in model.modules() if is_experts_class(type(m))]


def _prompt(seed: int = 0, length: int = 12) -> torch.Tensor:
    return torch.randint(2, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _canonical(module, expert: int, spec) -> dict[str, torch.Tensor]:
    """Expert `expert` of a family's Experts module in the store's layout (float64)."""
    up = getattr(module, spec.up_name)[expert].double()
    down = module.down_proj[expert].double()
    if spec.transposed:
        up, down = up.T, down.T
    tensors = {"w13": _gate_rows_first(up, spec), "w2": down}
    if spec.bias:
        tensors["b13"] = _gate_rows_first(getattr(module, f"{spec.up_name}_bias")[expert].double(), spec)
        tensors["b2"] = module.down_proj_bias[expert].double()
    return tensors


def _gate_rows_first(tensor: torch.Tensor, spec) -> torch.Tensor:
    return tensor if spec.concatenated or not spec.gated else torch.cat([tensor[0::2], tensor[1::2]])


def _family_rows(tensor: torch.Tensor, spec) -> torch.Tensor:
    """The inverse of _gate_rows_first: gate|up rows -> the family's order."""
    if spec.concatenated or not spec.gated:
        return tensor
    gate, up = tensor.chunk(2, dim=0)
    return torch.stack((gate, up), dim=1).flatten(0, 1)


def _steps(views: dict, shape13, shape2) -> tuple[torch.Tensor, torch.Tensor]:
    scale = views["scale"].double()  # int8-shared: one scale per input channel of w13, output channel of w2
    return scale[None, :].expand(shape13), scale[:, None].expand(shape2)


@pytest.mark.parametrize("family", CASES)
def test_unquantized_store_matches_transformers_exactly(family, family_store, family_reference):
    checkpoint, store = family_store(family, "none")
    reference = family_reference(checkpoint)
    model = mira.load(store, device="cpu", progress=False)
    ids = _prompt()
    with torch.no_grad():
        expected, got = reference(ids).logits, model(ids).logits
    assert (expected - got).abs().max().item() <= 1e-4
    assert torch.equal(reference.generate(ids, **GREEDY, disable_compile=True), model.generate(ids, **GREEDY))


@pytest.mark.parametrize("family", CASES)
def test_a_budget_reserves_the_kv_cache_transformers_keeps(family, family_store, family_reference):
    """The reserve's KV cache per token is the growth of transformers' own cache in a forward of the
    checkpoint (4 tokens, then 8), whatever the family's attention (indexer keys included)."""
    checkpoint, store = family_store(family, "none")
    reference = family_reference(checkpoint)
    with torch.no_grad():
        held = [_cache_values(reference(_prompt(length=n), use_cache=True)["cache"]) for n in (4, 8)]
    per_token = (held[1] - held[0]) // 4
    assert per_token > 0 and kv_values_per_token(reference.config) == per_token
    model = mira.load(store, device="cpu", progress=False, vram_budget=1 << 30, max_context=64)
    weights = sum(t.nbytes for t in (*model.hf_model.parameters(), *model.hf_model.buffers()))
    assert model.plan.reserve_bytes - weights == per_token * 64 * 4  # fp32 on the CPU, no workspaces


def _cache_values(cache) -> int:
    """Every tensor the cache's layers hold: keys, values, a sparse attention's indexer keys, and
    states of a fixed size, which drop out of the growth."""
    return sum(t.numel() for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("family", CASES)
def test_int8_store_is_exactly_the_dequantized_model(family, family_store, family_reference):
    checkpoint, store_dir = family_store(family, "int8-shared")
    store = ExpertStore.open(store_dir, progress=False)
    original = family_reference(checkpoint)
    dequantized = copy.deepcopy(original)
    spec = adapter_for(original.config).spec
    with torch.no_grad():
        for position, (orig, deq) in enumerate(zip(_experts_modules(original), _experts_modules(dequantized))):
            for expert in range(store.num_experts):
                views = store.layout.views(store.blob(position, expert))
                w13, w2 = dequantize_expert(views, store.layout)
                exact = _canonical(orig, expert, spec)
                step13, step2 = _steps(views, w13.shape, w2.shape)
                assert ((w13 - exact["w13"]).abs() <= step13 / 2).all()
                assert ((w2 - exact["w2"]).abs() <= step2 / 2).all()
                if spec.bias:  # stored exactly
                    assert torch.equal(views["b13"].double(), exact["b13"]) and torch.equal(views["b2"].double(),
                                                                                            exact["b2"])
                up, down = _family_rows(w13, spec), w2
                if spec.transposed:
                    up, down = up.T, down.T
                getattr(deq, spec.up_name)[expert] = up.float()
                deq.down_proj[expert] = down.float()
    model = mira.load(store_dir, device="cpu", progress=False)
    ids = _prompt()
    with torch.no_grad():
        got, expected, unquantized = model(ids).logits, dequantized(ids).logits, original(ids).logits
    assert (got - expected).abs().max().item() <= 1e-4
    assert (got - unquantized).abs().max().item() > 0  # the experts really were quantized


def test_ungated_experts_in_an_int4_store_compute_exactly_the_dequantized_model(tmp_path):
    """Nemotron-H's experts (up rows only, the squared ReLU) in int4, at an intermediate size of
    whole tiles: Mira computes transformers' model with the store's dequantized weights put back."""
    checkpoint = family_checkpoint("nemotron_h", tmp_path / "checkpoint", moe_intermediate_size=64)
    convert(checkpoint, tmp_path / "store", "int4", progress=False)
    store = ExpertStore.open(tmp_path / "store", progress=False)
    assert store.layout.scheme == "int4" and not store.layout.gated
    original = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    dequantized = copy.deepcopy(original)
    spec = adapter_for(original.config).spec
    with torch.no_grad():
        for position, module in enumerate(_experts_modules(dequantized)):
            for expert in range(store.num_experts):
                up, down = dequantize_expert(store.layout.views(store.blob(position, expert)), store.layout)
                if spec.transposed:
                    up, down = up.T, down.T
                getattr(module, spec.up_name)[expert] = up.float()
                module.down_proj[expert] = down.float()
    model = mira.load(tmp_path / "store", device="cpu", progress=False)
    ids = _prompt()
    with torch.no_grad():
        got, expected, unquantized = model(ids).logits, dequantized(ids).logits, original(ids).logits
    assert (got - expected).abs().max().item() <= 1e-4
    assert (got - unquantized).abs().max().item() > 0  # the experts really were quantized
    assert torch.equal(model.generate(ids, **GREEDY), dequantized.generate(ids, **GREEDY, disable_compile=True))


# Families with their own gating or activation, outside the derived bound: their int8 stores are checked
# by test_int8_store_is_exactly_the_dequantized_model (weights within half a step, Mira = that model).
OWN_ARITHMETIC = {"beam", "deepseek_v4", "ergo", "gemma4", "gemma4_text", "gpt_oss", "hy_v4", "inkling2_loop_text",
                  "inkling2_text", "minimax_m3_vl_text", "nemotron_h"}
SILU_GATED = [family for family in CASES if family not in OWN_ARITHMETIC]


@pytest.mark.parametrize("family", SILU_GATED)
def test_int8_error_of_each_moe_layer_is_within_the_derived_bound(family, family_store, family_reference):
    checkpoint, store_dir = family_store(family, "int8-shared")
    store = ExpertStore.open(store_dir, progress=False)
    original = family_reference(checkpoint)
    spec = adapter_for(original.config).spec
    act, gate = spec.ffn_functions()
    assert (gate is None and glu_of(act, None) == GluForm()) or gate.form == GluForm()  # SwiGLU, perhaps in own code
    calls = []
    hooks = [m.register_forward_pre_hook(lambda mod, args, calls=calls: calls.append(args))
             for m in _experts_modules(original)]
    with torch.no_grad():
        original(_prompt(seed=1, length=16))
    for hook in hooks:
        hook.remove()
    for position, (orig, (hidden, top_k_index, top_k_weights)) in enumerate(zip(_experts_modules(original), calls)):
        blobs = [store.blob(position, e) for e in range(store.num_experts)]
        got = moe_ffn_reference(hidden, top_k_index, top_k_weights, blobs, store.layout, F.silu).double()
        with torch.no_grad():
            expected = orig(hidden, top_k_index, top_k_weights).double()
        bound = _moe_error_bound(orig, spec, store, position, hidden, top_k_index, top_k_weights)
        assert ((got - expected).abs() <= bound + 1e-5 * (1 + expected.abs())).all()


def _moe_error_bound(orig, spec, store, position, hidden, top_k_index, top_k_weights):
    """tests/e2e/test_families.py's bound, with biases (exact) inside the gate/up and down outputs."""
    x = hidden.double()
    bound = torch.zeros_like(x)
    for expert in top_k_index.unique().tolist():
        views = store.layout.views(store.blob(position, expert))
        exact = _canonical(orig, expert, spec)
        w13, w2 = exact["w13"], exact["w2"]
        step13, step2 = _steps(views, w13.shape, w2.shape)
        token, k = torch.where(top_k_index == expert)
        xe = x[token]  # [T_e, H]
        d_gate_up = xe.abs() @ (step13 / 2).T  # [T_e, 2I]
        gate_up = xe @ w13.T + (exact["b13"] if spec.bias else 0)
        gate, up = gate_up.chunk(2, dim=-1)
        d_gate, d_up = d_gate_up.chunk(2, dim=-1)
        h = F.silu(gate) * up
        d_h = SILU_LIPSCHITZ * d_gate * (up.abs() + d_up) + F.silu(gate).abs() * d_up
        d_y = d_h @ (w2.abs() + step2 / 2).T + h.abs() @ (step2 / 2).T  # [T_e, H]
        bound.index_add_(0, token, d_y * top_k_weights[token, k, None].double().abs())
    return bound


@pytest.mark.parametrize("family", [f for f in ("gpt_oss", "hunyuan_v1_moe") if f in OFFERED])
def test_a_budget_with_prefetch_auto_runs_with_or_without_gate_speculation(family, family_store):
    """gpt-oss's router is recomputed by gate speculation (its logits' bias included), HunYuan's
    is not: under a budget that forces misses, prefetch auto stages for one and not the other, and
    both generate the text they generate with every expert resident."""
    _, store = family_store(family, "int8-shared")
    ids = _prompt(seed=3)
    resident = mira.load(store, device="cpu", progress=False)
    expected = resident.hf_model.generate(ids, **GREEDY)
    total = resident.store.num_layers * resident.store.num_experts
    model = mira.load(store, device="cpu", progress=False, vram_budget="40%", residency="inline", prefetch="auto")
    assert model.cache.policy.capacity < total
    assert (model.cache.staging is not None) == (family == "gpt_oss")
    assert torch.equal(model.hf_model.generate(ids, **GREEDY), expected)


@pytest.mark.parametrize("family", [f for f in ("inkling2_loop_text",) if f in OFFERED])
def test_a_looped_model_under_a_budget_keeps_its_text_and_refuses_staging_and_traces(family, family_store):
    """Inkling2-Loop runs its core layers three times a forward, which staging two layers ahead and a
    trace's one routing per layer cannot follow: under a budget that forces misses prefetch auto
    stages nothing and the text is the one with every expert resident; staging and traces are refused."""
    _, store = family_store(family, "none")
    ids = _prompt(length=8)
    greedy = {**GREEDY, "max_new_tokens": 24}
    resident = mira.load(store, device="cpu", progress=False)
    expected = resident.generate(ids, **greedy)
    model = mira.load(store, device="cpu", progress=False, vram_budget="50%")
    assert model.cache.policy.capacity < resident.store.num_layers * resident.store.num_experts
    assert model.cache.staging is None
    assert torch.equal(model.generate(ids, **greedy), expected)
    with pytest.raises(MiraError, match="looped core of layers several times; pass --prefetch off"):
        mira.load(store, device="cpu", progress=False, vram_budget="50%", prefetch="gate")
    with pytest.raises(MiraError, match="runs decoder layers 1 to 2 3 times a token"):
        RoutingRecorder(model)


@pytest.mark.parametrize("family", [f for f in ("gpt_oss", "ergo") if f in OFFERED])
def test_every_miss_on_the_cpu_worker_keeps_the_text_of_biased_clamped_experts(family, family_store):
    """gpt-oss's experts (biases, clamped SwiGLU) and Ergo's (each route's output normalised by its
    expert's norm) computed by the CPU worker for every miss give the greedy text of the CPU share
    switched off."""
    _, store = family_store(family, "int8-shared")
    # slots for one MoE layer's experts, and a prompt some of whose misses the policy leaves on the host
    share, ids = ("50%", _prompt(seed=7)) if family == "ergo" else ("40%", _prompt(seed=5))
    texts = {}
    for mode in ("off", "all"):
        model = mira.load(store, device="cpu", progress=False, vram_budget=share, residency="inline", prefetch="off",
                          cpu_experts=mode)
        texts[mode] = model.hf_model.generate(ids, **GREEDY)
        served = model.stats().get("cpu_experts", {})
    assert served and sum(layer["tokens"] for layer in served["layers"]) > 0
    assert torch.equal(texts["all"], texts["off"])
