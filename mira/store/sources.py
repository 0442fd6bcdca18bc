"""What a store was made from: the sha256, size and modification time of every source file.

A store's manifest keeps these records, so a store is known to be its source's by content, not by
the source's name: a checkpoint overwritten with other weights of the same shapes no longer matches
its store. Checking costs little when nothing changed: a file whose size and modification time are
the recorded ones is taken as unchanged, and only a file whose size or time changed is hashed again.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mira.store.files import sha256_file

SAFETENSORS_INDEX = "model.safetensors.index.json"
COPIED_SUFFIXES = {".json", ".jinja", ".txt", ".model", ".tiktoken"}  # config and tokenizer files
HASH_WORKERS = 4
READ_SUFFIXES = {".safetensors", ".jinja", ".model", ".tiktoken"}  # weights, chat templates, tokenizer models
READ_NAMES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "added_tokens.json", "chat_template.json", "vocab.json", "vocab.txt",
              "merges.txt", "preprocessor_config.json", "tekken.json"}


def source_files(model_dir: Path) -> list[str]:
    """Names of the files a store is made from: the weights, config and tokenizer files."""
    return sorted(path.name for path in model_dir.iterdir() if path.is_file() and path.name != SAFETENSORS_INDEX
                  and (path.suffix == ".safetensors" or path.suffix in COPIED_SUFFIXES))


def copied_files(model_dir: Path) -> list[str]:
    """The source files copied unchanged into a store (config and tokenizer files)."""
    return [name for name in source_files(model_dir) if Path(name).suffix in COPIED_SUFFIXES]


def record_sources(model_dir: Path) -> dict[str, dict]:
    """{file name: {"sha256", "size", "mtime_ns"}} of every source file of `model_dir`."""
    names = source_files(model_dir)
    with ThreadPoolExecutor(HASH_WORKERS) as pool:
        digests = list(pool.map(lambda name: sha256_file(model_dir / name), names))
    return {name: {**_stat(model_dir / name), "sha256": digest} for name, digest in zip(names, digests)}


def sources_match(model_dir: Path, recorded: dict[str, dict]) -> tuple[bool, dict[str, dict]]:
    """Whether `model_dir` still holds the files `recorded`, and the records refreshed with the times
    of files found unchanged by hash (so the next check need not hash them again). A file added since
    counts only if the store would take it in: weights, or a file transformers reads by name (a notes
    .txt or a stats .json beside the model does not make it another model)."""
    names = source_files(model_dir)
    if not recorded or not set(recorded) <= set(names) or any(_read_by_name(n) for n in set(names) - set(recorded)):
        return False, recorded
    refreshed = {}
    for name, record in recorded.items():
        now = _stat(model_dir / name)
        if now != {key: record.get(key) for key in now}:
            if now["size"] != record.get("size") or sha256_file(model_dir / name) != record.get("sha256"):
                return False, recorded
        refreshed[name] = {**record, **now}
    return True, refreshed


def _read_by_name(name: str) -> bool:
    """A weights, config or tokenizer file that loading the model reads whenever it is there."""
    return Path(name).suffix in READ_SUFFIXES or name in READ_NAMES


def _stat(path: Path) -> dict[str, int]:
    status = path.stat()
    return {"size": status.st_size, "mtime_ns": status.st_mtime_ns}
