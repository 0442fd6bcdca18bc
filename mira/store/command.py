"""`mira store ls|verify|rm`: the stores `mira.load` converted into the cache directory."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from mira.errors import MiraError


def add_command(subparsers) -> None:
    store = subparsers.add_parser(
        "store", help="list, verify or remove the stores converted on first use (the cache)",
        description="The stores `mira generate --model DIR` converts on first use live in $MIRA_CACHE/stores "
                    "(default ~/.cache/mira/stores), one per model directory and scheme.")
    actions = store.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = actions.add_parser("ls", aliases=["list"],
                            help="list the cached stores: size, scheme, source and whether it is current",
                            description="List the cached stores with their size, scheme and source directory, and "
                                        "whether the source still holds the files each was made from.")
    ls.set_defaults(run=_ls)
    verify = actions.add_parser("verify", help="check every file of stores against its checksum",
                                description="Check every file of the given stores (default: every cached store) "
                                            "against the checksums of its manifest; print the command that "
                                            "repairs each corrupt one.")
    verify.add_argument("stores", nargs="*", metavar="STORE", help="cached store names or store directories")
    verify.set_defaults(run=_verify)
    rm = actions.add_parser("rm", aliases=["remove"], help="remove cached stores", description="Remove cached stores.")
    rm.add_argument("stores", nargs="*", metavar="NAME", help="names of cached stores (as `mira store ls` prints)")
    rm.add_argument("--all", action="store_true", help="remove every cached store")
    rm.set_defaults(run=_rm)


def _ls(args: argparse.Namespace) -> None:
    from mira.store.cache import cache_dir, cached_stores
    from mira.store.manifest import PARTIAL_SUFFIX, Manifest
    from mira.store.sources import sources_match

    stores = cached_stores()
    print(f"{cache_dir()}: {len(stores)} store{'' if len(stores) == 1 else 's'}")
    for path in stores:
        size = f"{_size(path) / 2**20:.1f} MiB"
        if path.name.endswith(PARTIAL_SUFFIX):
            print(f"{path.name}\t{size}\tan unfinished conversion: running, or stopped (the model's next use "
                  "resumes it)")
            continue
        try:
            manifest = Manifest.read(path)
        except MiraError:
            print(f"{path.name}\t{size}\tunreadable manifest (the model's next use converts it again)")
            continue
        source = Path(manifest.source)
        if not manifest.sources:
            state = "made by an older Mira (no source record)"
        elif not source.is_dir():
            state = "source gone"
        else:
            state = "current" if sources_match(source, manifest.sources)[0] else "source changed"
        print(f"{path.name}\t{size}\t{manifest.scheme}\t{state}\t{manifest.source}")


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _verify(args: argparse.Namespace) -> None:
    from mira.store.cache import cached_stores
    from mira.store.manifest import MANIFEST, PARTIAL_SUFFIX, Manifest
    from mira.store.verify import file_problems

    paths = [_store_path(name, must_be_cached=False) for name in args.stores] or cached_stores()
    bad = 0
    for path in paths:
        if path.name.endswith(PARTIAL_SUFFIX) and not (path / MANIFEST).is_file():
            print(f"{path}: an unfinished conversion, not a store: the model's next use resumes it, `mira store rm "
                  f"{path.name}` removes it")
            continue
        try:
            manifest = Manifest.read(path)
        except MiraError as error:
            print(f"{path}: {error}")
            bad += 1
            continue
        problems = file_problems(path, manifest)
        if problems:
            bad += 1
            print(f"{path}: corrupt: " + "; ".join(f"{rel} {what}" for rel, what in problems.items())
                  + f"; repair it with `{manifest.repair_command(path)}`")
        else:
            print(f"{path}: ok ({len(manifest.files)} files)")
    if bad:
        raise MiraError(f"{bad} of {len(paths)} stores failed verification; repair each with the command above")


def _rm(args: argparse.Namespace) -> None:
    from mira.store.cache import cache_leftovers, cached_stores
    from mira.store.lock import store_lock
    from mira.store.manifest import written_store

    if args.all and args.stores:
        raise MiraError("--all removes every cached store and takes no names; pass either the names or --all")
    if not args.all and not args.stores:
        raise MiraError("name the cached stores to remove (see `mira store ls`), or pass --all")
    paths = cached_stores() if args.all else [_store_path(name, must_be_cached=True) for name in args.stores]
    for path in paths:
        with store_lock(written_store(path)):  # the lock the conversion writing a .partial holds
            shutil.rmtree(path)
        print(f"removed {path}", file=sys.stderr)
    for leftover in cache_leftovers() if args.all else []:
        shutil.rmtree(leftover, ignore_errors=True)


def _store_path(name: str, must_be_cached: bool) -> Path:
    """A cached store's name, or (unless `must_be_cached`) any store directory, as a path to a store."""
    from mira.store.cache import cache_dir, cached_stores
    from mira.store.manifest import looks_like_store

    cached = cache_dir() / name
    if "/" not in name and cached in cached_stores():
        return cached
    path = Path(name)
    if not must_be_cached and looks_like_store(path):
        return path
    where = "a cached store" if must_be_cached else "a cached store or a store directory"
    raise MiraError(f"{name} is not {where}; see `mira store ls`")
