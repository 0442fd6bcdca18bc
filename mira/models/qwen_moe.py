"""Qwen2-MoE (routed experts plus a sigmoid-gated shared expert) and Qwen3-MoE.

The shared expert is an ordinary transformers MLP and stays in the model (bf16, on the device);
only the routed experts move to the store.
"""

from mira.models.base import PER_EXPERT_MLP_KEYS, Adapter, standard_kv_values

QWEN2_MOE = Adapter(
    model_type="qwen2_moe",
    experts_module="transformers.models.qwen2_moe.modeling_qwen2_moe",
    experts_class="Qwen2MoeExperts",
    keys=PER_EXPERT_MLP_KEYS,
    num_experts=lambda c: c.num_experts,
    intermediate_size=lambda c: c.moe_intermediate_size,
    kv_values_per_token=standard_kv_values,
)

QWEN3_MOE = Adapter(
    model_type="qwen3_moe",
    experts_module="transformers.models.qwen3_moe.modeling_qwen3_moe",
    experts_class="Qwen3MoeExperts",
    keys=PER_EXPERT_MLP_KEYS,
    num_experts=lambda c: c.num_experts,
    intermediate_size=lambda c: c.moe_intermediate_size,
    kv_values_per_token=standard_kv_values,
)
