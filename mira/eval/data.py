"""The text `mira eval ppl` scores: documents from a .txt or .jsonl file, tokenized into one stream.

Without a file, the bundled model's held-out ShareGPT text (`heldout.jsonl` beside it, written by
tools/heldout_text.py from conversations the model never trained on).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mira.errors import MiraError
from mira.runtime.engine import BUNDLED_MODEL
from mira.store.files import read_text

HELDOUT_TEXT = BUNDLED_MODEL / "heldout.jsonl"


def read_documents(path: Path) -> list[str]:
    """The non-blank documents of `path`: the whole file for .txt (or any other suffix), the "text"
    field of every line for .jsonl.

    Raises:
        MiraError: the file is missing, unreadable, malformed or holds no text.
    """
    if not path.is_file():
        raise MiraError(f"data file {path} does not exist; pass --data with a .txt or .jsonl file")
    content = read_text(path, "data file")
    documents = _jsonl_texts(path, content) if path.suffix == ".jsonl" else [content]
    documents = [document for document in documents if document.strip()]
    if not documents:
        raise MiraError(f"data file {path} holds no text; pass a file with some")
    return documents


def _jsonl_texts(path: Path, content: str) -> list[str]:
    texts = []
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise MiraError(f"{path} line {number} is not JSON; a .jsonl data file holds one JSON object per line "
                            "with a \"text\" field") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise MiraError(f"{path} line {number} has no \"text\" string; give every line one")
        texts.append(record["text"])
    return texts


def token_stream(tokenizer, documents: list[str], max_tokens: int | None = None) -> torch.Tensor:
    """The documents' token ids one after another [N] (each tokenized as the tokenizer does by
    default), cut to the first `max_tokens`."""
    if tokenizer is None:
        raise MiraError("this model has no tokenizer files (tokenizer.json or tokenizer_config.json); "
                        "add them to the model directory")
    ids: list[int] = []
    for document in documents:
        ids += tokenizer(document, verbose=False).input_ids  # a long document is windowed, not read whole
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    return torch.tensor(ids[:max_tokens], dtype=torch.long)
