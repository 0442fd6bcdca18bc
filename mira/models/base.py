"""What Mira needs to know about one MoE architecture family (paper IV-A: model generality).

An adapter names the transformers Experts class that Mira replaces, where expert e of decoder layer
i lives on disk, how many experts a layer has and how large they are, and how many KV-cache values
one token costs. Everything else about the model is transformers' own code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PretrainedConfig


@dataclass(frozen=True)
class ExpertKeys:
    """On-disk tensor names of one expert, formatted with `layer` and `expert`.

    gate/up/down: per-expert [I, H], [I, H], [H, I] tensors (the layout of published checkpoints).
    fused_gate_up/fused_down: per-layer [E, 2I, H] and [E, H, I] tensors (transformers 5's own layout).
    """

    gate: str
    up: str
    down: str
    fused_gate_up: str = "model.layers.{layer}.mlp.experts.gate_up_proj"
    fused_down: str = "model.layers.{layer}.mlp.experts.down_proj"


@dataclass(frozen=True)
class Adapter:
    model_type: str  # config.model_type
    experts_module: str  # module defining the Experts class
    experts_class: str  # the class Mira's experts module stands in for
    keys: ExpertKeys
    num_experts: Callable[[PretrainedConfig], int]
    intermediate_size: Callable[[PretrainedConfig], int]
    kv_values_per_token: Callable[[PretrainedConfig], int]  # K and V values of one token, all layers


def standard_kv_values(config: PretrainedConfig) -> int:
    """2 x layers x kv heads x head dim: grouped-query attention caching keys and values."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim


PER_EXPERT_MLP_KEYS = ExpertKeys(
    gate="model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
    up="model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
    down="model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",
)
