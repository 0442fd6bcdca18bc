"""The store cache: where `mira.load` keeps the stores it converts from model directories.

A cached store is named for where it came from: `<name>-<hash of its full path>-<scheme>`, the name
being the model directory's, or a hub model's repo id and revision (mira.models.hub), under
`$MIRA_CACHE/stores` (default `$XDG_CACHE_HOME/mira/stores`, else ~/.cache/mira/stores), so two
checkpoints of one name in two places never share a store. Its manifest records every source file by content (mira.store.sources);
a lookup checks them, by size and time first and by hash where those changed, and converts again
when the source's files changed.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

from mira.errors import MiraError
from mira.store.convert import check_source, write_store
from mira.store.lock import store_lock
from mira.store.manifest import Manifest, is_store
from mira.store.sources import sources_match


def cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(os.environ.get("MIRA_CACHE") or Path(xdg or Path.home() / ".cache") / "mira") / "stores"


def cache_store_path(model_dir: Path, scheme: str, name: str | None = None) -> Path:
    """Where the store of `model_dir` in `scheme` is cached; `name` (default: the directory's) leads."""
    resolved = model_dir.resolve()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    return cache_dir() / f"{name or resolved.name}-{digest}-{scheme}"


def cache_store(model_dir: Path, scheme: str, progress: bool = True, name: str | None = None) -> Path:
    """The cached store of `model_dir` in `scheme` (named `name`, default the directory's), converted
    first if there is none or if the files of `model_dir` changed since it was made.

    Raises:
        MiraError: the model cannot be converted (the message says why and what to do).
    """
    target = cache_store_path(model_dir, scheme, name)
    if is_store(target) and _current(target, model_dir):
        return target
    source = check_source(model_dir, scheme)  # an unusable model is refused before anything is said or written
    _check_writable(target.parent)
    if not target.exists():
        print(f"mira: converting {model_dir} into the store {target} (first use; later runs reuse it)",
              file=sys.stderr)
    stale = _fingerprint(target) not in (None, source.fingerprint)
    if stale:  # the cache's place for this directory: a store of it before its config or shards changed
        print(f"mira: the config or shards of {model_dir} changed since {target} was made from them; converting "
              "again", file=sys.stderr)
    write_store(source, target, progress, force=stale)
    return target


def _fingerprint(store: Path) -> str | None:
    """The source fingerprint a readable store's manifest records; None elsewhere."""
    try:
        return Manifest.read(store).source_fingerprint if is_store(store) else None
    except MiraError:
        return None


def _check_writable(root: Path) -> None:
    """Raises MiraError, naming MIRA_CACHE, where the cache directory cannot be made or written."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as error:
        raise MiraError(f"cannot write the store cache {root} ({error.strerror}); set MIRA_CACHE to a writable "
                        "directory, or convert into one with `mira convert MODEL_DIR --out DIR` and pass --model "
                        "DIR") from None


def _current(store: Path, model_dir: Path) -> bool:
    """Whether `store` was made from the files `model_dir` holds now; records newer times of files
    found unchanged by hash, so they are not hashed again."""
    try:
        manifest = Manifest.read(store)
    except MiraError:
        return False  # converting repairs it
    same, refreshed = sources_match(model_dir, manifest.sources)
    if same and refreshed != manifest.sources:
        try:
            with store_lock(store):
                Manifest(**{**manifest.__dict__, "sources": refreshed}).write(store)
        except (OSError, MiraError):
            pass  # a read-only cache: the times are checked by hash again next time
    return same


def cached_stores() -> list[Path]:
    """Every store in the cache directory, by name, with what conversions left unfinished (`<store>.partial`)
    and stores whose manifest is gone: all that takes space there."""
    root = cache_dir()
    return sorted(path for path in root.iterdir() if path.is_dir() and not path.name.startswith(".")) \
        if root.is_dir() else []


def cache_leftovers() -> list[Path]:
    """What a replacement killed between its rename and its deletion left in the cache (hidden)."""
    root = cache_dir()
    return sorted(root.glob(".*.trash-*")) if root.is_dir() else []
