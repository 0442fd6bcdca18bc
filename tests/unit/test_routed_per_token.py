"""`routed_per_token`: the experts a token is routed to, read from each family's config by hand-made configs."""

from transformers import AriaTextConfig, DbrxConfig, DeepseekV2Config, Gemma4Config, MixtralConfig

from mira.models.loader import routed_per_token


def test_the_routed_experts_per_token_are_read_by_each_familys_name_for_them():
    assert routed_per_token(MixtralConfig(num_experts_per_tok=2)) == 2
    assert routed_per_token(AriaTextConfig(moe_topk=3)) == 3  # no num_experts_per_tok: reading it raises
    assert routed_per_token(DbrxConfig(ffn_config={"moe_top_k": 4})) == 4
    assert routed_per_token(Gemma4Config(text_config={"top_k_experts": 5})) == 5  # a multimodal config's text part
    assert routed_per_token(DeepseekV2Config()) is None  # set by checkpoints, not by the class: auto stays off
