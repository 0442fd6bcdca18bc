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
    """auto: on CUDA with the fused kernels layers run lagged (mira.runtime.config.resolve)."""
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
    prefetch off: every expert resident; gate: 12 of 24 experts fit, inline, and gate speculation
    stages experts on the device during the step."""
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
        assert model.cache.staging is not None
    experts = [m for m in model.hf_model.modules() if isinstance(m, MiraExperts)]
    staged = []
    if model.cache.staging is not None:
        before_layer = model.cache.staging.before_layer
        model.cache.staging.before_layer = lambda layer, expert: (staged.append(expert is not None),
                                                                  before_layer(layer, expert))

    with torch.no_grad():
        prefill = model(_prompt().cuda(), use_cache=True)
        step_ids = prefill.logits[:, -1:].argmax(-1)
        model(step_ids, past_key_values=prefill.past_key_values, use_cache=True)  # warm: lazy buffers, cuBLAS
        torch.cuda.synchronize()
        staged.clear()
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
        assert staged == [True, False, False]  # layer 0 staged its prediction for layer 2 in this step


@pytest.mark.parametrize("residency", ["inline", "lagged"])
def test_late_staging_copies_change_nothing_but_where_an_expert_is_read(mixtral_store, monkeypatch, residency):
    """Every staging copy is held back ~1 ms on the prefetch stream and every slot starts as garbage
    (0xFF: int8 -1, bf16 NaN scales): a kernel that read a stage row before its copy landed would
    compute NaN or another expert's output, and the greedy text would differ from the all-resident run."""
    from mira.cache.staging import DeviceStaging

    everything = mira.load(mixtral_store, device="cuda", dtype="bfloat16", vram_budget=64 << 30, prefetch="off",
                           progress=False)
    expected = everything.generate(_prompt(), **GREEDY).cpu()
    budget = everything.plan.reserve_bytes + 12 * everything.store.blob_bytes
    del everything
    stage = DeviceStaging._stage_on_device

    def late_stage(self, target, expert):  # runs with the prefetch stream current
        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU clock cycles before the copy starts
        stage(self, target, expert)

    monkeypatch.setattr(DeviceStaging, "_stage_on_device", late_stage)
    model = mira.load(mixtral_store, device="cuda", dtype="bfloat16", vram_budget=budget, prefetch="gate",
                      residency=residency, progress=False)
    model.cache.pool.buffer.fill_(0xFF)
    got = model.generate(_prompt(), **GREEDY).cpu()
    counts = model.stats()["prefetch"]
    print(f"\nprefetch under delayed copies, {residency}: {counts}")
    assert counts["used"] > 0 and counts["used"] + counts["wasted"] == counts["issued"]
    assert torch.equal(got, expected)
