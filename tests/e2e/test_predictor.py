"""Predictor end to end on a tiny random Mixtral of 5 MoE layers (paper IV-E): features recorded
while generating match the routing trace, the run-time predictor scores exactly as the heads do
offline, and train-predictor / eval-predictor work from recorded traces."""

from __future__ import annotations

import argparse
import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig

import mira
from mira.errors import MiraError
from mira.predict.baselines import GateSpeculation
from mira.runtime.experts import model_routers
from mira.cli.predictor import add_commands, record_with_features
from mira.predict.features import HeadInputs
from mira.predict.heads import HeadConfig, PredictorHeads, TrainedPredictor, load_predictor, predictor_file
from mira.runtime.experts import MiraExperts
from mira.store.convert import convert
from tiny_models import COMMON, write_tokenizer

LAYERS = 5
PROMPTS = ["the quick brown fox", "hello world, this is", "mixture of experts models route", "def sort(xs):",
           "jumps over the lazy dog", "a tiny tokenizer"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A 5-layer tiny Mixtral (top-2 of 8, hidden 64) converted into an int8-shared store."""
    root = tmp_path_factory.mktemp("predictor")
    torch.manual_seed(0)
    config = MixtralConfig(num_local_experts=8, **{**COMMON, "num_hidden_layers": LAYERS})
    config.eos_token_id, config.pad_token_id = 1, 0
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 1.0)
    model.save_pretrained(root / "checkpoint")
    write_tokenizer(root / "checkpoint")
    convert(root / "checkpoint", root / "store", "int8-shared", progress=False)
    return root / "store"


def _load(store):
    return mira.load(store, device="cpu", progress=False)


def test_recorded_features_match_the_routing_trace_and_the_routers(store, tmp_path):
    model = _load(store)
    trace, features = record_with_features(model, PROMPTS[:3], 5, tmp_path / "t.npz", raw=True, progress=False)
    assert (tmp_path / "t.npz").is_file() and (tmp_path / "t.features.npz").is_file()
    features.check(trace)  # the same routed experts, step by step, as the RoutingRecorder saw
    assert features.num_steps == 3 * 5 and features.speculation.shape == (15, LAYERS - 2, 8)
    starts = features.step_start[:-1]
    assert trace.is_prefill[starts].tolist() == [True, False, False, False, False] * 3
    assert features.tokens[trace.is_prefill[starts]].tolist() == [int(n) for n in np.bincount(
        trace.seq_id[trace.is_prefill])]  # a prompt is one step
    routers = model_routers(model.hf_model)
    for layer, router in enumerate(routers):  # Mixtral's router is linear: mean logits = W @ mean hidden
        weight = router.weight.detach().double().numpy()
        np.testing.assert_allclose(features.hidden[:, layer].astype(np.float64) @ weight.T,
                                   features.logits[:, layer], atol=2e-2)
    decode = features.tokens == 1
    for layer in range(LAYERS - 2):  # one token: speculation's top-2 are layer+2's router's on layer's input
        logits = features.hidden[decode, layer].astype(np.float64) @ routers[layer + 2].weight.detach().double().numpy().T
        assert (np.sort(np.argsort(-logits, -1)[:, :2], -1)
                == np.sort(np.argsort(-features.speculation[decode, layer], -1)[:, :2], -1)).mean() > 0.9


def test_the_runtime_predictor_scores_as_the_heads_do_offline(store, tmp_path):
    model = _load(store)
    config = HeadConfig(num_layers=LAYERS, num_experts=8, top_k=2, hidden_size=64, history_window=3)
    torch.manual_seed(1)
    heads = PredictorHeads(config).eval()
    predictor = TrainedPredictor(heads, GateSpeculation(model_routers(model.hf_model), model.store.num_experts), "cpu")
    online, logits = [], {}
    routers = model_routers(model.hf_model)
    experts = sorted((m for m in model.hf_model.modules() if isinstance(m, MiraExperts)),
                     key=lambda m: m.layer_position)

    def at_layer(module, args):  # what the runtime does at every MoE layer
        predictor.observe(module.layer_position, args[1])
        if module.layer_position < LAYERS - 2:
            scores = predictor.scores(module.layer_position, args[0], logits[module.layer_position], args[1])
            online.append(scores.clone())  # a view of the predictor's buffer, rewritten by its next call

    handles = [router.register_forward_hook(lambda m, a, out, p=p: logits.__setitem__(p, out[0]))
               for p, router in enumerate(routers)]
    handles += [module.register_forward_pre_hook(at_layer) for module in experts]
    try:
        _, features = record_with_features(model, PROMPTS[:2], 6, tmp_path / "t.npz", raw=True, progress=False)
    finally:
        for handle in handles:
            handle.remove()
    inputs = features.inputs(config.history_window)
    with torch.no_grad():
        offline = torch.stack([heads(i, HeadInputs(*(t[:, i] for t in inputs))).logits.softmax(-1)
                               for i in range(LAYERS - 2)], 1)  # [S, L-2, E]
    online = torch.stack(online).reshape(offline.shape)
    assert torch.allclose(online.sum(-1), torch.ones(offline.shape[:2]))
    torch.testing.assert_close(online, offline, atol=2e-3, rtol=0)  # offline hidden is stored in fp16


def _cli(*argv):
    parser = argparse.ArgumentParser(prog="mira")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([str(a) for a in argv])
    args.run(args)


def test_train_predictor_then_eval_predictor_from_recorded_traces(store, tmp_path, capsys):
    model = _load(store)
    record_with_features(model, PROMPTS, 8, tmp_path / "train.npz", raw=True, progress=False)
    record_with_features(model, PROMPTS[:2], 8, tmp_path / "heldout.npz", raw=True, progress=False)
    capsys.readouterr()
    _cli("train-predictor", "--model", store, "--traces", tmp_path / "train.npz", "--epochs", 3, "--quiet")
    assert f"predictor heads {predictor_file(store)}: 3 MixtureHeads" in capsys.readouterr().out
    predictor = load_predictor(store, model_routers(model.hf_model), "cpu")
    assert isinstance(predictor, TrainedPredictor) and predictor.num_layers == LAYERS

    _cli("eval-predictor", "--model", store, "--traces", tmp_path / "heldout.npz", "--json",
         "--plot", tmp_path / "coverage.png")
    result = json.loads(capsys.readouterr().out)
    assert set(result["coverage"]) == {"mixture", "act", "hist", "gate", "previous", "popularity", "oracle"}
    assert result["decode_steps"] == 2 * 7 and (tmp_path / "coverage.png").stat().st_size > 0
    oracle, gate = result["coverage"]["oracle"]["decode"], result["coverage"]["gate"]["decode"]
    assert oracle["@2"]["mean"] == 1.0 and len(gate["@2"]["layers"]) == LAYERS - 2
    _cli("eval-predictor", "--model", store, "--traces", tmp_path / "heldout.npz")
    table = capsys.readouterr().out
    assert "MixtureHead" in table and "gate speculation" in table and "L2 @2" in table


def test_heads_go_to_the_store_of_the_scheme_asked_for(store, tmp_path, capsys):
    """Heads fit every store of one checkpoint (one fingerprint); --quant picks the store they go to."""
    checkpoint = store.parent / "checkpoint"
    record_with_features(_load(store), PROMPTS[:2], 4, tmp_path / "t.npz", raw=True, progress=False)
    _cli("train-predictor", "--model", checkpoint, "--quant", "int8-row", "--traces", tmp_path / "t.npz",
         "--epochs", 1, "--quiet")
    row = mira.load(checkpoint, device="cpu", quant="int8-row", progress=False)
    assert f"predictor heads {predictor_file(row.store.path)}:" in capsys.readouterr().out
    assert row.store.path != store and predictor_file(row.store.path).is_file()
    assert isinstance(load_predictor(row.store.path, model_routers(row.hf_model), "cpu"), TrainedPredictor)
    with pytest.raises(MiraError, match="holds int8-shared experts, not int4"):
        _cli("train-predictor", "--model", store, "--quant", "int4", "--traces", tmp_path / "t.npz", "--quiet")


def test_heads_or_features_of_another_model_are_refused(store, checkpoints, tmp_path):
    model = _load(store)
    other = _load(checkpoints["mixtral"])  # 3 MoE layers, another fingerprint
    other_store = other.store.path
    record_with_features(model, PROMPTS[:2], 4, tmp_path / "t.npz", raw=True, progress=False)
    with pytest.raises(MiraError, match="recorded on another model"):
        _cli("eval-predictor", "--model", other_store, "--traces", tmp_path / "t.npz")
    _cli("train-predictor", "--model", store, "--traces", tmp_path / "t.npz", "--epochs", 1, "--quiet",
         "--out", tmp_path / "heads")
    predictor_file(other_store).parent.mkdir()
    shutil.copy(tmp_path / "heads" / "heads.safetensors", predictor_file(other_store))
    try:
        with pytest.raises(MiraError, match="trained on another model"):
            load_predictor(other_store, model_routers(other.hf_model), "cpu")
    finally:
        shutil.rmtree(predictor_file(other_store).parent)
    assert load_predictor(other_store, model_routers(other.hf_model), "cpu") is None


def test_feature_recording_switches_cuda_graphs_off_meanwhile_and_back_on(store, monkeypatch):
    """A replayed decode step would skip the routers' hooks the recorder relies on."""
    from mira.runtime.tracing import FeatureRecorder

    model = _load(store)
    switches = []
    monkeypatch.setattr(model, "use_cuda_graphs", switches.append)
    with FeatureRecorder(model):
        assert switches == []  # no graphs on the CPU: nothing to switch
    model.decode_graphs = object()  # as on CUDA
    with FeatureRecorder(model):
        assert switches == [False]
    assert switches == [False, True]


@pytest.mark.parametrize("family", ["longcat_flash", "inkling_text"])
def test_features_of_a_router_gate_speculation_cannot_follow_are_refused_by_name(family, tmp_path):
    from tiny_families import family_checkpoint

    from mira.runtime.tracing import FeatureRecorder

    model = mira.load(family_checkpoint(family, tmp_path / family), device="cpu", progress=False)
    with pytest.raises(MiraError, match=r"--features records gate speculation, which Mira cannot compute for this "
                                        r"model's routers \(\w+\); record the trace without --features"):
        FeatureRecorder(model)
