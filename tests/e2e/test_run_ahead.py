"""Decoding one step ahead of the host (mira.runtime.run_ahead) against transformers' own loop.

On the CPU, forced (`decode_ahead = True`; by default it runs where steps replay from CUDA graphs):
the same ids, streamed in the same order, as `generate`'s own sampling loop on the same settings,
greedy and seeded sampling, stopped by the length, an end-of-sequence id or a stopping criterion
(a caller's own criterion, unless a HostCriterion, keeps transformers' loop); token k is streamed
only once step k + 1 has been called; the logprob tap hands each token its own step's
log-probabilities; and a lagged model that settles each step two steps on makes the same policy
decisions as one that settles it at the next step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteriaList

import mira
from mira.runtime.generate import SamplingConfig, encode_prompt, stream_generate
from mira.runtime.run_ahead import HostCriterion
from mira.store.convert import convert
from stop_on_ids import StopOnIds
from tiny_families import CASES, VOCAB, family_checkpoint

EOS = 1  # the tiny checkpoints' end-of-sequence id
NO_STATIC_CACHE = {"minimax", "deepseek_v4"}  # families whose caches have no static form in transformers
NEW_TOKENS = 12


def _prompt(length: int = 10) -> torch.Tensor:
    return torch.randint(2, 320, (1, length), generator=torch.Generator().manual_seed(3))


def _lagged(store, slots: int | None = None):
    probe = mira.load(store, device="cpu", vram_budget=1 << 30, progress=False)
    budget = probe.plan.reserve_bytes + (slots if slots is not None else 9) * probe.store.blob_bytes
    return mira.load(store, device="cpu", vram_budget=budget, policy="mira", prefetch="off", residency="lagged",
                     progress=False)


class _Forced(LogitsProcessor):
    """Forces `token` at sequence length `at` (the id every later step then sees in the ids)."""

    def __init__(self, at: int, token: int):
        self.at, self.token = at, token

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] == self.at:
            scores.fill_(float("-inf"))
            scores[:, self.token] = 0.0
        return scores


class _StopAfter(HostCriterion):
    """Stops once the ids hold `token` after the prompt (read on the host when decoding ahead)."""

    def __init__(self, prompt: int, token: int):
        self.prompt, self.token = prompt, token

    def __call__(self, input_ids, scores, **kwargs):
        found = bool((input_ids[0, self.prompt:] == self.token).any())
        return torch.full((input_ids.shape[0],), found, dtype=torch.bool, device=input_ids.device)


class _Streamed:
    """A streamer that keeps what it was handed, and how many forwards had run at each new token."""

    def __init__(self, model):
        self.puts: list[list[int]] = []
        self.forwards_at_put: list[int] = []
        self.ended = False
        self._forwards = 0
        model.hf_model.register_forward_pre_hook(self._count)

    def _count(self, module, args) -> None:
        self._forwards += 1

    def put(self, value) -> None:
        self.puts.append(value.reshape(-1).tolist())
        self.forwards_at_put.append(self._forwards)

    def end(self) -> None:
        self.ended = True


def _both(model, prompt, **kwargs):
    """(ids, streamer) of the call decoded ahead, then by transformers' loop, on the same model state."""
    runs = []
    for ahead in (True, False):
        model.decode_ahead = ahead
        streamed = _Streamed(model)
        torch.manual_seed(5)
        runs.append((model.generate(prompt, streamer=streamed, pad_token_id=0, **kwargs), streamed))
    return runs


SETTINGS = {
    "greedy": dict(do_sample=False),
    "sampled": dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.2),
    "min-length": dict(do_sample=False, min_new_tokens=NEW_TOKENS),
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_decoding_ahead_gives_transformers_ids_in_the_same_order(stores, setting):
    model = mira.load(stores["mixtral", "int8-row"], device="cpu", residency="lagged", progress=False)
    (ids, streamed), (reference, expected) = _both(model, _prompt(), max_new_tokens=NEW_TOKENS, **SETTINGS[setting])
    assert torch.equal(ids, reference)
    assert streamed.puts == expected.puts and streamed.ended and expected.ended
    assert streamed.puts[0] == _prompt()[0].tolist()  # generate itself hands the prompt over first
    assert sum(len(p) for p in streamed.puts[1:]) == ids.shape[1] - _prompt().shape[1]
    # one step in flight: token k is streamed once step k + 1 has been called (the prompt's forward is
    # step 1), but for the last, after which no step is left to call
    new = len(streamed.puts) - 1
    assert streamed.forwards_at_put[1:] == [min(k + 1, new) for k in range(1, new + 1)]
    assert expected.forwards_at_put[1:] == list(range(1, new + 1))  # transformers' loop: step k, then token k


@pytest.mark.parametrize("stop", ["end-of-sequence", "criterion"])
def test_a_stop_ends_decoding_ahead_where_transformers_ends(stores, stop):
    """A stop at the 5th new token: the step already called after it is dropped."""
    model = mira.load(stores["mixtral", "int8-row"], device="cpu", residency="lagged", progress=False)
    prompt = _prompt()
    token = EOS if stop == "end-of-sequence" else 7
    forced = LogitsProcessorList([_Forced(prompt.shape[1] + 4, token)])
    criteria = StoppingCriteriaList([_StopAfter(prompt.shape[1], token)] if stop == "criterion" else [])
    (ids, streamed), (reference, expected) = _both(model, prompt, max_new_tokens=NEW_TOKENS, do_sample=False,
                                                   logits_processor=forced, stopping_criteria=criteria)
    assert ids.shape[1] == prompt.shape[1] + 5 and ids[0, -1] == token
    assert torch.equal(ids, reference) and streamed.puts == expected.puts
    assert streamed.forwards_at_put[-1] == 6  # the 6th step ran ahead and was dropped


