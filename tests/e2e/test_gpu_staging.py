"""On CUDA, no STAGE slot is read before its prefetch copy has landed (paper IV-F; DESIGN.md 2.8).

Each prefetch copy is held back ~50 ms on the prefetch stream (a `torch.cuda._sleep` kernel queued
before it) and every slot starts as 0xFF bytes (int8 -1, NaN bf16 scales). A staged expert is read
two MoE layers after it was staged; in between the host only launches one FFN and one layer of the
tiny model, a few milliseconds at most, so the compute stream gets to that read long before the
copy lands unless it waits on the slot's event. At that point, on the compute stream (where the
kernel reads the slot), each STAGE row the cache hands out is compared with the expert's bytes,
and the greedy tokens are compared with the all-resident run's. The last test takes the wait away
for slots whose last copy was a prefetch and checks that the comparison then does see stale bytes:
the check can fail, so its passing means the wait is there.

Skipped without a GPU; run on the GPU machine with `python -m pytest -m gpu tests/e2e/test_gpu_staging.py`.
"""

import pytest
import torch

import mira
from mira.cache.policy import Tier
from mira.predict.heads import HeadConfig, PredictorHeads, predictor_file, save_heads
from mira.cache.transfer import Transfer
from mira.store.manifest import Manifest
from tiny_models import COMMON, make_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GREEDY = dict(max_new_tokens=32, do_sample=False, pad_token_id=0)
HOLD_BACK_CYCLES = 100_000_000  # ~50 ms of GPU clock before each prefetch copy starts
SLOTS = 12  # of 24 experts


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A tiny Mixtral store (3 MoE layers, top-2 of 8) with random predictor heads beside it."""
    from mira.store.convert import convert

    root = tmp_path_factory.mktemp("gpu-staging")
    convert(make_checkpoint("mixtral", root / "ckpt"), root / "store", "int8-shared", progress=False)
    manifest = Manifest.read(root / "store")
    torch.manual_seed(0)
    config = HeadConfig(num_layers=len(manifest.moe_layers), num_experts=manifest.num_experts,
                        top_k=COMMON["num_experts_per_tok"], hidden_size=COMMON["hidden_size"])
    save_heads(PredictorHeads(config), predictor_file(root / "store"), manifest.source_fingerprint, training={})
    return root / "store"


def _prompt():
    return torch.randint(2, 320, (1, 16), generator=torch.Generator().manual_seed(5))


def _staged_generation(store, prefetch: str, monkeypatch, wait_for_prefetches: bool = True):
    """Greedy tokens under SLOTS slots with delayed prefetch copies, STAGE rows read, and how many of
    those rows held other bytes than their expert's when the compute stream reached them."""
    load, ready = Transfer.load, Transfer.ready
    prefetched: set[int] = set()  # slots whose last copy was a prefetch

    def held_back_load(self, src, dst, slot, prefetch=False, then=None):
        (prefetched.add if prefetch else prefetched.discard)(slot)
        if prefetch:
            self.prefetch_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.prefetch_stream):
                torch.cuda._sleep(HOLD_BACK_CYCLES)
        return load(self, src, dst, slot, prefetch, then)

    def ready_but_for_prefetches(self, slot):
        if slot not in prefetched:
            ready(self, slot)

    monkeypatch.setattr(Transfer, "load", held_back_load)
    if not wait_for_prefetches:
        monkeypatch.setattr(Transfer, "ready", ready_but_for_prefetches)
    probe = mira.load(store, device="cuda", dtype="bfloat16", vram_budget=64 << 30, prefetch="off", progress=False)
    budget = probe.plan.reserve_bytes + SLOTS * probe.store.blob_bytes
    del probe
    model = mira.load(store, device="cuda", dtype="bfloat16", vram_budget=budget, prefetch=prefetch,
                      residency="inline", progress=False)  # staging through STAGE slots (lagged: test_gpu_lagged.py)
    assert model.cache.pool.num_slots == SLOTS and model.cache.policy.stage_slots > 0
    model.cache.pool.buffer.fill_(0xFF)
    E = model.store.num_experts
    expected = {uid: model.store.blob(*divmod(uid, E)).cuda() for uid in range(model.store.num_layers * E)}
    stale = torch.zeros((), dtype=torch.int64, device="cuda")
    reads = []
    fetch = model.cache.fetch

    def checked_fetch(layer_position, experts, tokens):
        staged = [e for e in experts if model.cache.policy.tier_of(layer_position * E + e) is Tier.STAGE]
        blobs = fetch(layer_position, experts, tokens)
        for expert in staged:  # enqueued on the compute stream after the waits, before the kernel: no host sync
            stale.add_((blobs[expert] != expected[layer_position * E + expert]).any())
        reads.append(len(staged))
        return blobs

    model.cache.fetch = checked_fetch
    tokens = model.generate(_prompt(), **GREEDY).cpu()
    return tokens, sum(reads), int(stale), model.stats()["prefetch"]


@pytest.mark.parametrize("prefetch", ["gate", "trained"])
def test_stage_slots_are_read_only_after_their_delayed_copies_land(store, monkeypatch, prefetch):
    reference = mira.load(store, device="cuda", dtype="bfloat16", vram_budget=64 << 30, prefetch="off",
                          progress=False)
    expected = reference.generate(_prompt(), **GREEDY).cpu()
    del reference
    tokens, stage_reads, stale, counts = _staged_generation(store, prefetch, monkeypatch)
    print(f"\n{prefetch}: {stage_reads} STAGE reads, {stale} stale; prefetch {counts}")
    assert counts["used"] > 0 and stage_reads > 0
    assert stale == 0
    assert torch.equal(tokens, expected)


def test_without_the_wait_on_prefetched_slots_the_check_sees_stale_bytes(store, monkeypatch):
    _, stage_reads, stale, counts = _staged_generation(store, "gate", monkeypatch, wait_for_prefetches=False)
    print(f"\nno wait: {stage_reads} STAGE reads, {stale} stale; prefetch {counts}")
    assert stale > 0
