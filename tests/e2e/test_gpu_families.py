"""On CUDA, every family Mira runs (tests/e2e/test_moe_families.py's cases) under a budget that leaves
most experts in host memory: the greedy tokens of Mira's exact CPU path in float32, with decode steps
replayed from CUDA graphs wherever residency lags and the cache allows (eager elsewhere); and the
budget's KV reserve holds the static cache those steps use.

Skipped without a GPU; run on the GPU machine with `python -m pytest -m gpu`.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import mira
from mira.models.kvcache import kv_values_per_token
from mira.runtime.graphs import replayable_cache
from mira.store.convert import convert
from tiny_families import CASES, VOCAB, family_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
NEW_TOKENS = 16
GREEDY = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
CONTEXT = 64
# families whose own decode step needs the host, so that it runs eagerly (a capture is tried once and refused)
HOST_BOUND = {"phimoe": "its rotary embedding rebuilds its frequencies on the host at every step"}


@pytest.mark.parametrize("family", CASES)
def test_a_budgeted_family_on_cuda_generates_the_cpu_paths_float32_text(family, tmp_path):
    store = tmp_path / "store"
    convert(family_checkpoint(family, tmp_path / "ckpt"), store, "int8-shared", progress=False)
    prompt = torch.randint(2, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    expected = mira.load(store, device="cpu", progress=False).generate(prompt, **GREEDY)
    probe = mira.load(store, device="cuda", dtype="float32", max_context=CONTEXT, vram_budget=64 << 30,
                      progress=False)
    per_layer = probe.store.num_experts  # the least a budget holds: one layer's experts
    budget = probe.plan.reserve_bytes + per_layer * probe.store.blob_bytes
    del probe
    model = mira.load(store, device="cuda", dtype="float32", max_context=CONTEXT, vram_budget=budget,
                      prefetch="off", progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = model.generate(prompt, **GREEDY).cpu()
    refused = [w for w in caught if "could not be captured" in str(w.message)]
    stats = model.stats()
    print(f"\n{family}: {stats['residency']}, {stats['decode_steps_replayed']} steps replayed, "
          f"{stats['cache']['tokens_served']}")
    assert torch.equal(got, expected)
    assert stats["cache"]["tokens_served"]["miss"] > 0  # the budget left experts in host memory
    kv = model._kv_cache  # the static cache of generate's replayable steps (None: every step ran eagerly)
    replayable = stats["residency"] == "lagged" and kv is not None and replayable_cache(kv)
    if replayable and family not in HOST_BOUND:
        assert not refused
        assert stats["decode_steps_replayed"] == NEW_TOKENS - 2  # one warm-up, then captured and replayed
        held = sum(t.numel() for layer in kv.layers for t in (layer.keys, layer.values))
        assert 0 < held <= kv_values_per_token(model.hf_model.config) * CONTEXT  # within the budget's reserve
    else:
        assert stats["decode_steps_replayed"] == 0
        assert bool(refused) == replayable  # a host-bound family's capture is tried, refused with a warning