def test_a_callers_own_criterion_keeps_transformers_loop(stores):
    model = mira.load(stores["mixtral", "int8-row"], device="cpu", residency="lagged", progress=False)
    prompt = _prompt()
    forced = LogitsProcessorList([_Forced(prompt.shape[1] + 4, 7)])
    criteria = StoppingCriteriaList([StopOnIds(torch.tensor([7, 9]))])
    (ids, streamed), (reference, expected) = _both(model, prompt, max_new_tokens=NEW_TOKENS, do_sample=False,
                                                   logits_processor=forced, stopping_criteria=criteria)
    assert ids.shape[1] == prompt.shape[1] + 5 and torch.equal(ids, reference)
    assert streamed.forwards_at_put == expected.forwards_at_put  # no step ran ahead of its token


def test_the_logprob_tap_reads_each_tokens_own_step():
    model = mira.load(device="cpu", residency="lagged", progress=False)  # the bundled model
    prompt = encode_prompt(model, "Tell me about the sea.", raw=False)
    runs = []
    for ahead in (True, False):
        model.decode_ahead = ahead
        entries = []
        report = stream_generate(model, prompt, SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=0, logprobs=3),
                                 lambda text: None, on_logprob=entries.append)
        runs.append((report.new_ids, entries))
    (ids, entries), (expected_ids, expected) = runs
    assert ids == expected_ids and len(entries) == len(expected) == len(ids)
    for entry, reference in zip(entries, expected):  # transformers' loop here decodes on a dynamic KV cache:
        # the same sums in another order
        assert entry.token == reference.token
        assert [token for token, _ in entry.top] == [token for token, _ in reference.top]
        np.testing.assert_allclose([entry.logprob, *(p for _, p in entry.top)],
                                   [reference.logprob, *(p for _, p in reference.top)], rtol=0, atol=1e-4)


def test_settling_two_steps_on_decides_as_settling_at_the_next_step(stores):
    """A lagged model decoding ahead settles step k when step k + 2 starts, its counts sent to the
    host as step k + 1 starts: the same accesses in the same order, so the same ids, telemetry,
    copies and residents as settling each step when the next starts."""
    runs = {}
    for ahead in (True, False):
        model = _lagged(stores["mixtral", "int8-row"])
        model._defer_settle = True  # as on CUDA
        model.decode_ahead = ahead
        forwards, settled_at = [0], []  # the hook counts a forward after the model's own hook settles
        model.hf_model.register_forward_pre_hook(lambda module, args: forwards.__setitem__(0, forwards[0] + 1))
        settle = model._settle_step
        model._settle_step = lambda tokens, sent=False: settled_at.append((forwards[0], sent)) or settle(tokens, sent)
        ids = [model.generate(_prompt(length), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
               for length in (10, 5)]
        runs[ahead] = (model, ids, settled_at)
    (ahead, ahead_ids, ahead_settled), (after, after_ids, after_settled) = runs[True], runs[False]
    assert all(torch.equal(a, b) for a, b in zip(ahead_ids, after_ids))
    assert np.array_equal(ahead.cache.telemetry.counts, after.cache.telemetry.counts)
    assert ahead.cache.telemetry.copies == after.cache.telemetry.copies > 9
    assert ahead.cache.policy.resident() == after.cache.policy.resident()
    assert ahead.cache._slot_of == after.cache._slot_of
    steps = NEW_TOKENS  # forwards per call: the prompt's and NEW_TOKENS - 1 decode steps
    # (forwards before, sent): settling at the next step, step k's as step k + 1 starts, the last at
    # the call's end
    assert after_settled == [(k, False) for k in range(1, 2 * steps + 1)]
    # two steps on: step k's counts, sent as step k + 1 starts, settled as step k + 2 starts; at the
    # call's end the sent step's, then the last step's, read back then
    first = [(k + 1, True) for k in range(1, steps - 1)] + [(steps, True), (steps, False)]
    assert ahead_settled == first + [(k + steps, sent) for k, sent in first]


@pytest.mark.parametrize("family", CASES)
def test_every_family_decodes_ahead_to_transformers_ids(family, tmp_path):
    """Every family Mira runs (tests/tiny_families.py), lagged on a static KV cache: each step's inputs
    made by the family's own generation code, as transformers' loop makes them (sliding windows,
    linear attention, its own positions)."""
    store = tmp_path / "store"
    convert(family_checkpoint(family, tmp_path / "ckpt"), store, "int8-shared", progress=False)
    model = mira.load(store, device="cpu", residency="lagged", max_context=64, progress=False)
    prompt = torch.randint(2, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    (ids, streamed), (reference, expected) = _both(model, prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(ids, reference) and streamed.puts == expected.puts
    if model._kv_cache is None:  # a family that takes no static KV cache decodes in transformers' loop
        assert family in NO_STATIC_CACHE and streamed.forwards_at_put[1] == 1
    else:  # the step after the first token ran before that token was streamed
        assert streamed.forwards_at_put[1] == 2
