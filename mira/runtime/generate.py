"""Messages in, streamed text out: what `mira generate`, `mira chat` and `mira serve` share.

The sampling settings (the checkpoint's generation_config.json, overridden per call), chat
messages through the tokenizer's template, incremental decoding with stop strings, cancellation,
and the timings a user asks about: TTFT and decode tokens/s.
"""

from __future__ import annotations

import inspect
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, TextIO

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from mira.errors import MiraError
from mira.runtime.engine import MiraModel
from mira.runtime.run_ahead import HostCriterion

Message = dict[str, Any]  # {"role": "system" | "user" | "assistant" | "tool", "content": text, ...}
MAX_TOP_LOGPROBS = 20  # as OpenAI's API
MIN_REPETITION_PENALTY = 1e-2  # smaller ones divide seen tokens' logits past any use, and overflow them near 1e-37
SEEDS = (-2**63, 2**64 - 1)  # the seeds torch's generator takes (torch.manual_seed)
GREEDY_BELOW = 1e-5  # a smaller temperature decodes greedily: its samples are the argmax all but surely, and
# logits divided by it overflow to inf


@dataclass(frozen=True)
class SamplingConfig:
    """What one generation asks for. None leaves a setting to whatever sits under it: `with_defaults`,
    then the checkpoint's generation_config.json, then off (temperature 1, top-p 1, no top-k)."""

    max_new_tokens: int = 128  # 0: nothing is generated; the prompt's log-probabilities are still read if asked
    min_new_tokens: int = 0  # the end-of-sequence token is held off until this many were generated
    temperature: float | None = None  # 0 (or below GREEDY_BELOW) means greedy
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None  # transformers' (CTRL's): divides the logits of tokens already seen
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per occurrence in the generated text
    presence_penalty: float = 0.0  # OpenAI's: subtracted once if the token was generated at all
    stop: tuple[str, ...] = ()  # generation ends before the first of these; it is not part of the text
    seed: int | None = None  # None: a fresh random seed
    logprobs: int | None = None  # k: each new token's log-probability and the k most likely; None: off
    prompt_logprobs: bool = False  # with logprobs: the prompt's tokens' too (each but the first), from the prefill

    def __post_init__(self) -> None:
        checks = [
            (self.max_new_tokens >= 0, f"max new tokens must be at least 0, not {self.max_new_tokens}"),
            (0 <= self.min_new_tokens <= self.max_new_tokens,
             f"min new tokens must be between 0 and max new tokens, not {self.min_new_tokens}"),
            (self.temperature is None or self.temperature >= 0, f"temperature must be >= 0, not {self.temperature}"),
            (self.top_p is None or 0 < self.top_p <= 1, f"top-p must be in (0, 1], not {self.top_p}"),
            (self.top_k is None or self.top_k >= 0, f"top-k must be >= 0 (0: off), not {self.top_k}"),
            (self.repetition_penalty is None or self.repetition_penalty >= MIN_REPETITION_PENALTY,
             f"repetition penalty must be at least {MIN_REPETITION_PENALTY} (1: off), not {self.repetition_penalty}"),
            (all(self.stop), "a stop string must not be empty"),
            (self.seed is None or SEEDS[0] <= self.seed <= SEEDS[1],
             f"the seed must be between {SEEDS[0]} and {SEEDS[1]}, not {self.seed}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
             f"logprobs must be between 0 and {MAX_TOP_LOGPROBS} most likely tokens, not {self.logprobs}"),
            (not self.prompt_logprobs or self.logprobs is not None, "prompt logprobs need logprobs set"),
        ]
        for ok, message in checks:
            if not ok:
                raise MiraError(message)

    def with_defaults(self, defaults: SamplingConfig) -> SamplingConfig:
        """These settings, with `defaults`' sampling settings where these leave one to the checkpoint."""
        unset = {f.name: getattr(defaults, f.name) for f in fields(self)
                 if f.name in ("temperature", "top_p", "top_k", "repetition_penalty") and getattr(self, f.name) is None}
        return replace(self, **unset)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's natural-log probability under the model's own logits (before penalties,
    temperature, top-k or top-p), and the most likely tokens of that step with theirs, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class GenerationReport:
    text: str
    prompt_tokens: int
    new_ids: tuple[int, ...]  # the new tokens, up to the one that completed a stop string
    ttft_s: float  # prompt in -> first new token out
    decode_tokens_per_s: float  # new tokens after the first, per second
    finish_reason: str  # "stop" (end of sequence or a stop string), "length" (max new tokens) or "cancelled"
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token, when the sampling settings ask for them
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # one per prompt token after the first, when asked for

    @property
    def new_tokens(self) -> int:
        return len(self.new_ids)


