"""Offline training of the predictor heads (paper IV-E): traces in, heads beside the store out.

S steps, L MoE layers, E experts. The data are traces recorded with `mira trace --features`:
for every step and source layer i, the features of `mira.predict.features` and, as the target, the
routed mass at layer i+2 (the empirical distribution of the step's routed tokens over its
experts). Each MixtureHead is trained with the cross-entropy of that distribution under its
prediction; each branch's own cross-entropy is added (weighted by `branch_loss`), so that ActHead
and HistHead are predictors on their own and the gate mixes two competent opinions. A step weighs
as much as its tokens, as in Coverage@k's average: a prompt of 200 tokens counts 200 times a
generated token (on the bundled model's held-out traces, prompt-step Coverage@2 went from 0.375
to 0.418 with this weighting and decode steps stayed at 0.885). Whole sequences are held out for validation; each head stops
when its validation loss has not improved for `patience` epochs and keeps its best epoch.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch.nn import functional as F
from tqdm import tqdm

from mira.errors import MiraError
from mira.predict.config import TrainConfig
from mira.predict.coverage import coverage
from mira.predict.features import HeadInputs, load_features
from mira.predict.heads import HeadConfig, MixtureHead, PredictorHeads


@dataclass(frozen=True)
class TrainingData:
    """Every step of some traces, for all source layers at once.

    inputs: HeadInputs of [S, L-2, *] tensors; targets: float32 [S, L-2, E] routed mass at i+2;
    sequence: int64 [S] sequence of each step (unique over all traces); tokens: int64 [S].
    """

    inputs: HeadInputs
    targets: torch.Tensor
    sequence: np.ndarray
    tokens: np.ndarray
    routed: np.ndarray  # int64 [L, E] routed slots per expert over all steps (a popularity profile)
    top_k: int


def load_training_data(traces: list[str | os.PathLike], fingerprint: str, window: int) -> TrainingData:
    """Read traces and their features (`T.features.npz` beside each `T.npz`).

    Args:
        traces: trace files recorded with `mira trace --features`.
        fingerprint: the model's `source_fingerprint`; features of another model are refused.
        window: W of the history feature (the history restarts at each trace, as after loading).

    Raises:
        MiraError: a missing or mismatched features file, or features of another model.
    """
    if not traces:
        raise MiraError("no traces given; record some with `mira trace --features`")
    inputs, targets, sequences, tokens = [], [], [], []
    routed, offset = 0, 0
    for path in traces:
        trace, features = load_features(path, fingerprint)
        seq_id = trace.seq_id if trace.seq_id is not None else np.zeros(trace.num_tokens, np.int32)
        sequence = seq_id[features.step_start[:-1]].astype(np.int64) + offset  # [S]: unique over the traces
        offset = int(sequence.max()) + 1
        inputs.append(features.inputs(window))
        targets.append(torch.from_numpy(features.targets()))
        sequences.append(sequence)
        tokens.append(features.tokens)
        routed = routed + features.routed.sum(0, dtype=np.int64)
    return TrainingData(HeadInputs(*(torch.cat(parts) for parts in zip(*inputs))), torch.cat(targets),
                        np.concatenate(sequences), np.concatenate(tokens), routed, features.top_k)

def split_by_sequence(sequence: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Step indices of training and validation, whole sequences on each side.

    Args:
        sequence: int [S] the sequence of each step.
        fraction: share of sequences held out for validation (at least one).
        seed: the draw.

    Returns:
        (train, validation) int64 step indices.

    Raises:
        MiraError: fewer than two sequences.
    """
    sequences = np.unique(sequence)
    if len(sequences) < 2:
        raise MiraError("the traces hold one sequence only; record traces of several prompts to have a "
                        "validation split")
    held = np.random.default_rng(seed).permutation(sequences)[:max(1, round(fraction * len(sequences)))]
    validation = np.isin(sequence, held)
    return np.flatnonzero(~validation), np.flatnonzero(validation)


