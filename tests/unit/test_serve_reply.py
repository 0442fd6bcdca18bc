"""A completion's log-probabilities through the server's reply (mira.serve.app.Reply), whole and
streamed, with a SentencePiece-style tokenizer whose prompts begin with "<s>": every token's text
stands where its text_offset says in the returned text (the reference: whole-prefix decodes)."""

from __future__ import annotations

import json

import pytest

from mira.runtime.generate import GenerationReport, TextStream, TokenLogprob
from mira.serve.app import Reply
from token_text_reference import llama_style_tokenizer, token_texts


@pytest.fixture(scope="module")
def tokenizer():
    return llama_style_tokenizer()


def _entries(ids):
    return tuple(TokenLogprob(token, -1.0, ((token, -1.0),)) for token in ids)


def _report(tokenizer, prompt_ids, new_ids):
    stream = TextStream(tokenizer, (), lambda piece: None)  # the answer's text, as generation decodes it
    for token in new_ids:
        stream.add([token])
    stream.finish()
    return GenerationReport(stream.text, len(prompt_ids), tuple(new_ids), 0.1, 10.0, "length",
                            _entries(new_ids), _entries(prompt_ids[1:]))


def _expected(tokenizer, prompt_ids, new_ids, echoed):
    texts = token_texts(tokenizer, prompt_ids) + token_texts(tokenizer, new_ids)
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(prompt_ids))]
    offsets += [len(echoed) + sum(len(t) for t in texts[len(prompt_ids):i]) for i in range(len(prompt_ids), len(texts))]
    return texts, offsets


@pytest.mark.parametrize("prompt, answer", [("Once upon a time", " in a land far away"),
                                            ("the sea 你", " is calm é")])
def test_an_echoed_completion_names_each_token_where_it_stands(tokenizer, prompt, answer):
    prompt_ids = tokenizer(prompt).input_ids  # "<s>" first
    new_ids = tokenizer(answer, add_special_tokens=False).input_ids
    report = _report(tokenizer, prompt_ids, new_ids)
    texts, offsets = _expected(tokenizer, prompt_ids, new_ids, prompt)
    whole = Reply("cmpl-1", 0, "m", chat=False, tokenizer=tokenizer, echo=(prompt, prompt_ids))
    choice = whole.whole(report)["choices"][0]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == texts and logprobs["text_offset"] == offsets
    assert all(choice["text"][offset:offset + len(text)] == text for offset, text in zip(offsets, texts))
    assert choice["text"] == prompt + report.text

    streamed = Reply("cmpl-1", 0, "m", chat=False, tokenizer=tokenizer, echo=(prompt, prompt_ids))
    assert streamed.opening() is None and streamed.echo_owes == len(prompt_ids) - 1  # the echo waits for them
    events = [streamed.echoed(report.prompt_logprobs)] + [streamed.chunk("", entries=[entry])
                                                          for entry in report.logprobs]
    parts = [json.loads(event.removeprefix("data: "))["choices"][0]["logprobs"] for event in events]
    assert [t for part in parts for t in part["tokens"]] == texts
    assert [o for part in parts for o in part["text_offset"]] == offsets

