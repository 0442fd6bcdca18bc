"""Mira: Mixture-of-Experts inference on a GPU too small to hold the model.

Experts are quantized offline into a host-memory store and cached in GPU memory under a byte
budget; the rest of the model is Hugging Face transformers' own code.

    import mira
    model = mira.load("path/to/hf-moe-model", vram_budget=12 << 30)
    out = model.generate(input_ids, max_new_tokens=64)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from mira.errors import MiraError

if TYPE_CHECKING:
    from mira.runtime.config import RuntimeConfig
    from mira.runtime.engine import MiraModel

__version__ = "0.1.0"
__all__ = ["MiraError", "RuntimeConfig", "load", "__version__"]


def load(path: str | os.PathLike | None = None, config: RuntimeConfig | None = None, **overrides) -> MiraModel:
    """A model whose experts are served from a Mira store: `mira.runtime.engine.load`.

    `config` is a `mira.RuntimeConfig`; `overrides` set its fields by name (device, vram_budget,
    policy, prefetch, residency, ...). Imported lazily, so `import mira` stays cheap.
    """
    from mira.runtime.engine import load as _load

    return _load(path, config, **overrides)


def __getattr__(name: str):
    if name == "RuntimeConfig":
        from mira.runtime.config import RuntimeConfig

        return RuntimeConfig
    raise AttributeError(f"module 'mira' has no attribute {name!r}")
