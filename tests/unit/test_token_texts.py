"""A log-probability answer's token texts join into the answer's text (mira.serve.token_texts)."""

from __future__ import annotations

import pytest

from mira.runtime.generate import TextStream
from mira.serve.token_texts import TokenTexts
from token_text_reference import alternative_text, llama_style_tokenizer, token_texts


@pytest.fixture(scope="module")
def tokenizer():
    return llama_style_tokenizer()


def _answer_text(tokenizer, ids):
    """The text generation decodes for `ids`, token by token (mira.runtime.generate.TextStream)."""
    stream = TextStream(tokenizer, (), lambda piece: None)
    for token in ids:
        stream.add([token])
    stream.finish()
    return stream.text


@pytest.mark.parametrize("text", ["Hello world, the sea is calm.", "Once upon a time 你好 in a land", "é"])
def test_token_texts_join_into_the_decoded_text(tokenizer, text):
    ids = tokenizer(text).input_ids + [tokenizer.eos_token_id]  # "<s>" first, "</s>" last: both skipped
    texts = TokenTexts(tokenizer)
    got = [texts.add(token)[0] for token in ids]
    assert got == token_texts(tokenizer, ids)
    assert "".join(got) == _answer_text(tokenizer, ids) == tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(tokenizer.decode([token]) for token in ids) != "".join(got)  # what decoding alone would give


def test_a_word_keeps_its_leading_space_and_a_character_comes_whole_with_its_last_byte(tokenizer):
    ids = tokenizer("sea 你").input_ids  # <s>, then "▁sea▁" pieces, then the three bytes of 你
    texts = TokenTexts(tokenizer)
    got = [texts.add(token)[0] for token in ids]
    assert got[0] == "" and got[-3:] == ["", "", "你"]
    assert "".join(got) == "sea 你"


def test_alternatives_read_as_they_would_in_the_tokens_place(tokenizer):
    ids = tokenizer("Hello world, the 你 sea").input_ids
    byte_tokens = tokenizer.convert_tokens_to_ids(["<0xE4>", "<0xBD>", "<0xA0>"])
    texts = TokenTexts(tokenizer)
    for position, token in enumerate(ids):
        alternatives = [(token + shift) % len(tokenizer) for shift in (1, 7, 50)] + byte_tokens
        text, others = texts.add(token, alternatives)
        assert others == [alternative_text(tokenizer, ids[:position], other) for other in alternatives]
        assert text == alternative_text(tokenizer, ids[:position], token)
