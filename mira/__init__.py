"""Mira: Mixture-of-Experts inference on a GPU too small to hold the model.

Experts are quantized offline into a host-memory store and cached in GPU memory under a byte
budget; the rest of the model is Hugging Face transformers' own code.

    import mira
    model = mira.load("path/to/hf-moe-model", device="cuda", vram_budget=12 << 30)
    out = model.generate(input_ids, max_new_tokens=64)
"""

from mira.errors import MiraError

__version__ = "0.1.0"
__all__ = ["MiraError", "load", "__version__"]


def load(*args, **kwargs):
    """See mira.runtime.engine.load (imported lazily: `import mira` stays cheap)."""
    from mira.runtime.engine import load as _load

    return _load(*args, **kwargs)
