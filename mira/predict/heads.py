"""Predictor heads (paper IV-E): at MoE layer i, forecast how layer i+2 will route the step's tokens.

One MixtureHead per MoE layer i = 0..L-3 (none for the last two, which have no layer i+2):

    ActHead    hidden and router logits of layer i, and gate speculation for i+2 -> logits [E]
    HistHead   experts selected at layer i (mass and top-K) and recent routing of i+2 -> logits [E]
    MixtureHead  alpha * ActHead + (1 - alpha) * HistHead, alpha = sigmoid(a small gating network
               on the step's E-sized features): a contextual gate weighting the two branches

The heads are saved beside the store as one safetensors file whose header carries the metadata
(model fingerprint, shapes, feature set, training figures), written atomically; `load_predictor`
refuses heads of another model. `TrainedPredictor` runs them at serving time on the device with no
host sync and no allocation: its history, the features and every activation live in buffers made
once (`ServingHead` evaluates a MixtureHead with out= operations).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file
from torch import nn

from mira.errors import MiraError
from mira.predict.baselines import GateSpeculation
from mira.predict.config import HeadConfig
from mira.predict.features import HeadInputs, RoutingHistory, routed_mass
from mira.store.files import temporary_beside
from mira.store.manifest import Manifest

PREDICTOR_DIR = "predictor"
HEADS_FILE = "heads.safetensors"
FORMAT_VERSION = 1
FEATURES = ("hidden", "logits", "speculation", "selected", "top", "history")


class HeadOutput(NamedTuple):
    """Logits [N, E] of the mixture and of each branch, and the gate's alpha [N, 1]."""

    logits: torch.Tensor
    act: torch.Tensor
    hist: torch.Tensor
    alpha: torch.Tensor


class ActHead(nn.Module):
    """Activation branch: mean hidden state [H] (layer-normed), mean router logits [E] and gate
    speculation [E] -> one hidden layer of D units -> logits [E]."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden_size)
        self.net = nn.Sequential(nn.Dropout(config.dropout),
                                 nn.Linear(config.hidden_size + 2 * config.num_experts, config.width), nn.GELU(),
                                 nn.Linear(config.width, config.num_experts))

    def forward(self, x: HeadInputs) -> torch.Tensor:
        return self.net(torch.cat([self.norm(x.hidden), x.logits, x.speculation], -1))  # [N, E]


class HistHead(nn.Module):
    """History branch: selected mass [E], top-K marks [E] and recent routing of i+2 [E] -> D units -> logits [E]."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3 * config.num_experts, config.width), nn.GELU(),
                                 nn.Linear(config.width, config.num_experts))

    def forward(self, x: HeadInputs) -> torch.Tensor:
        return self.net(torch.cat([x.selected, x.top, x.history], -1))  # [N, E]


class MixtureHead(nn.Module):
    """ActHead and HistHead mixed by a contextual gate alpha computed from the E-sized features."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.act = ActHead(config)
        self.hist = HistHead(config)
        self.gate = nn.Sequential(nn.Linear(5 * config.num_experts, config.gate_width), nn.GELU(),
                                  nn.Linear(config.gate_width, 1))

    def forward(self, x: HeadInputs) -> HeadOutput:
        # N (step, layer) pairs, E experts
        act, hist = self.act(x), self.hist(x)  # [N, E] each
        context = torch.cat([x.logits, x.speculation, x.selected, x.top, x.history], -1)  # [N, 5E]
        alpha = torch.sigmoid(self.gate(context))  # [N, 1]
        return HeadOutput(alpha * act + (1 - alpha) * hist, act, hist, alpha)


class PredictorHeads(nn.Module):
    """The MixtureHeads of one model: `heads[i]` forecasts layer i+2 from layer i."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(MixtureHead(config) for _ in range(config.num_layers - 2))

    def forward(self, layer: int, x: HeadInputs) -> HeadOutput:
        return self.heads[layer](x)

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


