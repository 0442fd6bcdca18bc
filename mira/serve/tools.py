"""Tool calls through the checkpoint's own templates: its chat template shows the tools to the model,
and its tokenizer's response template (transformers' `parse_response`) reads the calls back out of
what the model generated. Nothing here knows a model family's format."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mira.errors import MiraError


class ToolsUnusable(Exception):
    """The model cannot take tools as its tokenizer stands; the message says why and what would fix it."""


@dataclass(frozen=True)
class ToolReply:
    """An answer read for the OpenAI API: its text (None when it is only calls) and its tool calls."""

    content: str | None
    tool_calls: list[dict]


def check_tools(tokenizer, messages: Sequence[dict], tools: list[dict]) -> None:
    """Refuse tools the model would never see or whose calls could not be read back.

    Raises:
        ToolsUnusable: the chat template renders the conversation the same with and without the tools,
            or the tokenizer has no response template (so no calls could be read).
    """
    if not hasattr(tokenizer, "parse_response"):
        raise ToolsUnusable("tool calls need a transformers whose tokenizers read responses (parse_response); "
                            "upgrade transformers")
    render = dict(tokenize=False, add_generation_prompt=True)
    if tokenizer.apply_chat_template(list(messages), tools=tools, **render) == \
            tokenizer.apply_chat_template(list(messages), **render):
        raise ToolsUnusable("the model's chat template does not show tools to the model, so it cannot call them")
    if getattr(tokenizer, "response_template", None) is None:
        raise ToolsUnusable("the model's tokenizer has no response_template to read tool calls with; start mira "
                            "serve with --response-template FILE.json (transformers' response template format)")


def read_reply(tokenizer, prompt_ids: list[int], new_ids: list[int], tools: list[dict],
               end_ids: set[int], stops: Sequence[str] = ()) -> ToolReply:
    """The tool calls and text of `new_ids`, the tokens generated after `prompt_ids`, by the tokenizer's
    response template; a last token in `end_ids` (the end of sequence) is not part of the answer, nor is
    the text from a stop string on (the last token may hold one, and more). An answer the template
    cannot read (a call that is not valid JSON, or has no name) comes back whole as text, with no calls."""
    if new_ids and new_ids[-1] in end_ids:
        new_ids = new_ids[:-1]
    try:
        message = tokenizer.parse_response(new_ids, prefix=prompt_ids, tools=tools)
        calls = [_openai_call(call) for call in message.get("tool_calls") or []]
    except (ValueError, KeyError, TypeError):  # not valid JSON, or a call without a name
        return ToolReply(_before_stop(tokenizer.decode(new_ids, skip_special_tokens=True), stops), [])
    content = message.get("content")
    if content and (cut := _before_stop(content, stops)) != content:
        content = cut.rstrip()  # as the template's text fields strip what they read
    return ToolReply(content or (None if calls else ""), calls)


def _before_stop(text: str, stops: Sequence[str]) -> str:
    """`text` up to the first of the stop strings in it (all of it where none is)."""
    return text[:min((i for i in (text.find(stop) for stop in stops) if i >= 0), default=len(text))]


def _openai_call(call: dict) -> dict:
    """A parsed call ({"type": "function", "function": {"name", "arguments": dict}}) as OpenAI sends one:
    with an id, and its arguments as a JSON string."""
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": function["name"],
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


def load_response_template(path: str | Path) -> dict[str, Any]:
    """A response template from a JSON file, checked by transformers' own loader.

    Raises:
        MiraError: the file is missing, not JSON, or not a response template.
    """
    try:
        from transformers.utils.chat_parsing.response_templates import load_response_template as check
    except ImportError:
        raise MiraError("--response-template needs a transformers whose tokenizers read responses "
                        "(parse_response); upgrade transformers") from None
    try:
        spec = json.loads(Path(path).read_text())
        check(spec)
    except OSError as error:
        raise MiraError(f"cannot read the response template {path}: {error.strerror}") from None
    except (json.JSONDecodeError, ValueError) as error:
        raise MiraError(f"{path} is not a response template ({error}); see transformers' chat response "
                        "parsing docs for the format") from None
    return spec
