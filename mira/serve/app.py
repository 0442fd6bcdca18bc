"""`create_app(model)`: the OpenAI-compatible HTTP API over one loaded model.

Requests are validated and tokenized on the event loop, then generated one at a time on the
device (mira.serve.worker); a client that disconnects cancels its generation.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import torch
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException

from mira.errors import MiraError
from mira.runtime.engine import MiraModel
from mira.runtime.generate import GenerationReport, SamplingConfig, TokenLogprob, encode_messages, end_ids
from mira.serve import protocol
from mira.serve.metrics import Metrics
from mira.serve.relay import STREAM_INTERVAL_S
from mira.serve.token_texts import TokenTexts
from mira.serve.tools import ToolReply, ToolsUnusable, check_tools, read_reply
from mira.serve.worker import STREAMED, DeviceWorker, Job, QueueFull, ShuttingDown

DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there


class ApiError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(protocol.error_body(self.message, self.kind, self.param, self.code), self.status,
                            headers=self.headers)


def create_app(model: MiraModel, model_id: str, api_key: str | None = None, max_waiting: int = 16,
               defaults: SamplingConfig | None = None, stream_interval_s: float = STREAM_INTERVAL_S) -> FastAPI:
    """The API for `model`, served under the name `model_id`.

    Args:
        model: a loaded model; the app's worker thread is the only one to run it while the app is up.
        model_id: the name `GET /v1/models` lists and requests must name (or leave out).
        api_key: when given, every endpoint but /health needs `Authorization: Bearer <api_key>`.
        max_waiting: requests that may wait behind the running one; more are answered 429.
        defaults: sampling settings for what a request leaves out, over the checkpoint's own.
        stream_interval_s: a stream's text goes out in chunks at most this often (0: one per piece), so
            the event loop takes no time from the generation per token.
    """
    metrics = Metrics()
    worker = DeviceWorker(model, max_waiting, metrics, stream_interval_s)
    ends = end_ids(model)
    defaults = defaults or SamplingConfig()
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            worker.close()

    app = FastAPI(title="Mira", lifespan=lifespan)
    app.state.stop_generating = worker.stop  # for the server's signal handler: the first Ctrl-C ends generations

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or wrong API key; send the header 'Authorization: Bearer <key>' with the "
                                "key the server was started with", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        metrics.request(_endpoint(request), error.status)
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        try:  # the body is read before the key is checked: a request without the key learns nothing more
            await authorize(request)
        except ApiError as unauthorized:
            return await api_error(request, unauthorized)
        problem = error.errors()[0]
        where = [str(part) for part in problem.get("loc", ()) if part != "body"]
        content_type = request.headers.get("content-type", "")
        if problem.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {problem.get('ctx', {}).get('error', problem['msg'])}"
            where = []
        elif not where and "json" not in content_type:
            message = (f"the request body must be JSON, sent with the header 'Content-Type: application/json' (it "
                       f"came as {content_type or 'no content type'})")
        else:  # a validator's own message goes out as it was written, without pydantic's "Value error, "
            said = problem["ctx"]["error"] if problem.get("type") == "value_error" else problem["msg"]
            message = f"{'.'.join(where) or 'body'}: {said}"
        return await api_error(request, ApiError(400, message, param=".".join(where) or None))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return await api_error(request, ApiError(error.status_code, str(error.detail), headers=error.headers))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model_id, "pending": worker.pending}

    api = APIRouter(dependencies=[Depends(authorize)])

    @api.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        pending = worker.pending
        return PlainTextResponse(metrics.render(waiting=max(0, pending - 1), running=min(1, pending)),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.get("/v1/models")
    async def models() -> dict:
        return protocol.model_list(model_id, created)

    @api.get("/v1/models/{name:path}")  # a repo id has a slash
    async def one_model(name: str) -> dict:
        check_model(name)
        return protocol.model_entry(model_id, created)

    @api.post("/v1/chat/completions")
    async def chat_completions(body: protocol.ChatCompletionRequest, request: Request):
        check_model(body.model)
        messages = [message.plain() for message in body.messages]
        tools = body.offered_tools()
        try:
            input_ids = encode_messages(model, messages, tools=tools)
        except (MiraError, TemplateError) as error:
            raise ApiError(400, f"the messages do not fit the model's chat template: {error}", param="messages")
        if tools is None:
            return await respond(request, "chat", body, input_ids)
        try:
            check_tools(model.tokenizer, messages, tools)
        except ToolsUnusable as error:
            raise ApiError(400, str(error), param="tools") from None
        prompt = input_ids[0].tolist()
        return await respond(request, "chat", body, input_ids, read_tools=lambda report: read_reply(
            model.tokenizer, prompt, list(report.new_ids), tools, ends, body.stop))

    @api.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest, request: Request):
        check_model(body.model)
        if model.tokenizer is None:
            raise ApiError(400, f"{model.store.path} has no tokenizer files")
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens 0 generates nothing; ask for at least 1, or set echo to true (with "
                                "logprobs to score the prompt)", param="max_tokens")
        if isinstance(body.prompt, str):
            input_ids, text = model.tokenizer(body.prompt, return_tensors="pt").input_ids, body.prompt
        else:
            vocabulary = model.hf_model.get_input_embeddings().num_embeddings
            if not all(0 <= token < vocabulary for token in body.prompt):
                raise ApiError(400, f"the prompt's token ids must be in 0..{vocabulary - 1}, the model's vocabulary",
                               param="prompt")
            input_ids, text = torch.tensor([body.prompt]), model.tokenizer.decode(body.prompt, skip_special_tokens=True)
        return await respond(request, "completions", body, input_ids, echo=text if body.echo else None)

    app.include_router(api)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_id:
            raise ApiError(404, f"the model {name!r} does not exist here; this server serves {model_id!r} "
                                "(GET /v1/models)", param="model", code="model_not_found")

    def sampling_for(body: protocol.SamplingRequest, prompt_tokens: int) -> SamplingConfig:
        room = model.max_context - prompt_tokens
        wanted = body.requested_tokens()
        prompt = "messages" if isinstance(body, protocol.ChatCompletionRequest) else "prompt"
        if prompt_tokens == 0:  # refused here, before a stream starts, rather than by the generation
            raise ApiError(400, "the prompt is empty (no tokens); give a prompt", param=prompt)
        if (wanted is None and room < 1) or (wanted is not None and wanted > room):
            asked = ("no token is left to generate: shorten the prompt" if wanted is None
                     else "does not fit: shorten it" if wanted == 0
                     else f"{wanted} more were asked for: shorten the prompt or lower max_tokens")
            raise ApiError(400, f"this model's context is {model.max_context} tokens; the prompt takes "
                                f"{prompt_tokens} and {asked}", param=prompt, code="context_length_exceeded")
        most = room if wanted is None else wanted
        if body.min_tokens > most:
            raise ApiError(400, f"min_tokens ({body.min_tokens}) is more than max_tokens ({most})",
                           param="min_tokens")
        sampling = SamplingConfig(
            max_new_tokens=most, min_new_tokens=body.min_tokens, temperature=body.temperature,
            top_p=body.top_p, top_k=body.top_k, repetition_penalty=body.repetition_penalty,
            frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty, stop=tuple(body.stop),
            seed=body.seed, logprobs=body.requested_logprobs(), prompt_logprobs=body.requested_prompt_logprobs())
        return sampling.with_defaults(defaults)

    async def respond(request: Request, endpoint: str, body: protocol.SamplingRequest, input_ids: torch.Tensor,
                      echo: str | None = None, read_tools: Callable[[GenerationReport], ToolReply] | None = None):
        try:  # an answer read for tool calls streams whole, at its end: text before it may be a call
            job = worker.submit(input_ids, sampling_for(body, input_ids.shape[1]),
                                stream=body.stream and read_tools is None)
        except QueueFull as full:
            raise ApiError(429, "the server is busy: every place in its queue is taken; retry later",
                           kind="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(full.retry_after)}) from None
        except ShuttingDown as stopping:
            raise ApiError(503, str(stopping), kind="server_error") from None
        request_id = f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        reply = Reply(request_id, int(time.time()), model_id, endpoint == "chat",
                      model.tokenizer if body.requested_logprobs() is not None else None,
                      None if echo is None else (echo, input_ids[0].tolist()), read_tools)
        if body.stream:
            metrics.request(_endpoint(request), 200)
            return StreamingResponse(stream(job, reply, body.include_usage), media_type="text/event-stream")
        report = await collect(job, request)
        if report is None:  # the client left; nobody reads an answer
            metrics.request(_endpoint(request), 499)
            return None
        metrics.request(_endpoint(request), 200)
        return reply.whole(report)

    return app


class Reply:
    """The bodies of one request's answer: whole, or as server-sent events. `tokenizer` is given when
    the request asked for log-probabilities (it names their tokens); `echo` (a completion's prompt text
    and token ids) when the prompt comes back before the completion; `read_tools` when the answer is
    read for tool calls."""

    def __init__(self, request_id: str, created: int, model_id: str, chat: bool, tokenizer=None,
                 echo: tuple[str, list[int]] | None = None,
                 read_tools: Callable[[GenerationReport], ToolReply] | None = None):
        self.request_id, self.created, self.model_id, self.chat = request_id, created, model_id, chat
        self.tokenizer = tokenizer
        self.echo = echo
        self.read_tools = read_tools
        self._texts = None if tokenizer is None else TokenTexts(tokenizer)  # of the sequence being answered
        self._offset = 0  # where the next token's text starts in the completion's text
        self._prompt_left = 0 if echo is None else len(echo[1])  # echoed prompt tokens whose entries are to come

    def whole(self, report: GenerationReport) -> dict:
        if self.chat:
            text, calls, finish = self._answer(report)
            return protocol.chat_completion(self.request_id, self.created, self.model_id, text, finish,
                                            report.prompt_tokens, report.new_tokens,
                                            self._logprobs(report.logprobs), calls)
        text, entries = report.text, report.logprobs
        if self.echo is not None:
            text, entries = self.echo[0] + text, (self.echo[1][0], *report.prompt_logprobs, *entries)
        return protocol.completion(self.request_id, self.created, self.model_id, text, report.finish_reason,
                                   report.prompt_tokens, report.new_tokens, self._logprobs(entries))

    def chunk(self, text: str | None, finish_reason: str | None = None,
              entries: Sequence[TokenLogprob | int] = ()) -> str:
        """One chunk of the stream: its text (None in the last, which carries the finish reason) and the
        log-probabilities of the tokens that came since the last chunk."""
        logprobs = self._logprobs(entries) if text is not None else None
        if self.chat:
            delta = {} if text is None else {"content": text}
            body = protocol.chat_chunk(self.request_id, self.created, self.model_id, delta, finish_reason, logprobs)
        else:
            body = protocol.completion(self.request_id, self.created, self.model_id, text or "", finish_reason,
                                       logprobs=logprobs)
        return _event(body)

    def ending(self, report: GenerationReport) -> list[str]:
        """The stream's last chunks: an answer read for tool calls, whole, then the finish reason."""
        if self.read_tools is None:
            return [self.chunk(None, report.finish_reason)]
        text, calls, finish = self._answer(report)
        delta = {"content": text}
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        return [_event(protocol.chat_chunk(self.request_id, self.created, self.model_id, delta,
                                           logprobs=self._logprobs(report.logprobs))),
                self.chunk(None, finish)]

    def _answer(self, report: GenerationReport) -> tuple[str | None, list[dict], str]:
        """A chat answer's text, tool calls and finish reason ("tool_calls" when it calls one)."""
        if self.read_tools is None:
            return report.text, [], report.finish_reason
        read = self.read_tools(report)
        return read.content, read.tool_calls, "tool_calls" if read.tool_calls else report.finish_reason

    def _logprobs(self, entries: Sequence[TokenLogprob | int]) -> dict | None:
        """The log-probabilities of `entries`, the next tokens of the answer (an echoed prompt's first)."""
        if self._texts is None:
            return None
        texts, offsets = [], []
        for entry in entries:
            token, top = (entry, ()) if isinstance(entry, int) else (entry.token, [other for other, _ in entry.top])
            texts.append(self._texts.add(token, top))
            offsets.append(self._offset)
            self._offset += len(texts[-1][0])
            if self._prompt_left:
                self._prompt_left -= 1
                if not self._prompt_left:  # the completion is decoded apart from the echoed prompt, after its text
                    self._texts, self._offset = TokenTexts(self.tokenizer), len(self.echo[0])
        if self.chat:
            return protocol.chat_logprobs(entries, texts)
        return protocol.completion_logprobs(entries, texts, offsets)

    def opening(self) -> str | None:
        """The stream's first chunk: a chat's role, or an echoed prompt's text and its first token
        where its other tokens' log-probabilities are not asked for (`echoed` sends them with it)."""
        if self.chat:
            return _event(protocol.chat_chunk(self.request_id, self.created, self.model_id,
                                              {"role": "assistant", "content": ""}))
        if self.echo is not None and not self.echo_owes:
            return self.chunk(self.echo[0], entries=[self.echo[1][0]])
        return None

    @property
    def echo_owes(self) -> int:
        """The log-probabilities of echoed prompt tokens that the prefill gives before the echo goes out."""
        return len(self.echo[1]) - 1 if self.echo is not None and self._texts is not None else 0

    def echoed(self, prompt_entries: Sequence[TokenLogprob]) -> str:
        """The echoed prompt's chunk: its text, with each of its tokens' log-probabilities."""
        return self.chunk(self.echo[0], entries=[self.echo[1][0], *prompt_entries])

    def usage(self, report: GenerationReport) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return _event(protocol.usage_chunk(self.request_id, self.created, self.model_id, obj, report.prompt_tokens,
                                           report.new_tokens))


