"""The key and value entries one token adds to the KV cache, as transformers' own code caches them.

The model is built on the meta device (no memory) with stand-ins for its Experts modules and run for
a few tokens with transformers' dynamic cache; the cache's growth per token is what a token costs,
whatever the family's attention: grouped-query, latent (MLA), sliding, hybrid, sizes per layer.
Where that forward cannot run on the meta device, the config rule of mira.models.base stands in.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from mira.models.loader import ExpertsPlaceholder, experts_swapped
from mira.models.registry import adapter_for

PROBE_TOKENS = (4, 8)  # prompt lengths whose caches are compared: below any sliding window


class _ZeroExperts(ExpertsPlaceholder):
    """Stands for the Experts modules in the probe: their output's shape is all the cache needs."""

    def forward(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return torch.zeros_like(hidden)


def kv_values_per_token(config: PretrainedConfig) -> int:
    """K and V values one token adds to the cache of the model of `config` (a multimodal one's text
    model); measured once per config in a process (a bench plans many budgets of one model)."""
    text = config.get_text_config()
    key = text.to_json_string(use_diff=False)
    if key not in _MEASURED:
        try:
            _MEASURED[key] = _measured(text)
        except Exception:  # a family whose forward the meta device cannot trace (data-dependent code)
            _MEASURED[key] = adapter_for(text).kv_values_per_token(text)
    return _MEASURED[key]


_MEASURED: dict[str, int] = {}  # config JSON -> values per token


def _measured(config: PretrainedConfig) -> int:
    with experts_swapped(adapter_for(config), _ZeroExperts), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config).eval()
    cached = []
    with torch.no_grad(), _nonzero_on_meta():
        for tokens in PROBE_TOKENS:
            ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
            output = model(ids, use_cache=True)
            cached.append(_cache_values(output["cache"] if "cache" in output else output["past_key_values"]))
    grown, tokens = cached[1] - cached[0], PROBE_TOKENS[1] - PROBE_TOKENS[0]
    if grown <= 0 or grown % tokens:
        raise ValueError(f"the cache grew by {grown} values over {tokens} tokens")
    return grown // tokens


def _nonzero_on_meta():
    """Let `nonzero` run on the meta device as though every element were nonzero (Qwen4-Exp's sparse
    attention picks its blocks with it): the cache's sizes do not depend on which are picked."""
    try:
        import torch.fx.experimental._config as fx_config
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(fx_config, "meta_nonzero_assume_all_nonzero"):  # a torch without the switch: where the
        return contextlib.nullcontext()  # probe needs it, the config rule stands in
    return fx_config.patch(meta_nonzero_assume_all_nonzero=True)


def _cache_values(cache) -> int:
    """Entries of the tensors a transformers cache holds per layer: keys and values ([batch, heads,
    tokens, dim], or a latent's), a sparse attention's indexer keys, and recurrent states, which keep
    their size and so drop out of the growth."""
    return sum(tensor.numel() for layer in getattr(cache, "layers", ()) for tensor in vars(layer).values()
               if isinstance(tensor, torch.Tensor) and tensor.dim() >= 3)
