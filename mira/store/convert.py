"""`mira convert`: a Hugging Face MoE checkpoint -> a Mira expert store (paper IV-B, DESIGN.md 2.3).

Experts are streamed out of the safetensors shards one at a time (memory-mapped by safetensors,
never the whole model in RAM), quantized and packed into one blob each; a layer's blobs are written
as one file, so peak memory is about one layer of quantized experts plus one expert in float64.

A store is exactly its source. Everything is written into `<out>.partial/` and renamed to `<out>`
at the end; `progress.json` there lists the files finished so far, so a conversion stopped at any
point resumes. Each file is flushed to disk before it is named finished, and the directories
before the rename, so that after a power loss no store is named whose files were in memory only.
A lock beside `<out>` (mira.store.lock) lets one conversion write it at a time. Converting into an
existing store checks it and rewrites only what is missing or corrupt; a store whose source's
weights changed since is converted again.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from mira.errors import MiraError
from mira.models.base import Adapter
from mira.models.expert_keys import FP8_SCALE_SUFFIX
from mira.models.loader import read_config, routed_per_token, skeleton
from mira.models.registry import adapter_for
from mira.store.dequant import checkpoint_quant_method, dequantize_fp8
from mira.store.expert_reader import ExpertReader
from mira.store.files import FILE_MODE, fsync_path, sha256_file, write_json_atomic
from mira.store.layout import ExpertLayout
from mira.store.lock import store_lock
from mira.store.manifest import MANIFEST, PARTIAL_SUFFIX, Manifest, format_version, looks_like_store
from mira.store.quant import quantize_expert
from mira.store.schemes import SCHEMES
from mira.store.sources import SAFETENSORS_INDEX, copied_files, record_sources
from mira.store.verify import file_problems

PROGRESS = "progress.json"
FULL_DISK = "(os error 28)"  # how safetensors reports ENOSPC
CONFIG = "config.json"
NON_EXPERT_SHARD_BYTES = 2 << 30
TMP_SUFFIX = ".tmp"  # files being written; never part of a store


def source_fingerprint(model_dir: Path) -> str:
    """sha256 of config.json and the names and sizes of the weight shards: identifies a model (its
    architecture and shards; predictor heads and features are keyed on it). The store's `sources`
    record the content of every file."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for shard in sorted(model_dir.glob("*.safetensors")):
        digest.update(f"{shard.name}:{shard.stat().st_size}".encode())
    return digest.hexdigest()


class _Checkpoint:
    """Named tensors of a sharded safetensors checkpoint, read lazily one at a time."""

    def __init__(self, model_dir: Path):
        shards = sorted(model_dir.glob("*.safetensors"))
        if not shards:
            raise MiraError(f"{model_dir} has no *.safetensors weights; Mira reads safetensors checkpoints only")
        self._handles = {}
        for shard in shards:
            try:
                self._handles[shard] = safe_open(str(shard), framework="pt")
            except (SafetensorError, OSError) as error:
                raise MiraError(f"cannot read the weights {shard} ({error}); is the checkpoint complete?") from None
        self.where = {key: shard for shard, handle in self._handles.items() for key in handle.keys()}

    def get(self, key: str) -> torch.Tensor:
        return self._handles[self.where[key]].get_tensor(key)

    def get_row(self, key: str, row: int) -> torch.Tensor:
        return self._handles[self.where[key]].get_slice(key)[row]

    def shape(self, key: str) -> list[int]:
        return list(self._handles[self.where[key]].get_slice(key).get_shape())


@dataclass
class Source:
    """A checkpoint checked and ready to convert: nothing is written before all of this holds."""

    model_dir: Path
    scheme: str
    adapter: Adapter
    ckpt: _Checkpoint
    experts: ExpertReader
    layers: list[int]
    num_experts: int
    layout: ExpertLayout
    fingerprint: str
    records: dict[str, dict]  # mira.store.sources

    @property
    def key(self) -> dict:
        """What a store or an interrupted conversion must have been made from to be reused."""
        return {"fingerprint": self.fingerprint, "scheme": self.scheme,
                "sources": {name: record["sha256"] for name, record in self.records.items()}}


def convert(model_dir: Path, out_dir: Path, scheme: str = "int8-shared", progress: bool = True,
            force: bool = False) -> Manifest:
    """Convert a local Hugging Face MoE checkpoint into a store, or check and repair an existing one.

    Args:
        model_dir: directory with config.json, *.safetensors and tokenizer files.
        out_dir: the store directory to create. If it is already a store of this model and scheme,
            its files are checked and those missing or corrupt are written again; if the model's
            files changed since it was made, it is converted again.
        scheme: "int8-shared", "int8-row" or "none".
        progress: show a progress bar.
        force: replace whatever Mira store `out_dir` holds (another model's, another scheme's).

    Returns:
        The manifest of the finished store.

    Raises:
        MiraError: unreadable, unsupported or inconsistent model, or `out_dir` holds something else.
    """
    return write_store(check_source(model_dir, scheme), out_dir, progress, force)


