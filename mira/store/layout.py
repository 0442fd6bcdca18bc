"""Byte layout of one expert blob in the store (paper IV-B, DESIGN.md 2.3).

Every expert is ONE contiguous byte blob so that one copy moves it, whether from the pinned
store into a GPU slot or from disk into the store. A blob is a sequence of aligned sections:

    int8-shared   w13 int8 [2I, H] | w2 int8 [H, I] | scale bf16 [H]
    int8-row      w13 int8 [2I, H] | w2 int8 [H, I] | scale13 bf16 [2I] | scale2 bf16 [H]
    int4          w13 uint8 [2I, H/2] | w2 uint8 [H, I/2] | group scales, zeros   (mira.store.int4)
    none          w13 dtype [2I, H] | w2 dtype [H, I]          (dtype: the checkpoint's own)

w13 holds the gate rows first, then the up rows (transformers' `gate_up_proj` order); experts
without a gate (`gated=False`) have the up rows only, w13 [I, H]. Experts with biases end with
b13 float32 [2I] (or [I]) | b2 float32 [H]. Biases and ungated experts are layout fields written
only when used, so a layout without them reads as before (mira.store.manifest versions them).
H hidden size, I expert intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mira.store import int4
from mira.store.schemes import SCHEMES

ALIGN = 128  # bytes; every section starts on this boundary (vectorised loads on the GPU)

_DTYPES = {"int8": torch.int8, "uint8": torch.uint8, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    for name, candidate in _DTYPES.items():
        if candidate == dtype:
            return name
    raise ValueError(f"unsupported expert dtype {dtype}; expected one of {sorted(_DTYPES)}")


def dtype_from_name(name: str) -> torch.dtype:
    return _DTYPES[name]


@dataclass(frozen=True)
class Section:
    name: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * self.dtype.itemsize


@dataclass(frozen=True)
class ExpertLayout:
    """Where each tensor of one expert lives inside its blob."""

    scheme: str
    hidden: int
    intermediate: int
    weight_dtype: torch.dtype = torch.int8  # the dtype of w13/w2; the checkpoint's own for "none"
    gated: bool = True  # w13 holds gate and up rows; else up rows only
    bias: bool = False  # b13 and b2 follow the weights and scales
    sections: dict[str, Section] = field(init=False, repr=False, compare=False)
    nbytes: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown quantization scheme {self.scheme!r}; choose one of {', '.join(SCHEMES)}")
        if self.scheme != "none" and self.weight_dtype != torch.int8:
            raise ValueError(f"scheme {self.scheme} stores int8 weights, not {self.weight_dtype}")
        H, I = self.hidden, self.intermediate
        rows13 = 2 * I if self.gated else I
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
            ("w13", self.weight_dtype, (rows13, H)),
            ("w2", self.weight_dtype, (H, I)),
        ]
        if self.scheme == "int8-shared":
            specs.append(("scale", torch.bfloat16, (H,)))
        elif self.scheme == "int8-row":
            specs += [("scale13", torch.bfloat16, (rows13,)), ("scale2", torch.bfloat16, (H,))]
        elif self.scheme == "int4":  # packed codes and group scales
            specs = int4.sections(H, I, gated=self.gated)
        if self.bias:
            specs += [("b13", torch.float32, (rows13,)), ("b2", torch.float32, (H,))]
        sections, offset = {}, 0
        for name, dtype, shape in specs:
            section = Section(name, offset, dtype, shape)
            sections[name] = section
            offset = _align(offset + section.nbytes)
        object.__setattr__(self, "sections", sections)
        object.__setattr__(self, "nbytes", offset)

    def views(self, blob: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views into one uint8 blob [nbytes] (no copy)."""
        if blob.dtype != torch.uint8 or blob.dim() != 1 or blob.numel() != self.nbytes:
            raise ValueError(f"expected a uint8 blob of {self.nbytes} bytes, got {blob.dtype} {tuple(blob.shape)}")
        return {
            s.name: blob[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in self.sections.values()
        }

    def pack(self, tensors: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        """Write `tensors` (same names and shapes as the sections) into the uint8 blob `out`."""
        out.zero_()
        for name, view in self.views(out).items():
            view.copy_(tensors[name])

    @property
    def weights(self) -> int:
        """Weights of one expert, whatever the scheme stores them in."""
        return self.sections["w13"].shape[0] * self.hidden + self.hidden * self.intermediate

    @property
    def extended(self) -> bool:
        """Whether this layout uses a field the first store format lacks (biases, ungated experts)."""
        return self.bias or not self.gated

    def to_json(self) -> dict:
        data = {
            "scheme": self.scheme,
            "hidden": self.hidden,
            "intermediate": self.intermediate,
            "weight_dtype": dtype_name(self.weight_dtype),
            "nbytes": self.nbytes,
            "sections": {s.name: {"offset": s.offset, "dtype": dtype_name(s.dtype), "shape": list(s.shape)}
                         for s in self.sections.values()},
        }
        if not self.gated:
            data["gated"] = False
        if self.bias:
            data["bias"] = True
        return data

    @classmethod
    def from_json(cls, data: dict) -> ExpertLayout:
        layout = cls(data["scheme"], data["hidden"], data["intermediate"], dtype_from_name(data["weight_dtype"]),
                     gated=data.get("gated", True), bias=data.get("bias", False))
        if layout.to_json() != data:
            raise ValueError("the store's blob layout differs from what this version of Mira writes")
        return layout


def _align(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN
