"""Synthetic models at real shapes, for timing at scale with nothing on disk (DESIGN.md 2.10c).

A preset is a transformers config with a published model's layer, expert, attention and vocabulary
sizes (from that model's config.json). `synthetic_skeleton` builds it with random bf16 non-expert
weights straight on the device (experts left out, as `mira.models.loader` does for real
checkpoints) and `synthetic_store` an `ExpertStore` whose blobs are random INT8 weights with a
per-expert scale, written straight into host memory and page-locked there. The router is random too, so routing has none of the
locality of a trained model: every result is labelled "synthetic routing".

A blob's values are chosen so that activations stay finite through every layer: INT8 weights
uniform in [-127, 127] with a scale of 0.02 / 73 (73 ~ the standard deviation of that uniform),
i.e. the dequantized weights have the 0.02 standard deviation of transformers' own initialisation.
An `int4` store quantizes the same weights: each layer's draw, read as one expert's matrices, is
quantized once (mira.store.int4, on the device given, as it is the slow step), and every expert of
the layer is that expert with its codes XORed with a byte of its own: the codes keep their spread,
each group its scale and zero.

Attention that normalizes its queries and keys (Qwen3-MoE's and OLMoE's q_norm / k_norm) gets those
norms' gains multiplied by `QK_NORM_GAIN`. With transformers' unit gains every attention logit is
about one in size, so each token attends nearly uniformly and receives the average of the
sequence: layer after layer the residual streams fill with one shared vector, and the routers
send every token to the same few experts. Gains of 4 make attention peaked, as in trained models,
and routing varied (`benchmarks/synthetic_routing.py` counts the experts used per layer). The
Mixtral and DeepSeek-V2-Lite presets have no such norms and route varied as they are.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from mira.bench.hf import compute_dtype
from mira.bench.presets import PRESETS
from mira.errors import MiraError
from mira.models.loader import ExpertsPlaceholder, experts_swapped, moe_sites
from mira.models.registry import adapter_for
from mira.store import int4
from mira.store.layout import ExpertLayout
from mira.store.manifest import Manifest, format_version
from mira.store.store import ExpertStore, host_buffer

WEIGHT_STD = 0.02  # of transformers' initialisation, and of the dequantized synthetic experts
QK_NORM_GAIN = 4.0  # gain of attention's query and key norms, where a preset has them (see above)
QK_NORMS = ("q_norm.weight", "k_norm.weight")
_UNIFORM_INT8_STD = 73.3  # standard deviation of integers uniform in [-127, 127]


def preset_config(name: str) -> PretrainedConfig:
    """The transformers config of preset `name` (no eos or pad id: synthetic ids never stop early)."""
    if name not in PRESETS:
        raise ValueError(f"unknown synthetic model {name!r}; choose one of {', '.join(PRESETS)}")
    config = AutoConfig.for_model(**PRESETS[name])
    config.eos_token_id = config.pad_token_id = None
    return config


def synthetic_config(name_or_path: str) -> tuple[PretrainedConfig, str]:
    """A preset's config, or the config of any Hugging Face `config.json` of a supported family, and a
    name for it (the preset's, or the file's folder).

    Raises:
        MiraError: neither a preset nor a readable config.json of a supported family.
    """
    if name_or_path in PRESETS:
        return preset_config(name_or_path), name_or_path
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise MiraError(f"--synthetic {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json")
    try:
        fields = json.loads(path.read_text())
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    except (ValueError, KeyError, TypeError) as error:
        raise MiraError(f"cannot build a model from {path} ({error}); pass a Hugging Face config.json") from None
    adapter_for(config)  # refuses an unsupported family with the list of supported ones
    config.eos_token_id = config.pad_token_id = None
    return config, path.parent.name or path.stem


class _InitablePlaceholder(ExpertsPlaceholder):
    """An experts placeholder with the (empty) tensors transformers' `_init_weights` initialises.

    `from_config` initialises every module, the Experts class included; loading a checkpoint
    (mira.models.loader) never gets there, building a random model does.
    """

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.gate_up_proj = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        self.down_proj = torch.nn.Parameter(torch.empty(0), requires_grad=False)


def synthetic_skeleton(config: PretrainedConfig, device: torch.device, seed: int = 0):
    """The model without its routed experts, random weights (transformers' init; query and key norm
    gains of QK_NORM_GAIN), on `device`.

    Returns:
        The model (eval mode, in mira.bench.hf.compute_dtype), its MoE sites and the seconds taken.
    """
    start = time.perf_counter()
    dtype = compute_dtype(config, device)
    torch.manual_seed(seed)
    with experts_swapped(adapter_for(config), _InitablePlaceholder), torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(QK_NORMS):
                parameter.mul_(QK_NORM_GAIN)
    model.eval()
    return model, moe_sites(model), time.perf_counter() - start


def synthetic_store(config: PretrainedConfig, num_layers: int, scheme: str, pin: bool, seed: int = 0,
                    progress: bool = True, name: str = "synthetic", device: torch.device | None = None
                    ) -> ExpertStore:
    """Random expert blobs (int8-shared, int8-row or int4) for every MoE layer, written straight into
    host memory [L, E, B]; int4's weights are quantized on `device` (default the CPU)."""
    adapter = adapter_for(config)
    spec = adapter.spec  # biases, where the family has them, stay zero (the host buffer starts zeroed)
    layout = ExpertLayout(scheme, spec.hidden, spec.intermediate, gated=spec.gated, bias=spec.bias)
    num_experts = adapter.spec.num_experts
    start = time.perf_counter()
    data = host_buffer((num_layers, num_experts, layout.nbytes))  # [L, E, B]
    generator = torch.Generator().manual_seed(seed)
    fill = _fill_int4_layer if scheme == "int4" else _fill_layer
    for layer in tqdm(range(num_layers), desc="synthetic experts", unit="layer", disable=not progress):
        fill(data[layer], layout, generator, device or torch.device("cpu"))
    manifest = Manifest(format_version(layout), config.model_type, f"synthetic:{name}", f"synthetic:{name}:{seed}",
                        list(range(num_layers)), num_experts, layout.to_json(), files={})
    store = ExpertStore(Path(f"<synthetic {name}>"), manifest, data)
    filled = time.perf_counter()
    if pin:
        store.page_lock()
    store.timings = {"bytes": data.numel(), "fill_s": round(filled - start, 2),
                     "page_lock_s": round(time.perf_counter() - filled, 2) if pin else None}
    return store


