"""The store's manifest: what a store holds, what it was made from, and checksums of every file.

A store is a directory:

    manifest.json                  this manifest
    config.json, tokenizer files   copied from the source model
    model*.safetensors             the non-expert weights, original names and dtype
    experts/layer-NNN.safetensors  one tensor "experts" uint8 [E, blob bytes] per MoE layer NNN;
                                   row e is expert e's blob (mira.store.layout)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from mira.errors import MiraError
from mira.store.files import write_json_atomic
from mira.store.layout import ExpertLayout

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Manifest:
    format_version: int
    model_type: str
    source: str  # the model directory it was converted from
    source_fingerprint: str  # sha256 of the source config and shard names and sizes
    moe_layers: list[int]  # decoder layer index of each MoE layer, in order
    num_experts: int
    layout: dict  # ExpertLayout.to_json()
    files: dict[str, str]  # relative path -> sha256

    @property
    def expert_layout(self) -> ExpertLayout:
        return ExpertLayout.from_json(self.layout)

    @property
    def scheme(self) -> str:
        return self.layout["scheme"]

    def expert_file(self, layer: int) -> str:
        return f"experts/layer-{layer:03d}.safetensors"

    def write(self, store_dir: Path) -> None:
        write_json_atomic(store_dir / MANIFEST, asdict(self))

    @classmethod
    def read(cls, store_dir: Path) -> Manifest:
        path = store_dir / MANIFEST
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise MiraError(f"cannot read the store manifest {path}: {error}; convert the model again "
                            "with `mira convert`") from error
        if data.get("format_version") != FORMAT_VERSION:
            raise MiraError(f"store {store_dir} has format version {data.get('format_version')}, this Mira reads "
                            f"version {FORMAT_VERSION}; convert the model again with `mira convert`")
        try:
            return cls(**data)
        except TypeError as error:
            raise MiraError(f"store manifest {path} is malformed ({error}); convert the model again") from error


def is_store(path: Path) -> bool:
    return (path / MANIFEST).is_file()
