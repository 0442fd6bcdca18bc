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
# Dots 3's sliding layers attend with sizes of their own (the config's swa_ fields, its per_layer_config), shrunk
# alike: half the heads, twice the latent, wider heads than the other layers
DOTS3_SLIDING = dict(swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_q_lora_rank=16, swa_kv_lora_rank=32,
                     swa_head_dim=32, swa_qk_nope_head_dim=24, swa_v_head_dim=16)
# Inkling 2: the sliding layers' own heads shrunk too, the unembedding padded to the vocabulary (as real checkpoints
# store it), sliding and full layers in turn
INKLING2 = dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, unpadded_vocab_size=VOCAB - 16,
                layer_types=["hybrid_sliding", "hybrid"] * 2)
# What a family needs beyond the shared sizes to be tiny and sound: layer kinds sized to three layers.
FAMILY_SIZES: dict[str, dict] = {
    **{family: dict(layer_types=HYBRID) for family in ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text",
                                                       "granitemoehybrid")},
    "kimi_linear": dict(layer_types=HYBRID, mlp_layer_types=DENSE_FIRST),
    "bailing_hybrid": dict(layer_types=HYBRID, mlp_layer_types=DENSE_FIRST),
    "beam": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"], mlp_layer_types=DENSE_FIRST),
    # four layers, two of them MoE, so that a budget of one layer's experts leaves some in host memory
    "jamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1),
    "nemotron_h": dict(num_hidden_layers=4, layer_types=["linear_attention", "moe", "full_attention", "moe"]),
    "lfm2_moe": dict(num_dense_layers=1, layer_types=["conv", "full_attention", "conv"]),
    "zaya": dict(num_experts_per_tok=1),
    # four layers, the default's pattern: three linear, then one indexed (QSA), whose indexer the default leaves
    # unset; blocks of 2 tokens and a budget of 4, so that a 12-token prompt has blocks left out
    **{family: dict(num_hidden_layers=4, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4,
                    indexer_compress_ratio=2)
       for family in ("qwen4_exp", "qwen4_exp_text")},
    # two decoder layers, each two attention sublayers (num_hidden_layers counts those) and one MoE; the rope is
    # head_dim wide, which real checkpoints set to qk_rope_head_dim; zero (identity) experts half the routed ones
    "longcat_flash": dict(num_hidden_layers=4, head_dim=8, zero_expert_num=4),
    "dots3_note_text": DOTS3_SLIDING,
    # its vision and audio adapters project to the text model's hidden size
    "dots3_note": dict(DOTS3_SLIDING, vision_config=dict(adapter_out_dim=64), audio_config=dict(adapter_out_dim=64)),
    # blocks of attention residuals each closed by a full-attention layer, as the default's blocks of six are
    "inkling2_text": dict(INKLING2, num_hidden_layers=4, n_layers_per_attn_res_block=2),
    # blocks of one layer, so that the looped core (whole blocks) has a layer before it and one after it, as the
    # default's has
    "inkling2_loop_text": dict(INKLING2, num_hidden_layers=4, n_layers_per_attn_res_block=1, loop_layer_index_start=1,
                               loop_layer_index_end=3),
    # four layers, the first two dense (the default) and shrunk; two indexed ones: an indexer and a reindexer reading
    # its keys and values (the default layout of two), the indexer's heads within the two query heads of a key head
    "kolibri1_1": dict(num_hidden_layers=4, layer_types=["sliding_attention", "indexed_attention"] * 2,
                       index_num_heads=2, mlp_only_intermediate_size=96),
    # MoE only when asked (the default is dense); the per-layer input embeddings shrunk with the vocabulary
    **{family: dict(enable_moe_block=True, top_k_experts=2, vocab_size_per_layer_input=VOCAB,
                    hidden_size_per_layer_input=16,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"])
       for family in ("gemma4", "gemma4_text")},
}
PER_LAYER_FIELDS = ("layer_types", "mlp_layer_types", "per_layer_config")  # sized to the default's layers


def tiny_config(model_type: str, **sizes_override) -> PretrainedConfig:
    """A small `model_type` config: every shared size the family's config has, shrunk (to
    `sizes_override` where given)."""
    default = AutoConfig.for_model(model_type)
    text = getattr(default, "text_config", None)
    target = text if isinstance(text, PretrainedConfig) else default
    family = {**FAMILY_SIZES.get(model_type, {}), **sizes_override}
    sizes = {k: v for k, v in {**SIZES, **family}.items() if _has(target, k) or k in family}
    if _get(target, "kv_lora_rank"):  # multi-head latent attention: head_dim is the rope dims (the config
        if "head_dim" not in family:  # derives it, unless the family gives it), and every head has its keys, as
            sizes.pop("head_dim", None)  # real checkpoints say (sdpa groups by the field)
        if "num_key_value_heads" in sizes:
            sizes["num_key_value_heads"] = sizes["num_attention_heads"]
    if target is default:
        return AutoConfig.for_model(model_type, **sizes)
    others = {k: sizes.pop(k) for k in list(sizes) if k in default.sub_configs}  # the other models' (vision, audio)
    text_fields = {k: v for k, v in text.to_dict().items() if k not in PER_LAYER_FIELDS}
    return AutoConfig.for_model(model_type, text_config={**text_fields, **sizes}, **others)


def _get(config: PretrainedConfig, name: str):
    """`name` of the config, None where it has none; a heterogeneous config's per-layer field, its first
    layer's (the config refuses to read it globally)."""
    if name in (getattr(config, "per_layer_attributes", None) or ()):
        config = config.per_layer_config[0]
    return getattr(config, name, None)


def _has(config: PretrainedConfig, name: str) -> bool:
    """Whether the config has `name`; a heterogeneous config (Gemma 4's) refuses to read a per-layer
    field globally, which still means it has it."""
    try:
        return hasattr(config, name)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return name in (getattr(config, "per_layer_attributes", None) or ())


# The families verified to pass (tests/e2e/test_moe_families.py); tests take those this transformers offers.
VERIFIED = [
    "afmoe", "aria_text", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "deepseek_v2", "deepseek_v3",
    "deepseek_v32", "deepseek_v4", "dots1", "dots3_note", "dots3_note_text", "ergo", "ernie4_5_moe", "exaone_moe",
    "flex_olmo", "flint", "gemma4", "gemma4_text", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "gpt_oss",
    "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "hy_v4",
    "inkling2_loop_text", "inkling2_text", "inkling_text", "jamba", "kimi_linear", "kolibri1", "kolibri1_1", "laguna",
    "lara_mini", "lfm2_moe", "longcat_flash", "mellum", "mimo_v2_flash", "minicpm5_moe", "minimax", "minimax_m2",
    "minimax_m3_vl_text", "mixtral", "nemotron_h", "olmoe", "param2moe", "phimoe", "qwen2_moe", "qwen3_5_moe",
    "qwen3_5_moe_text", "qwen3_moe", "qwen3_next", "qwen4_exp", "qwen4_exp_text", "sarvam_mla", "sarvam_moe",
    "solar_open", "zaya",
]
OFFERED = {family.model_type for family in moe_families()}
CASES = [family for family in VERIFIED if family in OFFERED]


def family_checkpoint(family: str, directory: Path, **sizes_override) -> Path:
    """A tiny random checkpoint of `family` in `directory`, with experts and routers that matter."""
    torch.manual_seed(0)
    config = tiny_config(family, **sizes_override)
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
