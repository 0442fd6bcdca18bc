"""On CUDA, under a budget that forces evictions, Mira generates what it generates with every
expert resident, and in float32 what the CPU path generates. (bf16 matmuls round differently on
the CPU and the GPU, so bf16 greedy text may part ways after a near-tie; that is not the cache.)

Skipped without a GPU; run on the GPU machine with `python -m pytest -m gpu`.
"""

import pytest
import torch

import mira
from gpu_counts import InsideModules, sync_warnings, syncs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GREEDY = dict(max_new_tokens=32, do_sample=False, pad_token_id=0)


def _prompt():
    return torch.randint(2, 320, (1, 16), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("residency", ["auto", "inline"])
@pytest.mark.parametrize(("dtype", "reference_device"), [("float32", "cpu"), ("bfloat16", "cuda")])
def test_cuda_under_an_evicting_budget_generates_the_reference_text(mixtral_store, dtype, reference_device, residency):
    """auto: the test store's experts are small, so its layers run lagged (mira.runtime.residency)."""
    everything = mira.load(mixtral_store, device="cuda", dtype=dtype, vram_budget=64 << 30, progress=False)
    assert everything.cache.pool.num_slots == 24
    reference = everything if reference_device == "cuda" else mira.load(mixtral_store, device="cpu", dtype=dtype,
                                                                          progress=False)
    expected = reference.generate(_prompt(), **GREEDY).cpu()
    budget = everything.plan.reserve_bytes + 10 * everything.store.blob_bytes  # 10 of 24 experts fit
    del everything, reference
    model = mira.load(mixtral_store, device="cuda", dtype=dtype, vram_budget=budget, residency=residency,
                      progress=False)
    assert model.cache.pool.num_slots == 10
    assert model.store.data.is_pinned()
    assert model.stats()["residency"] == ("lagged" if residency == "auto" else "inline")
    got = model.generate(_prompt(), **GREEDY).cpu()
    stats = model.stats()["cache"]
    print(f"\n{dtype}: {stats}")
    assert stats["copies"] > 10  # evictions happened
    assert torch.equal(got, expected)


@pytest.mark.parametrize("prefetch", ["off", "gate"])
def test_a_decode_step_syncs_once_per_moe_layer_inside_the_experts(mixtral_store, prefetch):
    """Counts host syncs (CUDA sync-debug warnings) and caching-allocator allocations made inside
    Mira's experts modules during one decode step: none allocated, at most one sync per MoE layer.
    prefetch off: every expert resident; gate: 12 of 24 experts fit, and gate speculation stages
    experts into STAGE during the step."""
    from mira.runtime.experts import MiraExperts

    everything = mira.load(mixtral_store, device="cuda", dtype="bfloat16", vram_budget=64 << 30, prefetch=prefetch,
                           progress=False)
    if prefetch == "off":
        model = everything
    else:
        budget = everything.plan.reserve_bytes + 12 * everything.store.blob_bytes
        del everything
        model = mira.load(mixtral_store, device="cuda", dtype="bfloat16", vram_budget=budget, prefetch=prefetch,
                          residency="inline", progress=False)
        assert model.cache.policy.stage_slots > 0
    experts = [m for m in model.hf_model.modules() if isinstance(m, MiraExperts)]

    def offered():
        return sum(model.stats()["prefetch"][k] for k in ("issued", "skipped", "declined"))

    with torch.no_grad():
        prefill = model(_prompt().cuda(), use_cache=True)
        step_ids = prefill.logits[:, -1:].argmax(-1)
        model(step_ids, past_key_values=prefill.past_key_values, use_cache=True)  # warm: lazy buffers, cuBLAS
        torch.cuda.synchronize()
        staged_before = offered()
        with sync_warnings() as caught, InsideModules(experts, caught) as inside:
            model(step_ids, past_key_values=prefill.past_key_values, use_cache=True)
    counts = inside.counts
    print(f"\nprefetch {prefetch}, decode step inside the experts modules: {counts}; whole step: "
          f"{syncs(caught)} sync warnings; prefetch {model.stats()['prefetch']}")
    assert counts["calls"] == len(experts) == 3
    assert all(type(m.ffn).__name__ == "TritonMoEFFN" for m in experts)  # the fused kernels ran
    assert counts["syncs"] <= len(experts)
    if prefetch == "off":  # every expert resident: nothing left to decide on the host
        assert counts["syncs"] == 0
    assert counts["allocations"] == 0
    if prefetch == "gate":
        assert offered() > staged_before  # the predictor ran and offered experts to STAGE in this step


def test_no_stage_slot_is_read_before_its_prefetch_copy_has_landed(mixtral_store, monkeypatch):
    """Every prefetch copy is held back ~1 ms on its stream and every slot starts as garbage
    (0xFF: int8 -1, bf16 NaN scales): a kernel that read a STAGE slot early would compute NaN or
    another expert's output, and the greedy text would differ from the all-resident run."""
    from mira.cache.transfer import Transfer

    everything = mira.load(mixtral_store, device="cuda", dtype="bfloat16", vram_budget=64 << 30, prefetch="off",
                           progress=False)
    expected = everything.generate(_prompt(), **GREEDY).cpu()
    budget = everything.plan.reserve_bytes + 12 * everything.store.blob_bytes
    del everything
    load = Transfer.load

    def slow_prefetch(self, src, dst, slot, prefetch=False, then=None):
        if prefetch:
            self.prefetch_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.prefetch_stream):
                torch.cuda._sleep(2_000_000)  # ~1 ms of GPU clock cycles before the copy starts
        return load(self, src, dst, slot, prefetch, then)

    monkeypatch.setattr(Transfer, "load", slow_prefetch)
    model = mira.load(mixtral_store, device="cuda", dtype="bfloat16", vram_budget=budget, prefetch="gate",
                      residency="inline", progress=False)
    model.cache.pool.buffer.fill_(0xFF)
    got = model.generate(_prompt(), **GREEDY).cpu()
    counts = model.stats()["prefetch"]
    print(f"\nprefetch under delayed copies: {counts}")
    assert counts["used"] > 0
    assert torch.equal(got, expected)
