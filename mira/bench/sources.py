"""Where `mira bench` gets its models: a local model or store, or a synthetic preset.

A source opens its expert store once and builds a fresh model for every configuration (so no
configuration inherits another's cache state or hooks); it also builds the baselines' full model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from mira.bench import hf
from mira.bench.synthetic import preset_config, synthetic_skeleton, synthetic_store
from mira.errors import MiraError
from mira.models.loader import build_model, moe_skeleton_layers, read_config
from mira.runtime.engine import BUNDLED_MODEL, MiraModel, assemble, store_tokenizer, resolve_store
from mira.store.manifest import is_store
from mira.store.store import ExpertStore


class Source:
    """One model to benchmark: its store (opened once), per-configuration Mira models, the baselines."""

    label: str
    routing: str  # "real" or "synthetic"
    config: object  # transformers config
    store: ExpertStore | None
    tokenizer: object

    heads: str | None = None  # trained predictor heads for prefetch "auto"/"trained" (else the store's own)

    def mira(self, budget: int, policy: str, prefetch: str, profile_counts: list[int] | None,
             max_context: int, residency: str = "auto") -> MiraModel:
        raise NotImplementedError

    def full_model(self, device: torch.device):
        """The whole model in bf16 (float32 on the CPU) on `device`, for the baselines."""
        raise NotImplementedError

    def release_store(self) -> None:
        self.store = None


class CheckpointSource(Source):
    def __init__(self, path: Path | None, device: torch.device, progress: bool):
        self.model_dir = path or BUNDLED_MODEL
        self.store_path = resolve_store(self.model_dir, None, progress)
        self.label = self.model_dir.name
        self.routing = "real"
        self.config = read_config(self.store_path)
        self.device = device
        self.store = ExpertStore.open(self.store_path, pin=device.type == "cuda", progress=progress)
        self.tokenizer = store_tokenizer(self.store_path)

    def mira(self, budget, policy, prefetch, profile_counts, max_context, residency="auto") -> MiraModel:
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        hf_model, sites = build_model(self.store_path, dtype, self.device)
        return assemble(hf_model, sites, self.store, self.tokenizer, budget, policy, max_context, profile_counts,
                        prefetch, self.heads, residency)

    def full_model(self, device):
        if is_store(self.model_dir):
            raise MiraError(f"the baselines need the original checkpoint, not the store {self.model_dir}; pass the "
                            "model directory the store was converted from")
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        return AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype).to(device).eval()


class SyntheticSource(Source):
    def __init__(self, name: str, device: torch.device, progress: bool):
        self.name = name
        self.label = f"{name} (synthetic)"
        self.routing = "synthetic"
        self.config = preset_config(name)
        self.device = device
        self.tokenizer = None
        self.store = synthetic_store(self.config, len(moe_skeleton_layers(self.config)), "int8-shared",
                                     pin=device.type == "cuda", progress=progress, name=name)

    def mira(self, budget, policy, prefetch, profile_counts, max_context, residency="auto") -> MiraModel:
        hf_model, sites, _ = synthetic_skeleton(self.config, self.device)
        return assemble(hf_model, sites, self.store, None, budget, policy, max_context, profile_counts, prefetch,
                        self.heads, residency)

    def full_model(self, device):
        return hf.full_model(self.config, device)


def open_source(model: str | None, synthetic: str | None, device: torch.device, progress: bool) -> Source:
    if synthetic is not None:
        return SyntheticSource(synthetic, device, progress)
    return CheckpointSource(Path(model) if model else None, device, progress)

