"""Which MoE families of this transformers Mira runs, read from their Experts classes alone.

Each family's Experts class is built from the family's default config on the meta device (no
memory), as its first layer's when the class takes a layer index (with its experts switched on where
the default is dense), and its spec checked as a model's is (mira.models.registry.check_supported).
"""

from __future__ import annotations

import copy
import importlib
import inspect
from dataclasses import dataclass

import torch
from transformers import AutoConfig

from mira.errors import MiraError
from mira.models.interface import Family, check_not_wrapped, moe_families
from mira.models.registry import check_supported
from mira.models.spec import ExpertsSpec, spec_of


@dataclass(frozen=True)
class FamilyStatus:
    family: Family
    runs: bool | None  # None: unknown, the default config builds no experts to inspect
    spec: ExpertsSpec | None = None  # when it runs
    problem: str | None = None  # why it does not run, or why it is unknown


def family_statuses() -> list[FamilyStatus]:
    """Every MoE family of this transformers (mira.models.interface.moe_families) and whether Mira runs it."""
    return [_status(family) for family in moe_families()]


# Fields a family's default config may leave unset or off where its released models are dense by
# default (Gemma 4) or give their sizes in the checkpoint alone (dots.llm1), with what builds experts.
EXPERT_COUNTS = ("num_experts", "n_routed_experts", "num_local_experts")
EXPERTS_PER_TOKEN = ("num_experts_per_tok", "top_k_experts")


def _status(family: Family) -> FamilyStatus:
    try:
        config = AutoConfig.for_model(family.model_type).get_text_config()
        module = importlib.import_module(_modeling_module(family))
        experts_class = getattr(module, family.experts_classes[0])
        layer = (0,) if "layer_idx" in inspect.signature(experts_class).parameters else ()  # per-layer settings
        experts = _built(experts_class, config, layer)
    except Exception as error:  # no experts even so: say so, go on
        return FamilyStatus(family, None, problem=f"its default config builds no {family.experts_classes[0]} "
                                                  f"({type(error).__name__}); convert a checkpoint to find out")
    try:
        for obj in vars(module).values():  # the family's model may build a class wrapping its Experts class
            if inspect.isclass(obj) and obj.__module__ == module.__name__:
                check_not_wrapped(obj, family.model_type)
        spec = spec_of(experts)
        check_supported(spec, family.model_type)
    except MiraError as error:
        return FamilyStatus(family, False, problem=str(error))
    return FamilyStatus(family, True, spec)


def _built(experts_class: type, config, layer: tuple) -> torch.nn.Module:
    """The Experts module of the default config on the meta device; where that builds none, of the
    config with its experts switched on and their unset counts filled in (8 experts, 2 a token)."""
    try:
        with torch.device("meta"):
            return experts_class(config, *layer)
    except Exception:
        config = copy.deepcopy(config)
        for names, value in ((EXPERT_COUNTS, 8), (EXPERTS_PER_TOKEN, 2)):
            for name in names:
                if hasattr(config, name) and getattr(config, name) is None:
                    setattr(config, name, value)
        if getattr(config, "moe_intermediate_size", 0) is None:
            config.moe_intermediate_size = config.intermediate_size
        if getattr(config, "enable_moe_block", None) is False:
            config.enable_moe_block = True
        with torch.device("meta"):
            return experts_class(config, *layer)


def _modeling_module(family: Family) -> str:
    import transformers

    return getattr(transformers, family.model_class).__module__
