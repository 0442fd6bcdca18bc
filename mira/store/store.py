"""The expert store in host memory (paper IV-B): every expert blob of the model, pinned on CUDA.

Opening a store checks it whole before anything uses it: the manifest's format version, the
sha256 of every file (expert files are hashed while they are read into memory, so this costs no
second pass) and the shape of every expert tensor. A store that fails any check is refused.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch
from tqdm import tqdm

from mira.errors import MiraError
from mira.store.files import CHUNK, sha256_file
from mira.store.layout import ExpertLayout
from mira.store.manifest import Manifest

_CORRUPT = "store {store} is corrupt: {what}; convert the model again with `mira convert`"


class ExpertStore:
    """All expert blobs of one model: `data` uint8 [L, E, B] (L MoE layers, E experts, B blob bytes)."""

    def __init__(self, path: Path, manifest: Manifest, data: torch.Tensor):
        self.path = path
        self.manifest = manifest
        self.layout: ExpertLayout = manifest.expert_layout
        self.data = data
        self.num_layers, self.num_experts, _ = data.shape

    @classmethod
    def open(cls, path: Path, pin: bool = False, progress: bool = True) -> ExpertStore:
        """Read and verify a store.

        Args:
            path: the store directory.
            pin: allocate the blobs in page-locked memory (for asynchronous copies to a GPU).
            progress: show a progress bar while reading.

        Raises:
            MiraError: a missing, altered or truncated file, or a manifest this version cannot read.
        """
        manifest = Manifest.read(path)
        layout = manifest.expert_layout
        expert_files = [manifest.expert_file(layer) for layer in manifest.moe_layers]
        for rel, expected in manifest.files.items():
            if rel in expert_files:
                continue
            if not (path / rel).is_file():
                raise MiraError(_CORRUPT.format(store=path, what=f"{rel} is missing"))
            if sha256_file(path / rel) != expected:
                raise MiraError(_CORRUPT.format(store=path, what=f"{rel} does not match its checksum"))
        shape = (len(manifest.moe_layers), manifest.num_experts, layout.nbytes)
        data = torch.empty(shape, dtype=torch.uint8, pin_memory=pin)
        bytes_total = data.numel()
        with tqdm(total=bytes_total, unit="B", unit_scale=True, desc="loading experts",
                  disable=not progress or bytes_total < (256 << 20)) as bar:
            for position, rel in enumerate(expert_files):
                if rel not in manifest.files:
                    raise MiraError(_CORRUPT.format(store=path, what=f"the manifest lists no checksum for {rel}"))
                _read_verified(path, rel, manifest.files[rel], data[position], bar)
        return cls(path, manifest, data)

    def blob(self, layer_position: int, expert: int) -> torch.Tensor:
        """Expert `expert` of the MoE layer at `layer_position` (0-based among MoE layers): uint8 [B]."""
        return self.data[layer_position, expert]

    @property
    def blob_bytes(self) -> int:
        return self.layout.nbytes


def _read_verified(store: Path, rel: str, expected_sha: str, out: torch.Tensor, bar: tqdm) -> None:
    """Read the single uint8 tensor of a safetensors file into `out` [E, B], hashing as it goes."""
    path = store / rel
    if not path.is_file():
        raise MiraError(_CORRUPT.format(store=store, what=f"{rel} is missing"))
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        head = f.read(8)
        digest.update(head)
        header_bytes = f.read(struct.unpack("<Q", head)[0]) if len(head) == 8 else b""
        digest.update(header_bytes)
        try:
            entry = json.loads(header_bytes)["experts"]
        except (ValueError, KeyError):
            raise MiraError(_CORRUPT.format(store=store, what=f"{rel} has no readable 'experts' tensor")) from None
        if entry.get("dtype") != "U8" or entry.get("shape") != list(out.shape):
            raise MiraError(_CORRUPT.format(store=store, what=f"{rel} holds {entry.get('dtype')} "
                                            f"{entry.get('shape')}, the manifest says U8 {list(out.shape)}"))
        view = memoryview(out.numpy()).cast("B")
        filled = 0
        while filled < len(view):
            n = f.readinto(view[filled : filled + CHUNK])
            if not n:
                raise MiraError(_CORRUPT.format(store=store, what=f"{rel} is truncated"))
            digest.update(view[filled : filled + n])
            filled += n
            bar.update(n)
        digest.update(f.read())
    if digest.hexdigest() != expected_sha:
        raise MiraError(_CORRUPT.format(store=store, what=f"{rel} does not match its checksum"))
