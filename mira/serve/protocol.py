"""The OpenAI API's shapes that `mira serve` speaks: request schemas (validated, with OpenAI's ranges)
and the response, stream-chunk and error bodies."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from mira.runtime.generate import MAX_TOP_LOGPROBS, MIN_REPETITION_PENALTY, SEEDS, TokenLogprob

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_COMPLETION_LOGPROBS = 5  # likewise, for the completions endpoint's most likely tokens
LEAST_LOGPROB = -9999.0  # a log-probability that underflowed to -inf is sent as this: JSON has no infinity


class _Strict(BaseModel):
    # strict: a string is not a number and a number is not a string; fields Mira does not know are ignored;
    # NaN and infinity are no number either
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


# Fields of OpenAI's API that would change the answer and that Mira does not serve: a request that sets one
# is refused rather than answered as if it had not (each value here is what leaves the field unset).
UNSERVED: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}), "best_of": (None, 1), "suffix": (None, ""), "parallel_tool_calls": (None, True),
    "response_format": (None, {"type": "text"}), "functions": (None, []), "function_call": (None, "none"),
}

LEGACY = {"functions": "give them as tools, OpenAI's newer form of them",
          "function_call": "give tools, with tool_choice \"auto\" or \"none\""}


def _refuse_unserved(value: Any, info: ValidationInfo) -> Any:
    if any(value == unset and type(value) is type(unset) for unset in UNSERVED[info.field_name]):
        return value
    fix = LEGACY.get(info.field_name, "leave it out of the request")
    raise ValueError(f"mira serve does not support {info.field_name}; {fix}")


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(item) is int for item in value)


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingRequest(_Strict):
    """Settings common to both endpoints; None leaves a setting to the server's flags, then the checkpoint."""

    model: str | None = None  # None: the one model this server serves
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)  # not in OpenAI's API: the end of sequence is held off this long
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # not in OpenAI's API (clients pass it as an extra); 0 is off
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY)  # likewise; transformers' multiplicative one
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    stop: str | list[str] | None = Field(None, validate_default=True)  # a list after validation
    seed: int | None = Field(None, ge=SEEDS[0], le=SEEDS[1])
    n: int = Field(1, ge=1, le=1)  # one choice per request
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: Any = None  # these and those of the endpoints below: refused unless left unset (UNSERVED)

    _unserved = field_validator("logit_bias")(_refuse_unserved)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """A field sent as null takes its default, as in OpenAI's API (SDKs send unset fields so)."""
        if not isinstance(data, dict):
            return data
        return {name: value for name, value in data.items()
                if value is not None or name not in cls.model_fields or cls.model_fields[name].default is None}

    @field_validator("stream_options")
    @classmethod
    def _options_need_a_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options go with \"stream\": true; set it, or leave out stream_options")
        return options

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_form(cls, stop: Any) -> Any:
        """Checked before the union's members, whose own errors would name pydantic's types."""
        if stop is None or isinstance(stop, str) or _strings(stop):
            return stop
        raise ValueError(f"give a string or a list of at most {MAX_STOP_STRINGS} strings")

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str]:
        strings = [stop] if isinstance(stop, str) else list(stop or [])
        if len(strings) > MAX_STOP_STRINGS or not all(strings):
            raise ValueError(f"give at most {MAX_STOP_STRINGS} stop strings, none of them empty")
        return strings

    def requested_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """How many most likely tokens to give beside each new token's log-probability; None: no logprobs."""
        return None

    def requested_prompt_logprobs(self) -> bool:
        """Whether the prompt's tokens' log-probabilities are asked for too."""
        return False

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON, as the model wrote it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError as error:
            raise ValueError(f"a tool call's arguments must be a JSON object ({error})") from None
        if not isinstance(parsed, dict):
            raise ValueError("a tool call's arguments must be a JSON object")
        return arguments


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only in an assistant's message of tool calls
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's message: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        """Checked before the union's members, whose own errors would name pydantic's types."""
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError("give a string or a list of text parts ({\"type\": \"text\", \"text\": ...})")
        for index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                named = f"of type {json.dumps(kind)}" if isinstance(kind, str) else "not a text part"
                raise ValueError(f"part {index} is {named}; mira serve takes text parts only "
                                 "({\"type\": \"text\", \"text\": ...})")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {index} needs its text as a string")
        return content

    @model_validator(mode="after")
    def _complete(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"{'an' if self.role == 'assistant' else 'a'} {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def plain(self) -> dict[str, Any]:
        """The message as a chat template takes it: a developer message is the system message; calls carry
        their arguments as a dict, as transformers' templates read them."""
        if self.content is None or isinstance(self.content, str):
            text = self.content
        else:
            text = "".join(part.text for part in self.content)
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function",
                                      "function": {"name": call.function.name,
                                                   "arguments": json.loads(call.function.arguments)}}
                                     for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionTool(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionTool

    def plain(self) -> dict[str, Any]:
        """The tool as transformers' chat templates take it."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Any = None  # "auto" (the default with tools) or "none" (the tools are not shown)
    parallel_tool_calls: Any = None
    response_format: Any = None
    functions: Any = None  # the older form of tools and tool_choice
    function_call: Any = None

    _unserved_chat = field_validator("parallel_tool_calls", "response_format", "functions", "function_call")(
        _refuse_unserved)

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, choice: Any) -> str | None:
        if choice not in (None, "auto", "none"):
            raise ValueError(f"mira serve cannot force a tool call (tool_choice {json.dumps(choice)}); give "
                             "\"auto\" or \"none\"")
        return choice

    def offered_tools(self) -> list[dict] | None:
        """The tools to show the model, as transformers' chat templates take them; None: no tools."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.plain() for tool in self.tools]

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return top

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]  # text or token ids; one prompt (a list of one)
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions; 0 with echo scores the prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = None  # the prompt comes back before the completion (with its logprobs, when asked)
    best_of: Any = None
    suffix: Any = None

    _unserved_completion = field_validator("best_of", "suffix")(_refuse_unserved)

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> bool:
        return bool(self.echo) and self.logprobs is not None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_form(cls, prompt: Any) -> Any:
        """Checked before the union's members, whose own errors would name pydantic's types."""
        if isinstance(prompt, str) or _token_ids(prompt) or _strings(prompt) or (
                isinstance(prompt, list) and all(_token_ids(ids) for ids in prompt)):
            return prompt
        raise ValueError("give a string or a list of token ids (integers), or a list of one of them")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str] | list[int] | list[list[int]]) -> str | list[int]:
        if not prompt:
            raise ValueError("the prompt is empty; give text or token ids")
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return prompt
        if len(prompt) != 1:
            raise ValueError("give one prompt per request")
        return prompt[0]


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def model_entry(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "mira"}


