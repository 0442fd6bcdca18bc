"""Dequantizers for quantized checkpoints, applied one expert (or one tensor) at a time while
converting (DESIGN.md 2.3).

- FP8 with block scales (DeepSeek-V3's published format): a float8_e4m3fn weight [R, C] and
  `weight_scale_inv` float32 [ceil(R / BR), ceil(C / BC)]; w = fp8 value x the scale of its
  BR x BC block (BR x BC from the config's `quantization_config.weight_block_size`, 128 x 128).
- MXFP4 (gpt-oss's format): `*_blocks` uint8 [..., G, 16], two FP4 (e2m1) values a byte, low
  nibble first, and `*_scales` uint8 [..., G], one e8m0 exponent (2 ** (s - 127)) per 32 values;
  w [..., G * 32].

Both return float32: every value they produce is exact in it.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from mira.errors import MiraError

FP8_DEFAULT_BLOCK = (128, 128)
FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))
E8M0_BIAS = 127
# e2m1: sign bit, 2 exponent bits, 1 mantissa bit; codes 0-7 positive, 8-15 their negatives
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values sharing one scale
CHECKPOINT_QUANT_METHODS = ("fp8", "mxfp4")  # quantization_config methods these dequantize


def fp8_block_size(config: PretrainedConfig) -> tuple[int, int]:
    """The FP8 scale block (rows, columns) of a checkpoint's config."""
    quant = getattr(config, "quantization_config", None) or {}
    block = quant.get("weight_block_size") if isinstance(quant, dict) else getattr(quant, "weight_block_size", None)
    return tuple(block) if block else FP8_DEFAULT_BLOCK


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A 2D float8 weight [R, C] times its block scales [ceil(R/BR), ceil(C/BC)] -> float32 [R, C].

    Raises:
        MiraError: a weight that is not float8, or scales of the wrong shape for `block`.
    """
    if weight.dtype not in FP8_DTYPES or weight.dim() != 2:
        raise MiraError(f"an FP8 block-scaled weight must be a 2D float8 tensor, not {weight.dtype} "
                        f"{tuple(weight.shape)}")
    rows, cols = weight.shape
    block_rows, block_cols = block
    expected = (-(-rows // block_rows), -(-cols // block_cols))
    if tuple(scale_inv.shape) != expected:
        raise MiraError(f"FP8 weight {tuple(weight.shape)} with blocks {block_rows}x{block_cols} needs scales "
                        f"{expected}, the checkpoint has {tuple(scale_inv.shape)}; check weight_block_size in "
                        "config.json")
    scale = scale_inv.float().repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
    return weight.float() * scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks [..., G, 16] uint8 and e8m0 scales [..., G] uint8 -> float32 [..., G * 32].

    Raises:
        MiraError: shapes or dtypes that are not MXFP4's.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] * 2 != MXFP4_BLOCK:
        raise MiraError(f"MXFP4 needs uint8 blocks [..., G, {MXFP4_BLOCK // 2}] and uint8 scales [..., G], not "
                        f"{blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    table = torch.tensor(FP4_E2M1, dtype=torch.float32)
    values = torch.stack((table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]), dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2)  # [..., G, 32], low nibble first
    exponent = scales.to(torch.int32) - E8M0_BIAS  # [..., G]
    return torch.ldexp(values, exponent[..., None].float()).flatten(-2)  # [..., G * 32]


def checkpoint_quant_method(config: PretrainedConfig) -> str | None:
    """The checkpoint's weight quantization Mira dequantizes (fp8, mxfp4), None when unquantized.

    Raises:
        MiraError: a quantization method Mira cannot read.
    """
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    method = getattr(method, "value", method)
    if method not in CHECKPOINT_QUANT_METHODS:
        raise MiraError(f"the checkpoint is quantized with {method!r}, which Mira cannot read; convert a checkpoint "
                        f"in bf16/fp16/fp32 or one of {', '.join(CHECKPOINT_QUANT_METHODS)}")
    return method
