"""Quantized checkpoints convert: FP8 with block scales (DeepSeek-V3's published format) and MXFP4
(gpt-oss's). Tiny checkpoints are written in each format's real layout, with its scale tensors and
quantization_config; the store must hold exactly their dequantized weights, computed here from the
formats' definitions (float64, block by block), independently of mira.store.dequant."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import mira
from mira.errors import MiraError
from mira.store.convert import convert
from mira.store.quant import dequantize_expert
from mira.store.store import ExpertStore
from tiny_families import VOCAB, tiny_config
from tiny_models import make_checkpoint, write_tokenizer

FP8_MAX = 448.0  # largest float8_e4m3fn
BLOCK = (16, 16)  # FP8 scale blocks of the tiny checkpoint (DeepSeek-V3 uses 128 x 128)
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # FP4 magnitudes by code (sign in bit 3)


def _shards(directory):
    return sorted(directory.glob("*.safetensors"))


def _rewrite(directory, transform, quantization_config):
    """Every shard's tensors through `transform(dict) -> dict`, and config.json with quantization_config."""
    for shard in _shards(directory):
        save_file(transform(load_file(shard)), shard, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))


# --- FP8 with block scales ---------------------------------------------------------------------------------------

def _fp8_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn weight and float32 scale_inv [ceil(R/16), ceil(C/16)], block amax mapped to FP8_MAX."""
    rows, cols = weight.shape
    scale = torch.empty(math.ceil(rows / BLOCK[0]), math.ceil(cols / BLOCK[1]))
    out = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = weight[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]].float()
            scale[i, j] = block.abs().max().clamp(min=1e-8) / FP8_MAX
            out[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]] = (block / scale[i, j]).to(
                torch.float8_e4m3fn)
    return out, scale


def _fp8_dequantized(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """float64, block by block: each fp8 value times its block's scale."""
    out = weight.double()
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            out[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]] *= scale_inv[i, j].double()
    return out


