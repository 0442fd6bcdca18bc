"""transformers' experts interface, as Mira reads it (paper IV-A: model generality).

transformers 5 decorates the Experts class of every modern MoE family with
`use_experts_implementation`: one call signature, forward(hidden [T, H], top_k_index [T, K],
top_k_weights [T, K]), fused 3D expert tensors, and flags saying how they are laid out. Mira stands
in for any such class, so a family is runnable when its Experts class carries the decorator.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass
from types import ModuleType

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


def check_not_wrapped(cls: type, source: str = "the model") -> None:
    """Raise where `cls` derives from an interface Experts class but replaces its forward with one of its
    own that calls it (Ergo's ErgoExperts: one row per route into ErgoExpertProjections, then a learned
    norm per expert before the weighted sum): Mira stands in for the interface's computation only.

    Raises:
        MiraError: naming both classes.
    """
    if uses_experts_interface(cls):
        return
    base = next((base for base in cls.__mro__[1:] if uses_experts_interface(base)), None)
    if base is not None:
        raise MiraError(f"{source}'s {cls.__name__} wraps the experts interface's {base.__name__} in a forward of "
                        "its own, which Mira does not compute; run it with transformers")


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
