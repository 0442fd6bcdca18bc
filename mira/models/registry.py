"""The adapter of a config: any MoE family whose Experts class uses transformers' experts interface."""

from __future__ import annotations

from transformers import PretrainedConfig

from mira.errors import MiraError
from mira.models.base import Adapter
from mira.models.spec import ExpertsSpec, anatomy


def adapter_for(config: PretrainedConfig, source: str = "the model") -> Adapter:
    """The adapter of `config`'s architecture, read from transformers.

    Raises:
        MiraError: not a MoE family of transformers' experts interface, or one whose experts do
            something Mira does not compute (named in the message).
    """
    found = anatomy(config, source)
    check_supported(found.spec, source)
    return Adapter(config.model_type, found)


def check_supported(spec: ExpertsSpec, source: str = "the model") -> None:
    """Raise unless Mira computes every part of `spec`'s experts (the reference path).

    Raises:
        MiraError: naming the part Mira does not compute.
    """
    name = spec.experts_class.__name__
    if spec.post_norm:
        raise MiraError(f"{source} normalises each expert's output ({name}.post_expert_norm), which Mira does not "
                        "compute; run it with transformers")
    stored = set(spec.param_names)
    norm = f"{spec.route_norm}." if spec.route_norm else None  # loaded with the model's other weights
    extra = sorted(n for n, _ in spec.module.named_parameters()
                   if n not in stored and not (norm and n.startswith(norm)))
    if extra:
        raise MiraError(f"{source}'s {name} has parameters Mira does not store ({', '.join(extra)}); run it with "
                        "transformers")
    if not spec.custom_gate:
        spec.activation()  # raises without an act_fn