def check_source(model_dir: Path, scheme: str) -> Source:
    """Read and check a checkpoint for conversion, writing nothing: a supported architecture, readable
    shards, and weights of every expert with the config's shapes.

    Raises:
        MiraError: what is wrong with the checkpoint, and the fix.
    """
    if scheme not in SCHEMES:
        raise MiraError(f"unknown quantization {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if looks_like_store(model_dir):
        raise MiraError(f"{model_dir} is a Mira store, not a checkpoint; pass it to --model as it is, or convert the "
                        "Hugging Face model directory it was made from")
    config = read_config(model_dir)
    checkpoint_quant_method(config)  # refuses a quantization Mira cannot read
    adapter = adapter_for(config, str(model_dir))
    spec = adapter.spec
    ckpt = _Checkpoint(model_dir)
    experts = ExpertReader(ckpt, adapter, config, model_dir)
    layers, num_experts = experts.layers, spec.num_experts
    top_k = routed_per_token(config) or 1
    if not layers or top_k > num_experts:
        raise MiraError(f"{model_dir / 'config.json'} routes each token to {top_k} of {num_experts} experts in "
                        f"{len(layers)} MoE layers; fix num_experts_per_tok or the expert count in config.json")
    experts.check()
    for name, tensor in skeleton(config).state_dict().items():  # the non-expert weights (meta: shapes only)
        if name in ckpt.where and ckpt.shape(name) != list(tensor.shape):
            raise MiraError(f"{model_dir / 'config.json'} does not match its weights: {name} is {ckpt.shape(name)}, "
                            f"the config makes it {list(tensor.shape)}; fix config.json or the weights")
    weight_dtype = torch.int8
    if scheme == "none":  # the checkpoint's own dtype; bf16 for one stored quantized
        weight_dtype = torch.bfloat16 if experts.dequantizes else experts.read(layers[0], 0)["w13"].dtype
    try:
        layout = ExpertLayout(scheme, spec.hidden, spec.intermediate, weight_dtype, gated=spec.gated, bias=spec.bias)
    except ValueError as error:
        raise MiraError(f"cannot store the experts of {model_dir} with --quant {scheme}: {error}") from None
    return Source(model_dir, scheme, adapter, ckpt, experts, layers, num_experts, layout,
                  source_fingerprint(model_dir), record_sources(model_dir))


def write_store(source: Source, out_dir: Path, progress: bool = True, force: bool = False) -> Manifest:
    """Convert a checked checkpoint (`check_source`) into `out_dir`, or check and repair the store there:
    as `convert`. A link is followed: the store it names is the one replaced or repaired."""
    out_dir = Path(os.path.realpath(out_dir))  # named by its parent and name, even as "." or through a link
    with store_lock(out_dir):
        for leftover in out_dir.parent.glob(f".{out_dir.name}.trash-*"):  # of a killed replacement
            shutil.rmtree(leftover, ignore_errors=True)
        try:
            if out_dir.exists():
                manifest = _check_existing(out_dir, source, force)
                if manifest is not None:
                    return manifest
            return _write_store(out_dir, source, progress)
        except OSError as error:  # a full disk; what was written is kept to resume
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise MiraError(f"cannot write the store {out_dir} ({error.strerror}); free space there, or pass another "
                            "--out (MIRA_CACHE for a store made on first use), then run the same command again") from None


def _check_existing(out_dir: Path, source: Source, force: bool) -> Manifest | None:
    """The manifest of `out_dir` if it is a sound store of `source`; else None, with `out_dir` moved
    to `<out>.partial` (its sound files kept, to be completed) or discarded (to be converted anew)."""
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        if out_dir == Path.cwd().resolve():
            raise MiraError(f"--out names the working directory {out_dir}, which the finished store would replace "
                            f"under your shell; pass --out ../{out_dir.name} from there, or another --out")
        return None  # empty: the finished store takes its place
    if not out_dir.is_dir() or not looks_like_store(out_dir):
        raise MiraError(f"{out_dir} exists and is not a Mira store; choose another --out or remove it")
    partial = _partial(out_dir)
    if partial.exists():  # a conversion interrupted before this store was finished: the store wins
        shutil.rmtree(partial)
    if force:
        _discard(out_dir)
        return None
    try:
        manifest = Manifest.read(out_dir)
    except MiraError:
        print(f"mira: converting {out_dir} again: its manifest is missing, unreadable or of another format version",
              file=sys.stderr)
        _discard(out_dir)
        return None
    if manifest.source_fingerprint != source.fingerprint:
        raise MiraError(f"store {out_dir} was made from another model ({manifest.source}); choose another --out, "
                        f"or pass --force to replace it with {source.model_dir}")
    if manifest.scheme != source.scheme:
        raise MiraError(f"store {out_dir} holds {manifest.scheme} experts, not {source.scheme}; choose another "
                        f"--out, pass --quant {manifest.scheme}, or pass --force to replace it")
    if {name: record.get("sha256") for name, record in manifest.sources.items()} != source.key["sources"]:
        print(f"mira: the files of {source.model_dir} changed since {out_dir} was made from them; converting again",
              file=sys.stderr)
        _discard(out_dir)
        return None
    problems = file_problems(out_dir, manifest)
    if not problems:
        here = str(source.model_dir.resolve())
        if manifest.sources != source.records or manifest.source != here:  # same content: newer times, a new place
            manifest = Manifest(**{**manifest.__dict__, "sources": source.records, "source": here})
            manifest.write(out_dir)
        return manifest
    print(f"mira: repairing {out_dir}: " + "; ".join(f"{rel} {what}" for rel, what in problems.items()),
          file=sys.stderr)
    out_dir.rename(partial)  # resumed like an interrupted conversion: sound files are kept
    return None


def _discard(path: Path) -> None:
    """Remove a directory so that no reader ever sees it half-deleted: renamed first, then deleted (a
    kill in between leaves a trash directory that the next conversion removes)."""
    trash = path.with_name(f".{path.name}.trash-{os.getpid()}")
    path.rename(trash)
    shutil.rmtree(trash)


def _partial(out_dir: Path) -> Path:
    return out_dir.with_name(out_dir.name + PARTIAL_SUFFIX)


def _write_store(out_dir: Path, source: Source, progress: bool) -> Manifest:
    """Convert into `<out>.partial/`, resuming what it holds, then rename it to `out_dir`."""
    partial = _partial(out_dir)
    done = _resume_state(partial, source.key)
    _save_progress(partial, source.key, done)
    (partial / "experts").mkdir(exist_ok=True)

    layout, num_experts = source.layout, source.num_experts
    bar = tqdm(total=len(source.layers) * num_experts, desc=f"quantizing experts ({source.scheme})", unit="expert",
               disable=not progress)
    manifest = Manifest(format_version(layout), source.adapter.model_type, str(source.model_dir.resolve()), source.fingerprint,
                        source.layers, num_experts, layout.to_json(), files={}, sources=source.records)
    for layer in source.layers:
        rel = manifest.expert_file(layer)
        if rel not in done:
            blobs = torch.empty(num_experts, layout.nbytes, dtype=torch.uint8)  # [E, blob bytes]
            for expert in range(num_experts):
                tensors = source.experts.read(layer, expert)
                layout.pack(quantize_expert(layout=layout, **tensors), blobs[expert])
                bar.update()
            done[rel] = _save_safetensors({"experts": blobs}, partial / rel)
            _save_progress(partial, source.key, done)
        else:
            bar.update(num_experts)
    bar.close()

    if not _non_expert_done(partial, done):
        done.update(_write_non_expert(source.ckpt, source.experts.expert_keys, partial, source.experts.block))
        _save_progress(partial, source.key, done)
    for name in copied_files(source.model_dir):
        if name not in done:
            config = dequantized_config(source.model_dir / name) if name == CONFIG else None
            if config is not None:  # weights stored dequantized: the store's config says so
                write_json_atomic(partial / name, config)
            else:
                shutil.copyfile(source.model_dir / name, partial / name)
                fsync_path(partial / name)
            done[name] = sha256_file(partial / name)
    _save_progress(partial, source.key, done)

    manifest = Manifest(**{**manifest.__dict__, "files": dict(sorted(done.items()))})
    _tidy(partial, manifest)
    manifest.write(partial)
    (partial / PROGRESS).unlink()
    for directory in (partial / "experts", partial):  # the renames into them, on disk before the store's
        fsync_path(directory)
    partial.rename(out_dir)
    fsync_path(out_dir.parent)
    return manifest


def dequantized_config(path: Path) -> dict | None:
    """config.json without its `quantization_config` (the store holds the weights dequantized); None
    when it has none."""
    config = json.loads(path.read_text())
    return config if config.pop("quantization_config", None) is not None else None


def _non_expert_done(partial: Path, done: dict[str, str]) -> bool:
    """Whether the non-expert shards and their index (written after the shards it lists) are finished."""
    if SAFETENSORS_INDEX not in done:
        return False
    shards = set(json.loads((partial / SAFETENSORS_INDEX).read_text())["weight_map"].values())
    return shards <= set(done)


def _resume_state(partial: Path, key: dict) -> dict[str, str]:
    """Files already finished in `<out>.partial/` by an interrupted conversion (or a repair) of the same
    model and scheme, each checked against its checksum; {} if there is none (the directory is then
    empty and ready)."""
    if not partial.exists():
        partial.mkdir()
        return {}
    listed = _listed_files(partial, key)
    if listed is None:
        if not _only_conversion_files(partial):
            raise MiraError(f"{partial} exists but is not an interrupted Mira conversion; remove it")
        listed = {}
    if not listed:  # nothing to keep (another model, or nothing finished): start over
        shutil.rmtree(partial)
        partial.mkdir()
        return {}
    return {rel: sha for rel, sha in listed.items() if (partial / rel).is_file() and sha256_file(partial / rel) == sha}


def _listed_files(partial: Path, key: dict) -> dict[str, str] | None:
    """The files `progress.json` (or, once the conversion was finishing, the manifest) lists as written,
    if made for `key`; {} if made for another model or scheme; None if neither file is there."""
    try:
        if (partial / PROGRESS).is_file():
            state = json.loads((partial / PROGRESS).read_text())
            same = {name: state.get(name) for name in key} == key
            return dict(state["files"]) if same else {}
        if (partial / MANIFEST).is_file():
            manifest = Manifest.read(partial)
            made_from = {"fingerprint": manifest.source_fingerprint, "scheme": manifest.scheme,
                         "sources": {name: record.get("sha256") for name, record in manifest.sources.items()}}
            return dict(manifest.files) if made_from == key else {}
    except (OSError, ValueError, KeyError, TypeError, MiraError):
        return {}  # a progress file or manifest cut short: start over
    return None


def _only_conversion_files(partial: Path) -> bool:
    """Whether `partial` holds nothing but what a conversion writes before its progress file: expert
    layer files and files being written."""
    for path in partial.rglob("*"):
        rel = path.relative_to(partial)
        if path.is_dir():
            if rel != Path("experts"):
                return False
        elif not (path.name.endswith(TMP_SUFFIX) or (rel.parent == Path("experts") and path.suffix == ".safetensors")):
            return False
    return True


def _tidy(partial: Path, manifest: Manifest) -> None:
    """Delete what an interrupted write left behind (unfinished files, stale layer files), so the
    finished store holds only its manifest's files (and, after a repair, predictor heads)."""
    for path in list(partial.rglob("*" + TMP_SUFFIX)) + list((partial / "experts").iterdir()):
        rel = path.relative_to(partial).as_posix()
        if path.is_file() and rel not in manifest.files:
            path.unlink()


def _save_progress(partial: Path, key: dict, done: dict[str, str]) -> None:
    write_json_atomic(partial / PROGRESS, {**key, "files": done})


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> str:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    except SafetensorError as error:  # its I/O errors carry the OS error's text only
        if FULL_DISK not in str(error):
            raise
        raise OSError(errno.ENOSPC, str(error), str(tmp)) from None
    os.chmod(tmp, FILE_MODE)  # as open() would make it: safetensors writes it for its owner alone
    fsync_path(tmp)  # on disk before it is named a finished file
    digest = sha256_file(tmp)
    tmp.replace(path)
    return digest


def _write_non_expert(ckpt: _Checkpoint, expert_keys: set[str], out: Path,
                      fp8_block: tuple[int, int]) -> dict[str, str]:
    """Copy every non-expert tensor, unchanged (FP8 ones dequantized), into shards of at most
    NON_EXPERT_SHARD_BYTES each, writing each shard as soon as it is full."""
    files: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        files[name] = _save_safetensors(shard, out / name)
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for key in sorted(k for k in ckpt.where if k not in expert_keys and not k.endswith(FP8_SCALE_SUFFIX)):
        tensor = ckpt.get(key)
        if key + FP8_SCALE_SUFFIX in ckpt.where:  # FP8 with block scales: stored dequantized, in bf16
            tensor = dequantize_fp8(tensor, ckpt.get(key + FP8_SCALE_SUFFIX), fp8_block).to(torch.bfloat16)
        if shard and sum(t.nbytes for t in shard.values()) + tensor.nbytes > NON_EXPERT_SHARD_BYTES:
            flush()
        shard[key] = tensor
    flush()
    write_json_atomic(out / SAFETENSORS_INDEX, {"metadata": {}, "weight_map": weight_map})
    files[SAFETENSORS_INDEX] = sha256_file(out / SAFETENSORS_INDEX)
    return files