def generation_kwargs(model: MiraModel, sampling: SamplingConfig) -> dict:
    """transformers `generate` arguments for `sampling` over the checkpoint's generation_config.json.

    Sampling is on when the call asks for a temperature above 0, or leaves the temperature unset and
    asks for top-p or top-k, or leaves all three unset and the checkpoint samples (`do_sample`).
    """
    checkpoint = model.hf_model.generation_config

    def setting(name: str, off):
        value = getattr(sampling, name)
        if value is None:
            value = getattr(checkpoint, name, None)
        return off if value is None else value

    if sampling.temperature is not None:
        sample = sampling.temperature >= GREEDY_BELOW
    elif sampling.top_p is not None or sampling.top_k is not None:
        sample = True
    else:
        sample = bool(checkpoint.do_sample)
    kwargs = dict(max_new_tokens=sampling.max_new_tokens, min_new_tokens=sampling.min_new_tokens or None,
                  do_sample=sample, repetition_penalty=setting("repetition_penalty", 1.0))
    if sample:
        kwargs.update(temperature=setting("temperature", 1.0), top_p=setting("top_p", 1.0), top_k=setting("top_k", 0))
    else:  # greedy: the checkpoint's sampling settings do not apply
        kwargs.update(temperature=None, top_p=None, top_k=None)
    return kwargs


class OccurrencePenalty(LogitsProcessor):
    """OpenAI's frequency and presence penalties: each token's logit less `frequency` times the times
    it was generated so far, less `presence` if it was generated at all (the prompt does not count)."""

    def __init__(self, prompt_tokens: int, frequency: float, presence: float):
        self.prompt_tokens = prompt_tokens
        self.frequency = frequency
        self.presence = presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # B sequences, T tokens so far, V vocabulary
        generated = input_ids[:, self.prompt_tokens:]  # [B, T - prompt]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)  # [B, V]


class TextStream:
    """Token ids in, text pieces out to `on_text`: decodes incrementally (a piece is emitted once its
    characters are whole), holds back text that may begin a stop string, and stops at the first one,
    which is not emitted."""

    def __init__(self, tokenizer, stop: Sequence[str], on_text: Callable[[str], None]):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.on_text = on_text
        self.stopped = False  # a stop string was met
        self.stopped_at = 0  # once stopped: the tokens added up to the one that completed the stop string
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] were decoded last time, as context for the next piece
        self._read = 0
        self._held = ""  # decoded text that may be the start of a stop string
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def add(self, ids: Sequence[int]) -> None:
        if self.stopped:
            return
        self._ids.extend(ids)
        piece = self._piece(self._ids[self._prefix:])
        if piece is not None:
            self._prefix, self._read = self._read, len(self._ids)
            self._push(piece)

    def preview(self, token: int) -> str:
        """The text `token` would add if it came next (before stop strings), without adding it: how a
        likely alternative to the next token reads."""
        return self._piece(self._ids[self._prefix:] + [token]) or ""

    def _piece(self, window: list[int]) -> str | None:
        """What decoding `window` (the ids from the last piece's start on) adds to the last piece, or
        None while it adds nothing or ends in the middle of a character."""
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(window)
        return after[len(before):] if len(after) > len(before) and not after.endswith("\ufffd") else None

    def finish(self) -> None:
        """Emit what is held back: the stream ended without meeting a stop string there."""
        if not self.stopped:
            tail = self._decode(self._ids[self._prefix:])[len(self._decode(self._ids[self._prefix:self._read])):]
            self._push(tail)
            if not self.stopped and self._held:
                self._emit(self._held)
                self._held = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _push(self, piece: str) -> None:
        text = self._held + piece
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if found:
            self._emit(text[:min(found)])
            self._held = ""
            self.stopped, self.stopped_at = True, len(self._ids)
            return
        held = max((k for s in self.stop for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])),
                   default=0)
        self._emit(text[:len(text) - held])
        self._held = text[len(text) - held:]

    def _emit(self, text: str) -> None:
        if text:
            self._pieces.append(text)
            self.on_text(text)


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Each position's log-probability of its token and its `top` likeliest, from logits [N, V]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    index = torch.tensor(tokens, dtype=torch.long, device=logprobs.device)  # [N]
    chosen = logprobs.gather(1, index[:, None])[:, 0].tolist()
    values, ids = logprobs.topk(top, dim=-1)  # [N, top]
    return [TokenLogprob(token, logprob, tuple(zip(row_ids, row_values)))
            for token, logprob, row_ids, row_values in zip(tokens, chosen, ids.tolist(), values.tolist())]