def save_heads(heads: PredictorHeads, path: str | os.PathLike, fingerprint: str, training: dict) -> Path:
    """Write the heads and their metadata into one safetensors file, atomically.

    Args:
        heads: trained heads.
        path: the file, by default `predictor_file(store)`; its folder is created if missing.
        fingerprint: the store manifest's `source_fingerprint` of the model the heads were trained on.
        training: JSON-ready training figures (traces, steps, losses, epochs, popularity counts...).

    Returns:
        The file written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format_version": FORMAT_VERSION, "fingerprint": fingerprint, "config": asdict(heads.config),
                "features": list(FEATURES), "parameters": heads.parameter_count(), "training": training}
    state = {name: tensor.detach().to("cpu", torch.float32).contiguous() for name, tensor in heads.state_dict().items()}
    handle, temporary = temporary_beside(path)
    os.close(handle)
    try:
        save_file(state, temporary, metadata={"mira": json.dumps(metadata)})
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def read_metadata(path: str | os.PathLike) -> dict:
    """The metadata of a heads file (see `save_heads`).

    Raises:
        MiraError: the file is not a heads file this Mira reads.
    """
    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = json.loads((file.metadata() or {})["mira"])
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as error:
        raise MiraError(f"{path} is not a predictor heads file ({error}); train the heads again with "
                        "`mira train-predictor`") from error
    if metadata.get("format_version") != FORMAT_VERSION:
        raise MiraError(f"predictor heads {path} have format version {metadata.get('format_version')}, this Mira "
                        f"reads {FORMAT_VERSION}; train them again with `mira train-predictor`")
    return metadata


def load_heads(path: str | os.PathLike, fingerprint: str) -> tuple[PredictorHeads, dict]:
    """Read heads saved by `save_heads`, refusing heads of another model.

    Args:
        path: the heads file.
        fingerprint: the `source_fingerprint` of the model they must belong to.

    Returns:
        The heads (CPU, eval mode) and their metadata.

    Raises:
        MiraError: not a heads file, another format version, or trained on another model.
    """
    metadata = read_metadata(path)
    if metadata["fingerprint"] != fingerprint:
        raise MiraError(f"the predictor heads {path} were trained on another model (fingerprint "
                        f"{metadata['fingerprint'][:12]}, this model {fingerprint[:12]}); delete them or train "
                        "new ones with `mira train-predictor --model MODEL --traces T.npz`")
    heads = PredictorHeads(HeadConfig(**metadata["config"]))
    heads.load_state_dict(load_file(str(path)))
    return heads.eval(), metadata


class ServingHead:
    """One MixtureHead evaluated with out= operations into buffers made once: what `MixtureHead.forward`
    computes, for one step, with no allocation (a decode step allocates nothing, DESIGN.md 2.5).

    It reads the step's features from one row laid out so that each branch's input is a slice:
    hidden [H] | logits | speculation | selected | top | history [E each]. ActHead reads the first
    H + 2E (its hidden part is layer-normed in place), HistHead the last 3E, the gate the last 5E.

    Raises:
        TypeError: a branch holds a module other than Linear, GELU or Dropout (identity at serving time).
    """

    def __init__(self, head: MixtureHead, config: HeadConfig, device: torch.device | str):
        H, E = config.hidden_size, config.num_experts
        self.hidden_size, self.num_experts = H, E
        self.norm = head.act.norm
        self.act = self._plan(head.act.net, device)
        self.hist = self._plan(head.hist.net, device)
        self.gate = self._plan(head.gate, device)
        self._mean, self._variance = torch.empty(1, 1, device=device), torch.empty(1, 1, device=device)
        self._square = torch.empty(1, H, device=device)
        self._mixture = torch.empty(1, E, device=device)

    @staticmethod
    def _plan(net: nn.Sequential, device: torch.device | str) -> list[tuple[nn.Module, torch.Tensor | None]]:
        """Each step of `net` with the buffer its output goes to (None: in place on its input)."""
        plan = []
        for module in net:
            if isinstance(module, nn.Linear):
                plan.append((module, torch.empty(1, module.out_features, device=device)))
            elif isinstance(module, nn.GELU):
                plan.append((module, None))
            elif not isinstance(module, nn.Dropout):
                raise TypeError(f"ServingHead evaluates Linear, GELU and Dropout, not {type(module).__name__}; "
                                "teach it the new module")
        return plan

    @staticmethod
    def _run(plan: list[tuple[nn.Module, torch.Tensor | None]], x: torch.Tensor) -> torch.Tensor:
        for module, out in plan:
            if out is None:
                x = F.gelu(x, approximate=module.approximate, out=x)
            else:
                x = torch.addmm(module.bias, x, module.weight.t(), out=out)
        return x

    def _layer_norm_(self, x: torch.Tensor) -> torch.Tensor:
        """nn.LayerNorm of x [1, H], in place."""
        mean = torch.mean(x, -1, keepdim=True, out=self._mean)
        x.sub_(mean)
        variance = torch.mean(torch.mul(x, x, out=self._square), -1, keepdim=True, out=self._variance)
        return x.mul_(variance.add_(self.norm.eps).rsqrt_()).mul_(self.norm.weight).add_(self.norm.bias)

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        """Mixture logits [1, E] from the step's features [1, H + 5E] (whose hidden part it normalizes)."""
        H, E = self.hidden_size, self.num_experts
        self._layer_norm_(features[:, :H])
        act = self._run(self.act, features[:, : H + 2 * E])  # [1, E]
        hist = self._run(self.hist, features[:, H + 2 * E :])  # [1, E]
        alpha = torch.sigmoid_(self._run(self.gate, features[:, H:]))  # [1, 1]
        return torch.sub(act, hist, out=self._mixture).mul_(alpha).add_(hist)  # alpha * act + (1 - alpha) * hist