def _layer(inputs: HeadInputs, layer: int, rows: np.ndarray | slice) -> HeadInputs:
    return HeadInputs(*(tensor[rows, layer] for tensor in inputs))


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Mean over rows, weighted by `weight` [N], of the cross-entropy of target [N, E] under logits [N, E]."""
    return (-(target * F.log_softmax(logits, -1)).sum(-1) * weight).sum() / weight.sum()


def _train_head(head: MixtureHead, data: TrainingData, layer: int, train: np.ndarray, validation: np.ndarray,
                config: TrainConfig, bar: tqdm) -> dict:
    """Fit one head, keep its best epoch; the figures of the run."""
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    generator = torch.Generator().manual_seed(config.seed + layer)
    weight = torch.from_numpy(data.tokens).float()  # [S]
    val_inputs, val_targets = _layer(data.inputs, layer, validation), data.targets[validation, layer]
    best_loss, best_state, best_epoch, epoch = float("inf"), None, 0, 0
    for epoch in range(1, config.epochs + 1):
        head.train()
        order = torch.from_numpy(train)[torch.randperm(len(train), generator=generator)]
        for start in range(0, len(order), config.batch_size):
            rows = order[start:start + config.batch_size]
            out = head(_layer(data.inputs, layer, rows))
            target, rows_weight = data.targets[rows, layer], weight[rows]
            loss = _cross_entropy(out.logits, target, rows_weight) + config.branch_loss * (
                _cross_entropy(out.act, target, rows_weight) + _cross_entropy(out.hist, target, rows_weight))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        head.eval()
        with torch.no_grad():
            val_loss = _cross_entropy(head(val_inputs).logits, val_targets, weight[validation]).item()
        bar.update(1)
        bar.set_postfix(layer=layer, val_loss=f"{val_loss:.4f}")
        if val_loss < best_loss:
            best_loss, best_epoch = val_loss, epoch
            best_state = {name: tensor.clone() for name, tensor in head.state_dict().items()}
        elif epoch - best_epoch >= config.patience:
            break
    bar.update(config.epochs - epoch)
    head.load_state_dict(best_state)
    decode = data.tokens[validation] == 1
    with torch.no_grad():
        predicted = head(val_inputs).logits.numpy()[decode, None]  # [V, 1, E]
    covered = coverage(predicted, val_targets.numpy()[decode, None], 2)[0] if decode.any() else None
    return {"layer": layer, "epochs": epoch, "best_epoch": best_epoch, "validation_loss": round(best_loss, 5),
            "validation_decode_coverage@2": None if covered is None else round(float(covered), 4)}


def train_heads(data: TrainingData, head_config: HeadConfig, config: TrainConfig = TrainConfig(),
                progress: bool = True) -> tuple[PredictorHeads, dict]:
    """Train one MixtureHead per source layer.

    Args:
        data: `load_training_data`'s steps.
        head_config: the heads' shapes (must match the data's).
        config: optimisation settings.
        progress: show a progress bar (one tick per head and epoch).

    Returns:
        The heads (eval mode) and JSON-ready figures: the setup, per head its epochs, best epoch,
        validation loss and Coverage@2 on the validation decode steps, and the popularity profile
        of the data.

    Raises:
        MiraError: the data do not fit the head shapes, or too few sequences to split.
    """
    steps, sources, experts = data.targets.shape
    if (sources + 2, experts, data.inputs.hidden.shape[-1]) != (head_config.num_layers, head_config.num_experts,
                                                                 head_config.hidden_size):
        raise MiraError(f"the traces have {sources + 2} MoE layers x {experts} experts, hidden size "
                        f"{data.inputs.hidden.shape[-1]}; the model {head_config.num_layers} x "
                        f"{head_config.num_experts}, {head_config.hidden_size}: record the traces on this model")
    torch.manual_seed(config.seed)
    train, validation = split_by_sequence(data.sequence, config.validation_fraction, config.seed)
    heads = PredictorHeads(head_config)
    with tqdm(total=sources * config.epochs, desc="training predictor heads", unit="epoch",
              disable=not progress) as bar:
        layers = [_train_head(head, data, layer, train, validation, config, bar)
                  for layer, head in enumerate(heads.heads)]
    figures = {"config": asdict(config), "steps": steps, "train_steps": len(train),
               "validation_steps": len(validation), "sequences": len(np.unique(data.sequence)),
               "tokens": int(data.tokens.sum()), "layers": layers, "popularity": data.routed.tolist()}
    return heads.eval(), figures

