"""Settings of the i -> i+2 predictor heads and of their training: data only, so that
`mira train-predictor --help` gives the defaults without loading torch."""

from __future__ import annotations

from dataclasses import dataclass

from mira.errors import MiraError

# Steps of target-layer routing the history feature averages. On the validation split of
# benchmarks/predictor.py's training traces, W made no difference to the MixtureHead (decode
# Coverage@2 0.883, 0.882, 0.884 for W = 1, 4, 16) and HistHead alone was best at W = 1 (0.620,
# 0.607, 0.595): the last step says the most about the next.
HISTORY_WINDOW = 1


@dataclass(frozen=True)
class HeadConfig:
    """Shapes and sizes of one model's heads.

    num_layers: L MoE layers (heads for 0..L-3); num_experts: E; top_k: K; hidden_size: H;
    width: D units of each branch's hidden layer; gate_width: units of the gating network;
    dropout: dropped share of the ActHead's input while training; history_window: W steps of the
    history feature. The defaults were chosen on the validation split of benchmarks/predictor.py's
    training traces.
    """

    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    width: int = 256
    gate_width: int = 16
    dropout: float = 0.1
    history_window: int = HISTORY_WINDOW

    def __post_init__(self) -> None:
        if self.num_layers < 3:
            raise MiraError(f"the model has {self.num_layers} MoE layers; i -> i+2 predictor heads need at least 3")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings. The defaults were chosen on the validation split of the bundled model's
    training traces (benchmarks/predictor.py records them and measures the result)."""

    epochs: int = 60  # most epochs per head
    batch_size: int = 256  # steps per update
    learning_rate: float = 1e-3
    weight_decay: float = 1e-4
    patience: int = 5  # epochs without a better validation loss before a head stops
    validation_fraction: float = 0.1  # share of sequences held out
    branch_loss: float = 0.5  # weight of each branch's own cross-entropy
    seed: int = 0