def _fill_layer(layer: torch.Tensor, layout: ExpertLayout, generator: torch.Generator, device: torch.device) -> None:
    """Random weights in every blob of one layer [E, B]: INT8 uniform, scales at WEIGHT_STD.

    One random draw per layer, read from a random offset (cyclically) for each expert: distinct
    experts at a fraction of the cost of a draw per expert.
    """
    if layout.scheme == "none":
        raise ValueError("synthetic stores are quantized (int8-shared, int8-row or int4)")
    first = layout.views(layer[0])
    sizes = [first["w13"].numel(), first["w2"].numel()]
    draw = _draw(sizes, generator)  # [P]
    for blob in layer:
        views = layout.views(blob)
        start = int(torch.randint(0, draw.numel(), (1,), generator=generator))
        for name, size in zip(("w13", "w2"), sizes):
            _copy_cyclic(draw, start, views[name].view(-1))
            start = (start + size) % draw.numel()
        for section in ("scale", "scale13", "scale2"):
            if section in views:
                views[section].fill_(WEIGHT_STD / _UNIFORM_INT8_STD)


def _fill_int4_layer(layer: torch.Tensor, layout: ExpertLayout, generator: torch.Generator,
                     device: torch.device) -> None:
    """The layer's INT8 draw at WEIGHT_STD as one expert's w13 [2I, H] and w2 [H, I], quantized to
    int4 once, and every blob of the layer [E, B] that expert with its codes XORed with a byte of
    its own (codes stay in 0..15 and spread as before; the group scales and zeros are shared)."""
    rows13, rows2 = layout.sections["w13"].shape[0], layout.sections["w2"].shape[0]
    H, I = layout.hidden, layout.intermediate
    draw = _draw([rows13 * H, rows2 * I], generator).to(device)  # [P]
    weights = draw.float() * (WEIGHT_STD / _UNIFORM_INT8_STD)
    quantized = int4.quantize(weights[: rows13 * H].view(rows13, H), weights[rows13 * H:].view(rows2, I))
    base = {name: tensor.cpu() for name, tensor in quantized.items()}
    keys = _distinct(256, layer.shape[0], generator)  # [E] distinct bytes (while E <= 256)
    for expert, blob in enumerate(layer):
        views = layout.views(blob)
        for name, tensor in base.items():
            if name.startswith("w"):
                torch.bitwise_xor(tensor, int(keys[expert]), out=views[name])
            else:
                views[name].copy_(tensor)


def _draw(sizes: list[int], generator: torch.Generator) -> torch.Tensor:
    """INT8 weights uniform in [-127, 127], as many as `sizes` add up to [P]."""
    return torch.randint(-127, 128, (sum(sizes),), dtype=torch.int8, generator=generator)


def _distinct(count: int, experts: int, generator: torch.Generator) -> torch.Tensor:
    """A value in [0, count) per expert [E]: distinct while there are as many values as experts."""
    return torch.randperm(max(count, experts), generator=generator)[:experts] % count


def _copy_cyclic(source: torch.Tensor, start: int, out: torch.Tensor) -> None:
    """out[j] = source[(start + j) % len(source)], for len(out) <= len(source)."""
    head = min(out.numel(), source.numel() - start)
    out[:head].copy_(source[start:start + head])
    out[head:].copy_(source[: out.numel() - head])
