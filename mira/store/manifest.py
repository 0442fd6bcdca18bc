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
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mira.errors import MiraError
from mira.store.files import write_json_atomic
from mira.store.layout import ExpertLayout

FORMAT_VERSION = 1  # a store whose blob layout has no biases and gated experts
EXTENDED_FORMAT_VERSION = 2  # blob layouts with biases or ungated experts (mira.store.layout)
INT4_FORMAT_VERSION = 3  # int4 blobs with tiled codes (mira.store.int4); int4 stores of before are not read
READABLE_VERSIONS = (FORMAT_VERSION, EXTENDED_FORMAT_VERSION, INT4_FORMAT_VERSION)
MANIFEST = "manifest.json"
PARTIAL_SUFFIX = ".partial"  # a conversion in progress writes <store>.partial, renamed to <store> when done


def format_version(layout: ExpertLayout) -> int:
    """The lowest format version that holds `layout`: a store without the extended fields stays
    readable by a Mira that knows version 1 only."""
    if layout.scheme == "int4":
        return INT4_FORMAT_VERSION
    return EXTENDED_FORMAT_VERSION if layout.extended else FORMAT_VERSION


@dataclass(frozen=True)
class Manifest:
    format_version: int
    model_type: str
    source: str  # the model directory it was converted from
    source_fingerprint: str  # sha256 of the source config and shard names and sizes: the model's identity
    moe_layers: list[int]  # decoder layer index of each MoE layer, in order
    num_experts: int
    layout: dict  # ExpertLayout.to_json()
    files: dict[str, str]  # relative path -> sha256
    sources: dict[str, dict] = field(default_factory=dict)  # source file -> sha256, size, mtime_ns (store.sources)

    @property
    def expert_layout(self) -> ExpertLayout:
        return ExpertLayout.from_json(self.layout)

    @property
    def scheme(self) -> str:
        return self.layout["scheme"]

    def expert_file(self, layer: int) -> str:
        return f"experts/layer-{layer:03d}.safetensors"

    def repair_command(self, store_dir: Path) -> str:
        """The command that checks this store and rewrites what is missing or corrupt (for what a stopped
        conversion or repair left, the store it was writing)."""
        store = written_store(store_dir)
        return f"mira convert {shlex.quote(self.source)} --out {shlex.quote(str(store))} --quant {self.scheme}"

    def write(self, store_dir: Path) -> None:
        write_json_atomic(store_dir / MANIFEST, asdict(self))

    @classmethod
    def read(cls, store_dir: Path) -> Manifest:
        """The manifest of `store_dir`.

        Raises:
            MiraError: it is missing, unreadable, malformed or of another format version; the message
                names the command that converts the store again.
        """
        path = store_dir / MANIFEST
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as error:
            raise MiraError(f"cannot read the store manifest {path} ({error}); {_again(store_dir, None)}") from None
        if data.get("format_version") not in READABLE_VERSIONS:
            raise MiraError(f"store {store_dir} has format version {data.get('format_version')}, this Mira reads "
                            f"versions {', '.join(map(str, READABLE_VERSIONS))}; "
                            f"{_again(store_dir, data.get('source'))}")
        try:
            manifest = cls(**data)
            if manifest.scheme == "int4" and manifest.format_version != INT4_FORMAT_VERSION:
                raise MiraError(f"store {store_dir} holds int4 experts in an older blob layout, which this Mira no "
                                f"longer reads; {_again(store_dir, data.get('source'))}")
            layout = ExpertLayout.from_json(manifest.layout)  # a layout this version reads
            if manifest.format_version != format_version(layout):
                raise ValueError(f"format version {manifest.format_version} with a layout of version "
                                 f"{format_version(layout)}")
        except (TypeError, KeyError, ValueError) as error:
            raise MiraError(f"store manifest {path} is malformed ({error}); "
                            f"{_again(store_dir, data.get('source'))}") from None
        return manifest


def _again(store_dir: Path, source: object) -> str:
    model = shlex.quote(source) if isinstance(source, str) else "MODEL_DIR"
    store = written_store(store_dir)
    if store != store_dir:  # a stopped conversion, finished under the store's own name
        return (f"it is what a stopped conversion into {store} left; finish that with `mira convert {model} --out "
                f"{shlex.quote(str(store))}`")
    return f"convert the model again with `mira convert {model} --out {shlex.quote(str(store_dir))}`"


def written_store(store_dir: Path) -> Path:
    """The store a `<store>.partial` directory was being written as; any other directory itself."""
    name = store_dir.name
    return store_dir.with_name(name.removesuffix(PARTIAL_SUFFIX)) if name.endswith(PARTIAL_SUFFIX) else store_dir


def stopped_conversion(store_dir: Path) -> Path | None:
    """Where a conversion into `store_dir` that stopped before it finished left its part, if it did."""
    partial = store_dir.with_name(store_dir.name + PARTIAL_SUFFIX)
    return partial if store_dir.name and partial.is_dir() else None


def is_store(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def looks_like_store(path: Path) -> bool:
    """A store, or what is left of one whose manifest is gone: a directory of expert layer files."""
    return is_store(path) or any((path / "experts").glob("layer-*.safetensors"))
