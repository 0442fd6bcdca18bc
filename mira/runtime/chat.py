"""`mira chat`: a conversation at the terminal, every turn sent with the whole history before it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from typing import TextIO

from mira.errors import MiraError
from mira.runtime.engine import MiraModel
from mira.runtime.generate import Message, SamplingConfig, encode_messages, stream_generate

COMMANDS = "/reset starts a new conversation, /exit (or end of input) leaves"


def chat(model: MiraModel, sampling: SamplingConfig, system: str | None = None,
         read: Callable[[], str] = input, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> list[Message]:
    """Read the user's turns with `read` until it raises EOFError or returns /exit, streaming each
    reply to `out`; a turn that does not fit in the context is reported on `err` and left out.

    Returns:
        The conversation as it stood at the end (system message first, when given).

    Raises:
        MiraError: the model has no tokenizer, or one without a chat template, which a conversation
            of several turns goes through.
    """
    if model.tokenizer is None:
        raise MiraError(f"{model.store.path} has no tokenizer files, which chat needs; use the Python API with "
                        "token ids")
    if not model.tokenizer.chat_template:
        raise MiraError(f"the tokenizer of {model.store.path} has no chat template, which chat sends every turn "
                        "through; use `mira generate --prompt TEXT` for one prompt at a time")
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    turn = 0
    while True:
        try:
            line = read().strip()
        except EOFError:
            break
        if line == "/exit":
            break
        if line == "/reset":
            messages = list(start)
            continue
        if not line:
            continue
        asked = [*messages, {"role": "user", "content": line}]
        seed = None if sampling.seed is None else sampling.seed + turn  # one reproducible seed per turn
        try:
            report = stream_generate(model, encode_messages(model, asked), replace(sampling, seed=seed),
                                     lambda text: (out.write(text), out.flush()))
        except MiraError as error:
            print(f"mira: error: {error} (or /reset)", file=err)
            continue
        out.write("\n")
        messages = [*asked, {"role": "assistant", "content": report.text}]
        turn += 1
    return messages
