"""OLMoE: every layer sparse, no shared expert."""

from mira.models.base import PER_EXPERT_MLP_KEYS, Adapter, standard_kv_values

OLMOE = Adapter(
    model_type="olmoe",
    experts_module="transformers.models.olmoe.modeling_olmoe",
    experts_class="OlmoeExperts",
    keys=PER_EXPERT_MLP_KEYS,
    num_experts=lambda c: c.num_experts,
    intermediate_size=lambda c: c.intermediate_size,
    kv_values_per_token=standard_kv_values,
)
