"""Text in, streamed text out, with the timings a user asks about: TTFT and decode tokens/s."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO

import torch
from transformers import TextStreamer

from mira.errors import MiraError
from mira.runtime.engine import MiraModel


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 128
    temperature: float = 0.7  # 0 means greedy
    top_p: float = 0.9
    seed: int = 0


@dataclass(frozen=True)
class GenerationReport:
    text: str
    prompt_tokens: int
    new_tokens: int
    ttft_s: float  # prompt in -> first new token out
    decode_tokens_per_s: float  # new tokens after the first, per second


class _TimedStreamer(TextStreamer):
    """Streams decoded text to `out` and notes when each new token arrives."""

    def __init__(self, tokenizer, out: TextIO | None):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.out = out
        self.token_times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.token_times.append(time.perf_counter())
        self._prompt_seen = True
        super().put(value)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if self.out is not None:
            self.out.write(text + ("\n" if stream_end else ""))
            self.out.flush()


def encode_prompt(model: MiraModel, prompt: str, raw: bool) -> torch.Tensor:
    """Token ids [1, T] of `prompt`, through the tokenizer's chat template unless `raw`."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise MiraError(f"{model.store.path} has no tokenizer files; use the Python API with token ids")
    if not raw and tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    if not raw:
        print("mira: the tokenizer has no chat template; using the prompt as raw text", file=sys.stderr)
    return tokenizer(prompt, return_tensors="pt").input_ids


def generate_text(model: MiraModel, prompt: str, sampling: SamplingConfig, raw: bool = False,
                  out: TextIO | None = sys.stdout) -> GenerationReport:
    """Generate from a text prompt, streaming the new text to `out`."""
    input_ids = encode_prompt(model, prompt, raw)
    streamer = _TimedStreamer(model.tokenizer, out)
    torch.manual_seed(sampling.seed)
    start = time.perf_counter()
    output = model.generate(
        input_ids,
        max_new_tokens=sampling.max_new_tokens,
        do_sample=sampling.temperature > 0,
        temperature=sampling.temperature if sampling.temperature > 0 else None,
        top_p=sampling.top_p if sampling.temperature > 0 else None,
        top_k=None,
        streamer=streamer,
        pad_token_id=model.tokenizer.pad_token_id or model.tokenizer.eos_token_id,
    )
    new = output[0, input_ids.shape[1]:]
    times = streamer.token_times
    ttft = times[0] - start if times else float("nan")
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")
    return GenerationReport(model.tokenizer.decode(new, skip_special_tokens=True), input_ids.shape[1], len(new),
                            ttft, decode)
