"""Tiny random checkpoints of every supported family, written with transformers' `save_pretrained`
so that the on-disk names are the real ones, plus a small byte-level BPE tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    DeepseekV2Config,
    DeepseekV3Config,
    MixtralConfig,
    OlmoeConfig,
    PreTrainedTokenizerFast,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)
from transformers import AutoModelForCausalLM

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False)
MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=2, topk_group=1,
           first_k_dense_replace=1, n_shared_experts=1, moe_intermediate_size=48, n_routed_experts=8)

MIXTRAL_EXPERTS = 8
CONFIGS = {
    "mixtral": lambda: MixtralConfig(num_local_experts=MIXTRAL_EXPERTS, **COMMON),
    "qwen2_moe": lambda: Qwen2MoeConfig(num_experts=8, moe_intermediate_size=48, shared_expert_intermediate_size=64,
                                        **COMMON),
    "qwen3_moe": lambda: Qwen3MoeConfig(num_experts=8, moe_intermediate_size=48, head_dim=16, **COMMON),
    "deepseek_v2": lambda: DeepseekV2Config(q_lora_rank=None, topk_method="group_limited_greedy",
                                            routed_scaling_factor=1.5, **MLA, **COMMON),
    "deepseek_v3": lambda: DeepseekV3Config(q_lora_rank=16, routed_scaling_factor=2.5, **MLA, **COMMON),
    "olmoe": lambda: OlmoeConfig(num_experts=8, eos_token_id=1, pad_token_id=0, **COMMON),
}
FAMILIES = sorted(CONFIGS)
INT4_SIZES = dict(intermediate_size=128, moe_intermediate_size=64)  # experts of whole int4 tiles (mira.store.int4)

TEXT = ["the quick brown fox jumps over the lazy dog", "hello world, this is a tiny tokenizer",
        "mixture of experts models route each token to a few experts", "def sort(xs): return sorted(xs)"] * 20


def write_tokenizer(directory: Path) -> None:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(directory)


def make_checkpoint(family: str, directory: Path, seed: int = 0, **sizes) -> Path:
    """Write a tiny random `family` checkpoint (float32) with a tokenizer into `directory`; `sizes`
    override config fields (INT4_SIZES)."""
    torch.manual_seed(seed)
    config = CONFIGS[family]()
    for name, value in sizes.items():
        setattr(config, name, value)
    config.eos_token_id, config.pad_token_id = 1, 0
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:  # larger than the default init, so experts matter in the logits
                param.normal_(0.0, 0.2)
            elif name.endswith("mlp.gate.weight"):  # a decisive router: quantization noise flips no top-k choice
                param.normal_(0.0, 1.0)
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return directory


def mixtral_layer_call(seed: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random inputs of one tiny-Mixtral MoE layer call: hidden [T, H], distinct top-k expert ids
    per token [T, K] and routing weights [T, K]."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, COMMON["hidden_size"], generator=generator)
    top_k = COMMON["num_experts_per_tok"]
    index = torch.stack([torch.randperm(MIXTRAL_EXPERTS, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator)
    return hidden, index, weights


def mixtral_layer_reference(store, layer: int, hidden, index, weights) -> torch.Tensor:
    """That call's output in float64 from the store's blobs of `layer` (mira.kernels.reference)."""
    from mira.kernels.reference import moe_ffn_reference

    blobs = [store.blob(layer, e) for e in range(MIXTRAL_EXPERTS)]
    return moe_ffn_reference(hidden.double(), index, weights.double(), blobs, store.layout, torch.nn.functional.silu)


def dequantized_model(checkpoint: Path, store_dir: Path):
    """transformers' own float32 model of `checkpoint` with every expert replaced by its dequantized
    weights from the store at `store_dir`: the quantized model, computed by transformers."""
    from mira.store.quant import dequantize_expert
    from mira.store.store import ExpertStore

    store = ExpertStore.open(store_dir, progress=False)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    with torch.no_grad():
        for position, module in enumerate(experts):
            for expert in range(store.num_experts):
                w13, w2 = dequantize_expert(store.layout.views(store.blob(position, expert)), store.layout)
                module.gate_up_proj[expert] = w13.float()
                module.down_proj[expert] = w2.float()
    return model
