"""Decode steps replayed from CUDA graphs (DESIGN.md 2.8).

A decode step is some hundreds of small kernel launches from Python: transformers' attention,
norms and routers, and Mira's expert kernels. On a host that launches slowly the GPU mostly waits
(`benchmarks/profile_decode.py` shows how long). When no MoE layer needs the host during a decode step (`MiraExperts.host_free`),
the step is captured once as a CUDA graph and then replayed: one launch per token.

A graph replays fixed kernels on fixed addresses, so a step is captured per signature: the
names, shapes and dtypes of its tensor arguments, the values of the others, and the KV cache
object, which must be transformers' `StaticCache` (fixed buffers, positions kept on the device).
`MiraModel.generate` supplies one for batch-1 decoding. A signature is captured the second time
it is seen; the first time runs eagerly as a warm-up (lazy buffers, cuBLAS and Triton set-up). Any
other call (prefill, a dynamic cache, a layer that syncs, the CPU) runs eagerly, unchanged.

A replay runs no Python, so module hooks inside the step do not fire. The experts modules'
forward pre-hooks are called after each replay with that step's arguments (the graph's own
buffers, holding this step's values): that is what recording routing needs. Other hooks inside
the model see captured steps only once, at capture: a caller that needs them on every step
switches graphs off meanwhile (`MiraModel.use_cuda_graphs(False)`, as the feature recorder of
mira.predict.features does). transformers' own output-capturing hooks (hidden states,
attentions, router logits on request) are part of the capture: their outputs are graph buffers,
handed out as copies like the logits.
"""

from __future__ import annotations

import inspect
import traceback
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from transformers import PretrainedConfig, StaticCache
from transformers.cache_utils import (STATIC_LAYER_TYPE_MAPPING, StaticLayer, StaticSlidingWindowLayer,
                                      get_layer_types_and_kwargs)

from mira.runtime.experts import MiraExperts


def replayable_cache(cache: Any) -> bool:
    """A cache whose every layer keeps fixed buffers and its position on the device: a plain
    `StaticCache`, already filled by a prefill (its buffers exist)."""
    return (isinstance(cache, StaticCache) and len(cache.layers) > 0
            and all(type(layer) is StaticLayer and layer.is_initialized for layer in cache.layers))


def takes_static_cache(model: Any) -> bool:
    """Whether transformers can give `model` a `StaticCache`: its generate makes it a `Cache` (it keeps
    none of its own, as MiniMax does) and each of its layer kinds has a static layer. A model that
    cannot decodes eagerly."""
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if supports is not None and not supports():
        return False
    layer_types = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))[0]
    return all(kind in STATIC_LAYER_TYPE_MAPPING for kind in layer_types)


def static_cache(config: PretrainedConfig, max_cache_len: int) -> StaticCache:
    """transformers' `StaticCache` for `config`, with a full-length `StaticLayer` in place of each
    sliding-window layer: that layer counts its tokens in a Python integer, which a replay would
    not advance. The attention mask, built from the config's window, still keeps each sliding layer
    to its window (the mask is all that limits it when no cache layer slides)."""
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    cache.layers = [StaticLayer(max_cache_len=max_cache_len) if type(layer) is StaticSlidingWindowLayer else layer
                    for layer in cache.layers]
    return cache


CACHE_ARGUMENTS = ("past_key_values", "cache")  # the KV cache's keyword (transformers renamed it)


