"""On CUDA, lagged residency (mira.cache.tables) decodes under an evicting budget with no host sync
and no allocation inside the experts modules, generates exactly what every expert resident
generates, also when every copy lands late (kernels then read the pinned host blob, which holds
the same bytes), and leaves every table entry at its expert's slot row or host blob. The same
holds with prefetching staged on the device (mira.cache.staging), whose decode steps are replayed
from CUDA graphs.

Skipped without a GPU; run on the GPU machine with `python -m pytest -m gpu`.
"""

import pytest
import torch

import mira
from mira.predict.baselines import GateSpeculation
from mira.runtime.experts import model_routers
from mira.predict.heads import HeadConfig, PredictorHeads, TrainedPredictor
from mira.runtime.experts import MiraExperts
from mira.cache.transfer import Transfer
from gpu_counts import InsideModules, cuda_allocations, sync_warnings, syncs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GREEDY = dict(max_new_tokens=32, do_sample=False, pad_token_id=0)
SLOTS = 9  # of 24 experts: one layer's 8 and one more, so nearly every step evicts
LATE_CYCLES = 20_000_000  # ~10 ms at the H200's clock: longer than a tiny model's decode step
STEP_TOKENS = (7, 101, 250, 33)


def _prompt():
    return torch.randint(2, 320, (1, 16), generator=torch.Generator().manual_seed(5))


def _lagged_model(store, dtype: str, policy: str = "lru", prefetch: str = "off"):
    everything = mira.load(store, device="cuda", dtype=dtype, vram_budget=64 << 30, prefetch="off", progress=False)
    expected = everything.generate(_prompt(), **GREEDY).cpu()
    slots = SLOTS + (3 if prefetch != "off" else 0)  # staging keeps three rows of the slots
    budget = everything.plan.reserve_bytes + slots * everything.store.blob_bytes
    del everything
    model = mira.load(store, device="cuda", dtype=dtype, vram_budget=budget, policy=policy, prefetch=prefetch,
                      residency="lagged", progress=False)
    layers = [m for m in model.hf_model.modules() if isinstance(m, MiraExperts)]
    assert all(m.lagged and m.host_free and type(m.ffn).__name__ == "TritonMoEFFN" for m in layers)
    assert model.cache.pool.num_slots == slots and model.store.data.is_pinned()
    assert (model.cache.staging is not None) == (prefetch != "off")
    return model, expected


def _assert_tables_follow_the_slots(cache) -> None:
    torch.cuda.synchronize()
    tables = cache.tables.tables.tolist()
    for uid in range(cache.store.num_layers * cache.store.num_experts):
        layer, expert = divmod(uid, cache.store.num_experts)
        slot = cache._slot_of.get(uid)
        place = cache.store.blob(layer, expert) if slot is None else cache.pool.row(slot)
        assert tables[layer][expert] == place.data_ptr(), (layer, expert, slot)


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_lagged_residency_generates_the_all_resident_text(mixtral_store, monkeypatch, dtype, late):
    model, expected = _lagged_model(mixtral_store, dtype)
    if late:  # every copy waits ~10 ms on its stream first; the compute stream never waits for it
        load = Transfer.load

        def late_load(self, src, dst, slot, then=None):
            with torch.cuda.stream(self.demand_stream):
                torch.cuda._sleep(LATE_CYCLES)
            return load(self, src, dst, slot, then)

        monkeypatch.setattr(Transfer, "load", late_load)
    got = model.generate(_prompt(), **GREEDY).cpu()
    stats = model.stats()["cache"]
    print(f"\n{dtype}, late copies {late}: {stats}")
    assert stats["copies"] > SLOTS  # evictions happened
    assert stats["tokens_routed"] == (16 + GREEDY["max_new_tokens"] - 1) * 3 * 2
    assert torch.equal(got, expected)
    _assert_tables_follow_the_slots(model.cache)


@pytest.mark.parametrize("prefetch", ["gate", "trained"])
def test_cuda_lagged_staging_generates_the_all_resident_text_from_replayed_steps(mixtral_store, prefetch):
    model, expected = _lagged_model(mixtral_store, "bfloat16", policy="mira", prefetch="gate")
    if prefetch == "trained":  # untrained heads: right or wrong, staging must not change the text
        config = HeadConfig(num_layers=3, num_experts=8, top_k=2, hidden_size=model.hf_model.config.hidden_size)
        heads = PredictorHeads(config)
        predictor = TrainedPredictor(heads, GateSpeculation(model_routers(model.hf_model), 8), "cuda")
        for layer in [m for m in model.hf_model.modules() if isinstance(m, MiraExperts)]:
            layer.predictor = predictor
    got = model.generate(_prompt(), **GREEDY).cpu()
    stats = model.stats()
    print(f"\nlagged staging, {prefetch}: prefetch {stats['prefetch']}, replayed {stats['decode_steps_replayed']}, "
          f"served {stats['cache']['tokens_served']}")
    assert torch.equal(got, expected)
    assert stats["decode_steps_replayed"] > 0
    assert 0 < stats["prefetch"]["issued"] == stats["prefetch"]["used"] + stats["prefetch"]["wasted"]
    _assert_tables_follow_the_slots(model.cache)


@pytest.mark.parametrize(("policy", "prefetch"), [("lru", "off"), ("mira", "gate")])
def test_a_lagged_decode_step_neither_syncs_nor_allocates_inside_the_experts(mixtral_store, policy, prefetch):
    """Host syncs (CUDA sync-debug warnings) and caching-allocator allocations inside Mira's experts
    modules during decode steps (tests/gpu_counts.py): none, also while staging on the device; and
    the settle after each step syncs once and allocates nothing, while it admits experts and
    rewrites their table entries."""
    model, _ = _lagged_model(mixtral_store, "bfloat16", policy, prefetch)
    experts = [m for m in model.hf_model.modules() if isinstance(m, MiraExperts)]
    with torch.no_grad():
        prefill = model(_prompt().cuda(), use_cache=True)
        step_ids = prefill.logits[:, -1:].argmax(-1)
        model(step_ids, past_key_values=prefill.past_key_values, use_cache=True)  # warm: lazy buffers, cuBLAS
        torch.cuda.synchronize()
        settle = {"syncs": 0, "allocations": 0}
        copies = model.cache.telemetry.copies
        with sync_warnings() as caught, InsideModules(experts, caught) as inside:
            for token in STEP_TOKENS:  # steps over other tokens than the warm one: misses to admit
                step_ids.fill_(token)
                model.hf_model.forward(step_ids, past_key_values=prefill.past_key_values, use_cache=True)
                seen, allocated = len(caught), cuda_allocations()
                model.cache.settle()
                settle["allocations"] += cuda_allocations() - allocated
                settle["syncs"] += syncs(caught[seen:])
    counts = inside.counts
    settle["copies"] = model.cache.telemetry.copies - copies
    print(f"\nlagged decode steps inside the experts modules: {counts}; settles: {settle}")
    assert counts["calls"] == len(experts) * len(STEP_TOKENS) == 3 * len(STEP_TOKENS)
    assert counts["syncs"] == 0 and counts["allocations"] == 0
    assert settle["syncs"] == len(STEP_TOKENS) and settle["allocations"] == 0
    assert settle["copies"] > 0  # the settles admitted experts: they rewrote table entries
    _assert_tables_follow_the_slots(model.cache)
