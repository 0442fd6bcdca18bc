"""`mira convert`: a Hugging Face MoE checkpoint -> a Mira expert store (paper IV-B, DESIGN.md 2.3).

Experts are streamed out of the safetensors shards one at a time (memory-mapped by safetensors,
never the whole model in RAM), quantized and packed into one blob each; a layer's blobs are written
as one file, so peak memory is about one layer of quantized experts plus one expert in float64.
Everything is written into `<out>.partial/` and renamed to `<out>` at the end; an interrupted
conversion resumes from the layers already written there.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from mira.errors import MiraError
from mira.models.base import Adapter
from mira.models.loader import moe_skeleton_layers, read_config
from mira.models.registry import adapter_for
from mira.store.files import sha256_file, write_json_atomic
from mira.store.layout import ExpertLayout
from mira.store.manifest import FORMAT_VERSION, Manifest, is_store
from mira.store.quant import quantize_expert

PROGRESS = "progress.json"
NON_EXPERT_SHARD_BYTES = 2 << 30
COPIED_SUFFIXES = {".json", ".jinja", ".txt", ".model", ".tiktoken"}
SAFETENSORS_INDEX = "model.safetensors.index.json"


def source_fingerprint(model_dir: Path) -> str:
    """sha256 of config.json and the names and sizes of the weight shards: identifies a checkpoint."""
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
        self._handles = {shard: safe_open(str(shard), framework="pt") for shard in shards}
        self.where = {key: shard for shard, handle in self._handles.items() for key in handle.keys()}

    def get(self, key: str) -> torch.Tensor:
        return self._handles[self.where[key]].get_tensor(key)

    def get_row(self, key: str, row: int) -> torch.Tensor:
        return self._handles[self.where[key]].get_slice(key)[row]


def _expert_names(adapter: Adapter, layer: int, expert: int) -> list[str]:
    k = adapter.keys
    return [name.format(layer=layer, expert=expert) for name in (k.gate, k.up, k.down)]


def _read_expert(ckpt: _Checkpoint, adapter: Adapter, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([2I, H] gate rows then up rows, [H, I]) of one expert, per-expert or fused on disk."""
    gate, up, down = _expert_names(adapter, layer, expert)
    if gate in ckpt.where:
        return torch.cat([ckpt.get(gate), ckpt.get(up)]), ckpt.get(down)
    fused_gate_up = adapter.keys.fused_gate_up.format(layer=layer)
    if fused_gate_up in ckpt.where:
        return ckpt.get_row(fused_gate_up, expert), ckpt.get_row(adapter.keys.fused_down.format(layer=layer), expert)
    raise MiraError(f"the checkpoint has no weights for expert {expert} of layer {layer} (looked for {gate!r} "
                    f"and {fused_gate_up!r}); is the checkpoint complete?")


