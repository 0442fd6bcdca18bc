"""Launch configurations of the fused expert kernels, stored as data per device and shape.

`benchmarks/kernels_int8.py --autotune` times candidate configurations on a GPU and writes the best per
expert shape into `<device>.json` beside this file (device: the GPU's name, lower-cased, spaces to
dashes: "NVIDIA H200" -> `nvidia-h200.json`). The runtime reads that file; a shape or device with
no stored entry gets `default_config`, a reasonable configuration chosen from the shape alone.

A file looks like:

    {"device": "NVIDIA H200", "written_by": "...", "date": "...",
     "shapes": {"4096x14336": {"decode_max_pairs": 16, "gate_up_gemv": {...}, "down_gemv": {...},
                               "gemm": {...}}}}

Shape keys are `{hidden}x{intermediate}`. The configuration does not depend on the quantization
scheme: both INT8 schemes read the same weight bytes and differ only in a few scale loads.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mira.store.files import write_json_atomic

TUNING_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class GemvConfig:
    """One decode (GEMV) launch: each program owns `block_rows` output rows and walks the
    reduction dimension `block_cols` columns at a time, `unroll` chunks per loop step (more bytes
    in flight per program; the compiler does not pipeline these loads by itself).

    cvt: how INT8 becomes fp32 on the CUDA cores: "native" (the int-to-float unit, quarter rate on
        recent GPUs), "bits" (integer logic and one add, full rate) or "prmt" (one byte-permute
        per weight, inline PTX; the interpreter uses "bits" instead). INT4 has conversions of its
        own and reads the other fields its own way (mira.kernels.triton_int4).
    mma: run the product on the tensor cores instead, the routed token padded to 16 columns
        (block_rows >= 16; unroll and cvt unused; num_stages pipelines the weight loads).
    programs_per_sm: (the gate/up launch on the CUDA cores) spread a routed pair's rows over about
        this many programs per SM (the device's SM count divided among the pairs), each walking a
        contiguous run of row blocks; 0: one row block per program.
    split: (the down launch on the CUDA cores) split each row's reduction over I between this
        many programs, for more programs than H / block_rows; the last to finish adds the
        partial sums, in a fixed order.
    """

    block_rows: int = 16
    block_cols: int = 256
    unroll: int = 2
    num_warps: int = 4
    num_stages: int = 1
    cvt: str = "bits"
    mma: bool = False
    programs_per_sm: int = 0
    split: int = 1


@dataclass(frozen=True)
class GemmConfig:
    """The prefill (grouped GEMM) launches: tiles of `block_n` weight rows x `block_m` routed
    tokens of one expert, reducing `block_k` columns per step. Both prefill launches share it,
    because they share the token-to-block assignment (which depends on `block_m`)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3


@dataclass(frozen=True)
class KernelConfig:
    """Everything the launcher needs for one expert shape on one device.

    decode_max_pairs: calls with at most this many routed (token, expert) pairs use the GEMV
        launches; more use the grouped GEMM.
    dependent_launch: (the INT4 kernels) where the GPU can and it pays (mira.kernels.dependent),
        the decode's down launch starts while gate/up still runs.
    down_per_pair: the decode's down launch on the CUDA cores gives each of a token's routed
        experts programs of their own, whose partial sums the last to arrive adds, instead of one
        program walking the K experts in turn (a wait on memory for each).
    """

    decode_max_pairs: int = 16
    gate_up_gemv: GemvConfig = field(default_factory=GemvConfig)
    down_gemv: GemvConfig = field(default_factory=lambda: GemvConfig(block_rows=8, block_cols=512))
    gemm: GemmConfig = field(default_factory=GemmConfig)
    dependent_launch: bool = True
    down_per_pair: bool = True

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> KernelConfig:
        return cls(
            decode_max_pairs=int(data["decode_max_pairs"]),
            gate_up_gemv=GemvConfig(**data["gate_up_gemv"]),
            down_gemv=GemvConfig(**data["down_gemv"]),
            gemm=GemmConfig(**data["gemm"]),
            dependent_launch=bool(data.get("dependent_launch", True)),
            down_per_pair=bool(data.get("down_per_pair", True)),
        )


def device_key(device_name: str) -> str:
    """File stem for a device name: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "unknown"


def shape_key(hidden: int, intermediate: int) -> str:
    return f"{hidden}x{intermediate}"


def default_config(hidden: int, intermediate: int) -> KernelConfig:
    """An untuned configuration: enough decode programs to fill a large GPU for small experts."""
    rows = 16 if intermediate >= 8192 else 4
    return KernelConfig(gate_up_gemv=GemvConfig(block_rows=rows, block_cols=256 if hidden >= 256 else 64))


def load_config(device_name: str, hidden: int, intermediate: int, directory: Path = TUNING_DIR) -> KernelConfig:
    """The stored configuration for this device and shape, or `default_config` when none is stored.

    Raises:
        ValueError: the device's file exists but cannot be read as tuning data (fix or delete it;
            `python benchmarks/kernels_int8.py --autotune` rewrites it).
    """
    path = directory / f"{device_key(device_name)}.json"
    if not path.exists():
        return default_config(hidden, intermediate)
    try:
        shapes = json.loads(path.read_text())["shapes"]
        entry = shapes.get(shape_key(hidden, intermediate))
        return default_config(hidden, intermediate) if entry is None else KernelConfig.from_json(entry)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"{path} is not valid kernel tuning data ({error}); delete it or rerun "
            "`python benchmarks/kernels_int8.py --autotune` on that GPU"
        ) from error


def save_configs(device_name: str, configs: dict[tuple[int, int], KernelConfig], meta: dict,
                 directory: Path = TUNING_DIR) -> Path:
    """Merge `configs` ({(hidden, intermediate): config}) into the device's file, written whole or not
    at all (the directory made if missing); returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{device_key(device_name)}.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    shapes = data.get("shapes", {})
    shapes.update({shape_key(h, i): config.to_json() for (h, i), config in configs.items()})
    data = {"device": device_name, **meta, "shapes": dict(sorted(shapes.items()))}
    write_json_atomic(path, data)
    return path
