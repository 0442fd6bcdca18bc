"""What Mira needs to know about one MoE architecture (paper IV-A: model generality).

Everything is derived from transformers: the Experts class Mira stands in for, its sizes and
layout (mira.models.spec), where its tensors lie in a checkpoint (mira.models.expert_keys). The one
thing transformers does not say is how many KV-cache values a token costs, which the budget needs:
mira.models.kvcache measures it; `kv_values_per_token` here works it out from the config, where
that cannot run.
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
    """K and V values one token caches, all layers: multi-head latent attention (DeepSeek-V2/V3 style)
    as full per-head keys, nope + rope dims, and values (as transformers cached them; 5.25 caches the
    compressed latent, so this overestimates there), else grouped-query attention over the
    layers that attend (`layer_types`, where hybrid models name them). A multimodal model's config
    is read through its text model's."""
    config = config.get_text_config()
    if all(getattr(config, name, None) for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                     "v_head_dim")):
        key_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        return config.num_hidden_layers * config.num_attention_heads * (key_dim + config.v_head_dim)
    return standard_kv_values(config)


def standard_kv_values(config: PretrainedConfig) -> int:
    """2 x kv heads x head dim, summed over the layers that attend with keys and values of their own:
    grouped-query attention caching keys and values (each layer's own sizes where the config gives
    layers their own); a layer reusing another's (transformers' `kv_sharing_modes`) caches none."""
    layers = config.num_hidden_layers
    head_dims = _per_layer(layer_values(config, "head_dim"), layers)
    kv_heads = _per_layer(layer_values(config, "num_key_value_heads"), layers)
    layer_types = getattr(config, "layer_types", None)
    attends = [True] * layers
    if isinstance(layer_types, (list, tuple)) and layer_types:
        attends = ["attention" in str(kind) and "linear" not in str(kind) for kind in layer_types]
    sharing = getattr(config, "kv_sharing_modes", None) or [None] * layers
    attends = [attending and mode != "reuse" for attending, mode in zip(attends, sharing)]
    heads = config.num_attention_heads
    return sum(2 * (kv_heads[i] or heads) * (head_dims[i] or config.hidden_size // heads)
               for i in range(layers) if attends[i])


def layer_values(config: PretrainedConfig, name: str) -> list:
    """`name` at each layer where the config gives layers their own (transformers' heterogeneous
    configs, `per_layer_config`, which refuse to read such a field globally), else its one value."""
    if name in (getattr(config, "per_layer_attributes", None) or ()):
        return [getattr(config.per_layer_config[i], name, None) for i in range(config.num_hidden_layers)]
    return [getattr(config, name, None)]


def _per_layer(values: list, layers: int) -> list:
    return values if len(values) == layers else values * layers