def convert(model_dir: Path, out_dir: Path, scheme: str = "int8-shared", progress: bool = True) -> Manifest:
    """Convert a local Hugging Face MoE checkpoint into a store.

    Args:
        model_dir: directory with config.json, *.safetensors and tokenizer files.
        out_dir: the store directory to create.
        scheme: "int8-shared", "int8-row" or "none".
        progress: show a progress bar.

    Returns:
        The manifest of the finished store (an existing store of the same model and scheme is reused).

    Raises:
        MiraError: unreadable or unsupported model, or `out_dir` holds something else.
    """
    config = read_config(model_dir)
    adapter = adapter_for(config, str(model_dir))
    fingerprint = source_fingerprint(model_dir)
    if out_dir.exists():
        return _existing_store(out_dir, fingerprint, scheme, model_dir)

    ckpt = _Checkpoint(model_dir)
    layers = moe_skeleton_layers(config)
    num_experts, hidden = adapter.num_experts(config), config.hidden_size
    weight_dtype = torch.int8
    if scheme == "none":
        weight_dtype = _read_expert(ckpt, adapter, layers[0], 0)[0].dtype
    layout = ExpertLayout(scheme, hidden, adapter.intermediate_size(config), weight_dtype)

    partial = out_dir.with_name(out_dir.name + ".partial")
    done = _resume_state(partial, fingerprint, scheme)
    (partial / "experts").mkdir(parents=True, exist_ok=True)

    bar = tqdm(total=len(layers) * num_experts, desc=f"quantizing experts ({scheme})", unit="expert",
               disable=not progress)
    manifest = Manifest(FORMAT_VERSION, config.model_type, str(model_dir.resolve()), fingerprint, layers,
                        num_experts, layout.to_json(), files={})
    for layer in layers:
        rel = manifest.expert_file(layer)
        if rel not in done:
            blobs = torch.empty(num_experts, layout.nbytes, dtype=torch.uint8)  # [E, blob bytes]
            for expert in range(num_experts):
                w13, w2 = _read_expert(ckpt, adapter, layer, expert)
                layout.pack(quantize_expert(w13, w2, layout), blobs[expert])
                bar.update()
            done[rel] = _save_safetensors({"experts": blobs}, partial / rel)
            write_json_atomic(partial / PROGRESS, {"fingerprint": fingerprint, "scheme": scheme, "files": done})
        else:
            bar.update(num_experts)
    bar.close()

    expert_keys = {name for layer in layers for e in range(num_experts) for name in _expert_names(adapter, layer, e)}
    expert_keys |= {k.format(layer=layer) for layer in layers for k in (adapter.keys.fused_gate_up, adapter.keys.fused_down)}
    done.update(_write_non_expert(ckpt, expert_keys, partial))
    for path in model_dir.iterdir():
        if path.is_file() and path.suffix in COPIED_SUFFIXES and path.name != SAFETENSORS_INDEX:
            shutil.copyfile(path, partial / path.name)
            done[path.name] = sha256_file(partial / path.name)

    manifest = Manifest(**{**manifest.__dict__, "files": dict(sorted(done.items()))})
    manifest.write(partial)
    (partial / PROGRESS).unlink()
    partial.rename(out_dir)
    return manifest


def _existing_store(out_dir: Path, fingerprint: str, scheme: str, model_dir: Path) -> Manifest:
    if not is_store(out_dir):
        raise MiraError(f"{out_dir} exists and is not a Mira store; choose another --out or remove it")
    manifest = Manifest.read(out_dir)
    if manifest.source_fingerprint != fingerprint:
        raise MiraError(f"store {out_dir} was made from another model ({manifest.source}); choose another --out "
                        f"or remove it to convert {model_dir}")
    if manifest.scheme != scheme:
        raise MiraError(f"store {out_dir} holds {manifest.scheme} experts, not {scheme}; choose another --out "
                        f"or pass --quant {manifest.scheme}")
    return manifest


def _resume_state(partial: Path, fingerprint: str, scheme: str) -> dict[str, str]:
    """Files already finished by an interrupted conversion of the same model and scheme."""
    progress = partial / PROGRESS
    if not progress.is_file():
        if partial.exists():
            raise MiraError(f"{partial} exists but is not an interrupted Mira conversion; remove it")
        return {}
    state = json.loads(progress.read_text())
    if state.get("fingerprint") != fingerprint or state.get("scheme") != scheme:
        shutil.rmtree(partial)  # an interrupted conversion of another model or scheme: start over
        return {}
    return {rel: sha for rel, sha in state["files"].items()
            if (partial / rel).is_file() and sha256_file(partial / rel) == sha}


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> str:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    digest = sha256_file(tmp)
    tmp.replace(path)
    return digest


def _write_non_expert(ckpt: _Checkpoint, expert_keys: set[str], out: Path) -> dict[str, str]:
    """Copy every non-expert tensor, unchanged, into shards of at most NON_EXPERT_SHARD_BYTES each,
    writing each shard as soon as it is full."""
    files: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        files[name] = _save_safetensors(shard, out / name)
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for key in sorted(k for k in ckpt.where if k not in expert_keys):
        tensor = ckpt.get(key)
        if shard and sum(t.nbytes for t in shard.values()) + tensor.nbytes > NON_EXPERT_SHARD_BYTES:
            flush()
        shard[key] = tensor
    flush()
    write_json_atomic(out / SAFETENSORS_INDEX, {"metadata": {}, "weight_map": weight_map})
    files[SAFETENSORS_INDEX] = sha256_file(out / SAFETENSORS_INDEX)
    return files
