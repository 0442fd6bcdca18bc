"""Where `mira bench` gets its models: a local model or store, or a synthetic model at real shapes.

A source opens the expert store of one quantization scheme when asked (`open_store`; the previous
one released first, so two large stores never share host memory) and builds a fresh model for every
configuration (so no configuration inherits another's cache state or hooks); it also builds the
baselines' full model. With a routing trace, every model it builds routes as the trace did
(mira.bench.replay).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from mira.bench import hf
from mira.bench.configs import BASELINES
from mira.cache.policy import Popularity
from mira.bench.replay import RoutingReplay
from mira.bench.synthetic import synthetic_config, synthetic_skeleton, synthetic_store
from mira.errors import MiraError
from mira.store.trace import RoutingTrace
from mira.models.loader import build_model, moe_skeleton_layers, read_config
from mira.runtime.config import RuntimeConfig
from mira.runtime.engine import BUNDLED_MODEL, MiraModel, assemble, resolve_store, store_tokenizer
from mira.store.manifest import Manifest, is_store
from mira.store.store import ExpertStore

SYNTHETIC_SCHEMES = ("int8-shared", "int8-row", "int4")


class Source:
    """One model to benchmark: its store (opened once), per-configuration Mira models, the baselines."""

    label: str
    synthetic: bool  # random weights, hence random routers
    config: object  # transformers config
    store: ExpertStore | None = None  # the open store (`open_store`)
    tokenizer: object
    device: torch.device

    heads: str | None = None  # trained predictor heads for prefetch "auto"/"trained" (else the store's own)
    cpu_threads: int | None = None  # threads of the CPU computing missed experts, where a configuration has it
    trace: RoutingTrace | None = None  # routing to replay instead of the routers' own
    replay_from: int = 0  # the trace row every prompt starts from

    @property
    def routing(self) -> str:
        """How the source's models route: "real", "synthetic" or "replayed from <trace>"."""
        if self.trace is not None:
            return f"replayed from {Path(self.trace.source).name} (real, recorded)"
        return "synthetic" if self.synthetic else "real"

    @property
    def scheme(self) -> str:
        """The quantization scheme of the open store."""
        return self.store.layout.scheme

    def scheme_of(self, scheme: str | None) -> str:
        """The scheme `scheme` names (None: the source's default).

        Raises:
            MiraError: the source cannot have a store of `scheme`.
        """
        raise NotImplementedError

    def open_store(self, scheme: str | None) -> None:
        """Make the store of `scheme` (None: the default) the one models are built on, releasing the
        open one first.

        Raises:
            MiraError: no store of `scheme` can be had (a store of another scheme was given).
        """
        raise NotImplementedError

    def mira(self, config: RuntimeConfig, profile: Popularity | None) -> MiraModel:
        """A Mira model of this source with `config` (its trained heads, if any, added)."""
        raise NotImplementedError

    def _config(self, config: RuntimeConfig) -> RuntimeConfig:
        config = config.with_overrides(heads=self.heads) if self.heads else config
        if self.cpu_threads is not None and config.hybrid.mode != "off":
            config = config.with_overrides(cpu_threads=self.cpu_threads)
        return config

    def _replaying(self, model: MiraModel) -> MiraModel:
        if self.trace is not None:
            RoutingReplay(self.trace, model, self.replay_from)
        return model

    def full_model(self, device: torch.device):
        """The whole model on `device` in `hf.compute_dtype`, for the baselines."""
        raise NotImplementedError

    def release_store(self) -> None:
        self.store = None