def _endpoint(request: Request) -> str:
    """The metrics label of a request: its route's path, or "other" for paths the API does not have."""
    route = request.scope.get("route")
    return getattr(route, "path", "other")


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


async def stream(job: Job, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events of one generation, ending in [DONE]. When the client disconnects, Starlette
    stops iterating and the generation is cancelled."""
    try:
        opening = reply.opening()
        if opening:
            yield opening
        held: list[TokenLogprob] = []  # log-probabilities of tokens whose text has not come out yet
        owed = reply.echo_owes  # the prompt's, first of all, which go out with the echoed prompt
        while True:
            events = await job.events.take()  # what came since the last chunk goes in one chunk
            text = "".join(value for kind, value in events if kind == "text")
            held += [value for kind, value in events if kind == "logprob"]
            if owed and len(held) >= owed:
                yield reply.echoed(held[:owed])
                held, owed = held[owed:], 0
            if text:
                yield reply.chunk(text, entries=held)
                held = []
            kind, value = events[-1]  # "done" or "error" is always the last event
            if kind in STREAMED:
                continue
            if held:  # tokens without text of their own (an end of sequence, a stop string's)
                yield reply.chunk("", entries=held)
            if kind == "done":
                for event in reply.ending(value):
                    yield event
                if include_usage:
                    yield reply.usage(value)
            else:
                yield _event(protocol.error_body(f"generation failed: {value}", "server_error"))
            break
        yield "data: [DONE]\n\n"
    finally:
        job.cancel.set()  # no-op once the generation has ended


async def collect(job: Job, request: Request) -> GenerationReport | None:
    """The finished generation, or None when the client disconnected first (which cancels it)."""
    while True:
        try:
            kind, value = (await asyncio.wait_for(job.events.take(), DISCONNECT_POLL_S))[0]  # its only event
        except TimeoutError:
            if await request.is_disconnected():
                job.cancel.set()
                return None
            continue
        if kind == "done":
            return value
        if kind == "error":
            if isinstance(value, MiraError):
                raise ApiError(400, str(value))
            if isinstance(value, ShuttingDown):
                raise ApiError(503, str(value), kind="server_error")
            raise ApiError(500, f"generation failed: {value}", kind="server_error")
