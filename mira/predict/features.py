"""Predictor features (paper IV-E): what the head at MoE layer i sees, the same offline and at run time.

S steps (forward passes), T tokens of one step, L MoE layers, E experts per layer, K routed per
token, H hidden size, W history window. For one step and source layer i (0 <= i < L-2):

    hidden      [H]  mean over the step's tokens of layer i's MoE input (after the post-attention norm)
    logits      [E]  mean of layer i's router logits
    selected    [E]  routed token mass at layer i: how many of the step's T*K routed slots went to
                     each expert, divided by T*K
    top         [E]  1 on the K experts with the most mass at layer i (ties to the lower id), else 0
    history     [E]  mean of `selected` at the target layer i+2 over the W previous steps; it carries
                     across sequences (a prompt sees the end of the previous sequence); all zeros only
                     before the first step observed
    speculation [E]  gate speculation for layer i+2 (mira.predict.baselines.GateSpeculation)

`mira trace --features` writes what only the model can give (hidden, logits, speculation) with the
routed counts of every step into `T.features.npz` beside the trace `T.npz`:

    step_start   int64   [S+1]       token offsets of the steps in the trace
    hidden       float16 [S, L, H]
    logits       float32 [S, L, E]
    routed       int32   [S, L, E]   routed slots per expert (targets and `selected`; ties the file to its trace)
    speculation  float32 [S, L-2, E]
    top_k, fingerprint               K, and the store's source fingerprint (the model it came from)

`selected`, `top` and `history` are derived from `routed` by the functions below, which the run
time uses too, so a head sees the same features in training and in service.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from mira.errors import MiraError
from mira.store.files import write_npz_atomic
from mira.store.trace import RoutingTrace, _read_npz


def features_path(trace_path: str | os.PathLike) -> Path:
    """Where the features of the trace `T.npz` live: `T.features.npz` beside it."""
    path = Path(trace_path)
    return path.with_name(path.name.removesuffix(".npz") + ".features.npz")


def routed_mass(top_k_index: torch.Tensor, out: torch.Tensor, one: torch.Tensor) -> torch.Tensor:
    """Share of a step's routed slots that went to each expert, written into `out`; no host sync, no
    allocation.

    Args:
        top_k_index: int [T, K] routed expert ids.
        out: float32 [E] on the ids' device.
        one: float32 [1] holding 1.0 on that device.

    Returns:
        `out`, summing to 1.
    """
    routed = top_k_index.reshape(-1)  # [T*K]
    return out.zero_().scatter_add_(0, routed, one.expand(routed.numel())).div_(routed.numel())


def top_mask(mass: torch.Tensor, k: int) -> torch.Tensor:
    """1.0 on the k experts with the most mass (ties to the lower id), else 0.

    Args:
        mass: float [..., E].
        k: experts marked.

    Returns:
        float32 [..., E].
    """
    # a tiny decreasing ramp makes ties go to the lower id on every device and in every sort
    ramp = torch.arange(mass.shape[-1], 0, -1, device=mass.device, dtype=torch.float32) * 1e-6  # [E]
    best = torch.topk(mass.float() + ramp, k, dim=-1).indices  # [..., k]
    return torch.zeros(mass.shape, device=mass.device).scatter_(-1, best, 1.0)


class RoutingHistory:
    """Routed mass of the last W steps at every MoE layer, kept on the device in preallocated buffers.

    `observe` writes a layer's mass into a ring of W steps; `recent` averages the steps held. The
    step count per layer is a host integer, so neither call reads the device.
    """

    def __init__(self, num_layers: int, num_experts: int, window: int, device: torch.device | str):
        if window < 1:
            raise ValueError(f"the history window must be at least 1 step, got {window}")
        self.window = window
        self._ring = torch.zeros(num_layers, window, num_experts, device=device)  # [L, W, E]
        self._recent = torch.zeros(num_layers, num_experts, device=device)  # [L, E]
        self._seen = [0] * num_layers

    def observe(self, layer: int, mass: torch.Tensor) -> None:
        """Record the routed mass [E] of `layer` for the current step."""
        self._ring[layer, self._seen[layer] % self.window].copy_(mass)
        self._seen[layer] += 1

    def recent(self, layer: int) -> torch.Tensor:
        """The mean routed mass [E] of `layer` over the last min(W, steps observed) steps; zeros before any.

        The returned tensor is a view of a buffer that the next call for this layer overwrites.
        """
        held = min(self._seen[layer], self.window)
        return torch.sum(self._ring[layer], 0, out=self._recent[layer]).div_(max(held, 1))


def history(mass: np.ndarray, window: int) -> np.ndarray:
    """What `RoutingHistory.recent` returns before each step, for a whole run of steps at once.

    Args:
        mass: float [S, L, E] routed mass per step and layer, in the order the steps ran.
        window: W.

    Returns:
        float32 [S, L, E]: row s is the mean of rows max(0, s-W)..s-1 (zeros for s = 0).
    """
    steps = mass.shape[0]
    cumulative = np.concatenate([np.zeros_like(mass[:1], dtype=np.float64), np.cumsum(mass, 0, dtype=np.float64)])
    ends = np.arange(steps)
    starts = np.maximum(ends - window, 0)
    held = np.maximum(ends - starts, 1)[:, None, None]
    return ((cumulative[ends] - cumulative[starts]) / held).astype(np.float32)


class HeadInputs(NamedTuple):
    """The features of N (step, source layer) pairs; see the module docstring. All float32."""

    hidden: torch.Tensor  # [N, H]
    logits: torch.Tensor  # [N, E]
    selected: torch.Tensor  # [N, E]
    top: torch.Tensor  # [N, E]
    history: torch.Tensor  # [N, E]
    speculation: torch.Tensor  # [N, E]


@dataclass(frozen=True, eq=False)
class FeatureSet:
    """The features of one trace, as written by `mira trace --features` (module docstring)."""

    step_start: np.ndarray  # int64 [S+1]
    hidden: np.ndarray  # float16 [S, L, H]
    logits: np.ndarray  # float32 [S, L, E]
    routed: np.ndarray  # int32 [S, L, E]
    speculation: np.ndarray  # float32 [S, L-2, E]
    top_k: int
    fingerprint: str
    source: str = "<memory>"

    @property
    def num_steps(self) -> int:
        return self.hidden.shape[0]

    @property
    def num_layers(self) -> int:
        return self.hidden.shape[1]

    @property
    def num_experts(self) -> int:
        return self.logits.shape[2]

    @property
    def tokens(self) -> np.ndarray:
        """int64 [S]: tokens of each step."""
        return np.diff(self.step_start)

    @property
    def mass(self) -> np.ndarray:
        """float32 [S, L, E]: routed mass of each step and layer (rows sum to 1)."""
        return (self.routed / (self.tokens * self.top_k)[:, None, None]).astype(np.float32)

    def inputs(self, window: int) -> HeadInputs:
        """The head inputs of every step and source layer, as the run time computes them.

        Args:
            window: W of the history feature.

        Returns:
            HeadInputs whose tensors are [S, L-2, *]: source layers 0..L-3.
        """
        sources = self.num_layers - 2
        mass = torch.from_numpy(self.mass)  # [S, L, E]
        return HeadInputs(
            hidden=torch.from_numpy(self.hidden[:, :sources].astype(np.float32)),
            logits=torch.from_numpy(self.logits[:, :sources]),
            selected=mass[:, :sources],
            top=top_mask(mass[:, :sources], self.top_k),
            history=torch.from_numpy(history(self.mass, window)[:, 2:]),
            speculation=torch.from_numpy(self.speculation),
        )

    def targets(self) -> np.ndarray:
        """float32 [S, L-2, E]: the routed mass at layer i+2 for each source layer i."""
        return self.mass[:, 2:]

    def check(self, trace: RoutingTrace) -> None:
        """Make sure these features were recorded with `trace` (same steps, same routing).

        Raises:
            MiraError: the step boundaries or the routed counts differ from the trace's.
        """
        fix = "record the trace and its features together with `mira trace --features`"
        if self.step_start[-1] != trace.num_tokens or trace.num_layers != self.num_layers:
            raise MiraError(f"features {self.source} cover {self.step_start[-1]} tokens x {self.num_layers} MoE "
                            f"layers, the trace {trace.source} {trace.num_tokens} x {trace.num_layers}; {fix}")
        if trace.num_experts != self.num_experts or trace.top_k != self.top_k:
            raise MiraError(f"features {self.source} are for top-{self.top_k} of {self.num_experts} experts, the "
                            f"trace {trace.source} for top-{trace.top_k} of {trace.num_experts}; {fix}")
        if not np.array_equal(step_counts(trace, self.step_start), self.routed):
            raise MiraError(f"features {self.source} do not match the routing of the trace {trace.source}; {fix}")

    def save(self, path: str | os.PathLike) -> None:
        """Write the features to `path` atomically (a temporary file in the same folder, then renamed)."""
        path = Path(path)
        arrays = dict(step_start=self.step_start, hidden=self.hidden, logits=self.logits, routed=self.routed,
                      speculation=self.speculation, top_k=np.int64(self.top_k), fingerprint=np.str_(self.fingerprint))
        write_npz_atomic(path, arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> FeatureSet:
        """Read features written by `save`.

        Raises:
            MiraError: the file is missing (naming the command that writes it), unreadable, or lacks an array.
        """
        path = Path(path)
        if not path.is_file():
            raise MiraError(f"no predictor features at {path}; record them with `mira trace --features --out "
                            f"{path.name.removesuffix('.features.npz')}.npz`")
        arrays = _read_npz(str(path))
        names = ("step_start", "hidden", "logits", "routed", "speculation", "top_k", "fingerprint")
        missing = [name for name in names if name not in arrays]
        if missing:
            raise MiraError(f"features {path} lack {', '.join(missing)}; record them again with `mira trace --features`")
        return cls(arrays["step_start"], arrays["hidden"], arrays["logits"], arrays["routed"], arrays["speculation"],
                   int(arrays["top_k"]), str(arrays["fingerprint"]), source=str(path))


def load_features(trace_path: str | os.PathLike, fingerprint: str) -> tuple[RoutingTrace, FeatureSet]:
    """A trace and the features beside it, checked against each other and against the model.

    Args:
        trace_path: a trace `T.npz` recorded with `mira trace --features` (its features in `T.features.npz`).
        fingerprint: the `source_fingerprint` of the model in use.

    Raises:
        MiraError: the trace or its features are missing or unreadable, do not match each other, or
            were recorded on another model.
    """
    trace = RoutingTrace.load(trace_path)
    features = FeatureSet.load(features_path(trace_path))
    features.check(trace)
    if features.fingerprint != fingerprint:
        raise MiraError(f"the features {features.source} were recorded on another model (fingerprint "
                        f"{features.fingerprint[:12]}, this model {fingerprint[:12]}); record them with "
                        "`mira trace --features` on this model")
    return trace, features


def step_counts(trace: RoutingTrace, step_start: np.ndarray) -> np.ndarray:
    """Routed slots per expert of each step and layer, from a trace and its step boundaries.

    Args:
        trace: T tokens, L layers, top-K of E.
        step_start: int64 [S+1] token offsets of the steps.

    Returns:
        int32 [S, L, E].
    """
    steps = len(step_start) - 1
    step_of_token = np.repeat(np.arange(steps), np.diff(step_start))  # [T]
    layers, experts = trace.num_layers, trace.num_experts
    flat = (step_of_token[:, None, None] * layers + np.arange(layers)[None, :, None]) * experts + trace.topk_ids
    return np.bincount(flat.ravel(), minlength=steps * layers * experts).reshape(steps, layers, experts).astype(np.int32)
