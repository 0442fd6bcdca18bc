"""Predictor heads (paper IV-E): shapes, learning an i -> i+2 dependency, the heads file, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mira.errors import MiraError
from mira.predict.coverage import coverage
from mira.predict.features import HeadInputs
from mira.predict.heads import HeadConfig, PredictorHeads, load_heads, read_metadata, save_heads
from mira.predict.train import TrainConfig, TrainingData, split_by_sequence, train_heads

E, H, L = 8, 16, 4  # experts, hidden, MoE layers: heads for source layers 0 and 1


def _inputs(steps: int, seed: int = 0) -> HeadInputs:
    generator = torch.Generator().manual_seed(seed)
    mass = torch.softmax(torch.randn(steps, L - 2, E, generator=generator), -1)
    return HeadInputs(hidden=torch.randn(steps, L - 2, H, generator=generator),
                      logits=torch.randn(steps, L - 2, E, generator=generator), selected=mass,
                      top=(mass >= mass.topk(2, -1).values[..., -1:]).float(),
                      history=torch.softmax(torch.randn(steps, L - 2, E, generator=generator), -1),
                      speculation=torch.rand(steps, L - 2, E, generator=generator))


def _layer(inputs: HeadInputs, layer: int) -> HeadInputs:
    return HeadInputs(*(t[:, layer] for t in inputs))


def _two_experts(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Mass 1/2 on each of two distinct experts per row (a decode step routed top-2)."""
    second = torch.where(second == first, (first + 1) % E, second)
    return (torch.nn.functional.one_hot(first, E) + torch.nn.functional.one_hot(second, E)).float() / 2


def _data(inputs: HeadInputs, targets: torch.Tensor, sequences: int) -> TrainingData:
    steps = targets.shape[0]
    return TrainingData(inputs, targets, np.arange(steps) % sequences, np.ones(steps, np.int64),
                        np.ones((L, E), np.int64), top_k=2)


CONFIG = HeadConfig(num_layers=L, num_experts=E, top_k=2, hidden_size=H, width=32, gate_width=8)
FAST = TrainConfig(epochs=30, batch_size=64, learning_rate=1e-2, patience=4)


def test_heads_exist_for_every_layer_but_the_last_two_and_give_logits_per_expert():
    heads = PredictorHeads(CONFIG)
    assert len(heads.heads) == L - 2
    out = heads(1, _layer(_inputs(5), 1))
    assert out.logits.shape == out.act.shape == out.hist.shape == (5, E)
    assert out.alpha.shape == (5, 1) and bool(((out.alpha > 0) & (out.alpha < 1)).all())
    torch.testing.assert_close(out.logits, out.alpha * out.act + (1 - out.alpha) * out.hist)
    with pytest.raises(MiraError, match="at least 3"):
        HeadConfig(num_layers=2, num_experts=E, top_k=2, hidden_size=H)


def _routed_by(hidden: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """Top-2 routing of hidden [S, L-2, H] by a router [L-2, H, E], as mass [S, L-2, E]."""
    top = torch.einsum("slh,lhe->sle", hidden, router).topk(2, -1).indices  # [S, L-2, 2]
    return _two_experts(top[..., 0], top[..., 1])


def test_training_learns_an_i_plus_2_dependency_on_the_hidden_state():
    router = torch.randn(L - 2, H, E, generator=torch.Generator().manual_seed(9))  # layer i+2's, seen from i
    inputs = _inputs(1200)
    torch.manual_seed(0)
    data = _data(inputs, _routed_by(inputs.hidden, router), sequences=40)
    heads, figures = train_heads(data, CONFIG, FAST, progress=False)
    test = _inputs(400, seed=1)
    with torch.no_grad():
        scores = torch.stack([heads(i, _layer(test, i)).logits for i in range(L - 2)], 1)
    covered = coverage(scores.numpy(), _routed_by(test.hidden, router).numpy(), 2)
    assert covered.min() > 0.65, covered  # chance: 2 of 8 experts = 0.25; measured 0.75-0.8
    _, validation = split_by_sequence(data.sequence, FAST.validation_fraction, FAST.seed)
    for i, layer in enumerate(figures["layers"]):  # each head keeps its best epoch, not its last
        with torch.no_grad():
            logits = heads(i, _layer(HeadInputs(*(t[validation] for t in inputs)), i)).logits
        loss = -(data.targets[validation, i] * logits.log_softmax(-1)).sum(-1).mean().item()
        assert loss == pytest.approx(layer["validation_loss"], abs=1e-4)
    assert [layer["layer"] for layer in figures["layers"]] == [0, 1]
    assert all(layer["best_epoch"] <= layer["epochs"] <= FAST.epochs for layer in figures["layers"])
    assert figures["validation_steps"] + figures["train_steps"] == 1200


def test_the_history_branch_alone_learns_a_dependency_on_recent_routing():
    inputs = _inputs(1200)
    history = inputs.history.argmax(-1)  # [S, L-2]
    targets = _two_experts(history, (history + 3) % E)
    heads, _ = train_heads(_data(inputs, targets, sequences=40), CONFIG, FAST, progress=False)
    test = _inputs(300, seed=2)
    history = test.history.argmax(-1)
    with torch.no_grad():
        scores = torch.stack([heads(i, _layer(test, i)).hist for i in range(L - 2)], 1)
    assert coverage(scores.numpy(), _two_experts(history, (history + 3) % E).numpy(), 2).min() > 0.75


def test_validation_holds_out_whole_sequences():
    sequence = np.repeat(np.arange(10), 7)
    train, validation = split_by_sequence(sequence, 0.2, seed=0)
    assert len(train) + len(validation) == 70
    assert set(sequence[train]).isdisjoint(sequence[validation]) and len(set(sequence[validation])) == 2
    with pytest.raises(MiraError, match="one sequence only"):
        split_by_sequence(np.zeros(5, np.int64), 0.2, seed=0)


def test_heads_round_trip_with_their_metadata(tmp_path):
    heads = PredictorHeads(CONFIG).eval()
    path = save_heads(heads, tmp_path / "predictor" / "heads.safetensors", "f" * 64, {"steps": 7})
    assert sorted(p.name for p in path.parent.iterdir()) == ["heads.safetensors"]  # no temporary left
    loaded, metadata = load_heads(path, "f" * 64)
    x = _layer(_inputs(3), 0)
    with torch.no_grad():
        torch.testing.assert_close(loaded(0, x).logits, heads(0, x).logits)
    assert metadata["config"]["num_experts"] == E and metadata["training"] == {"steps": 7}
    assert metadata["parameters"] == heads.parameter_count() and "speculation" in metadata["features"]
    assert read_metadata(path)["fingerprint"] == "f" * 64


def test_heads_of_another_model_or_not_heads_at_all_are_refused(tmp_path):
    path = save_heads(PredictorHeads(CONFIG), tmp_path / "heads.safetensors", "a" * 64, {})
    with pytest.raises(MiraError, match="trained on another model.*mira train-predictor"):
        load_heads(path, "b" * 64)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(MiraError, match="not a predictor heads file"):
        load_heads(junk, "a" * 64)
