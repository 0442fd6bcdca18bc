"""Every user-fixable problem is refused with one clear message that names the fix."""

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import mira
from mira.cache.budget import plan_slots
from mira.errors import MiraError
from mira.store.convert import convert


def test_missing_directory(tmp_path):
    with pytest.raises(MiraError, match=r"does not exist; pass --model \(convert's MODEL_DIR, mira.load's path, lm-eval's pretrained=\)"):
        mira.load(tmp_path / "nowhere", device="cpu")


def test_directory_without_config(tmp_path):
    with pytest.raises(MiraError, match="has no config.json"):
        convert(tmp_path, tmp_path / "store")


def test_unreadable_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(MiraError, match="cannot read"):
        mira.load(tmp_path, device="cpu")


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path)
    with pytest.raises(MiraError, match="'llama' model.*supported architectures.*deepseek_v2.*mixtral.*olmoe"):
        convert(tmp_path, tmp_path / "store")


def test_corrupt_store_is_refused(tmp_path, stores):
    store = tmp_path / "store"
    shutil.copytree(stores["mixtral", "int8-shared"], store)
    layer_file = sorted((store / "experts").iterdir())[1]
    data = bytearray(layer_file.read_bytes())
    data[-100] ^= 0xFF
    layer_file.write_bytes(bytes(data))
    with pytest.raises(MiraError, match=f"corrupt: experts/{layer_file.name} does not match its checksum"):
        mira.load(store, device="cpu", progress=False)


def test_truncated_and_missing_store_files_are_refused(tmp_path, stores):
    store = tmp_path / "store"
    shutil.copytree(stores["olmoe", "int8-row"], store)
    layer_file = sorted((store / "experts").iterdir())[0]
    layer_file.write_bytes(layer_file.read_bytes()[:-10])
    with pytest.raises(MiraError, match="truncated"):
        mira.load(store, device="cpu", progress=False)
    (store / "tokenizer.json").unlink()
    with pytest.raises(MiraError, match="tokenizer.json is missing"):
        mira.load(store, device="cpu", progress=False)


def test_store_of_another_scheme_is_refused(stores):
    with pytest.raises(MiraError, match="holds int8-shared experts, not int8-row.*--quant int8-shared"):
        mira.load(stores["mixtral", "int8-shared"], device="cpu", quant="int8-row")


def test_converting_into_a_store_of_another_model_is_refused(checkpoints, stores):
    with pytest.raises(MiraError, match="was made from another model"):
        convert(checkpoints["olmoe"], stores["mixtral", "int8-shared"], "int8-shared")
    with pytest.raises(MiraError, match="holds int8-shared experts, not none"):
        convert(checkpoints["mixtral"], stores["mixtral", "int8-shared"], "none")


def test_store_of_a_newer_format_is_refused(tmp_path, stores):
    store = tmp_path / "store"
    shutil.copytree(stores["mixtral", "none"], store)
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["format_version"] = 99
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(MiraError, match="format version 99"):
        mira.load(store, device="cpu")


def test_budget_below_the_non_expert_weights_and_kv_cache_says_how_much_is_needed(stores):
    with pytest.raises(MiraError, match=r"budget of 1000 B is below the [0-9.]+ KiB needed \(.*KV cache for 256 "
                                        r"tokens.*\); pass --vram-budget of at least .* or a smaller --max-context; "
                                        r"a size without a unit is bytes: write 12GiB, not 12$"):
        mira.load(stores["mixtral", "int8-shared"], device="cpu", vram_budget=1000, progress=False)


def test_only_a_budget_under_a_kibibyte_is_taken_for_a_missing_unit():
    # 3 MiB of weights, 1 MiB of KV cache, 8 slots of 1 MiB: 12 MiB needed
    plan = dict(non_expert_bytes=3 << 20, kv_bytes=1 << 20, workspace_bytes=0, blob_bytes=1 << 20,
                experts_per_layer=8, total_experts=64, max_context=256)
    for budget in (2 << 20, 200 << 10):  # 2MiB, 200KiB: sizes with units
        with pytest.raises(MiraError, match=r"budget of .* is below the 12.00 MiB needed .* or a smaller "
                                            r"--max-context$"):
            plan_slots(budget, **plan)
    with pytest.raises(MiraError, match=r"budget of 12 B .*; a size without a unit is bytes: write 12GiB, not 12$"):
        plan_slots(12, **plan)
    with pytest.raises(MiraError, match=r"budget of 12582911 B is below the 12582912 B needed"):  # both 12.00 MiB
        plan_slots((12 << 20) - 1, **plan)


def test_a_policy_or_prefetch_with_no_slots_to_act_on_is_refused(stores):
    """The API's counterpart of the CLI's refusal (tests/e2e/test_cli_args.py): on the CPU without a
    budget every expert is read in place, so a policy or prefetch mode would be silently ignored."""
    for setting, value in (("policy", "lru"), ("prefetch", "gate")):
        with pytest.raises(MiraError, match=rf"^{setting}='{value}' has no effect on the CPU without vram_budget .*; "
                                            rf"pass vram_budget \(e.g. '25%'\) or leave out {setting}$"):
            mira.load(stores["mixtral", "int8-shared"], device="cpu", progress=False, **{setting: value})
    model = mira.load(stores["mixtral", "int8-shared"], device="cpu", progress=False, policy="mira", prefetch="auto")
    assert model.plan is None  # the defaults, named, still load: no slots


def test_a_profile_of_another_shape_with_as_many_experts_is_refused(stores, tmp_path):
    from mira.store.store import ExpertStore
    from mira.store.trace import RoutingTrace

    store = ExpertStore.open(stores["mixtral", "int8-shared"])
    layers, experts = store.num_layers, store.num_experts
    assert experts % 2 == 0  # the profile splits each layer into two of half the experts
    ids = np.zeros((1, layers * 2, 1), dtype=np.int16)
    RoutingTrace(ids, experts // 2).save(tmp_path / "folded.npz")
    with pytest.raises(MiraError, match=rf"routes over {layers * 2} layers x {experts // 2} experts but this model "
                                        rf"has {layers} x {experts}; record the profile with `mira trace`"):
        mira.load(stores["mixtral", "int8-shared"], device="cpu", vram_budget="50%", policy="static",
                  profile=str(tmp_path / "folded.npz"), progress=False)


def test_prompt_longer_than_the_context(stores):
    model = mira.load(stores["qwen3_moe", "int8-shared"], device="cpu", max_context=16, progress=False)
    with pytest.raises(MiraError, match="longer than the context of 16 tokens"):
        model.generate(torch.ones(1, 12, dtype=torch.long), max_new_tokens=8)
    with pytest.raises(MiraError, match="12 tokens plus 8 new tokens is longer than the context of 16"):
        model.generate(torch.ones(1, 12, dtype=torch.long), max_length=20)  # a total length, as transformers takes
    with pytest.raises(MiraError, match="20 tokens plus 0 new tokens is longer than the context of 16"):
        model.generate(torch.ones(1, 20, dtype=torch.long))


def test_cuda_requested_without_a_gpu(stores):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(MiraError, match="no CUDA device.*--device cpu"):
        mira.load(stores["mixtral", "none"], device="cuda")
