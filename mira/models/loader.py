"""Build a transformers model whose routed experts are never read into it (DESIGN.md 2.1).

While `from_pretrained` builds the model, the architecture's Experts class is swapped for a
parameter-free placeholder (one place, restored in `finally`); the checkpoint's expert tensors then
match no parameter and are skipped unread. Everything else (attention, norms, embeddings, router,
shared experts, LM head) loads through transformers' own code, in the requested dtype.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from mira.errors import MiraError
from mira.models.base import Adapter, layer_values
from mira.models.registry import adapter_for

_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")
# Sizes and counts the supported families read from config.json: each must be a whole number.
INTEGER_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts",
                  "num_experts_per_tok", "first_k_dense_replace", "max_position_embeddings", "kv_lora_rank",
                  "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group",
                  "decoder_sparse_step")


def routed_per_token(config) -> int | None:
    """Experts each token is routed to, by the names the families' configs give it (Aria's
    moe_topk, DBRX's ffn_config.moe_top_k, Gemma 4's top_k_experts, in a multimodal config's text
    config); None where the config sets none."""
    for holder in (config, config.get_text_config(), getattr(config, "ffn_config", None)):
        for name in ("num_experts_per_tok", "moe_topk", "moe_top_k", "top_k_experts"):
            value = getattr(holder, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def looped_layers(config) -> tuple[range, int] | None:
    """The decoder layers a looped model runs again within one forward, and how many times it runs
    them (Inkling2-Loop's loop_layer_index_start/end and loop_num_passes); None where each runs once."""
    text = config.get_text_config()
    passes = getattr(text, "loop_num_passes", None)
    if not isinstance(passes, int) or passes < 2:
        return None
    return range(text.loop_layer_index_start, text.loop_layer_index_end), passes


class ExpertsPlaceholder(nn.Module):
    """Stands where the Experts module was while the model is built; replaced before first use.

    Where the family normalises each route's output (ExpertsSpec.route_norm), it holds that norm
    module under the family's name, so that its weights load with the rest of the model.
    """

    # set by experts_swapped for such a family; private names, which no family's attribute can shadow
    _norm_name: str | None = None
    _norm_template: nn.Module | None = None  # the family's norm module on the meta device

    def __init__(self, config: PretrainedConfig, *args, **kwargs):
        super().__init__()
        if self._norm_name is not None:  # on the device being built on (meta while loading a checkpoint)
            norm = copy.deepcopy(self._norm_template).to_empty(device=torch.get_default_device())
            setattr(self, self._norm_name, norm)
        # Nothing else to initialise; transformers' weight init would otherwise take it for the Experts class
        # it stands for (the name it finds in the family's module while the model is built).
        self._is_hf_initialized = True

    @property
    def _norm(self) -> nn.Module | None:
        """The family's per-route norm, loaded; None where it has none."""
        return None if self._norm_name is None else getattr(self, self._norm_name)

    def forward(self, *args, **kwargs):
        raise RuntimeError("the experts of this model are not bound to a Mira expert store")


@dataclass(frozen=True)
class MoESite:
    """Where one Experts module sits: its parent module, attribute name and decoder layer index."""

    parent: nn.Module
    attr: str
    layer: int
    route_norm: nn.Module | None = None  # the family's per-route norm, loaded by the placeholder here

    @property
    def router(self) -> nn.Module | None:
        return router_of(self.parent)


def router_of(parent: nn.Module) -> nn.Module | None:
    """The router beside an Experts module: its sibling `gate` (most families) or `router` (gpt-oss);
    None where the MoE block routes without a module of its own."""
    for name in ("gate", "router"):
        child = getattr(parent, name, None)
        if isinstance(child, nn.Module):
            return child
    return None


def read_config(model_dir: Path) -> PretrainedConfig:
    """The transformers config of a local model directory.

    Raises:
        MiraError: the directory or its config.json is missing or unreadable.
    """
    if not model_dir.is_dir():
        what = "is a file, not a directory" if model_dir.exists() else "does not exist"
        raise MiraError(f"model directory {model_dir} {what}; pass a local Hugging Face model directory")
    if not (model_dir / "config.json").is_file():
        raise MiraError(f"{model_dir} has no config.json; pass a Hugging Face model directory (config.json, "
                        "*.safetensors, tokenizer files) or a Mira store")
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as error:  # transformers raises many kinds for a bad file; each is the file's fault
        raise MiraError(f"cannot read {model_dir / 'config.json'}: {error}; fix the file or pass another "
                        "model") from None
    for name in INTEGER_FIELDS:
        for value in layer_values(config, name):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise MiraError(f"{model_dir / 'config.json'} has {name} {value!r}, not a whole number; "
                                "fix config.json")
    return config


@contextlib.contextmanager
def experts_swapped(adapter: Adapter, placeholder: type[ExpertsPlaceholder] = ExpertsPlaceholder) -> Iterator[None]:
    """While inside, the family's Experts class is `placeholder` (restored on exit, even on error), with
    the family's per-route norm where it has one."""
    spec = adapter.spec
    if spec.route_norm is not None:
        placeholder = type(placeholder.__name__, (placeholder,), {
            "_norm_name": spec.route_norm, "_norm_template": getattr(spec.module, spec.route_norm)})
    module = importlib.import_module(adapter.experts_module)
    original = getattr(module, adapter.experts_class)
    setattr(module, adapter.experts_class, placeholder)
    try:
        yield
    finally:
        setattr(module, adapter.experts_class, original)


def _model_class(config: PretrainedConfig) -> type:
    base = AutoModelForCausalLM._model_mapping[type(config)]
    # Expert tensors in the checkpoint are expected to be left unread: say so, so transformers does
    # not report them as unexpected keys.
    ignore = list(getattr(base, "_keys_to_ignore_on_load_unexpected", None) or []) + [r"\.experts\."]
    # The base's module too: transformers applies its checkpoint key conversions (renamings such as
    # word_embeddings -> embed_tokens) only to classes of its own modules.
    return type(base.__name__, (base,), {"_keys_to_ignore_on_load_unexpected": ignore, "__module__": base.__module__})


def build_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, list[MoESite]]:
    """Load the non-expert part of a checkpoint and find its MoE sites.

    Args:
        model_dir: a Hugging Face directory (config.json and safetensors), e.g. a Mira store.
        dtype: dtype of the non-expert weights.
        device: where the model runs.

    Returns:
        The model in eval mode, and its Experts sites in layer order (each holds an
        ExpertsPlaceholder until bound).
    """
    config = read_config(model_dir)
    adapter = adapter_for(config, str(model_dir))
    with experts_swapped(adapter):
        model = _model_class(config).from_pretrained(model_dir, dtype=dtype)
    model.to(device).eval()
    return model, moe_sites(model)


def skeleton(config: PretrainedConfig) -> nn.Module:
    """The model of `config` on the meta device (no memory), with placeholders for its Experts modules."""
    adapter = adapter_for(config)
    with experts_swapped(adapter), torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def moe_skeleton_layers(config: PretrainedConfig) -> list[int]:
    """Decoder layer indices that hold routed experts, found by building the model on the meta device."""
    return [site.layer for site in moe_sites(skeleton(config))]


def moe_sites(model: nn.Module) -> list[MoESite]:
    sites = []
    for name, module in model.named_modules():
        for attr, child in module.named_children():
            if isinstance(child, ExpertsPlaceholder):
                match = _LAYER_INDEX.search(f".{name}.")
                if match is None:
                    raise MiraError(f"cannot tell the decoder layer of experts module {name}.{attr}")
                sites.append(MoESite(module, attr, int(match.group(1)), child._norm))
    return sorted(sites, key=lambda s: s.layer)
