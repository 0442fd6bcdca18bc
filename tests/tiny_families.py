"""Tiny random configs of any MoE family transformers offers, built from the family's own config
class: the sizes every family shares are shrunk, the rest keep the family's defaults."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from mira.models.interface import moe_families
from mira.models.registry import adapter_for
from tiny_models import write_tokenizer

VOCAB = 320
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
             shared_expert_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, num_experts=8, num_local_experts=8, n_routed_experts=8, num_experts_per_tok=2,
             max_position_embeddings=256, tie_word_embeddings=False, first_k_dense_replace=1, n_shared_experts=1,
             n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
             v_head_dim=16, eos_token_id=1, pad_token_id=0, bos_token_id=2)
HYBRID = ["linear_attention", "full_attention", "linear_attention"]  # one attending layer between two others
DENSE_FIRST = ["dense", "sparse", "sparse"]
# What a family needs beyond the shared sizes to be tiny and sound: layer kinds sized to three layers.
FAMILY_SIZES: dict[str, dict] = {
    **{family: dict(layer_types=HYBRID) for family in ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp",
                                                       "qwen4_exp_text", "granitemoehybrid")},
    "kimi_linear": dict(layer_types=HYBRID, mlp_layer_types=DENSE_FIRST),
    "bailing_hybrid": dict(layer_types=HYBRID, mlp_layer_types=DENSE_FIRST),
    "beam": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"], mlp_layer_types=DENSE_FIRST),
    # four layers, two of them MoE, so that a budget of one layer's experts leaves some in host memory
    "jamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1),
    "nemotron_h": dict(num_hidden_layers=4, layer_types=["linear_attention", "moe", "full_attention", "moe"]),
    "lfm2_moe": dict(num_dense_layers=1, layer_types=["conv", "full_attention", "conv"]),
    "zaya": dict(num_experts_per_tok=1),
    # MoE only when asked (the default is dense); the per-layer input embeddings shrunk with the vocabulary
    **{family: dict(enable_moe_block=True, top_k_experts=2, vocab_size_per_layer_input=VOCAB,
                    hidden_size_per_layer_input=16,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"])
       for family in ("gemma4", "gemma4_text")},
}
PER_LAYER_FIELDS = ("layer_types", "mlp_layer_types", "per_layer_config")  # sized to the default's layers


def tiny_config(model_type: str) -> PretrainedConfig:
    """A small `model_type` config: every shared size the family's config has, shrunk."""
    default = AutoConfig.for_model(model_type)
    text = getattr(default, "text_config", None)
    target = text if isinstance(text, PretrainedConfig) else default
    family = FAMILY_SIZES.get(model_type, {})
    sizes = {k: v for k, v in {**SIZES, **family}.items() if _has(target, k) or k in family}
    if getattr(target, "kv_lora_rank", None):  # multi-head latent attention: head_dim is the rope dims, and
        sizes.pop("head_dim", None)  # every head has its keys, as real checkpoints say (sdpa groups by the field)
        if "num_key_value_heads" in sizes:
            sizes["num_key_value_heads"] = sizes["num_attention_heads"]
    if target is default:
        return AutoConfig.for_model(model_type, **sizes)
    text_fields = {k: v for k, v in text.to_dict().items() if k not in PER_LAYER_FIELDS}
    return AutoConfig.for_model(model_type, text_config={**text_fields, **sizes})


def _has(config: PretrainedConfig, name: str) -> bool:
    """Whether the config has `name`; a heterogeneous config (Gemma 4's) refuses to read a per-layer
    field globally, which still means it has it."""
    try:
        return hasattr(config, name)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return name in (getattr(config, "per_layer_attributes", None) or ())


# The families verified to pass (tests/e2e/test_moe_families.py); tests take those this transformers offers.
VERIFIED = [
    "afmoe", "aria_text", "axk1", "bailing_hybrid", "beam", "cohere2_moe", "deepseek_v2", "deepseek_v3",
    "deepseek_v4", "dots1", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint", "gemma4", "gemma4_text", "glm4_moe",
    "glm4_moe_lite", "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared",
    "hunyuan_v1_moe", "hy_v3", "hy_v4", "inkling_text", "jamba", "kimi_linear", "kolibri1", "laguna", "lara_mini",
    "lfm2_moe", "mellum", "mimo_v2_flash", "minimax", "minimax_m2", "minimax_m3_vl_text", "mixtral", "nemotron_h",
    "olmoe", "phimoe", "qwen2_moe", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_moe", "qwen3_next", "sarvam_mla",
    "sarvam_moe", "solar_open", "zaya",
]
OFFERED = {family.model_type for family in moe_families()}
CASES = [family for family in VERIFIED if family in OFFERED]


def family_checkpoint(family: str, directory: Path) -> Path:
    """A tiny random checkpoint of `family` in `directory`, with experts and routers that matter."""
    torch.manual_seed(0)
    config = tiny_config(family)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    num_experts = adapter_for(model.config).spec.num_experts
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name and "shared" not in name:  # larger than the default init: experts matter
                param.normal_(0.0, 0.2)
            elif name.endswith(("gate.weight", "router.weight")) and param.dim() == 2 and param.shape[0] == num_experts:
                param.normal_(0.0, 1.0)  # a decisive router
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return directory
