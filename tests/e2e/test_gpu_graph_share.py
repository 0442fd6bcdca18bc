"""On CUDA, the CPU lanes' share of decode calls inside replayed steps (mira.runtime.graph_share):
the CPU path's greedy text in float32, each decode step captured once and replayed, and the
calibrated quotas on this machine, priced again as decoding goes.

Skipped without a GPU; run on the GPU machine with `python -m pytest -m gpu`.
"""

import pytest
import torch

import mira

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
NEW_TOKENS = 32
GREEDY = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
K = 2  # the tiny Mixtral routes 2 experts a token


def _prompt():
    """Longer than a decode call: its prefill is not one of the decode steps that price the quotas."""
    return torch.randint(2, 320, (1, 20), generator=torch.Generator().manual_seed(5))


def _budget(store, slots: int, dtype: str) -> int:
    probe = mira.load(store, device="cuda", dtype=dtype, vram_budget=64 << 30, progress=False)
    return probe.plan.reserve_bytes + slots * probe.store.blob_bytes


@pytest.mark.parametrize("lanes", [1, 2])
def test_replayed_steps_with_the_lanes_generate_the_cpu_paths_float32_text(mixtral_store, lanes):
    expected = mira.load(mixtral_store, device="cpu", progress=False).generate(_prompt(), **GREEDY)
    model = mira.load(mixtral_store, device="cuda", dtype="float32", vram_budget=_budget(mixtral_store, 10, "float32"),
                      prefetch="off", cpu_experts="graph", cpu_threads=2, cpu_lanes=lanes, progress=False)
    share = model.graph_share
    share.quotas, share.prices = [K] * len(share.quotas), None  # every miss, for good: the lanes' part is checked
    got = model.generate(_prompt(), **GREEDY).cpu()
    stats = model.stats()
    print(f"\n{stats['cpu_experts']}")
    assert torch.equal(got, expected)
    assert (model.decode_graphs.captures, model.decode_graphs.replays) == (1, NEW_TOKENS - 2)
    assert stats["residency"] == "lagged" and stats["cpu_experts"]["experts"] > 0


def test_the_quota_is_calibrated_and_bf16_decoding_replays(mixtral_store):
    model = mira.load(mixtral_store, device="cuda", dtype="bfloat16",
                      vram_budget=_budget(mixtral_store, 10, "bfloat16"), prefetch="off", cpu_experts="graph",
                      progress=False)
    quotas = model.graph_share.quotas
    assert len(quotas) == 3 and all(0 <= q <= K for q in quotas)
    model.generate(_prompt(), **GREEDY)
    print(f"\n{model.stats()['cpu_experts']}")
    # the quotas are priced again after 16 of the 31 decode steps; a change drops the captured step,
    # which costs one more eager warm-up
    assert model.graph_share.requotes <= 1
    assert model.decode_graphs.replays == NEW_TOKENS - 2 - model.graph_share.requotes