class LogprobTap:
    """Each decoding step's log-probabilities, read from the logits the model's forward returns (a
    forward hook: what generate's logits processors do to them afterwards does not reach it), kept
    for the token that step chose. With `prompt` (the prompt's ids), the first forward, the prefill,
    must return logits at every prompt position: each prompt token's log-probability given the tokens
    before it (all but the first) is read from them, and the `top` likeliest at its place. Batch 1;
    `close` removes the hook."""

    def __init__(self, hf_model: torch.nn.Module, top: int, on_logprob: Callable[[TokenLogprob], None],
                 prompt: Sequence[int] | None = None):
        self.top = top
        self.on_logprob = on_logprob
        self.taken: list[TokenLogprob] = []
        self.prompt_taken: list[TokenLogprob] = []
        self._prompt = prompt
        self._logits: deque[torch.Tensor] = deque()  # [V] of each forward whose token is not taken yet (a
        # loop running ahead calls the next forward before it hands over the last token)
        self._hook = hf_model.register_forward_hook(self._keep)

    def _keep(self, module: torch.nn.Module, args, output) -> None:
        if self._prompt is not None:  # the prefill
            logits = output.logits[0]  # [T, V]
            if logits.shape[0] != len(self._prompt):
                raise MiraError(f"the prefill returned logits at {logits.shape[0]} of the prompt's {len(self._prompt)} "
                                "positions; the prompt's log-probabilities need them all")
            self.prompt_taken = token_logprobs(logits[:-1], self._prompt[1:], self.top)
            self._prompt = None
            for entry in self.prompt_taken:
                self.on_logprob(entry)
        self._logits.append(output.logits[0, -1])

    def take(self, token: int) -> None:
        """Record the step's log-probability of `token`, the token the step chose."""
        entry, = token_logprobs(self._logits.popleft()[None], [token], self.top)
        self.taken.append(entry)
        self.on_logprob(entry)

    def close(self) -> None:
        self._hook.remove()


class _Streamer(BaseStreamer):
    """transformers' streamer hook: new ids into the TextStream (and the logprob tap, if any), with
    the time each arrives. Ids after a stop string are dropped: the loop checks its criteria before
    it streams a token, so it decodes one more step after the token that met the stop."""

    def __init__(self, stream: TextStream, tap: LogprobTap | None):
        self.stream = stream
        self.tap = tap
        self.token_times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate puts the prompt first
            self._prompt_seen = True
            return
        if self.stream.stopped:
            return
        self.token_times.append(time.perf_counter())
        ids = value.reshape(-1).tolist()
        if self.tap is not None:
            self.tap.take(ids[0])
        self.stream.add(ids)

    def end(self) -> None:
        self.stream.finish()


class _Halt(HostCriterion):
    """Ends generation after the step in which a stop string was met or `cancel` was set."""

    def __init__(self, stream: TextStream, cancel: threading.Event):
        self.stream = stream
        self.cancel = cancel

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        halt = self.stream.stopped or self.cancel.is_set()
        return torch.full((input_ids.shape[0],), halt, dtype=torch.bool, device=input_ids.device)


def end_ids(model: MiraModel) -> set[int]:
    """The token ids that end a generation: the checkpoint's end-of-sequence ids and its tokenizer's."""
    ends = model.hf_model.generation_config.eos_token_id
    ids = set(ends if isinstance(ends, list) else [] if ends is None else [ends])
    if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:
        ids.add(model.tokenizer.eos_token_id)
    return ids


def _tokenizer(model: MiraModel):
    if model.tokenizer is None:
        raise MiraError(f"{model.store.path} has no tokenizer files; use the Python API with token ids")
    return model.tokenizer


def encode_messages(model: MiraModel, messages: Sequence[Message], raw: bool = False,
                    tools: list[dict] | None = None) -> torch.Tensor:
    """Token ids [1, T] of a conversation through the tokenizer's chat template, ready for the
    assistant's turn, with `tools` (function schemas) shown where the template shows them; `raw` (or a
    tokenizer without a template) takes one user message as plain text."""
    tokenizer = _tokenizer(model)
    if not messages:
        raise MiraError("the conversation has no messages; give at least one user message")
    if not raw and tokenizer.chat_template:
        text = tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    if len(messages) > 1 or messages[0]["role"] != "user":
        reason = "--raw was asked for" if raw else f"the tokenizer of {model.store.path} has no chat template"
        fix = "pass a plain prompt, or drop --raw" if raw else "send a single user message"
        raise MiraError(f"{reason}, so only one user message can be given; {fix}")
    if not raw:
        print("mira: the tokenizer has no chat template; using the prompt as raw text", file=sys.stderr)
    return tokenizer(messages[0]["content"], return_tensors="pt").input_ids


def encode_prompt(model: MiraModel, prompt: str, raw: bool) -> torch.Tensor:
    """Token ids [1, T] of `prompt` as the user's message, through the chat template unless `raw`."""
    return encode_messages(model, [{"role": "user", "content": prompt}], raw)


