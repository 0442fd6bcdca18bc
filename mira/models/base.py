"""What Mira needs to know about one MoE architecture (paper IV-A: model generality).

Everything is derived from transformers: the Experts class Mira stands in for, its sizes and
layout (mira.models.spec), where its tensors lie in a checkpoint (mira.models.expert_keys). The one
thing transformers does not say is how many KV-cache values a token costs, which the budget needs:
`kv_values_per_token` reads it from the config.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from mira.models.spec import ExpertsSpec, ModelAnatomy


@dataclass(frozen=True)
class Adapter:
    """One model's architecture: its anatomy on the meta device and its KV cost per token."""

    model_type: str  # config.model_type
    anatomy: ModelAnatomy

    @property
    def spec(self) -> ExpertsSpec:
        return self.anatomy.spec

    @property
    def experts_module(self) -> str:
        """The module defining the Experts class (where the loader swaps it while building)."""
        return self.spec.experts_class.__module__

    @property
    def experts_class(self) -> str:
        return self.spec.experts_class.__name__

    @staticmethod
    def kv_values_per_token(config: PretrainedConfig) -> int:
        return kv_values_per_token(config)


def kv_values_per_token(config: PretrainedConfig) -> int:
    """K and V values one token caches, all layers: multi-head latent attention (DeepSeek-V2/V3 style,
    transformers caches full per-head keys, nope + rope dims, and values), else grouped-query
    attention over the layers that attend (`layer_types`, where hybrid models name them)."""
    if all(getattr(config, name, None) for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                     "v_head_dim")):
        key_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        return config.num_hidden_layers * config.num_attention_heads * (key_dim + config.v_head_dim)
    return standard_kv_values(config)


def standard_kv_values(config: PretrainedConfig) -> int:
    """2 x attending layers x kv heads x head dim: grouped-query attention caching keys and values."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    layer_types = getattr(config, "layer_types", None)
    layers = config.num_hidden_layers
    if isinstance(layer_types, (list, tuple)) and layer_types:
        layers = sum(1 for kind in layer_types if "attention" in str(kind) and "linear" not in str(kind))
    return 2 * layers * kv_heads * head_dim
