"""DeepSeek-V2 and V3: shared experts, group-limited routing, dense first layers.

The router (with its group limit and, for V3, the score-correction bias) and the shared experts
are transformers' modules and stay in the model; layers before `first_k_dense_replace` are dense
MLPs and have no Experts module, so Mira never sees them. Transformers' multi-head latent attention
caches full per-head keys (nope + rope dims) and values, which is what the KV budget counts.
"""

from transformers import PretrainedConfig

from mira.models.base import PER_EXPERT_MLP_KEYS, Adapter


def mla_kv_values(config: PretrainedConfig) -> int:
    key_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    return config.num_hidden_layers * config.num_attention_heads * (key_dim + config.v_head_dim)


DEEPSEEK_V2 = Adapter(
    model_type="deepseek_v2",
    experts_module="transformers.models.deepseek_v2.modeling_deepseek_v2",
    experts_class="DeepseekV2Experts",
    keys=PER_EXPERT_MLP_KEYS,
    num_experts=lambda c: c.n_routed_experts,
    intermediate_size=lambda c: c.moe_intermediate_size,
    kv_values_per_token=mla_kv_values,
)

DEEPSEEK_V3 = Adapter(
    model_type="deepseek_v3",
    experts_module="transformers.models.deepseek_v3.modeling_deepseek_v3",
    experts_class="DeepseekV3Experts",
    keys=PER_EXPERT_MLP_KEYS,
    num_experts=lambda c: c.n_routed_experts,
    intermediate_size=lambda c: c.moe_intermediate_size,
    kv_values_per_token=mla_kv_values,
)
