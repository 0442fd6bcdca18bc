"""Mixtral: experts under `block_sparse_moe`, w1 gate, w3 up, w2 down."""

from mira.models.base import Adapter, ExpertKeys, standard_kv_values

MIXTRAL = Adapter(
    model_type="mixtral",
    experts_module="transformers.models.mixtral.modeling_mixtral",
    experts_class="MixtralExperts",
    keys=ExpertKeys(
        gate="model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
        up="model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
        down="model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight",
    ),
    num_experts=lambda c: c.num_local_experts,
    intermediate_size=lambda c: c.intermediate_size,
    kv_values_per_token=standard_kv_values,
)