def stream_generate(model: MiraModel, input_ids: torch.Tensor, sampling: SamplingConfig,
                    on_text: Callable[[str], None], cancel: threading.Event | None = None,
                    on_logprob: Callable[[TokenLogprob], None] = lambda entry: None) -> GenerationReport:
    """Generate from token ids [1, T], handing each new piece of text to `on_text` as it comes, and,
    when `sampling.logprobs` asks for them, each new token's log-probabilities to `on_logprob` (after
    the prompt's, when `sampling.prompt_logprobs` asks for those too).

    With `sampling.max_new_tokens` 0 nothing is generated: one forward reads the prompt's
    log-probabilities if they are asked for (scoring a prompt).

    Seeds torch's generator from `sampling.seed` first, so a seeded call gives the same text whatever
    ran before it; the caller runs one generation at a time on the device. Setting `cancel` ends the
    generation after its current step.

    Raises:
        MiraError: a setting out of range, or the prompt plus max new tokens longer than the context.
    """
    tokenizer = _tokenizer(model)
    if sampling.max_new_tokens == 0:
        return _score_prompt(model, input_ids, sampling, on_logprob)
    cancel = cancel or threading.Event()
    stream = TextStream(tokenizer, sampling.stop, on_text)
    tap = None if sampling.logprobs is None else LogprobTap(
        model.hf_model, sampling.logprobs, on_logprob, input_ids[0].tolist() if sampling.prompt_logprobs else None)
    kwargs = generation_kwargs(model, sampling)
    if sampling.prompt_logprobs and "logits_to_keep" in inspect.signature(type(model.hf_model).forward).parameters:
        kwargs["logits_to_keep"] = 0  # logits at every position (generate's default keeps the last only)
    streamer = _Streamer(stream, tap)
    processors = LogitsProcessorList()
    if sampling.frequency_penalty or sampling.presence_penalty:
        processors.append(OccurrencePenalty(input_ids.shape[1], sampling.frequency_penalty, sampling.presence_penalty))
    if sampling.seed is None:
        torch.seed()
    else:
        torch.manual_seed(sampling.seed)
    start = time.perf_counter()
    try:
        output = model.generate(
            input_ids, **kwargs, logits_processor=processors, streamer=streamer,
            attention_mask=torch.ones_like(input_ids),  # else transformers masks every id equal to the pad id:
            # the bundled model's BOS is its pad token
            stopping_criteria=StoppingCriteriaList([_Halt(stream, cancel)]),
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
    finally:
        if tap is not None:
            tap.close()
    new_ids = tuple(output[0, input_ids.shape[1]:].tolist())
    if stream.stopped:
        new_ids = new_ids[:stream.stopped_at]
    times = streamer.token_times
    ttft = times[0] - start if times else float("nan")
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")
    if cancel.is_set() and not stream.stopped:
        finish = "cancelled"
    elif stream.stopped or len(new_ids) < sampling.max_new_tokens or new_ids[-1] in end_ids(model):
        finish = "stop"
    else:
        finish = "length"
    return GenerationReport(stream.text, input_ids.shape[1], new_ids, ttft, decode, finish,
                            tuple(tap.taken) if tap is not None else (),
                            tuple(tap.prompt_taken) if tap is not None else ())


def _score_prompt(model: MiraModel, input_ids: torch.Tensor, sampling: SamplingConfig,
                  on_logprob: Callable[[TokenLogprob], None]) -> GenerationReport:
    """A generation of no new tokens: one forward over the prompt [1, T] when its log-probabilities
    are asked for (`sampling.prompt_logprobs`), none otherwise."""
    prompt_tokens = input_ids.shape[1]
    model.check_fits(prompt_tokens, 0)
    taken: tuple[TokenLogprob, ...] = ()
    if sampling.prompt_logprobs:
        with torch.no_grad():  # as generate: buffers made on a first call stay usable by later generations
            logits = model(input_ids=input_ids.to(model.device), use_cache=False).logits[0]  # [T, V]
        model.finish_step()  # the step's routing goes to the policy now, as after a generation
        taken = tuple(token_logprobs(logits[:-1], input_ids[0, 1:].tolist(), sampling.logprobs))
        for entry in taken:
            on_logprob(entry)
    return GenerationReport("", prompt_tokens, (), math.nan, math.nan, "length", (), taken)


def generate_text(model: MiraModel, prompt: str | Sequence[Message], sampling: SamplingConfig, raw: bool = False,
                  out: TextIO | None = sys.stdout) -> GenerationReport:
    """Generate from a prompt (the user's message) or a conversation, streaming the new text to `out`."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt

    def write(text: str) -> None:
        if out is not None:
            out.write(text)
            out.flush()

    report = stream_generate(model, encode_messages(model, messages, raw), sampling, write)
    write("\n")
    return report
