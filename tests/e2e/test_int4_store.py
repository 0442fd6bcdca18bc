"""int4 stores end to end on the CPU: converted like every store, served through the reference path,
counted by budgets at their own blob size (mira.store.int4)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import mira
from mira.cli import main
from mira.store.convert import convert
from mira.store.store import ExpertStore
from tiny_models import FAMILIES, dequantized_model

GREEDY = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)


def _prompt(seed=0, length=12):
    return torch.randint(2, 320, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_int4_store_computes_exactly_the_dequantized_model(family, int4_checkpoints, int4_stores):
    reference = dequantized_model(int4_checkpoints[family], int4_stores[family])
    original = AutoModelForCausalLM.from_pretrained(int4_checkpoints[family], dtype=torch.float32).eval()
    model = mira.load(int4_stores[family], device="cpu", progress=False)
    assert model.stats()["quant"] == "int4"
    ids = _prompt()
    with torch.no_grad():
        got, expected, unquantized = model(ids).logits, reference(ids).logits, original(ids).logits
    assert (got - expected).abs().max().item() <= 1e-4
    # really quantized; random tiny networks amplify the ~10% weight error (test_families.py), so no tight bound
    assert 0 < ((got - unquantized).norm() / unquantized.norm()).item() < 1
    assert torch.equal(model.generate(ids, **GREEDY), reference.generate(ids, **GREEDY, disable_compile=True))


def test_a_budget_holds_more_int4_experts_than_int8(tmp_path, int4_checkpoints, int4_stores):
    int8_store = tmp_path / "int8"  # the same model's experts in int8-shared
    convert(int4_checkpoints["mixtral"], int8_store, "int8-shared", progress=False)
    int8 = mira.load(int8_store, device="cpu", vram_budget=1 << 30, progress=False)
    four = mira.load(int4_stores["mixtral"], device="cpu", vram_budget=1 << 30, progress=False)
    budget = int8.plan.reserve_bytes + 9 * int8.store.blob_bytes  # 9 int8 experts of 24
    four_blob = four.store.blob_bytes
    assert four_blob < 0.7 * int8.store.blob_bytes  # tiny experts: group scales weigh more than at real sizes
    limited8 = mira.load(int8_store, device="cpu", vram_budget=budget, progress=False)
    limited4 = mira.load(int4_stores["mixtral"], device="cpu", vram_budget=budget, policy="lru", progress=False)
    assert limited8.cache.pool.num_slots == 9
    assert limited4.cache.pool.num_slots == (budget - limited4.plan.reserve_bytes) // four_blob > 9
    unlimited = mira.load(int4_stores["mixtral"], device="cpu", progress=False)
    assert torch.equal(limited4.generate(_prompt(1), **GREEDY), unlimited.generate(_prompt(1), **GREEDY))
    stats = limited4.stats()["cache"]
    assert stats["bytes_to_device"] == stats["copies"] * four_blob > 0


def test_convert_cli_writes_an_int4_store_that_verifies(int4_checkpoints, tmp_path, capsys):
    out = tmp_path / "store"
    assert main(["convert", str(int4_checkpoints["olmoe"]), "--out", str(out), "--quant", "int4", "--quiet"]) == 0
    assert "int4" in capsys.readouterr().out
    assert main(["store", "verify", str(out)]) == 0
    assert ExpertStore.open(out, progress=False).manifest.scheme == "int4"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("residency", ["auto", "inline"])
def test_cuda_int4_under_an_evicting_budget_generates_the_cpu_text(int4_stores, residency):
    """float32 on CUDA through the fused INT4 kernels, 10 of 24 experts in slots: lagged (auto, the
    misses read from pinned memory by the kernels, steps replayed from CUDA graphs) or inline (the
    misses copied into slots) generates what the CPU reference path generates."""
    from mira.runtime.experts import MiraExperts

    store = int4_stores["mixtral"]
    expected = mira.load(store, device="cpu", progress=False).generate(_prompt(), **GREEDY)
    everything = mira.load(store, device="cuda", dtype="float32", vram_budget=64 << 30, progress=False)
    budget = everything.plan.reserve_bytes + 10 * everything.store.blob_bytes
    del everything
    model = mira.load(store, device="cuda", dtype="float32", vram_budget=budget, residency=residency, progress=False)
    assert model.cache.pool.num_slots == 10 and model.store.data.is_pinned()
    experts = [m for m in model.hf_model.modules() if isinstance(m, MiraExperts)]
    assert experts and all(type(m.ffn).__name__ == "TritonInt4MoEFFN" for m in experts)
    got = model.generate(_prompt(), **GREEDY).cpu()
    assert model.stats()["cache"]["copies"] > 10  # evictions happened
    assert torch.equal(got, expected)
