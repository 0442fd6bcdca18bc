"""The KV cache's values per token that the budget reserves, worked by hand for each kind of config."""

from __future__ import annotations

from transformers import AutoConfig

from mira.models.base import kv_values_per_token, layer_values


def test_grouped_query_attention_caches_keys_and_values_of_every_layer():
    # 2 layers x (K and V) x 2 kv heads x head dim 64 / 8 = 8
    config = AutoConfig.for_model("mixtral", num_hidden_layers=2, hidden_size=64, num_attention_heads=8,
                                  num_key_value_heads=2)
    assert kv_values_per_token(config) == 2 * 2 * 2 * 8


def test_layers_that_do_not_attend_cache_nothing():
    config = AutoConfig.for_model("qwen3_next", num_hidden_layers=3, hidden_size=64, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16,
                                  layer_types=["linear_attention", "full_attention", "linear_attention"])
    assert kv_values_per_token(config) == 1 * 2 * 2 * 16  # the one full-attention layer


def test_a_layer_with_its_own_head_dim_caches_by_it():
    """Gemma 4's configs give some layers their own head_dim (transformers' per_layer_config) and
    refuse to read it globally: 16, 16 and 32 here, 2 kv heads each."""
    config = AutoConfig.for_model("gemma4_text", num_hidden_layers=3, hidden_size=64, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, per_layer_config={2: {"head_dim": 32}},
                                  layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    assert layer_values(config, "head_dim") == [16, 16, 32]
    assert layer_values(config, "num_key_value_heads") == [2]  # one value for every layer
    assert kv_values_per_token(config) == 2 * 2 * (16 + 16 + 32)


def test_a_multimodal_config_is_read_through_its_text_model():
    """Gemma 4's checkpoints are multimodal: the model Mira builds keeps the whole config, whose text
    part holds the layers (the whole one has no num_hidden_layers)."""
    text = dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                per_layer_config={2: {"head_dim": 32}})
    config = AutoConfig.for_model("gemma4", text_config=text)
    assert not hasattr(config, "num_hidden_layers")
    assert kv_values_per_token(config) == kv_values_per_token(config.get_text_config()) == 2 * 2 * (16 + 16 + 32)
