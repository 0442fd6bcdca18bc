"""The supported architectures, looked up by `config.model_type`."""

from __future__ import annotations

from transformers import PretrainedConfig

from mira.errors import MiraError
from mira.models.base import Adapter
from mira.models.deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from mira.models.mixtral import MIXTRAL
from mira.models.olmoe import OLMOE
from mira.models.qwen_moe import QWEN2_MOE, QWEN3_MOE

ADAPTERS: dict[str, Adapter] = {a.model_type: a for a in (MIXTRAL, QWEN2_MOE, QWEN3_MOE, DEEPSEEK_V2, DEEPSEEK_V3, OLMOE)}


def adapter_for(config: PretrainedConfig, source: str = "the model") -> Adapter:
    """The adapter of `config`'s architecture.

    Raises:
        MiraError: the architecture is not supported; the message lists the supported ones.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise MiraError(
            f"{source} is a {model_type!r} model, which Mira does not support; "
            f"supported architectures (config.json model_type): {', '.join(sorted(ADAPTERS))}"
        )
    return ADAPTERS[model_type]
