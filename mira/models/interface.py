"""transformers' experts interface, as Mira reads it (paper IV-A: model generality).

transformers 5 decorates the Experts class of every modern MoE family with
`use_experts_implementation`: one call signature, forward(hidden [T, H], top_k_index [T, K],
top_k_weights [T, K]), fused 3D expert tensors, and flags saying how they are laid out. Mira stands
in for any such class, so a family is runnable when its Experts class carries the decorator.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn
from transformers import PretrainedConfig

from mira.errors import MiraError

INTERFACE_MODULE = "transformers.integrations.moe"


def moe_integration() -> ModuleType:
    """transformers' experts integration module.

    Raises:
        MiraError: this transformers has no experts interface (it predates it), or importing it failed.
    """
    import transformers

    try:
        module = importlib.import_module(INTERFACE_MODULE)
    except ImportError as error:
        missing = getattr(error, "name", None)
        if not (isinstance(error, ModuleNotFoundError) and f"{INTERFACE_MODULE}.".startswith(f"{missing}.")):
            # the module is there but failed: a dependency missing, or a local file named like one
            raise MiraError(f"transformers {transformers.__version__} could not import {INTERFACE_MODULE}: {error}") \
                from error
        module = None
    if module is None or not hasattr(module, "use_experts_implementation"):
        raise MiraError(f"transformers {transformers.__version__} has no experts interface ({INTERFACE_MODULE}."
                        "use_experts_implementation); install transformers 5 or later")
    return module


def uses_experts_interface(cls: type) -> bool:
    """Whether `cls` is an Experts class decorated with `use_experts_implementation`: its forward is
    the decorator's dispatching wrapper."""
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    decorator = moe_integration().use_experts_implementation
    return (code is not None and code.co_filename == decorator.__code__.co_filename
            and code.co_qualname.startswith(decorator.__qualname__ + "."))


def interface_base(cls: type) -> type | None:
    """The interface Experts class `cls` derives from, where it is not one itself."""
    if uses_experts_interface(cls):
        return None
    return next((base for base in cls.__mro__[1:] if uses_experts_interface(base)), None)


def check_not_wrapped(cls: type, source: str = "the model") -> None:
    """Raise where `cls` derives from an interface Experts class but replaces its forward with one of its
    own that calls it, unless that forward is a per-route norm (`route_norm_of`): Mira stands in for the
    interface's computation and computes that norm, nothing else.

    Raises:
        MiraError: naming both classes.
    """
    base = interface_base(cls)
    if base is not None and route_norm_of(cls) is None:
        raise MiraError(f"{source}'s {cls.__name__} wraps the experts interface's {base.__name__} in a forward of "
                        "its own, which Mira does not compute; run it with transformers")


def is_experts_class(cls: type) -> bool:
    """Whether Mira stands in for modules of `cls`: an interface Experts class, or a per-route norm around one."""
    return uses_experts_interface(cls) or route_norm_of(cls) is not None


# The probe of route_norm_of: T tokens, K routes each, E experts, H hidden.
_PROBE_T, _PROBE_K, _PROBE_E, _PROBE_H = 3, 2, 5, 4


class _ProbeNorm(nn.Module):
    """Stands for a per-expert norm in the probe: an RMS norm scaled by a factor of the expert's."""

    def forward(self, rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        return rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True)) * (expert_ids + 2).to(rows.dtype)[:, None]


def _probe_ffn(rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """Stands for one expert's FFN of each row in the probe: distinct and nonlinear per expert."""
    return torch.tanh(rows * (expert_ids + 1).to(rows.dtype)[:, None] + expert_ids.to(rows.dtype)[:, None])


@functools.cache
def route_norm_of(cls: type) -> str | None:
    """The attribute naming the module with which `cls` normalises each route's output before the
    routing-weighted sum, where `cls` wraps an interface Experts class that way (Ergo's ErgoExperts:
    every route a row of its own through the interface at unit weight, then `norm(rows, expert_ids)`,
    then the weighted sum); None where it does not.

    Found by running cls.forward in float64 with stand-ins for the interface's computation and for
    every attribute the forward reads other than `num_experts`: it must read exactly one, call it as a
    norm, and give the formula Mira computes (mira.runtime.experts).
    """
    base = interface_base(cls)
    if base is None:
        return None
    read: list[str] = []

    class Interface(base):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            per_route = [top_k_weights[:, k, None] * _probe_ffn(hidden_states, top_k_index[:, k])
                         for k in range(top_k_index.shape[1])]
            return torch.stack(per_route).sum(0)

    def stand_in(self, name: str):
        if name.startswith("_"):  # torch's own attributes, looked up before they are set
            raise AttributeError(name)
        read.append(name)
        norm = _ProbeNorm()
        setattr(self, name, norm)
        return norm

    probe_class = type(f"Probe{cls.__name__}", (cls, Interface), {"__getattr__": stand_in})
    probe = probe_class.__new__(probe_class)
    nn.Module.__init__(probe)
    probe.num_experts = _PROBE_E
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(_PROBE_T, _PROBE_H, dtype=torch.float64, generator=generator)
    index = torch.stack([torch.randperm(_PROBE_E, generator=generator)[:_PROBE_K] for _ in range(_PROBE_T)])
    weights = torch.rand(_PROBE_T, _PROBE_K, dtype=torch.float64, generator=generator)
    try:
        out = probe.forward(hidden, index, weights)
    except Exception:  # noqa: BLE001 - any other forward is one Mira does not compute
        return None
    if len(read) != 1:
        return None
    routes = index.reshape(-1)
    normed = _ProbeNorm()(_probe_ffn(hidden.repeat_interleave(_PROBE_K, 0), routes), routes)
    expected = (normed.view(_PROBE_T, _PROBE_K, _PROBE_H) * weights[..., None]).sum(1)
    if not isinstance(out, torch.Tensor) or out.shape != expected.shape or not torch.allclose(out, expected):
        return None
    return read[0]


def causal_lm_class(config: PretrainedConfig) -> type:
    """The transformers class that runs `config` as a causal language model.

    Raises:
        MiraError: transformers has no causal LM for this model type.
    """
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise MiraError(f"transformers has no causal language model for model_type {config.model_type!r}; "
                        "Mira runs text generation models only") from None


@dataclass(frozen=True)
class Family:
    """One model type transformers runs as a causal LM whose module defines interface Experts classes."""

    model_type: str
    model_class: str
    experts_classes: tuple[str, ...]


def moe_families() -> list[Family]:
    """Every causal LM family of this transformers whose Experts class uses the experts interface."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    families = []
    for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        try:
            module = sys.modules[getattr(transformers, class_name).__module__]
        except (AttributeError, ImportError, KeyError):  # a model whose optional dependencies are missing
            continue
        experts = tuple(sorted(name for name, obj in vars(module).items()
                               if inspect.isclass(obj) and obj.__module__ == module.__name__
                               and uses_experts_interface(obj)))
        if experts:
            families.append(Family(model_type, class_name, experts))
    return families
