"""One expert at a time out of a checkpoint, in the store's canonical layout (DESIGN.md 2.3).

The recipes of mira.models.expert_keys say which checkpoint tensors make expert e's slice of each
fused parameter; this reads them (dequantizing FP8 and MXFP4 with mira.store.dequant), replays
transformers' conversion on them, and turns the family's layout into Mira's: w13 [2I, H] with the
gate rows first (up rows only [I, H] when ungated), w2 [H, I], biases b13 [2I] and b2 [H].

E experts, H hidden, I expert intermediate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from transformers import PretrainedConfig

from mira.errors import MiraError
from mira.models.base import Adapter
from mira.models.expert_keys import FP8_SCALE_SUFFIX, MXFP4_SUFFIXES, ExpertKeys, Recipe
from mira.store.dequant import dequantize_fp8, dequantize_mxfp4, fp8_block_size


class Tensors(Protocol):
    """Named tensors of a checkpoint, read lazily (convert's _Checkpoint)."""

    where: dict

    def get(self, key: str) -> torch.Tensor: ...

    def get_row(self, key: str, row: int) -> torch.Tensor: ...

    def shape(self, key: str) -> list[int]: ...


class ExpertReader:
    """Reads expert e of each MoE layer of a checkpoint in the canonical layout.

    Args:
        ckpt: the checkpoint's tensors.
        adapter: the model's architecture (mira.models.registry.adapter_for).
        config: its config (FP8 block size).
        model_dir: the checkpoint directory, for messages.
    """

    def __init__(self, ckpt: Tensors, adapter: Adapter, config: PretrainedConfig, model_dir: Path):
        self.ckpt = ckpt
        self.spec = adapter.spec
        self.model_dir = model_dir
        self.recipes = ExpertKeys(adapter.anatomy, ckpt.where, str(model_dir))
        self.sites = dict(sorted(adapter.anatomy.sites.items(), key=lambda item: item[1]))  # name -> layer
        self.block = fp8_block_size(config)

    @property
    def layers(self) -> list[int]:
        return list(self.sites.values())

    @property
    def expert_keys(self) -> set[str]:
        """Every checkpoint key holding expert weights or their scales (left out of the non-expert copy)."""
        return self.recipes.expert_keys

    @property
    def dequantizes(self) -> bool:
        """Whether the experts are stored quantized (FP8 or MXFP4) in the checkpoint."""
        return any(self._recipe(site, name, 0).fmt != "plain" for site in self.sites for name in self.spec.param_names)

    def site(self, layer: int) -> str:
        return next(name for name, at in self.sites.items() if at == layer)

    def read(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """Expert `expert` of decoder layer `layer`: w13, w2 (and b13, b2 with biases), canonical layout."""
        spec, site = self.spec, self.site(layer)
        up = self._param(site, spec.up_name, expert)  # [2I, H] or [H, 2I] transposed; gate/up alternate unless concatenated
        down = self._param(site, "down_proj", expert)  # [H, I] or [I, H] transposed
        if spec.transposed:
            up, down = up.T, down.T
        tensors = {"w13": self._gate_rows_first(up), "w2": down}
        if spec.bias:
            tensors["b13"] = self._gate_rows_first(self._param(site, f"{spec.up_name}_bias", expert))
            tensors["b2"] = self._param(site, "down_proj_bias", expert)
        return tensors

    def check(self) -> None:
        """Every expert of every layer is in the checkpoint, shaped as expert 0 of its layer, and expert
        0 reads with the shapes the config gives (reading one expert a layer).

        Raises:
            MiraError: what is missing or mismatched, and the fix.
        """
        missing = self.recipes.missing()
        if missing:
            raise MiraError(f"the weights of {self.model_dir} have nothing for {missing[0]}, though config.json has "
                            "experts there; is the checkpoint complete, and its config.json the one it was saved with?")
        for site in self.sites:
            for name in self.spec.param_names:
                first = self._recipe(site, name, 0)
                shapes = [self._stored_shape(key, first) for key in first.keys]
                for expert in range(1, self.spec.num_experts):
                    recipe = self._recipe(site, name, expert)
                    for key, expected in zip(recipe.keys, shapes):
                        if self._stored_shape(key, recipe) != expected:
                            raise self._mismatch(key, self._stored_shape(key, recipe), expected)
                found = list(self._read(first).shape)
                if found != list(first.shape):
                    raise self._mismatch(first.keys[0], found, list(first.shape))

    def _mismatch(self, key: str, found: list[int], expected: list[int]) -> MiraError:
        spec = self.spec
        return MiraError(f"{self.model_dir / 'config.json'} does not match its weights: {key} is {found}, the config "
                         f"says {expected} (hidden size {spec.hidden}, expert intermediate size {spec.intermediate}, "
                         f"{spec.num_experts} experts); fix config.json or the weights")

    def _stored_shape(self, key: str, recipe: Recipe) -> list[int]:
        name = key + MXFP4_SUFFIXES[0] if recipe.fmt == "mxfp4" else key
        shape = self.ckpt.shape(name)
        return shape[1:] if recipe.row is not None else shape

    def _recipe(self, site: str, name: str, expert: int) -> Recipe:
        return self.recipes.recipe(site, name, expert)

    def _param(self, site: str, name: str, expert: int) -> torch.Tensor:
        recipe = self._recipe(site, name, expert)
        tensor = self._read(recipe)
        if tuple(tensor.shape) != recipe.shape:
            raise self._mismatch(recipe.keys[0], list(tensor.shape), list(recipe.shape))
        return tensor

    def _read(self, recipe: Recipe) -> torch.Tensor:
        """The expert's slice of one parameter, in the family's layout (dequantized to float32 if quantized)."""
        return recipe.apply([self._load(key, recipe) for key in recipe.keys])

    def _load(self, key: str, recipe: Recipe) -> torch.Tensor:
        def get(name: str) -> torch.Tensor:
            return self.ckpt.get(name) if recipe.row is None else self.ckpt.get_row(name, recipe.row)

        if recipe.fmt == "fp8":
            return dequantize_fp8(get(key), get(key + FP8_SCALE_SUFFIX), self.block)
        if recipe.fmt == "mxfp4":
            weight = dequantize_mxfp4(get(key + MXFP4_SUFFIXES[0]), get(key + MXFP4_SUFFIXES[1]))  # [out, in]
            return weight.T if self.spec.transposed else weight
        return get(key)

    def _gate_rows_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """[2I, ...] with the gate rows then the up rows, from the family's order (alternating unless
        concatenated)."""
        if self.spec.concatenated or not self.spec.gated:
            return tensor
        return torch.cat([tensor[0::2], tensor[1::2]])
