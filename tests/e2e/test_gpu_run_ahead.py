"""On CUDA, decoding one step ahead of the host (mira.runtime.run_ahead, the default where decode
steps replay): the same greedy ids as transformers' loop (`decode_ahead = False`) on the same
lagged model under a budget, with the steps replayed from CUDA graphs; and between two new tokens
the host does not wait for the device but to read a token back that has landed, where transformers'
loop waits for each step. A caller's stopping criterion that holds CUDA tensors of its own keeps
transformers' loop, and stops where it would.

Skipped without a GPU; run on the GPU machine with `python -m pytest -m gpu`.
"""

import pytest
import torch
from transformers import StoppingCriteriaList

import mira
from gpu_counts import sync_warnings, syncs
from stop_on_ids import StopOnIds

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
NEW_TOKENS = 24


class _Syncs:
    """A streamer that notes the host syncs caught so far at each new token."""

    def __init__(self, caught: list):
        self.caught, self.at_token = caught, []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.at_token.append(syncs(self.caught))
        self._prompt_seen = True

    def end(self) -> None:
        pass


def _lagged(store):
    probe = mira.load(store, device="cuda", dtype="bfloat16", vram_budget=64 << 30, progress=False)
    budget = probe.plan.reserve_bytes + 10 * probe.store.blob_bytes  # 10 of 24 experts: misses read from the host
    del probe
    return mira.load(store, device="cuda", dtype="bfloat16", vram_budget=budget, prefetch="off",
                     residency="lagged", progress=False)


def test_decoding_ahead_replays_the_same_ids_without_waiting_for_each_step(mixtral_store):
    model = _lagged(mixtral_store)
    prompts = [torch.randint(2, 320, (1, length), generator=torch.Generator().manual_seed(length))
               for length in (16, 9)]
    greedy = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    runs = {}
    for ahead in (True, False):
        model.decode_ahead = ahead
        model.generate(prompts[0], **greedy)  # warm-up: each loop's decode step captured
        replays = model.decode_graphs.replays
        tokens, between = [], []
        for prompt in prompts:
            with sync_warnings() as caught:
                streamer = _Syncs(caught)
                tokens.append(model.generate(prompt, streamer=streamer, **greedy).cpu())
            between.append([b - a for a, b in zip(streamer.at_token, streamer.at_token[1:])])
        runs[ahead] = tokens, between, model.decode_graphs.replays - replays
    (ahead_tokens, ahead_between, ahead_replays), (first_tokens, first_between, first_replays) = runs[True], runs[False]
    assert all(torch.equal(a, b) for a, b in zip(ahead_tokens, first_tokens))
    assert ahead_replays == first_replays == len(prompts) * (NEW_TOKENS - 1)
    print(f"\nhost syncs between two new tokens: ahead {ahead_between}, token first {first_between}")
    assert all(count == 0 for counts in ahead_between for count in counts)
    assert all(count > 0 for counts in first_between for count in counts)


def test_a_criterion_holding_cuda_tensors_stops_where_transformers_loop_stops(mixtral_store):
    model = _lagged(mixtral_store)
    prompt = torch.randint(2, 320, (1, 12), generator=torch.Generator().manual_seed(4))
    greedy = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    full = model.generate(prompt, **greedy)[0, 12:].cpu()  # by default decoded ahead, steps replayed
    stop = full[5:7].to("cuda")  # two ids, the first of which comes at the 6th new token at the latest
    first = min(i for i, token in enumerate(full.tolist()) if token in stop.tolist())
    ids = model.generate(prompt, stopping_criteria=StoppingCriteriaList([StopOnIds(stop)]), **greedy)
    assert torch.equal(ids[0, 12:].cpu(), full[: first + 1])