def _copied(value: Any) -> Any:
    """Tensors (also inside tuples, lists and dicts, such as hidden states per layer or attention
    masks per layer type) cloned; anything else, such as the KV cache, as it is."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copied(item) for item in value)
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    return value


def _copy_into(buffer: Any, value: Any) -> None:
    """The tensors of `value` copied into the same places of `buffer` (a `_copied` of its like)."""
    if isinstance(value, torch.Tensor):
        buffer.copy_(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            _copy_into(buffer[key], item)


def _argument_key(value: Any) -> Hashable:
    """What a captured step depends on in one argument: a tensor's shape, dtype and device (its
    values are copied in at replay), a dict of tensors' keys and theirs, a plain value itself.

    Raises:
        TypeError: anything else, which a replay could not reproduce.
    """
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype, value.device
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict) and all(isinstance(item, torch.Tensor) or item is None for item in value.values()):
        return tuple((key, _argument_key(item)) for key, item in sorted(value.items()))
    raise TypeError(type(value).__name__)


class _Graph:
    """One captured decode step: the buffers its inputs are copied into, its output, and the
    arguments each experts module was called with (graph buffers, rewritten by every replay)."""

    def __init__(self, forward: Callable, kwargs: dict[str, Any], layers: Sequence[MiraExperts], pool) -> None:
        self.inputs = {name: _copied(value) for name, value in kwargs.items()}
        self.calls: list[tuple[MiraExperts, tuple]] = []
        handles = [layer.register_forward_pre_hook(lambda module, args: self.calls.append((module, args)))
                   for layer in layers]
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph, pool=pool):
                self.output = forward(**self.inputs)
        finally:
            for handle in handles:
                handle.remove()

    def replay(self, kwargs: dict[str, Any]):
        for name, value in kwargs.items():
            _copy_into(self.inputs[name], value)
        self.graph.replay()
        # a replay runs no Python: show the experts modules' forward pre-hooks (e.g. mira.runtime.tracing's
        # routing recorder) the arguments this step called them with, as an eager step would have
        for module, args in self.calls:
            for hook in list(module._forward_pre_hooks.values()):
                hook(module, args)
        # the output's buffers are overwritten by the next replay: hand out copies, as an eager step would
        return self.output.__class__(**{name: _copied(value) for name, value in self.output.items()})


class DecodeGraphs:
    """Stands in for a transformers model's `forward`: replays captured decode steps.

    Args:
        forward: the model's own forward (the bound method).
        layers: the model's Mira experts modules.

    Attributes:
        layers: the Mira experts modules, which must all be `host_free` for a step to be captured.
        captures, replays: decode steps captured and replayed so far.
    """

    def __init__(self, forward: Callable, layers: Sequence[MiraExperts]):
        self._forward = forward
        self.__signature__ = inspect.signature(forward)  # generate checks its keywords against the forward's
        self.layers = list(layers)
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[Hashable, _Graph] = {}
        self._seen: set[Hashable] = set()
        self._refused: set[Hashable] = set()
        self.captures = 0
        self.replays = 0

    def __call__(self, *args, **kwargs):
        key = None if args else self._signature(kwargs)
        if key is None or key in self._refused:
            return self._forward(*args, **kwargs)
        graph = self._graphs.get(key)
        if graph is None:
            if key not in self._seen:
                self._seen.add(key)
                return self._forward(**kwargs)
            try:
                graph = _Graph(self._forward, kwargs, self.layers, self._pool)
            except RuntimeError as error:  # something in the step needs the host after all
                self._refused.add(key)
                where = traceback.extract_tb(error.__traceback__)[-1]
                warnings.warn(f"mira: a decode step could not be captured as a CUDA graph ({error}, at "
                              f"{where.filename}:{where.lineno}); it runs eagerly", RuntimeWarning, stacklevel=2)
                return self._forward(**kwargs)
            self._graphs[key] = graph
            self.captures += 1
        self.replays += 1
        return graph.replay(kwargs)

    def forget(self) -> None:
        """Drop every captured step (their memory goes back to the allocator)."""
        self._graphs.clear()
        self._seen.clear()

    def _signature(self, kwargs: dict[str, Any]) -> Hashable | None:
        """What a captured step depends on, or None when this call must run eagerly."""
        input_ids = kwargs.get("input_ids")
        cache = next((kwargs[name] for name in CACHE_ARGUMENTS if kwargs.get(name) is not None), None)
        if (input_ids is None or input_ids.ndim != 2 or input_ids.shape[1] != 1 or not input_ids.is_cuda
                or kwargs.get("inputs_embeds") is not None or not replayable_cache(cache)
                or not all(layer.host_free for layer in self.layers)):
            return None
        key: list[Hashable] = [id(cache)]
        for name, value in sorted(kwargs.items()):
            if name in CACHE_ARGUMENTS:
                continue
            try:
                key.append((name, _argument_key(value)))
            except TypeError:
                return None
        return tuple(key)
