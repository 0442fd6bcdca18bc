"""The request schemas' refusals of malformed prompts, stop strings and message contents: one line in
the API's words, where pydantic's unions would name each member type they tried."""

import pytest
from pydantic import ValidationError

from mira.serve.protocol import ChatCompletionRequest, CompletionRequest

UNION_MEMBERS = ("list[", "str]", "int]", "TextPart", "Input should be")


def _refusal(schema, **fields) -> str:
    with pytest.raises(ValidationError) as caught:
        schema(**fields)
    problems = caught.value.errors()
    assert len(problems) == 1, problems  # one line, not one per union member
    message = str(problems[0]["ctx"]["error"])
    assert not any(member in message for member in UNION_MEMBERS), message
    return message


@pytest.mark.parametrize("prompt", [{"a": 1}, 5, [1.5], [True], ["a", [1]], [[1], "a"]])
def test_a_prompt_of_no_accepted_form_is_refused_naming_the_forms(prompt):
    assert "a string or a list of token ids" in _refusal(CompletionRequest, prompt=prompt)


@pytest.mark.parametrize("prompt, taken", [("Hi", "Hi"), (["Hi"], "Hi"), ([1, 2], [1, 2]), ([[1, 2]], [1, 2])])
def test_each_accepted_prompt_form_comes_through_as_one_prompt(prompt, taken):
    assert CompletionRequest(prompt=prompt).prompt == taken


@pytest.mark.parametrize("stop", [5, [5], ["a", None], {"a": 1}])
def test_a_stop_of_no_accepted_form_is_refused_naming_the_forms(stop):
    assert "a string or a list of at most 4 strings" in _refusal(CompletionRequest, prompt="Hi", stop=stop)


def _chat(content) -> dict:
    return {"messages": [{"role": "user", "content": content}]}


@pytest.mark.parametrize("content, says", [
    (5, "a string or a list of text parts"),
    ({"type": "text", "text": "hi"}, "a string or a list of text parts"),
    ([{"type": "image_url", "image_url": {"url": "x"}}], 'part 0 is of type "image_url"; mira serve takes text parts'),
    ([{"type": "text", "text": "a"}, "b"], "part 1 is not a text part"),
    ([{"type": "text"}], "part 0 needs its text as a string"),
    ([{"type": "text", "text": 5}], "part 0 needs its text as a string"),
])
def test_message_content_other_than_text_is_refused_naming_the_part(content, says):
    assert says in _refusal(ChatCompletionRequest, **_chat(content))


def test_text_parts_are_joined_as_the_message_text():
    request = ChatCompletionRequest(**_chat([{"type": "text", "text": "Hello, "}, {"type": "text", "text": "you"}]))
    assert request.messages[0].plain() == {"role": "user", "content": "Hello, you"}
