"""Tool calls read back through a tokenizer's response template (mira.serve.tools), and the chat
messages that carry calls and their results (mira.serve.protocol), on hand-written answers."""

import json

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from mira.errors import MiraError
from mira.runtime.engine import BUNDLED_MODEL
from mira.serve.protocol import ChatCompletionRequest
from mira.serve.tools import ToolReply, ToolsUnusable, check_tools, load_response_template, read_reply

# Calls written as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, the rest is the answer's text.
CALLS = {"start_anchor": "<|assistant|>\n", "fields": {
    "content": {"content": "text"},
    "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json", "repeats": True,
                   "transform": {"type": "function",
                                 "function": {"name": "{content.name}", "arguments": "{content.arguments}"}}}}}
SHOWS_TOOLS = ("{{ bos_token }}{% if tools %}<|system|>\nTools: {{ tools | tojson }}<|end|>\n{% endif %}"
               "{% for message in messages %}<|{{ message.role }}|>\n{{ message.content }}<|end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


@pytest.fixture
def tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    tokenizer.response_template = CALLS
    return tokenizer


def _read(tokenizer, answer: str, end: bool = True):
    ids = tokenizer(answer, add_special_tokens=False).input_ids + ([tokenizer.eos_token_id] if end else [])
    return read_reply(tokenizer, [], ids, TOOLS, {tokenizer.eos_token_id})


def test_calls_come_back_as_openai_calls_with_their_arguments_as_json(tokenizer):
    reply = _read(tokenizer, 'Let me look.<tool_call>{"name": "weather", "arguments": {"city": "Paris", "days": 3}}'
                             '</tool_call><tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>')
    assert [call["function"]["name"] for call in reply.tool_calls] == ["weather", "weather"]
    assert [json.loads(call["function"]["arguments"]) for call in reply.tool_calls] == [
        {"city": "Paris", "days": 3}, {"city": "Oslo"}]
    assert all(call["type"] == "function" and call["id"].startswith("call_") for call in reply.tool_calls)
    assert reply.tool_calls[0]["id"] != reply.tool_calls[1]["id"]
    assert reply.content == "Let me look."  # the end-of-sequence token is not part of the text


def test_an_answer_without_calls_is_its_text_and_a_malformed_call_stays_text(tokenizer):
    assert _read(tokenizer, "It is sunny.").content == "It is sunny." and not _read(tokenizer, "It is sunny.").tool_calls
    broken = 'Wait.<tool_call>{"name": "weather", "arguments": {"city": </tool_call>'
    reply = _read(tokenizer, broken)
    assert reply.tool_calls == [] and reply.content == broken


def test_a_call_without_a_name_stays_text(tokenizer):
    tokenizer.response_template = {**CALLS, "fields": {**CALLS["fields"], "tool_calls": {
        **CALLS["fields"]["tool_calls"], "transform": {"type": "function", "function": {"arguments": "{content}"}}}}}
    answer = '<tool_call>{"city": "Paris"}</tool_call>'
    assert _read(tokenizer, answer) == ToolReply(answer, [])


def test_a_call_alone_has_no_text(tokenizer):
    reply = _read(tokenizer, '<tool_call>{"name": "weather", "arguments": {}}</tool_call>', end=False)
    assert reply.content is None and json.loads(reply.tool_calls[0]["function"]["arguments"]) == {}


def test_tools_are_refused_where_the_model_would_not_see_them_or_its_calls_could_not_be_read(tokenizer):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with pytest.raises(ToolsUnusable, match="does not show tools"):
        check_tools(tokenizer, messages, TOOLS)  # the bundled model's template has no place for tools
    tokenizer.chat_template = SHOWS_TOOLS
    check_tools(tokenizer, messages, TOOLS)
    tokenizer.response_template = None
    with pytest.raises(ToolsUnusable, match="--response-template"):
        check_tools(tokenizer, messages, TOOLS)


def test_a_response_template_file_is_checked_when_read(tmp_path):
    good = tmp_path / "calls.json"
    good.write_text(json.dumps(CALLS))
    assert load_response_template(good) == CALLS
    (tmp_path / "bad.json").write_text(json.dumps({**CALLS, "fields": {"content": {"content": "yaml"}}}))
    with pytest.raises(MiraError, match="is not a response template"):
        load_response_template(tmp_path / "bad.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(MiraError, match="is not a response template"):
        load_response_template(tmp_path / "broken.json")
    with pytest.raises(MiraError, match="cannot read"):
        load_response_template(tmp_path / "missing.json")


def _request(*messages, **fields):
    return ChatCompletionRequest.model_validate({"messages": list(messages), **fields})


def test_messages_of_calls_and_results_reach_the_template_as_transformers_reads_them():
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    request = _request({"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None,
                                                                 "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, tools=TOOLS)
    assert [message.plain() for message in request.messages][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    assert request.offered_tools() == TOOLS
    assert _request({"role": "user", "content": "Hi"}, tools=TOOLS, tool_choice="none").offered_tools() is None


@pytest.mark.parametrize("message, fields, says", [
    ({"role": "tool", "content": "sunny"}, {}, "tool_call_id"),
    ({"role": "assistant", "content": None}, {}, "needs content"),
    ({"role": "user", "content": "Hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, {}, "only an assistant"),
    ({"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}, {}, "JSON object"),
    ({"role": "user", "content": "Hi"}, {"tool_choice": "required"}, "cannot force a tool call"),
    ({"role": "user", "content": "Hi"}, {"tool_choice": {"type": "function", "function": {"name": "f"}}},
     "cannot force a tool call"),
    ({"role": "user", "content": "Hi"}, {"parallel_tool_calls": False}, "does not support parallel_tool_calls"),
])
def test_malformed_tool_requests_are_refused_with_what_to_change(message, fields, says):
    with pytest.raises(ValidationError, match=says):
        _request(message, **fields)
