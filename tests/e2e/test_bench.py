"""`mira bench` on the CPU: synthetic models compute what transformers computes with the same
weights, and a whole bench run writes every configuration's row, the comparison and the chart."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config, MixtralConfig, OlmoeConfig, Qwen3MoeConfig

from mira.bench.hf import compute_dtype
from mira.bench.synthetic import WEIGHT_STD, PRESETS, preset_config, synthetic_skeleton, synthetic_store
from mira.models.loader import moe_skeleton_layers
from mira.runtime.config import CPU_BF16_EXPERT_WEIGHTS
from mira.runtime.engine import assemble
from mira.store.quant import dequantize_expert

SMALL = {
    "mixtral": lambda: MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                     num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False),
    "qwen3_moe": lambda: Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        num_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
                                        tie_word_embeddings=False),
    "olmoe": lambda: OlmoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                 max_position_embeddings=64, tie_word_embeddings=False),
    "deepseek_v2": lambda: DeepseekV2Config(  # the first layer dense, as DeepSeek-V2-Lite: one MoE layer of two
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=16, topk_method="greedy", n_group=1, topk_group=1, max_position_embeddings=64,
        tie_word_embeddings=False),
}


@pytest.mark.parametrize("family", sorted(SMALL))
@pytest.mark.parametrize("scheme", ["int8-shared", "int8-row", "int4"])
def test_a_synthetic_model_computes_what_transformers_computes_with_its_weights(family, scheme):
    config = SMALL[family]()
    skeleton, sites, _ = synthetic_skeleton(config, torch.device("cpu"), seed=3)
    store = synthetic_store(config, len(sites), scheme, pin=False, seed=3, progress=False)
    assert store.data.shape[:2] == (len(moe_skeleton_layers(config)), 8)
    full = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    non_expert = {name: tensor for name, tensor in skeleton.state_dict().items() if ".experts." not in name}
    missing, _ = full.load_state_dict(non_expert, strict=False)
    assert all(".experts." in name for name in missing)  # everything but the routed experts came from the skeleton
    names = {id(module): name for name, module in skeleton.named_modules()}
    weights = []
    for position, site in enumerate(sites):
        original = getattr(full.get_submodule(names[id(site.parent)]), site.attr)
        for expert in range(8):
            w13, w2 = dequantize_expert(store.layout.views(store.blob(position, expert)), store.layout)
            weights.append(torch.cat([w13.flatten(), w2.flatten()]))
            with torch.no_grad():
                original.gate_up_proj[expert] = w13.float()
                original.down_proj[expert] = w2.float()
    every = torch.stack(weights)  # [L*E, P]
    assert every.std().item() == pytest.approx(WEIGHT_STD, rel=0.05)  # the scale documented in the module
    assert torch.unique(every, dim=0).shape[0] == len(every)  # every expert is different
    model = assemble(skeleton, sites, store, None)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = full(ids).logits
        got = model(ids).logits
    assert (got - expected).abs().max().item() <= 1e-4


def test_the_bench_computes_in_the_dtype_mira_load_picks_for_the_experts_size():
    assert 3 * 2048 * 1024 >= CPU_BF16_EXPERT_WEIGHTS > 3 * 64 * 128  # OLMoE's experts, and the small config's
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compute_dtype(SMALL["olmoe"](), cpu) == torch.float32
    assert compute_dtype(SMALL["olmoe"](), cuda) == compute_dtype(preset_config("olmoe-1b-7b"), cpu) == torch.bfloat16
    skeleton, _, _ = synthetic_skeleton(SMALL["olmoe"](), cpu)
    assert skeleton.dtype == torch.float32


def test_every_preset_builds_its_config_with_the_published_expert_counts():
    layers = {name: len(moe_skeleton_layers(preset_config(name))) for name in PRESETS}
    assert layers == {"mixtral-8x7b": 32, "deepseek-v2-lite": 26, "qwen3-30b-a3b": 48, "olmoe-1b-7b": 16}
    with pytest.raises(ValueError, match="choose one of"):
        preset_config("mixtral-8x22b")


def test_a_bench_run_reports_every_configuration_the_comparison_and_a_chart(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "mira.cli", "bench", "--budgets", "5%,25%,all,1MiB", "--configs",
         "mira+p,mira,mira-cpu-all,static,hf-gpu,hf-offload", "--fixed", "8x4", "--repeats", "2", "--out", str(out),
         "--quiet", "--beams", "2", "--beam-budget", "5%", "--cpu-threads", "2"],  # on 2 cores the default is 1
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    rows = {(row["config"], row["budget"]): row for row in result["runs"] if not row.get("beam_search")}
    mira_configs = ("mira+p", "mira", "mira-cpu-all", "static")
    (beam,) = [row for row in result["runs"] if row.get("beam_search")]
    assert set(rows) == {(c, b) for c in mira_configs for b in ("5%", "25%", "all", "1MiB")} | {
        ("hf-gpu", "all"), ("hf-offload", "all")}
    assert "needs a CUDA device" in rows["hf-offload", "all"]["skipped"]
    assert f"skipped hf-offload at all: {rows['hf-offload', 'all']['skipped']}\n" in run.stderr  # whole, not cut
    for config in mira_configs:  # 12 layers of 8 experts: 5% is 5 slots, 8% the least that holds one layer's 8
        assert rows[config, "5%"]["skipped"] == ("5% gives slots for 5 of the model's 96 experts, fewer than the 8 of "
                                                 "one MoE layer, which must all fit while it computes; a share of 8% "
                                                 "or more fits")
        # a size below one layer's needs names the bench's option, not generate's --vram-budget
        assert re.fullmatch(r"the budget of 1.00 MiB is below the [0-9.]+ MiB needed \(.*\); --budgets of at least "
                            r"[0-9.]+ MiB runs it", rows[config, "1MiB"]["skipped"])
    assert beam["num_beams"] == 2 and beam["skipped"] == rows["mira", "5%"]["skipped"]  # the beams' budget too
    for (config, budget), row in rows.items():
        if (config.startswith("mira") or config == "static") and budget not in ("5%", "1MiB"):
            assert row["new_tokens"] == 4 and row["prompt_tokens"] == 8
            served = row["tokens_served"]
            assert sum(served.values()) == row["prompts"] * (8 + 4 - 1) * 12 * 2  # every routed token, every layer
            assert row["bound"]["decode_steps"] == 3  # the last repeat's
            # the median of two timed repeats, after an untimed one, and their range
            low, high = row["decode_tokens_per_s_range"]
            assert len(row["repeats"]) == 2 and low <= row["decode_tokens_per_s"] <= high
            assert sorted(r["decode_tokens_per_s"] for r in row["repeats"]) == [low, high]
            changes = row["decode_route_changes"]  # 8 experts, top 2: 28 possible sets
            assert 0 <= changes["value"] <= 1 and changes["uniform"] == round(1 - 1 / 28, 3)
            if budget == "all":
                assert served["miss"] == 0 and row["slots"] == 96
    assert rows["mira+p", "25%"]["prefetcher"] == "GateSpeculation" and rows["mira", "25%"]["prefetcher"] is None
    # auto residency: lagged for the static policy, which never admits a miss; inline for the mira policy
    assert rows["static", "25%"]["residency"] == "lagged" and rows["mira", "25%"]["residency"] == "inline"
    assert rows["mira+p", "25%"]["prefetch"]["issued"] > 0
    # every miss the policy leaves in host memory computed by a one-thread CPU worker: a miss for the policy still
    hybrid, plain = rows["mira-cpu-all", "25%"], rows["mira", "25%"]
    assert hybrid["residency"] == "inline" and hybrid["cpu_experts"]["mode"] == "all"
    assert hybrid["cpu_experts"]["threads"] == 2 and 0 < hybrid["cpu_lookups"] <= hybrid["lookups"]["miss"]
    assert 0 < hybrid["cpu_tokens"] <= hybrid["tokens_served"]["miss"] and plain["cpu_tokens"] == 0
    assert rows["mira-cpu-all", "all"]["cpu_experts"] == {"mode": "off"}  # every expert resident: no misses
    # per repeat, the CPU's experts of that run: the last one's are the last repeat's CPU lookups
    assert hybrid["repeats"][-1]["cpu_experts"] == hybrid["cpu_lookups"]
    assert all(r["cpu_experts"] > 0 and r["cpu_compute_ms_per_expert"] > 0 for r in hybrid["repeats"])
    assert "cpu_experts" not in plain["repeats"][0]
    # the per-layer table covers the timed repeats, not the untimed run before them
    assert hybrid["cpu_experts"]["covers"] == "timed runs"
    assert hybrid["cpu_experts"]["experts"] == sum(r["cpu_experts"] for r in hybrid["repeats"])
    assert sum(layer["experts"] for layer in hybrid["cpu_experts"]["layers"]) == hybrid["cpu_experts"]["experts"]
    for budget in ("25%", "all"):  # mira against the fastest baseline that ran at the budget
        ran = {c: row["decode_tokens_per_s"] for (c, b), row in rows.items()
               if b == budget and c in ("static", "hf-gpu") and not row.get("skipped")}
        best = max(ran, key=ran.get)
        compared = result["comparison"][budget]
        assert compared["best_baseline"] == best and compared["mira_over_best_baseline"] == round(
            rows["mira", budget]["decode_tokens_per_s"] / ran[best], 3)
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert "mira-tiny-moe, real routing" in run.stdout


def test_a_resumed_bench_keeps_what_was_measured_and_runs_only_the_rest(tmp_path, capsys):
    from mira.cli import main

    out = tmp_path / "bench.json"
    common = ["bench", "--fixed", "8x3", "--repeats", "1", "--out", str(out), "--quiet"]
    assert main([*common, "--budgets", "25%", "--configs", "mira+p,mira"]) == 0
    first = json.loads(out.read_text())
    assert [(r["config"], r["budget"]) for r in first["runs"]] == [("mira+p", "25%"), ("mira", "25%")]
    assert first["comparison"] == {}  # no baseline ran

    assert main([*common, "--budgets", "25%,all", "--configs", "mira+p,mira,static", "--resume"]) == 0
    resumed = json.loads(out.read_text())
    assert resumed["runs"][:2] == first["runs"]  # kept as measured, not measured again
    assert [(r["config"], r["budget"]) for r in resumed["runs"][2:]] == [
        ("static", "25%"), ("mira+p", "all"), ("mira", "all"), ("static", "all")]
    assert resumed["budgets"] == ["25%", "all"] and resumed["configs"] == ["mira+p", "mira", "static"]
    assert resumed["segments"][0]["command"] == first["command"]
    assert resumed["segments"][1]["command"].startswith("mira bench") and "--resume" in resumed["segments"][1]["command"]
    assert set(resumed["comparison"]) == {"25%", "all"}  # over every run, the kept ones too

    capsys.readouterr()
    assert main([*common[:2], "8x4", *common[3:], "--budgets", "25%", "--configs", "mira", "--resume"]) == 1
    error = capsys.readouterr().err
    assert "holds another run (prompt_set" in error and "drop --resume" in error
    assert json.loads(out.read_text()) == resumed  # a refused resume leaves the file as it was


def test_a_bench_records_a_prompt_file_s_prompts_at_the_length_the_model_reads(tmp_path):
    from mira.cli import main

    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "bench.json"
    prompts.write_text('{"prompt": "How do I sort a list?", "input_tokens": 999, "max_new_tokens": 3}\n')
    assert main(["bench", "--prompts", str(prompts), "--configs", "mira", "--budgets", "all", "--repeats", "1",
                 "--out", str(out), "--quiet"]) == 0
    result = json.loads(out.read_text())
    (row,) = result["runs"]
    assert result["prompts"] == [{"input_tokens": row["prompt_tokens"], "max_new_tokens": 3}]  # not the file's 999
    assert 5 < row["prompt_tokens"] < 100


@pytest.mark.parametrize("family", ["gemma4", "gemma4_text", "aria_text"])
def test_a_bench_runs_families_that_name_top_k_and_the_vocabulary_their_own_way(family, tmp_path):
    # Gemma 4 and Aria name the routed experts top_k_experts and moe_topk; Gemma 4's multimodal config
    # keeps the vocabulary in its text config
    from mira.cli import main
    from tiny_families import family_checkpoint

    checkpoint, out = family_checkpoint(family, tmp_path / family), tmp_path / "bench.json"
    assert main(["bench", "--model", str(checkpoint), "--fixed", "8x3", "--configs", "mira,static", "--budgets",
                 "50%", "--repeats", "1", "--out", str(out), "--quiet"]) == 0
    rows = json.loads(out.read_text())["runs"]
    assert [r["config"] for r in rows] == ["mira", "static"] and not any(r.get("skipped") for r in rows)
    assert all(r["new_tokens"] == 3 for r in rows)


def test_an_interleaved_bench_times_the_configurations_in_turns_each_on_a_fresh_model(tmp_path, monkeypatch, capsys):
    from mira.bench import run as bench_run
    from mira.cli import main

    calls = []
    measure = bench_run._mira_row

    def recorded(source, name, *args, **kwargs):
        calls.append((name, kwargs["repeats"]))
        return measure(source, name, *args, **kwargs)

    monkeypatch.setattr(bench_run, "_mira_row", recorded)
    common = ["bench", "--fixed", "8x3", "--budgets", "25%", "--configs", "mira,static", "--quiet"]
    turns_out, once_out = tmp_path / "turns.json", tmp_path / "once.json"
    assert main([*common, "--repeats", "2", "--interleave", "--out", str(turns_out)]) == 0
    assert calls == [("mira", 1), ("static", 1), ("mira", 1), ("static", 1)]  # round by round
    assert main([*common, "--repeats", "1", "--out", str(once_out)]) == 0
    turns, once = json.loads(turns_out.read_text()), json.loads(once_out.read_text())
    assert turns["interleave"] is True and "interleave" not in once
    assert [r["config"] for r in turns["runs"]] == [r["config"] for r in once["runs"]] == ["mira", "static"]
    for merged, single in zip(turns["runs"], once["runs"]):
        # every turn a fresh model's untimed run and one timed run: the last turn counts what a model
        # timed once after its untimed run counts
        assert merged["lookups"] == single["lookups"] and merged["tokens_served"] == single["tokens_served"]
        low, high = merged["decode_tokens_per_s_range"]
        assert len(merged["repeats"]) == 2 and low <= merged["decode_tokens_per_s"] <= high
    capsys.readouterr()
    assert main([*common, "--repeats", "2", "--out", str(turns_out), "--resume"]) == 1  # not interleaved
    assert "holds another run (interleave True" in capsys.readouterr().err


def test_random_continuation_makes_greedy_decoding_emit_the_same_seeded_ids_in_any_model():
    from mira.bench.measure import RandomContinuation, time_generation
    from mira.bench.prompts import FIRST_ID, BenchPrompt

    config = SMALL["qwen3_moe"]()
    prompts = [BenchPrompt(None, 8, 6), BenchPrompt(None, 5, 4)]
    decoded = []
    for seed in (3, 4):  # two different random models
        skeleton, sites, _ = synthetic_skeleton(config, torch.device("cpu"), seed=seed)
        store = synthetic_store(config, len(sites), "int8-shared", pin=False, seed=seed, progress=False)
        model = assemble(skeleton, sites, store, None)
        outputs = []

        def generate(ids, **kwargs):
            outputs.append(model.generate(ids, **kwargs))
            return outputs[-1]
        timing = time_generation(generate, prompts, None, config.vocab_size, "cpu", random_continuation=True)
        assert timing.new_tokens == 6 + 4
        decoded.append([out[0, prompt.input_tokens:].tolist() for out, prompt in zip(outputs, prompts)])
        with pytest.raises(ValueError, match="beam search"):
            time_generation(generate, prompts[:1], None, config.vocab_size, "cpu", num_beams=2,
                            random_continuation=True)
    # prompt n's new tokens are RandomContinuation(vocab, n)'s draws at their positions, whatever the model
    expected = [[RandomContinuation(config.vocab_size, n).token(p.input_tokens + i) for i in range(p.max_new_tokens)]
                for n, p in enumerate(prompts)]
    assert decoded == [expected, expected]
    assert all(FIRST_ID <= token < config.vocab_size for ids in expected for token in ids)
    assert len({token for ids in expected for token in ids}) > 5  # not one repeated id
    # forced ids override the minimum-length processor: no preset may have an id that ends a run
    assert all(preset_config(name).eos_token_id is None for name in PRESETS)