class TrainedPredictor:
    """Trained MixtureHeads serving one model at run time (the `Predictor` interface of baselines.py).

    Per step the runtime calls `observe` at every MoE layer once its routing is known and `scores`
    at layers 0..L-3; both run on the device, never read it back and allocate nothing: the history
    of each layer lives in `RoutingHistory`'s buffers, the features of the step in one row made
    once, and the heads run as `ServingHead`s. The history carries across sequences, as it did in
    training.

    Args:
        heads: the heads (moved to `device`).
        speculation: gate speculation with the model's routers (a head feature).
        device: where the model runs.
    """

    def __init__(self, heads: PredictorHeads, speculation: GateSpeculation, device: torch.device | str):
        config = heads.config
        if speculation.num_layers != config.num_layers:
            raise MiraError(f"the predictor heads were trained for {config.num_layers} MoE layers, the model has "
                            f"{speculation.num_layers}; train them again with `mira train-predictor`")
        self.heads = heads.to(device).eval()
        self.speculation = speculation
        self.num_layers = config.num_layers
        self.num_experts = config.num_experts
        self.hidden_size = config.hidden_size
        self.top_k = config.top_k
        self.history = RoutingHistory(config.num_layers, config.num_experts, config.history_window, device)
        self._serving = [ServingHead(head, config, device) for head in self.heads.heads]
        H, E, K = config.hidden_size, config.num_experts, config.top_k
        # the step's features: hidden | logits | speculation | selected | top | history
        self._features = torch.zeros(1, H + 5 * E, device=device)  # [1, H + 5E]
        self._mass = torch.zeros(E, device=device)  # observe's routed mass
        self._one = torch.ones(1, device=device)
        self._ramp = torch.arange(E, 0, -1, device=device, dtype=torch.float32) * 1e-6  # features.top_mask's tie-break
        self._ranked = torch.empty(E, device=device)
        self._top_values = torch.empty(K, device=device)
        self._top_index = torch.empty(K, dtype=torch.int64, device=device)
        self._scores = torch.zeros(config.num_layers, E, device=device)  # [L, E]: one row per source layer

    def observe(self, layer: int, top_k_index: torch.Tensor) -> None:
        """Record the routing [T, K] of MoE layer `layer` in this step (for the history feature)."""
        self.history.observe(layer, routed_mass(top_k_index, self._mass, self._one))

    def scores(self, layer: int, hidden: torch.Tensor, router_logits: torch.Tensor,
               top_k_index: torch.Tensor) -> torch.Tensor:
        """The MixtureHead's distribution over layer+2's experts; no host sync, no allocation.

        T tokens, H hidden, E experts, K routed per token.

        Args:
            layer: source MoE layer position, 0..L-3.
            hidden: [T, H] the MoE input of `layer`.
            router_logits: [T, E] its router's logits.
            top_k_index: [T, K] its routed experts.

        Returns:
            float32 [E], summing to 1: a view of this layer's row of a buffer that the next call
            for `layer` overwrites.
        """
        H, E = self.hidden_size, self.num_experts
        features = self._features  # [1, H + 5E]
        mean_hidden, logits, speculation, selected, top, history = (
            features[:, :H], *features[0, H:].view(5, E))  # [1, H], then [E] each
        with torch.no_grad():
            torch.mean(hidden, 0, keepdim=True, dtype=torch.float32, out=mean_hidden)
            torch.mean(router_logits, 0, dtype=torch.float32, out=logits)
            speculation.copy_(self.speculation.scores(layer, hidden))
            routed_mass(top_k_index, selected, self._one)
            torch.topk(torch.add(selected, self._ramp, out=self._ranked), self.top_k,
                       out=(self._top_values, self._top_index))  # the K most routed, ties to the lower id
            top.zero_().scatter_(0, self._top_index, 1.0)
            history.copy_(self.history.recent(layer + 2))
            mixture = self._serving[layer](features)  # [1, E]
            return torch.softmax(mixture[0], -1, out=self._scores[layer])


def predictor_file(store_dir: str | os.PathLike) -> Path:
    """Where the heads of the store `store_dir` live: `<store>/predictor/heads.safetensors`."""
    return Path(store_dir) / PREDICTOR_DIR / HEADS_FILE


def load_predictor(store_dir: str | os.PathLike, routers: Sequence[nn.Module],
                   device: torch.device | str) -> TrainedPredictor | None:
    """The trained predictor saved beside a store, if there is one.

    Args:
        store_dir: the store; its heads are `<store>/predictor/heads.safetensors`.
        routers: the model's router of each MoE layer, in order (`baselines.model_routers`).
        device: where the model runs.

    Returns:
        The predictor on `device`, or None when the store has no heads.

    Raises:
        MiraError: the heads belong to another model, or cannot be read.
    """
    path = predictor_file(store_dir)
    if not path.is_file():
        return None
    heads, _ = load_heads(path, Manifest.read(Path(store_dir)).source_fingerprint)
    return TrainedPredictor(heads, GateSpeculation(routers, heads.config.num_experts), device)
