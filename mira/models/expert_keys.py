"""Where each expert lies in a checkpoint, found through transformers' own key conversion.

transformers loads a family's checkpoint into its fused 3D expert parameters through a list of
weight transforms (`transformers.conversion_mapping`): renamings, and converters that stack
per-expert tensors (`MergeModulelist`), join gate and up (`Concatenate`), transpose or interleave.
Mira runs the same renamings on every checkpoint key to find which fused parameter it feeds, and
replays the converter's operations on one expert's slices only, so one expert is read at a time.

Quantized checkpoints: a per-expert weight `K` stored as float8 with `K_scale_inv` beside it (FP8
with block scales, DeepSeek-V3's format), or a fused parameter stored as `P_blocks` and
`P_scales` (MXFP4, gpt-oss's format) are named in the recipe; mira.store.dequant reads them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from mira.errors import MiraError
from mira.models.spec import ModelAnatomy

_INTEGER = re.compile(r"(?<=\.)\d+(?=\.)")
FP8_SCALE_SUFFIX = "_scale_inv"
MXFP4_SUFFIXES = ("_blocks", "_scales")
# transformers' operations that dequantize a family's original quantized experts on load and hand a lone plain
# tensor on unchanged (Inkling 2 Loop's NVFP4 and MXFP8): nothing to replay on a plain expert
DEQUANTIZING_OPS = ("Inkling2LoopDequantizeExperts",)


@dataclass(frozen=True)
class Recipe:
    """How to read one expert's slice of one fused parameter.

    keys: checkpoint keys in the converter's order (per-expert tensors), or one fused key.
    row: the expert's row of the fused key; None when each key is this expert's own tensor.
    ops: the converter's operations, replayed on this expert's slices (`apply`).
    shape: the expert's slice of the parameter in the family's layout.
    fmt: "plain", "fp8" (each key has a `_scale_inv` companion) or "mxfp4" (the key names the
        `_blocks`/`_scales` pair, without the suffix).
    """

    keys: tuple[str, ...]
    row: int | None
    ops: tuple
    shape: tuple[int, ...]
    fmt: str = "plain"

    def apply(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Replay the converter's operations on this expert's slices (one per key) -> `shape`."""
        from transformers.core_model_loading import Concatenate, Interleave, MergeModulelist, Transpose

        for op in self.ops:
            if isinstance(op, MergeModulelist) and op.dim == 0 and self.row is None:
                continue  # stacks experts along dim 0: one expert's slice is its own tensor
            if type(op).__name__ in DEQUANTIZING_OPS and self.fmt == "plain" and len(tensors) == 1:
                continue  # a plain expert, which the op hands on unchanged
            if isinstance(op, Concatenate) and op.dim != 0:
                tensors = [torch.cat(tensors, dim=_expert_dim(op.dim))]
            elif isinstance(op, Transpose) and 0 not in (op.dim0, op.dim1) and len(tensors) == 1:
                (tensor,) = tensors
                if not (op.check_dims and tuple(tensor.shape) == self.shape):
                    tensors = [tensor.transpose(_expert_dim(op.dim0), _expert_dim(op.dim1))]
            elif isinstance(op, Interleave) and op.dim != 0 and len(tensors) == 1:
                tensors = [_interleave(tensors[0], _expert_dim(op.dim), op.inverse)]
            else:
                raise MiraError(f"transformers converts {self.keys[0]} with {op!r}, which Mira cannot replay expert "
                                "by expert")
        if len(tensors) != 1:
            raise MiraError(f"transformers' conversion of {', '.join(self.keys)} leaves {len(tensors)} tensors; Mira "
                            "cannot read these experts")
        return tensors[0]


def _expert_dim(dim: int) -> int:
    """A dimension of the fused [E, ...] tensor as a dimension of one expert's slice."""
    return dim - 1 if dim > 0 else dim


