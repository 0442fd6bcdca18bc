"""Replaying recorded routing at a model's shapes (`mira bench --synthetic CONFIG.json --routing T.npz`)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import MixtralConfig

from mira.bench.replay import RoutingReplay
from mira.bench.synthetic import synthetic_config, synthetic_skeleton, synthetic_store
from mira.errors import MiraError
from mira.store.trace import RoutingTrace
from mira.runtime.engine import assemble
from mira.runtime.experts import MiraExperts

LAYERS, EXPERTS, TOP_K = 3, 8, 2


def small_config() -> MixtralConfig:
    return MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                         num_experts_per_tok=TOP_K, max_position_embeddings=128, tie_word_embeddings=False)


def random_trace(tokens: int, layers: int = LAYERS, experts: int = EXPERTS, seed: int = 0) -> RoutingTrace:
    rng = np.random.default_rng(seed)
    ids = np.stack([np.stack([rng.choice(experts, TOP_K, replace=False) for _ in range(layers)])
                    for _ in range(tokens)]).astype(np.int16)  # [T, L, K], distinct experts per token and layer
    return RoutingTrace(ids, experts, source="random.npz")


def small_model():
    config = small_config()
    skeleton, sites, _ = synthetic_skeleton(config, torch.device("cpu"), seed=1)
    store = synthetic_store(config, len(sites), "int8-shared", pin=False, seed=1, progress=False)
    return assemble(skeleton, sites, store, None)


def test_every_moe_layer_routes_as_the_trace_did_at_every_step():
    model, trace = small_model(), random_trace(40)
    RoutingReplay(trace, model, start=5)
    seen = []  # (layer, ids [T, K]) as the experts modules were called
    for layer in (m for m in model.hf_model.modules() if isinstance(m, MiraExperts)):
        layer.register_forward_pre_hook(lambda module, args: seen.append((module.layer_position, args[1].clone())))
    prompt = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # each prompt replays the same rows from `start`
        seen.clear()
        model.generate(prompt, max_new_tokens=4, do_sample=False)
        steps = [seen[i:i + LAYERS] for i in range(0, len(seen), LAYERS)]
        assert len(steps) == 4  # the prompt, then three one-token steps
        rows = [range(5, 11), range(11, 12), range(12, 13), range(13, 14)]
        for step, step_rows in zip(steps, rows):
            for layer, ids in step:
                expected = torch.from_numpy(trace.topk_ids[list(step_rows), layer].astype(np.int64))
                assert torch.equal(ids, expected)


def test_a_trace_of_another_shape_or_too_short_is_refused():
    model = small_model()
    with pytest.raises(MiraError, match=r"routes 4 MoE layers x 8 experts, top-2, but the model has 3 x 8, top-2"):
        RoutingReplay(random_trace(10, layers=4), model)
    RoutingReplay(random_trace(8), model)
    with pytest.raises(MiraError, match="has 8 tokens; this run needs 9"):
        model.generate(torch.zeros(1, 6, dtype=torch.long), max_new_tokens=5, do_sample=False)


def test_synthetic_config_takes_any_supported_config_json(tmp_path):
    path = tmp_path / "tiny-mixtral" / "config.json"
    path.parent.mkdir()
    path.write_text(small_config().to_json_string())
    config, name = synthetic_config(str(path.parent))
    assert (config.model_type, config.num_hidden_layers, config.num_local_experts, name) == (
        "mixtral", LAYERS, EXPERTS, "tiny-mixtral")
    assert config.eos_token_id is None
    (tmp_path / "bert.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(MiraError, match="'bert' model, which Mira does not support"):
        synthetic_config(str(tmp_path / "bert.json"))
    with pytest.raises(MiraError, match="neither a preset"):
        synthetic_config(str(tmp_path / "missing.json"))


def test_a_bench_run_replays_a_trace_in_every_configuration(tmp_path):
    config_dir = tmp_path / "tiny-mixtral"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(small_config().to_json_string())
    random_trace(120, seed=2).save(tmp_path / "routing.npz")
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "mira.cli", "bench", "--synthetic", str(config_dir), "--routing",
         str(tmp_path / "routing.npz"), "--device", "cpu", "--budgets", "50%", "--configs", "mira,lru,static",
         "--fixed", "8x6", "--repeats", "1", "--out", str(out), "--quiet"],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["routing"].startswith("replayed from routing.npz")
    assert result["replay"]["measured_rows_from"] == 72 and "cannot" not in result["replay"]["note"]
    # every configuration saw the same routing: the trace's rows 72..85, so the same routed tokens per tier sum
    trace = RoutingTrace.load(tmp_path / "routing.npz")
    rows = trace.topk_ids[72:72 + 8 + 6 - 1]  # the prompt and the 5 steps after it
    for row in result["runs"]:
        assert sum(row["tokens_served"].values()) == rows.size