def model_list(model_id: str, created: int) -> dict:
    return {"object": "list", "data": [model_entry(model_id, created)]}


def chat_logprobs(entries: Sequence[TokenLogprob], texts: Sequence[tuple[str, list[str]]]) -> dict:
    """A chat choice's `logprobs`: each token's text (`texts`: its own and those of its step's most
    likely tokens, mira.serve.token_texts), UTF-8 bytes and log-probability, with the most likely
    tokens of its step."""
    def token(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": max(logprob, LEAST_LOGPROB), "bytes": list(text.encode())}

    return {"content": [{**token(text, e.logprob),
                         "top_logprobs": [token(other, lp) for other, (_, lp) in zip(others, e.top)]}
                        for e, (text, others) in zip(entries, texts)],
            "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob | int], texts: Sequence[tuple[str, list[str]]],
                        offsets: Sequence[int]) -> dict:
    """A completion choice's `logprobs`: the tokens' texts (`texts`: each token's own and those of its
    step's most likely tokens, mira.serve.token_texts), their log-probabilities, each step's most likely
    tokens by text, and where each token's text starts in the answer (`offsets`). An echoed prompt's
    first token, which nothing predicts, is a bare id: its log-probability and most likely tokens are
    null."""
    return {"tokens": [text for text, _ in texts],
            "token_logprobs": [None if isinstance(e, int) else max(e.logprob, LEAST_LOGPROB) for e in entries],
            "top_logprobs": [None if isinstance(e, int) else
                             {other: max(lp, LEAST_LOGPROB) for other, (_, lp) in zip(others, e.top)}
                             for e, (_, others) in zip(entries, texts)],
            "text_offset": list(offsets)}


def chat_completion(request_id: str, created: int, model_id: str, text: str | None, finish_reason: str,
                    prompt_tokens: int, completion_tokens: int, logprobs: dict | None = None,
                    tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model_id,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}],
            "usage": usage(prompt_tokens, completion_tokens)}


def chat_chunk(request_id: str, created: int, model_id: str, delta: dict, finish_reason: str | None = None,
               logprobs: dict | None = None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model_id,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}


def completion(request_id: str, created: int, model_id: str, text: str, finish_reason: str | None,
               prompt_tokens: int | None = None, completion_tokens: int | None = None,
               logprobs: dict | None = None) -> dict:
    """A completion, or one chunk of a streamed one (no usage)."""
    body = {"id": request_id, "object": "text_completion", "created": created, "model": model_id,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}]}
    if prompt_tokens is not None:
        body["usage"] = usage(prompt_tokens, completion_tokens)
    return body


def usage_chunk(request_id: str, created: int, model_id: str, obj: str, prompt_tokens: int,
                completion_tokens: int) -> dict:
    """The last chunk of a stream that asked for `stream_options.include_usage`: usage, no choices."""
    return {"id": request_id, "object": obj, "created": created, "model": model_id, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}