def _interleave(tensor: torch.Tensor, dim: int, inverse: bool) -> torch.Tensor:
    """transformers' Interleave on one expert's slice: split `dim` in two and alternate the halves."""
    dim = dim % tensor.dim()
    shape = list(tensor.shape)
    shape[dim:dim + 1] = [2, shape[dim] // 2] if inverse else [shape[dim] // 2, 2]
    return tensor.reshape(shape).transpose(dim, dim + 1).reshape(tensor.shape).contiguous()


class ExpertKeys:
    """The recipe of every expert slice of every Experts module of a model, from its checkpoint keys.

    Args:
        anatomy: the model on the meta device (mira.models.spec.anatomy).
        keys: every tensor name in the checkpoint.
        source: the checkpoint, for messages.

    Raises:
        MiraError: transformers has no conversion API Mira can use, or an expert is missing.
    """

    def __init__(self, anatomy: ModelAnatomy, keys: Iterable[str], source: str = "the checkpoint"):
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter, rename_source_key
        except ImportError as error:
            import transformers

            raise MiraError(f"transformers {transformers.__version__} lacks the checkpoint conversion API Mira reads "
                            f"({error}); install a transformers release that has transformers.conversion_mapping"
                            ) from None
        keys = set(keys)
        model, spec = anatomy.model, anatomy.spec
        self.source = source
        self.shapes = {f"{site}.{name}": tuple(getattr(model.get_submodule(site), name).shape[1:])
                       for site in anatomy.sites for name in spec.param_names}
        self.layers = {f"{site}.{name}": layer for site, layer in anatomy.sites.items() for name in spec.param_names}
        self.num_experts = spec.num_experts
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        prefix = getattr(model, "base_model_prefix", "") or ""
        per_expert: dict[str, dict[int, dict[str, str]]] = {}  # param -> expert -> source pattern -> key
        self._ops: dict[str, tuple[tuple, tuple[str, ...]]] = {}  # param -> (ops, source patterns in order)
        self._fused: dict[str, tuple[str, str]] = {}  # param -> (fused key, fmt)
        self.expert_keys: set[str] = set()  # every checkpoint key holding expert weights (or their scales)
        self._fp8: set[str] = set()  # params whose per-expert keys are float8 with block scales
        self._position: dict[str, int] = {}  # per-expert key -> index of its expert number among its dotted parts
        for key in keys:
            fmt, name = "plain", key
            if key.endswith(MXFP4_SUFFIXES[0]) and key[: -len(MXFP4_SUFFIXES[0])] + MXFP4_SUFFIXES[1] in keys:
                fmt, name = "mxfp4", key[: -len(MXFP4_SUFFIXES[0])]
            try:
                target, pattern = rename_source_key(name, renamings, converters)
            except TypeError as error:  # another transformers' signature
                import transformers

                raise MiraError(f"transformers {transformers.__version__}'s rename_source_key is not the one Mira "
                                f"reads ({error}); install a transformers release Mira supports") from None
            target = self._param(target, prefix)
            if target is None:
                continue
            self.expert_keys.add(key)
            if fmt == "plain" and key + FP8_SCALE_SUFFIX in keys:
                fmt = "fp8"
                self.expert_keys.add(key + FP8_SCALE_SUFFIX)
            if fmt == "mxfp4":
                self.expert_keys.add(name + MXFP4_SUFFIXES[1])
            expert, position = _dropped_integer(name, target)
            converter = next((c for c in converters if pattern is not None and pattern in c.source_patterns), None)
            if expert is None:
                if target in self._fused:  # its scales beside it, say: Mira would read one of them alone
                    raise MiraError(f"transformers makes {target} of several tensors of {source} "
                                    f"({self._fused[target][0]}, {name}); Mira cannot read these experts")
                self._fused[target] = (name, fmt)
                self._ops[target] = (tuple(converter.operations) if converter else (), ())
            else:
                if converter is None:
                    raise MiraError(f"{source} names {key} like one expert's tensor but transformers maps it to "
                                    f"{target} without a converter; Mira cannot read these experts")
                per_expert.setdefault(target, {}).setdefault(expert, {})[pattern] = key
                self._position[key] = position
                self._ops[target] = (tuple(converter.operations), tuple(converter.source_patterns))
                if fmt == "fp8":
                    self._fp8.add(target)
        self._per_expert = per_expert

    def _param(self, target: str, prefix: str) -> str | None:
        for candidate in (target, f"{prefix}.{target}", target.removeprefix(f"{prefix}.")):
            if candidate in self.shapes:
                return candidate
        return None

    def recipe(self, site: str, name: str, expert: int) -> Recipe:
        """How to read expert `expert`'s slice of parameter `name` of the Experts module at `site`.

        Raises:
            MiraError: the checkpoint lacks it.
        """
        param = f"{site}.{name}"
        shape = self.shapes[param]
        ops, patterns = self._ops.get(param, ((), ()))
        if param in self._fused:
            key, fmt = self._fused[param]
            return Recipe((key,), expert, ops, shape, fmt)
        experts = self._per_expert.get(param, {})
        seen = {pattern for by_pattern in experts.values() for pattern in by_pattern}  # what other experts have
        by_pattern = experts.get(expert, {})
        keys = tuple(by_pattern[p] for p in patterns if p in by_pattern)
        if not keys or set(by_pattern) != seen:
            missing = f"weights for expert {expert} of {param}"
            if experts:  # name the first missing key as the experts present are named
                other = next(iter(experts.values()))
                pattern = next(p for p in patterns if p in other and p not in by_pattern)
                parts = other[pattern].split(".")
                parts[self._position[other[pattern]]] = str(expert)
                missing = repr(".".join(parts))
            raise MiraError(f"the weights of {self.source} have no {missing}, though config.json promises "
                            f"{self.num_experts} experts in layer "
                            f"{self.layers[param]}; is the checkpoint complete, and its config.json the one it was "
                            "saved with?")
        return Recipe(keys, None, ops, shape, "fp8" if param in self._fp8 else "plain")

    def missing(self) -> list[str]:
        """The fused parameters no checkpoint key feeds."""
        return sorted(p for p in self.shapes if p not in self._fused and p not in self._per_expert)


def _dropped_integer(source: str, target: str) -> tuple[int | None, int]:
    """The expert index of a per-expert key, the one dotted integer of `source` that `target` lacks
    (the layer index is in both), and the index of that part among `source`'s dotted parts; None for
    a fused tensor."""
    dropped = list((Counter(_INTEGER.findall(source)) - Counter(_INTEGER.findall(target))).elements())
    if len(dropped) != 1:
        return None, -1
    parts = source.split(".")
    kept = Counter(target.split("."))
    for position in range(len(parts) - 1, -1, -1):  # the dropped occurrence: the last one target has fewer of
        if parts[position] == dropped[0] and parts[:position + 1].count(dropped[0]) > kept[dropped[0]]:
            return int(dropped[0]), position
    return int(dropped[0]), parts.index(dropped[0])