def _is_fp8_quantized(name: str, tensor: torch.Tensor) -> bool:
    """The linear weights DeepSeek-V3's release stores in FP8: all but embeddings, norms, router and head."""
    return (name.endswith("_proj.weight") or ".experts." in name) and tensor.dim() == 2


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    directory = make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("fp8") / "deepseek_v3")

    def quantize(tensors):
        out = {}
        for name, tensor in tensors.items():
            if _is_fp8_quantized(name, tensor):
                out[name], out[name + "_scale_inv"] = _fp8_quantize(tensor)
            else:
                out[name] = tensor
        return out

    _rewrite(directory, quantize, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": list(BLOCK)})
    return directory


def _checkpoint_tensors(directory):
    tensors = {}
    for shard in _shards(directory):
        with safe_open(str(shard), framework="pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors


@pytest.mark.parametrize("scheme", ["none", "int8-shared"])
def test_fp8_block_scaled_checkpoint_converts_to_its_dequantized_weights(fp8_checkpoint, tmp_path, scheme):
    manifest = convert(fp8_checkpoint, tmp_path / "store", scheme, progress=False)
    store = ExpertStore.open(tmp_path / "store", progress=False)
    ckpt = _checkpoint_tensors(fp8_checkpoint)
    assert ckpt["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    for position, layer in enumerate(manifest.moe_layers):
        for expert in range(store.num_experts):
            prefix = f"model.layers.{layer}.mlp.experts.{expert}."
            exact = {name: _fp8_dequantized(ckpt[prefix + f"{name}.weight"], ckpt[prefix + f"{name}.weight_scale_inv"])
                     for name in ("gate_proj", "up_proj", "down_proj")}
            w13_exact, w2_exact = torch.cat([exact["gate_proj"], exact["up_proj"]]), exact["down_proj"]
            views = store.layout.views(store.blob(position, expert))
            w13, w2 = dequantize_expert(views, store.layout)
            if scheme == "none":  # bf16: the dequantized weights, rounded once
                assert views["w13"].dtype == torch.bfloat16
                assert torch.equal(views["w13"], w13_exact.to(torch.bfloat16))
                assert torch.equal(views["w2"], w2_exact.to(torch.bfloat16))
            else:  # within half a quantization step of the dequantized weights
                scale = views["scale"].double()
                assert ((w13 - w13_exact).abs() <= scale[None, :] / 2).all()
                assert ((w2 - w2_exact).abs() <= scale[:, None] / 2).all()
    stored = _checkpoint_tensors(tmp_path / "store")
    assert not any(name.endswith("_scale_inv") for name in stored)
    name = "model.layers.0.self_attn.o_proj.weight"  # a non-expert FP8 weight: stored dequantized, bf16
    assert torch.equal(stored[name], _fp8_dequantized(ckpt[name], ckpt[name + "_scale_inv"]).to(torch.bfloat16))
    assert "quantization_config" not in json.loads((tmp_path / "store" / "config.json").read_text())
    model = mira.load(tmp_path / "store", device="cpu", progress=False)
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 7)


def test_fp8_scales_of_the_wrong_shape_are_refused(fp8_checkpoint, tmp_path):
    config = json.loads((fp8_checkpoint / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [32, 32]  # the scales were made for 16 x 16
    bad = tmp_path / "bad"
    bad.mkdir()
    for path in fp8_checkpoint.iterdir():
        (bad / path.name).write_bytes(path.read_bytes())
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(MiraError, match="needs scales .* check weight_block_size"):
        convert(bad, tmp_path / "store", "none", progress=False)
    assert not (tmp_path / "store").exists()


# --- MXFP4 -------------------------------------------------------------------------------------------------------

def _mxfp4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., C] -> blocks uint8 [..., C/32, 16] (two e2m1 codes a byte, low nibble first) and e8m0
    scales uint8 [..., C/32]: each group of 32 scaled by a power of two so its largest value fits 6."""
    groups = weight.double().unflatten(-1, (-1, 32))  # [..., G, 32]
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -100) / 6.0))  # [..., G]
    scaled = groups / torch.pow(2.0, exponent)[..., None]
    magnitudes = torch.tensor(E2M1, dtype=torch.float64)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1)  # nearest magnitude
    codes = codes + 8 * (scaled < 0)
    pairs = codes.to(torch.uint8).unflatten(-1, (16, 2))
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def _mxfp4_dequantized(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 [..., G * 32] from the e2m1 definition: (-1)^s * m/2 (e = 0) or 2^(e-1) * (1 + m/2)."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32]
    sign = torch.where(codes & 8 > 0, -1.0, 1.0).double()
    exponent, mantissa = (codes >> 1) & 3, (codes & 1).double()
    value = torch.where(exponent == 0, mantissa / 2, torch.pow(2.0, exponent.double() - 1) * (1 + mantissa / 2))
    return (sign * value * torch.pow(2.0, scales.double() - 127)[..., None]).flatten(-2)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("mxfp4") / "gpt_oss"
    model = AutoModelForCausalLM.from_config(tiny_config("gpt_oss"), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    write_tokenizer(directory)

    def quantize(tensors):
        out = {}
        for name, tensor in tensors.items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out] -> stored [E, out, in]
                out[name + "_blocks"], out[name + "_scales"] = _mxfp4_quantize(tensor.transpose(1, 2))
            else:
                out[name] = tensor
        return out

    _rewrite(directory, quantize, {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                       "model.layers.*.mlp.router",
                                                                                       "model.embed_tokens", "lm_head"]})
    return directory


def test_mxfp4_checkpoint_converts_to_its_dequantized_weights_and_runs_as_them(mxfp4_checkpoint, tmp_path):
    manifest = convert(mxfp4_checkpoint, tmp_path / "store", "none", progress=False)
    store = ExpertStore.open(tmp_path / "store", progress=False)
    ckpt = _checkpoint_tensors(mxfp4_checkpoint)
    dequantized = {}
    for position, layer in enumerate(manifest.moe_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        gate_up = _mxfp4_dequantized(ckpt[prefix + "gate_up_proj_blocks"], ckpt[prefix + "gate_up_proj_scales"])
        down = _mxfp4_dequantized(ckpt[prefix + "down_proj_blocks"], ckpt[prefix + "down_proj_scales"])
        dequantized[prefix + "gate_up_proj"], dequantized[prefix + "down_proj"] = gate_up.transpose(1, 2), \
            down.transpose(1, 2)
        for expert in range(store.num_experts):
            views = store.layout.views(store.blob(position, expert))
            rows = gate_up[expert]  # [2I, H], gate and up rows alternating (gpt-oss)
            assert torch.equal(views["w13"], torch.cat([rows[0::2], rows[1::2]]).to(torch.bfloat16))
            assert torch.equal(views["w2"], down[expert].to(torch.bfloat16))
            assert torch.equal(views["b13"].double(), torch.cat([ckpt[prefix + "gate_up_proj_bias"][expert][0::2],
                                                                 ckpt[prefix + "gate_up_proj_bias"][expert][1::2]]).double())
    assert "quantization_config" not in json.loads((tmp_path / "store" / "config.json").read_text())
    # transformers' fp32 forward with the dequantized weights is Mira's on the store (the MXFP4 values are exact in bf16)
    reference_dir = tmp_path / "dequantized"
    reference_dir.mkdir()
    tensors = {name: tensor for name, tensor in ckpt.items() if not name.endswith(("_blocks", "_scales"))}
    tensors.update({name: tensor.float().contiguous() for name, tensor in dequantized.items()})
    save_file(tensors, reference_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mxfp4_checkpoint / "config.json").read_text())
    config.pop("quantization_config")
    (reference_dir / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    model = mira.load(tmp_path / "store", device="cpu", progress=False)
    ids = torch.randint(2, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (reference(ids).logits - model(ids).logits).abs().max().item() <= 1e-4
