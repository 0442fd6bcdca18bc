"""On CUDA, decode steps replayed from CUDA graphs (mira.runtime.graphs) generate exactly the tokens
eager steps generate on the same static KV cache, count the same telemetry, and show the routing
recorder the same routing; and each step is captured once and then replayed.

Skipped without a GPU; run on the GPU machine with `python -m pytest -m gpu`.
"""

import numpy as np
import pytest
import torch
from transformers import StaticCache

import mira
from mira.runtime.generate import SamplingConfig, encode_prompt, stream_generate
from mira.runtime.tracing import RoutingRecorder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
NEW_TOKENS = 24
GREEDY = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


def _prompts():
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(2, 320, (1, length), generator=generator) for length in (16, 9, 16)]


def _run(model, kv_cache=None):
    """Tokens, routing trace and telemetry counts of generating from every prompt."""
    before = model.cache.telemetry.counts.copy()
    with RoutingRecorder(model) as recorder:
        tokens = []
        for prompt in _prompts():
            recorder.next_sequence()
            if kv_cache is not None:
                kv_cache.reset()
            extra = {} if kv_cache is None else {"past_key_values": kv_cache}
            tokens.append(model.generate(prompt, **GREEDY, **extra).cpu())
    return tokens, recorder.trace(), model.cache.telemetry.counts - before


@pytest.mark.parametrize("budget_experts", [None, 10])
def test_replayed_decode_steps_match_eager_steps(mixtral_store, budget_experts):
    model = mira.load(mixtral_store, device="cuda", dtype="bfloat16", vram_budget=64 << 30, prefetch="off", progress=False)
    if budget_experts is not None:  # 10 of 24 experts fit, lagged: misses are read from the host store
        budget = model.plan.reserve_bytes + budget_experts * model.store.blob_bytes
        del model
        model = mira.load(mixtral_store, device="cuda", dtype="bfloat16", vram_budget=budget, prefetch="off",
                          residency="lagged", progress=False)
        assert model.cache.pool.num_slots == budget_experts
    graphs = model.decode_graphs
    assert graphs is not None
    replayed_tokens, replayed_trace, replayed_counts = _run(model)

    # each generate call: a prefill and NEW_TOKENS - 1 decode steps of one signature; the very first
    # decode step warms up, the second is captured, every later one is a replay
    decode_steps = len(_prompts()) * (NEW_TOKENS - 1)
    assert (graphs.captures, graphs.replays) == (1, decode_steps - 1)

    model.use_cuda_graphs(False)
    kv_cache = StaticCache(config=model.hf_model.config, max_cache_len=model.max_context)
    eager_tokens, eager_trace, eager_counts = _run(model, kv_cache)
    for replayed, eager in zip(replayed_tokens, eager_tokens):
        assert torch.equal(replayed, eager)
    assert np.array_equal(replayed_trace.topk_ids, eager_trace.topk_ids)
    assert replayed_trace.topk_ids.shape[0] == sum(p.shape[1] for p in _prompts()) + decode_steps
    routed = np.zeros_like(eager_counts[..., 0])
    np.add.at(routed, (np.arange(routed.shape[0])[None, :, None], eager_trace.topk_ids.astype(np.int64)), 1)
    assert np.array_equal(eager_counts[..., 0], routed)  # the telemetry counts every routed token once
    assert np.array_equal(replayed_counts[..., 0], eager_counts[..., 0])
    if budget_experts is None:
        assert np.array_equal(replayed_counts, eager_counts)



@pytest.mark.parametrize("prompt_logprobs", [False, True], ids=["new", "with-prompt"])
def test_logprobs_of_replayed_steps_are_those_of_one_forward_over_the_text(prompt_logprobs):
    model = mira.load(device="cuda", progress=False)  # the bundled model, every expert resident
    prompt = encode_prompt(model, "Tell me about the sea.", raw=False)
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, temperature=0, logprobs=3,
                              prompt_logprobs=prompt_logprobs)
    report = stream_generate(model, prompt, sampling, lambda text: None)
    assert model.decode_graphs.replays >= NEW_TOKENS - 3  # the steps whose logits the tap read were replayed
    generated = [entry.token for entry in report.logprobs]
    assert len(generated) == report.new_tokens == NEW_TOKENS
    with torch.no_grad():  # many tokens at once: an eager forward
        logits = model(torch.cat([prompt, torch.tensor([generated])], dim=1).to(model.device)).logits[0].double().cpu()
    reference = torch.log_softmax(logits, dim=-1)[prompt.shape[1] - 1:-1]  # [NEW_TOKENS, V]
    held_off = {model.tokenizer.eos_token_id}  # min_new_tokens masks the end of sequence, not its log-probability
    for step, entry in enumerate(report.logprobs):
        assert next(token for token, _ in entry.top if token not in held_off) == entry.token  # greedy: the likeliest
        assert entry.logprob == pytest.approx(reference[step, entry.token].item(), abs=0.1)  # bf16 logits
    if prompt_logprobs:  # read from the prefill of the same generation
        before = torch.log_softmax(logits, dim=-1)[:prompt.shape[1] - 1]  # [T - 1, V]
        taken = prompt[0, 1:].tolist()
        assert [entry.token for entry in report.prompt_logprobs] == taken
        assert [entry.logprob for entry in report.prompt_logprobs] == pytest.approx(
            before[range(len(taken)), taken].tolist(), abs=0.1)
