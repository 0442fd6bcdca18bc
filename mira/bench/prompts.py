"""The prompt sets of `mira bench` (paper V): sampled conversations, and a fixed 64-in / N-out setting.

A prompt file holds JSON lines {"prompt": text, "input_tokens": n, "max_new_tokens": m}:
`tools/bench_prompts.py` writes one from held-out ShareGPT conversations (the first user message;
the length of the first reply as the output length). A model with a tokenizer encodes the text
through its chat template; a synthetic model, which has none, gets `input_tokens` random ids, so
every model sees the same input and output lengths.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from mira.errors import MiraError
from mira.store.files import read_text

FIRST_ID = 5  # random prompt ids start above the ids tokenizers keep for special tokens


@dataclass(frozen=True)
class BenchPrompt:
    text: str | None  # None: random ids only
    input_tokens: int
    max_new_tokens: int


def read_prompt_file(path: Path) -> list[BenchPrompt]:
    """Prompts from a JSON-lines file (module docstring).

    Raises:
        MiraError: a missing file, a malformed line, or no prompts.
    """
    if not path.is_file():
        raise MiraError(f"prompt file {path} does not exist; write one with `python tools/bench_prompts.py`")
    prompts = []
    for number, line in enumerate(read_text(path, "prompt file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            prompt = BenchPrompt(str(record["prompt"]), int(record["input_tokens"]), int(record["max_new_tokens"]))
        except json.JSONDecodeError as error:
            raise MiraError(f"{path}:{number}: the line is not valid JSON ({error})") from None
        except (KeyError, TypeError, ValueError):
            raise MiraError(f"{path}:{number}: expected a JSON object with \"prompt\", \"input_tokens\" and "
                            "\"max_new_tokens\"") from None
        if prompt.input_tokens < 1 or prompt.max_new_tokens < 1:
            raise MiraError(f"{path}:{number}: \"input_tokens\" and \"max_new_tokens\" must be at least 1")
        prompts.append(prompt)
    if not prompts:
        raise MiraError(f"{path} holds no prompts")
    return prompts


def fixed_prompts(count: int, input_tokens: int = 64, new_tokens: int = 256) -> list[BenchPrompt]:
    return [BenchPrompt(None, input_tokens, new_tokens) for _ in range(count)]


def prompt_ids(prompt: BenchPrompt, tokenizer, vocab_size: int, seed: int) -> torch.Tensor:
    """Token ids [1, T] for one prompt: its text through `tokenizer`'s chat template, else random ids.

    A text prompt on a model with a tokenizer keeps its own length; random ids have exactly
    `prompt.input_tokens` (drawn from `seed`, so every configuration sees the same ids).
    """
    if prompt.text is not None and tokenizer is not None:
        messages = [{"role": "user", "content": prompt.text}]
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        return tokenizer(prompt.text, return_tensors="pt").input_ids
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_ID, vocab_size, (1, prompt.input_tokens), generator=generator)