class CheckpointSource(Source):
    def __init__(self, path: Path | None, device: torch.device, progress: bool, scheme: str | None = None):
        self.model_dir = path or BUNDLED_MODEL
        self.label = self.model_dir.name
        self.synthetic = False
        self.device = device
        self.progress = progress
        self.store_path = resolve_store(self.model_dir, scheme, progress)  # converted on first use
        self.default_scheme = Manifest.read(self.store_path).scheme  # int8-shared, or a store's own
        self.config = read_config(self.store_path)
        self.tokenizer = store_tokenizer(self.store_path)

    def scheme_of(self, scheme: str | None) -> str:
        return scheme or self.default_scheme

    def open_store(self, scheme: str | None) -> None:
        self.store = None
        self.store_path = resolve_store(self.model_dir, self.scheme_of(scheme), self.progress)
        self.store = ExpertStore.open(self.store_path, pin=self.device.type == "cuda", progress=self.progress)

    def mira(self, config: RuntimeConfig, profile: Popularity | None) -> MiraModel:
        hf_model, sites = build_model(self.store_path, hf.compute_dtype(self.config, self.device), self.device)
        return self._replaying(assemble(hf_model, sites, self.store, self.tokenizer, self._config(config), profile))

    def full_model(self, device):
        if is_store(self.model_dir):
            raise MiraError(f"the baselines need the original checkpoint, not the store {self.model_dir}; pass the "
                            "model directory the store was converted from")
        dtype = hf.compute_dtype(self.config, device)
        return AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype).to(device).eval()


class SyntheticSource(Source):
    def __init__(self, name: str, device: torch.device, progress: bool):
        self.config, self.name = synthetic_config(name)
        self.label = f"{self.name} (synthetic)"
        self.synthetic = True
        self.device = device
        self.progress = progress
        self.tokenizer = None

    def scheme_of(self, scheme: str | None) -> str:
        scheme = scheme or "int8-shared"
        if scheme not in SYNTHETIC_SCHEMES:
            raise MiraError(f"a synthetic model's experts are random quantized weights: pass --quant with "
                            f"{', '.join(SYNTHETIC_SCHEMES)}, not {scheme}")
        return scheme

    def open_store(self, scheme: str | None) -> None:
        scheme = self.scheme_of(scheme)
        self.store = None  # released before the next is filled: two stores need not fit in host memory at once
        self.store = synthetic_store(self.config, len(moe_skeleton_layers(self.config)), scheme,
                                     pin=self.device.type == "cuda", progress=self.progress, name=self.name,
                                     device=self.device)

    def mira(self, config: RuntimeConfig, profile: Popularity | None) -> MiraModel:
        hf_model, sites, _ = synthetic_skeleton(self.config, self.device)
        return self._replaying(assemble(hf_model, sites, self.store, None, self._config(config), profile))

    def full_model(self, device):
        return hf.full_model(self.config, device)


def open_source(model: str | None, synthetic: str | None, device: torch.device, progress: bool,
                routing: str | None = None, schemes: tuple[str | None, ...] = (None,),
                configs: tuple[str, ...] = ()) -> Source:
    """The model to benchmark: `synthetic` (a preset name or a config.json) or `model` (a directory or
    store; None: the bundled model), replaying the routing trace `routing` if given, able to open a
    store of each of `schemes` (None: int8-shared, or a store's own) for `configs`; none is open yet.

    Raises:
        MiraError: an unreadable trace or config, a trace of another shape than the model, a
            scheme the source cannot have (a Mira store has one), or baselines of a store.
    """
    if model is not None and len(schemes) > 1 and is_store(Path(model)):
        raise MiraError(f"{model} is a Mira store, which holds one quantization scheme; pass the model directory "
                        "it was converted from to measure several")
    if routing is not None and not Path(routing).is_file():
        raise MiraError(f"no routing trace at {routing}; record one with `mira trace` or pass the path of an existing "
                        "one")
    trace = RoutingTrace.load(routing) if routing is not None else None
    source = SyntheticSource(synthetic, device, progress) if synthetic is not None else CheckpointSource(
        Path(model) if model else None, device, progress, schemes[0])
    for scheme in schemes:
        source.scheme_of(scheme)  # every scheme refused before any store is made
    if model is not None and is_store(Path(model)) and (baselines := [c for c in configs if c in BASELINES]):
        raise MiraError(f"the baselines ({', '.join(baselines)}) run the original checkpoint, which the store {model} "
                        "does not keep; pass the model directory it was converted from, or leave them out of --configs")
    source.trace = trace
    return source

