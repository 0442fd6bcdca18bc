"""Published MoE models' shapes, for `mira bench --synthetic` (mira.bench.synthetic builds them):
data only, so that naming them needs neither torch nor transformers."""

# Sizes from each model's published config.json (Hugging Face model pages of the same names).
PRESETS: dict[str, dict] = {  # name -> a transformers config's fields, model_type first
    "mixtral-8x7b": dict(model_type="mixtral",  # mistralai/Mixtral-8x7B-v0.1
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
        rope_theta=1e6, tie_word_embeddings=False),
    "deepseek-v2-lite": dict(model_type="deepseek_v2",  # deepseek-ai/DeepSeek-V2-Lite
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy", n_group=1, topk_group=1,
        routed_scaling_factor=1.0, norm_topk_prob=False, max_position_embeddings=163840, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe",  # Qwen/Qwen3-30B-A3B
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960, tie_word_embeddings=False),
    "olmoe-1b-7b": dict(model_type="olmoe",  # allenai/OLMoE-1B-7B-0924
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096,
        tie_word_embeddings=False),
}
