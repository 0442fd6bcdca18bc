"""Sampling settings, chat messages, stop strings, penalties and cancellation shared by generate, chat
and serve, on the bundled model (CPU) against transformers' own generate and hand-worked cases."""

import threading
from io import StringIO
from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig

import mira
from mira.errors import MiraError
from mira.runtime.chat import chat
from mira.runtime.engine import BUNDLED_MODEL
from mira.runtime.generate import (
    OccurrencePenalty,
    SamplingConfig,
    TextStream,
    encode_messages,
    generate_text,
    generation_kwargs,
    stream_generate,
)
from mira.store.convert import convert

CONVERSATION = [{"role": "system", "content": "You answer in one sentence."},
                {"role": "user", "content": "What is Python?"},
                {"role": "assistant", "content": "A programming language."},
                {"role": "user", "content": "Who made it?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    store = tmp_path_factory.mktemp("bundled") / "store"
    convert(BUNDLED_MODEL, store, "int8-shared", progress=False)
    return mira.load(store, device="cpu", progress=False)


def _generate(model, ids, sampling, cancel=None):
    pieces = []
    report = stream_generate(model, ids, sampling, pieces.append, cancel)
    assert "".join(pieces) == report.text  # what was streamed is the text reported
    return report


def test_messages_go_through_the_chat_template_with_every_turn(model):
    by_hand = ("<|endoftext|><|system|>\nYou answer in one sentence.<|end|>\n<|user|>\nWhat is Python?<|end|>\n"
               "<|assistant|>\nA programming language.<|end|>\n<|user|>\nWho made it?<|end|>\n<|assistant|>\n")
    expected = model.tokenizer(by_hand, add_special_tokens=False).input_ids
    assert encode_messages(model, CONVERSATION)[0].tolist() == expected
    with pytest.raises(MiraError, match="only one user message"):
        encode_messages(model, CONVERSATION, raw=True)


def test_settings_come_from_the_checkpoint_and_calls_override_them():
    def kwargs(checkpoint, sampling):
        return generation_kwargs(SimpleNamespace(hf_model=SimpleNamespace(generation_config=checkpoint)), sampling)

    sampler = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.8, top_k=20, repetition_penalty=1.2)
    got = kwargs(sampler, SamplingConfig(max_new_tokens=5))
    assert (got["do_sample"], got["temperature"], got["top_p"], got["top_k"], got["repetition_penalty"]) == \
        (True, 0.6, 0.8, 20, 1.2)
    got = kwargs(sampler, SamplingConfig(max_new_tokens=5, temperature=0.9, top_k=3))
    assert (got["temperature"], got["top_p"], got["top_k"]) == (0.9, 0.8, 3)
    assert kwargs(sampler, SamplingConfig(temperature=0))["do_sample"] is False
    assert kwargs(sampler, SamplingConfig(temperature=1e-45))["do_sample"] is False  # x / 1e-45 overflows
    plain = GenerationConfig(bos_token_id=0)  # a checkpoint that says nothing: greedy, and off when sampling
    assert kwargs(plain, SamplingConfig())["do_sample"] is False
    got = kwargs(plain, SamplingConfig(top_p=0.5))
    assert (got["do_sample"], got["temperature"], got["top_p"], got["top_k"]) == (True, 1.0, 0.5, 0)
    server = SamplingConfig(temperature=0.3, top_k=7)
    assert SamplingConfig(top_k=2).with_defaults(server) == SamplingConfig(temperature=0.3, top_k=2)
    with pytest.raises(MiraError, match="top-p"):
        SamplingConfig(top_p=1.5)
    SamplingConfig(seed=2**64 - 1), SamplingConfig(seed=-2**63)  # what torch.manual_seed takes
    for seed in (2**64, -2**63 - 1):
        with pytest.raises(MiraError, match="seed"):
            SamplingConfig(seed=seed)


def test_seeded_sampling_is_transformers_sampling_and_reproducible(model):
    ids = encode_messages(model, CONVERSATION)
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.9, top_k=40, top_p=0.95, seed=7)
    first = _generate(model, ids, sampling)
    _generate(model, ids, SamplingConfig(max_new_tokens=5, temperature=1.0, seed=99))  # something in between
    again = _generate(model, ids, sampling)
    assert (again.text, again.new_tokens) == (first.text, first.new_tokens)
    torch.manual_seed(7)
    reference = model.generate(ids, max_new_tokens=12, do_sample=True, temperature=0.9, top_k=40, top_p=0.95,
                               attention_mask=torch.ones_like(ids), pad_token_id=model.tokenizer.pad_token_id)
    assert first.new_tokens == reference.shape[1] - ids.shape[1]
    assert first.text == model.tokenizer.decode(reference[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("frequency, presence", [(-1.5, -0.5), (2.0, 0.5)])
def test_frequency_and_presence_penalties_against_a_hand_rolled_greedy_loop(model, frequency, presence):
    ids = encode_messages(model, [{"role": "user", "content": "Say hello to everyone in the room, please."}])
    report = _generate(model, ids, SamplingConfig(max_new_tokens=16, temperature=0, frequency_penalty=frequency,
                                                  presence_penalty=presence))
    tokens = ids[0].tolist()
    counts = torch.zeros(model.hf_model.config.vocab_size, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(16):
            logits = model(torch.tensor([tokens])).logits[0, -1].double()
            choice = int((logits - frequency * counts - presence * (counts > 0).double()).argmax())
            tokens.append(choice)
            counts[choice] += 1
            if choice == model.tokenizer.eos_token_id:
                break
    assert report.text == model.tokenizer.decode(tokens[ids.shape[1]:], skip_special_tokens=True)
    plain = _generate(model, ids, SamplingConfig(max_new_tokens=16, temperature=0))
    assert plain.text != report.text  # the penalties changed something


def test_occurrence_penalty_hand_worked():
    prompt_and_generated = torch.tensor([[3, 1, 1, 2]])  # prompt [3], generated 1, 1, 2
    scores = torch.zeros(1, 5)
    penalised = OccurrencePenalty(1, frequency=0.5, presence=0.25)(prompt_and_generated, scores)
    assert penalised.tolist() == [[0.0, -1.25, -0.75, 0.0, 0.0]]


def test_a_stop_string_ends_the_text_before_it(model):
    ids = encode_messages(model, [{"role": "user", "content": "Tell me about the sea."}])
    free = _generate(model, ids, SamplingConfig(max_new_tokens=30, temperature=0))
    words = free.text.split(" ")
    assert len(words) > 4
    stop = " " + words[3][:3]  # a stop string that may span tokens
    cut = free.text.index(stop)
    stopped = _generate(model, ids, SamplingConfig(max_new_tokens=30, temperature=0, stop=("zzqq", stop)))
    assert stopped.text == free.text[:cut] and stopped.finish_reason == "stop"
    met = next(k for k in range(1, free.new_tokens + 1)
               if stop in model.tokenizer.decode(free.new_ids[:k], skip_special_tokens=True))
    assert stopped.new_ids == free.new_ids[:met]  # up to the token that completed the stop string
    unmet = _generate(model, ids, SamplingConfig(max_new_tokens=30, temperature=0, stop=(free.text[-2:] + "#",)))
    assert unmet.text == free.text  # text held back as a possible stop is released at the end


class _Pieces:
    """A tokenizer whose ids are fixed strings (with skip_special_tokens)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


def test_text_stream_holds_back_what_may_begin_a_stop_string():
    out = []
    stream = TextStream(_Pieces(["Hel", "lo w", "or", "ld!"]), ["o wor", "xyz"], out.append)
    stream.add([0])
    assert out == ["Hel"]
    stream.add([1])  # "lo w" may begin "o wor": "l" goes out, "o w" waits
    assert out == ["Hel", "l"]
    stream.add([2])
    assert stream.stopped and stream.text == "Hell"
    stream.add([3])  # ignored after the stop
    stream.finish()
    assert stream.text == "Hell"


def test_text_stream_emits_whole_characters_only(model):
    text = "Café ☕ and 😀 emoji"
    ids = model.tokenizer(text, add_special_tokens=False).input_ids
    out = []
    stream = TextStream(model.tokenizer, [], out.append)
    for token in ids:
        stream.add([token])
    stream.finish()
    assert "".join(out) == model.tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in piece for piece in out)


def test_cancel_ends_generation_after_the_current_step(model):
    ids = encode_messages(model, [{"role": "user", "content": "Write a long story."}])
    cancel = threading.Event()
    tokens = []

    def on_text(piece):
        tokens.append(piece)
        if len(tokens) == 3:
            cancel.set()

    report = stream_generate(model, ids, SamplingConfig(max_new_tokens=200, min_new_tokens=200, temperature=0),
                             on_text, cancel)
    assert report.finish_reason == "cancelled"
    assert 3 <= report.new_tokens <= 5  # pieces can span tokens; it stops in the step that set it


def test_chat_sends_every_turn_with_the_conversation_before_it(model):
    turns = iter(["What is Python?", "/reset", "What is Python?", "Who made it?", "/exit", "never read"])
    out = StringIO()
    sampling = SamplingConfig(max_new_tokens=8, temperature=0)
    history = chat(model, sampling, "You answer in one sentence.", read=lambda: next(turns), out=out)
    replies = out.getvalue().split("\n")[:-1]
    assert len(replies) == 3 and replies[0] == replies[1]
    first = generate_text(model, CONVERSATION[:2], sampling, out=None).text
    second = generate_text(model, [*CONVERSATION[:2], {"role": "assistant", "content": first},
                                   {"role": "user", "content": "Who made it?"}], sampling, out=None)
    assert replies[1:] == [first, second.text]
    assert [m["role"] for m in history] == ["system", "user", "assistant", "user", "assistant"]



def test_prompt_logprobs_come_from_the_prefill_of_the_generation(model):
    ids = model.tokenizer("Once upon a time, in a land", return_tensors="pt").input_ids  # [1, T]
    with torch.no_grad():
        reference = torch.log_softmax(model.hf_model(ids).logits[0, :-1].double(), dim=-1)  # [T - 1, V]
    forwards = []
    hook = model.hf_model.register_forward_hook(lambda module, args, output: forwards.append(output.logits.shape[1]))
    try:
        report = _generate(model, ids, SamplingConfig(max_new_tokens=3, temperature=0, logprobs=2,
                                                      prompt_logprobs=True))
    finally:
        hook.remove()
    assert forwards[0] == ids.shape[1] and len(forwards) == len(report.new_ids)  # no forward of the prompt alone
    taken = ids[0, 1:].tolist()
    assert [entry.token for entry in report.prompt_logprobs] == taken
    assert [entry.logprob for entry in report.prompt_logprobs] == pytest.approx(
        reference[range(len(taken)), taken].tolist(), abs=1e-4)
    assert [[i for i, _ in entry.top] for entry in report.prompt_logprobs] == reference.topk(2).indices.tolist()
