"""The fused INT4 Triton kernels against the PyTorch reference (DESIGN.md 2.8; STYLE.md habit 4).

Without CUDA the kernels run in Triton's interpreter on the CPU (TRITON_INTERPRET=1, set in
tests/conftest.py before triton is imported) at small sizes of whole tiles and groups: H 128 is two
tiles and two groups, I 192 three of each, so that steps, tile blocks and split spans come out
ragged. On a GPU the same tests run compiled, and the tests marked `gpu` add every real expert
shape, a zero-copy read of a pinned host blob, the no-allocation / no-sync check of a decode step
and graph replays.

Every output and workspace is filled with NaN first, so an element a kernel fails to write fails
the comparison. Tolerances as in test_triton_ffn.py: fp32 hidden states match the fp32 reference to
1e-5 (relative norm); bf16 ones are compared with a float64 evaluation of the reference.

T tokens, E experts, K routed per token, H hidden, I expert intermediate.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton.language")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mira.kernels import ReferenceMoEFFN, dependent, make_moe_ffn, triton_int4  # noqa: E402
from mira.kernels.reference import moe_ffn_reference  # noqa: E402
from mira.kernels.triton_int4 import (  # noqa: E402
    CVTS, TritonInt4MoEFFN, default_int4_config, load_int4_config, tuning_name,
)
from mira.kernels.tuning import GemmConfig, GemvConfig, KernelConfig, save_configs  # noqa: E402
from mira.store.layout import ExpertLayout  # noqa: E402
from mira.store.quant import quantize_expert  # noqa: E402

from cuda_graphs import captured  # noqa: E402
from routing_cases import DEVICE, relative_error, routing  # noqa: E402
H, I, E, K = 128, 192, 6, 2
FP32_TOL = 1e-5
FOLD_TOL = 5e-5  # cvt "fold": sums of codes offset by 2**23, exact to about 2**-17 of a group's (`_code_floats`)
HALF2_TOL = 2e-3  # cvt "half2" (the untuned default's): fp16 sums within a group, a bf16-level tolerance
BF16_TOL = 1e-2 if DEVICE == "cuda" else 2.5e-2


def prefill_only(gemm: GemmConfig) -> KernelConfig:
    """The untuned configuration with this GEMM and every call sent to it (decode_max_pairs 0)."""
    return dataclasses.replace(default_int4_config(H, I), decode_max_pairs=0, gemm=gemm)


DECODE_CONFIGS = {
    # gate/up: a step of 4 groups over H's 2 (half the lanes masked), two unit tiles per program
    # (the second program's second tile past I); down: the reduction split in 2 (spans of 2 groups
    # and 1), each span one step, the last program to arrive adding the partials
    "gemv-ragged": KernelConfig(gate_up_gemv=GemvConfig(128, 256, unroll=4, num_warps=1),
                                down_gemv=GemvConfig(64, 128, unroll=16, split=2, num_warps=1)),
    # gate/up: runs of tiles per program (programs_per_sm), a step of H's 2 groups (unmasked);
    # down: both H tiles in one program
    "gemv-runs": KernelConfig(gate_up_gemv=GemvConfig(64, 128, unroll=4, num_warps=1, programs_per_sm=1),
                              down_gemv=GemvConfig(128, 256, unroll=16, num_warps=1)),
    "default": default_int4_config(H, I),
    # a step of one group: gate/up two steps over H, down three over I (what a loop carries from
    # one step to the next)
    "gemv-steps": KernelConfig(gate_up_gemv=GemvConfig(64, 64, unroll=4, num_warps=1),
                               down_gemv=GemvConfig(64, 64, unroll=8, num_warps=1)),
    # the "fold" conversion (runs everywhere) in the ragged launch shapes
    "gemv-fold": KernelConfig(gate_up_gemv=GemvConfig(128, 256, unroll=4, num_warps=1, cvt="fold"),
                              down_gemv=GemvConfig(64, 128, unroll=16, split=2, num_warps=1, cvt="fold")),
}
# the down launch's program walking a token's K experts in turn, in the ragged launch shapes
DECODE_CONFIGS["gemv-in-turn"] = dataclasses.replace(DECODE_CONFIGS["gemv-ragged"], down_per_pair=False)
PREFILL_CONFIGS = {
    # a K step of half a group; three row blocks of one tile
    "gemm-m16": prefill_only(GemmConfig(16, 64, 32, num_warps=4, num_stages=2)),
    # row blocks of two tiles (the second gate/up block half past I); block_k cut to the group
    "gemm-m32": prefill_only(GemmConfig(32, 128, 128, num_warps=4, num_stages=2)),
}
CONFIGS = {**DECODE_CONFIGS, **PREFILL_CONFIGS}


def quantized_blobs(layout: ExpertLayout, experts: int, seed: int, device: str = DEVICE) -> list[torch.Tensor]:
    """`experts` blobs quantized from random fp32 weights (the path real stores take)."""
    gen = torch.Generator().manual_seed(seed)
    h, i = layout.hidden, layout.intermediate
    blobs = []
    for _ in range(experts):
        blob = torch.empty(layout.nbytes, dtype=torch.uint8)
        layout.pack(quantize_expert(torch.randn(2 * i, h, generator=gen) / h**0.5,
                                    torch.randn(h, i, generator=gen) / i**0.5, layout), blob)
        blobs.append(blob.to(device))
    return blobs


def random_blobs(layout: ExpertLayout, experts: int, seed: int, device: str) -> list[torch.Tensor]:
    """`experts` blobs of random codes, scales and zeros, made on the device (real shapes: fast):
    scales of about 1 / (4.6 sqrt(fan-in)), so that a weight's spread is about 1 / sqrt(fan-in) and
    activations stay O(1); zeros within a scale of 0."""
    gen = torch.Generator(device=device).manual_seed(seed)
    slots = torch.randint(0, 256, (experts, layout.nbytes), generator=gen, device=device, dtype=torch.uint8)
    for blob in slots:
        views = layout.views(blob)
        for name, fan_in in (("sz13", layout.hidden), ("sz2", layout.intermediate)):
            sz = views[name]  # [N, R, 2]: (s, z) per group and row
            s = (torch.rand(sz.shape[:2], generator=gen, device=device) + 0.5) / (4.6 * fan_in**0.5)
            sz[..., 0] = s
            sz[..., 1] = s * (2 * torch.rand(sz.shape[:2], generator=gen, device=device) - 1)
    return list(slots)


def poisoned_ffn(layout: ExpertLayout, config: KernelConfig, tokens: int, dtype: torch.dtype) -> TritonInt4MoEFFN:
    """A kernel object whose workspaces are all NaN."""
    ffn = TritonInt4MoEFFN(layout, DEVICE, config=config, num_experts=E, max_tokens=tokens, top_k=K, dtype=dtype)
    for buffer in (ffn._decode_act, ffn._split_partials, *ffn._prefill.values()):
        buffer.fill_(float("nan"))
    return ffn


def run_poisoned(ffn, hidden, index, weights, blobs) -> torch.Tensor:
    out = torch.full_like(hidden, float("nan"))
    assert ffn(hidden, index, weights, blobs, out=out) is out
    return out


@pytest.fixture(scope="module")
def small():
    layout = ExpertLayout("int4", H, I)
    return layout, quantized_blobs(layout, E, seed=1)


@pytest.mark.parametrize("config", DECODE_CONFIGS)
@pytest.mark.parametrize("tokens", [1, 3])
def test_decode_matches_reference_fp32(small, tokens, config):
    layout, blobs = small
    hidden = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    index, weights = routing(tokens, E, K, seed=tokens)
    ffn = poisoned_ffn(layout, DECODE_CONFIGS[config], tokens, torch.float32)
    out = run_poisoned(ffn, hidden, index, weights, blobs)
    cvt = DECODE_CONFIGS[config].gate_up_gemv.cvt
    tol = {"fold": FOLD_TOL, "half2": HALF2_TOL}.get(cvt, FP32_TOL)
    assert relative_error(out, moe_ffn_reference(hidden, index, weights, blobs, layout, F.silu)) < tol


@pytest.mark.parametrize("config", PREFILL_CONFIGS)
@pytest.mark.parametrize("tokens", [1, 19])
def test_prefill_matches_reference_fp32(small, tokens, config):
    layout, blobs = small
    hidden = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    index, weights = routing(tokens, E, K, seed=tokens)
    ffn = poisoned_ffn(layout, PREFILL_CONFIGS[config], tokens, torch.float32)
    out = run_poisoned(ffn, hidden, index, weights, blobs)
    assert relative_error(out, moe_ffn_reference(hidden, index, weights, blobs, layout, F.silu)) < FP32_TOL


@pytest.mark.parametrize(("config", "tokens"), [("gemv-ragged", 3), ("gemm-m16", 19)])
def test_bf16_hidden_matches_float64_reference(small, config, tokens):
    layout, blobs = small
    hidden = torch.randn(tokens, H, generator=torch.Generator().manual_seed(7)).to(DEVICE, torch.bfloat16)
    index, weights = routing(tokens, E, K, seed=7)
    weights = weights.bfloat16()
    out = run_poisoned(poisoned_ffn(layout, CONFIGS[config], tokens, torch.bfloat16), hidden, index, weights, blobs)
    assert out.dtype == torch.bfloat16
    truth = moe_ffn_reference(hidden.double(), index, weights.double(), blobs, layout, F.silu)
    assert relative_error(out, truth) < BF16_TOL


@pytest.mark.parametrize(("config", "tokens"), [("gemv-runs", 2), ("gemm-m16", 19)])
def test_repeated_experts(small, config, tokens):
    """Every token routed to experts 3 and 5 (in either order); in the GEMM one expert's 19 pairs
    span two blocks."""
    layout, blobs = small
    hidden = torch.randn(tokens, H, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    index = torch.tensor([[3, 5], [5, 3]] * (tokens // 2) + [[3, 5]] * (tokens % 2), device=DEVICE)  # [T, K]
    weights = torch.rand(tokens, K, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    out = run_poisoned(poisoned_ffn(layout, CONFIGS[config], tokens, torch.float32), hidden, index, weights, blobs)
    assert relative_error(out, moe_ffn_reference(hidden, index, weights, blobs, layout, F.silu)) < FP32_TOL


def test_split_down_resets_its_counts(small):
    """A split down launch's arrival counts are back at zero after a call, so the next call is
    summed again, in the same order: equal to a fresh object's result."""
    layout, blobs = small
    config = DECODE_CONFIGS["gemv-ragged"]
    ffn = poisoned_ffn(layout, config, 2, torch.float32)
    first = torch.randn(2, H, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    second = torch.randn(1, H, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    index, weights = routing(2, E, K, seed=11)
    run_poisoned(ffn, first, index, weights, blobs)
    assert int(ffn._split_counts.count_nonzero()) == 0
    again = run_poisoned(ffn, second, index[:1], weights[:1], blobs)
    fresh = run_poisoned(poisoned_ffn(layout, config, 2, torch.float32), second, index[:1], weights[:1], blobs)
    assert torch.equal(again, fresh)


@pytest.mark.parametrize("config", ["gemv-ragged", "gemm-m16"])
def test_routed_expert_without_blob_yields_nan_rows(small, config):
    layout, blobs = small
    blobs = list(blobs)
    blobs[2] = None
    index = torch.tensor([[0, 1], [2, 4], [4, 5]], device=DEVICE)
    weights = torch.full((3, K), 0.5, device=DEVICE)
    hidden = torch.randn(3, H, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    out = TritonInt4MoEFFN(layout, DEVICE, config=CONFIGS[config])(hidden, index, weights, blobs)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2]]).all()
    ref = moe_ffn_reference(hidden[[0, 2]], index[[0, 2]], weights[[0, 2]], blobs, layout, F.silu)
    assert relative_error(out[[0, 2]], ref) < FP32_TOL


def test_forward_bases_matches_the_blob_list(small):
    layout, blobs = small
    ffn = TritonInt4MoEFFN(layout, DEVICE, config=DECODE_CONFIGS["gemv-runs"])
    bases = torch.tensor([b.data_ptr() for b in blobs], dtype=torch.int64, device=DEVICE)
    hidden = torch.randn(1, H, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    index, weights = routing(1, E, K, seed=4)
    assert torch.equal(ffn.forward_bases(hidden, index, weights, bases), ffn(hidden, index, weights, blobs))


def test_factory_picks_the_int4_kernels_and_the_reference_on_cpu(small):
    layout, blobs = small
    assert isinstance(make_moe_ffn("cpu", layout, F.silu), ReferenceMoEFFN)
    assert isinstance(make_moe_ffn("cuda", layout, F.gelu), ReferenceMoEFFN)
    fused = make_moe_ffn(DEVICE, layout, "silu", backend="triton", config=DECODE_CONFIGS["gemv-ragged"])
    assert isinstance(fused, TritonInt4MoEFFN) and fused.cut_granule is None
    hidden = torch.randn(1, H, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    index, weights = routing(1, E, K, seed=9)
    plain = make_moe_ffn(DEVICE, layout, "silu", backend="reference")
    assert relative_error(fused(hidden, index, weights, blobs), plain(hidden, index, weights, blobs)) < FP32_TOL


def with_gemv(**fields) -> KernelConfig:
    """The untuned configuration with these fields of its down GEMV changed."""
    config = default_int4_config(H, I)
    return dataclasses.replace(config, down_gemv=dataclasses.replace(config.down_gemv, **fields))


@pytest.mark.parametrize(("config", "message"), [
    (with_gemv(mma=True), "down_gemv: the INT4 kernels have no tensor-core GEMV"),
    (with_gemv(cvt="prmt"), "down_gemv: the INT4 GEMVs convert codes as one of bits, fold, half2, not 'prmt'"),
    (with_gemv(block_rows=32), "down_gemv: block_rows must be whole tiles of 64 rows"),
    (with_gemv(block_rows=192), "down_gemv: block_rows must be whole tiles of 64 rows, a power of two"),
    (with_gemv(block_cols=32), "down_gemv: block_cols must be whole groups of 64 columns"),
    (with_gemv(unroll=3), "down_gemv: unroll must divide the 16 sub-steps of a group"),
    (prefill_only(GemmConfig(16, 32, 32)), "gemm: block_n must be whole tiles of 64 rows"),
    (prefill_only(GemmConfig(16, 64, 8)), "gemm: block_k must be a power of two of at least 16"),
])
def test_configurations_the_kernels_cannot_run_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        TritonInt4MoEFFN(ExpertLayout("int4", H, I), DEVICE, config=config)


@triton.jit
def _store_down_lines(codes_ptr, scales_ptr, tile, g0, group_end, H, I, W2_OFF, SZ2_OFF):
    codes, scales = triton_int4._down_lines(tile, g0, group_end, H, I, W2_OFF, SZ2_OFF, 8)
    tl.store(codes_ptr + tl.arange(0, 8 * 16), codes)
    tl.store(scales_ptr + tl.arange(0, 8 * 2), scales)


@pytest.mark.parametrize(("tile", "groups"), [(0, (0, 25)), (63, (200, 224)), (5, (24, 25))])
def test_down_prefetch_asks_for_the_lines_the_down_launch_reads(tile, groups):
    """The lines a prefetching down program asks L2 for, over its steps of 8 groups, are exactly the
    128-byte lines of its tile's codes and (s, z) words in its groups, worked out from the layout
    (Mixtral's shape: 64 tiles of H rows, 224 groups of I; a split span of 25 groups, the last
    span and tile, a span of one group)."""
    hidden, intermediate = 4096, 14336
    layout = ExpertLayout("int4", hidden, intermediate)
    w2, sz2 = layout.sections["w2"], layout.sections["sz2"]
    start, end = groups
    want = set()
    for g in range(start, end):
        codes = w2.offset + tile * 32 * intermediate + g * 64 * 32  # a tile's column: 32 bytes, a group 64 columns
        want |= {codes + 128 * n for n in range(16)}
        scales = sz2.offset + (g * hidden + tile * 64) * 4  # (s, z) words [I / 64, H]: a tile's 64 rows
        want |= {scales, scales + 128}
    got = set()
    for g0 in range(start, end, 8):
        codes, scales = torch.empty(128, dtype=torch.int64), torch.empty(16, dtype=torch.int64)
        _store_down_lines[(1,)](codes, scales, tile, g0, end, hidden, intermediate, w2.offset, sz2.offset)
        got |= set(codes.tolist()) | set(scales.tolist())
    assert got == want
    assert all(w2.offset <= line < w2.offset + w2.nbytes or sz2.offset <= line < sz2.offset + sz2.nbytes
               for line in got)


@pytest.mark.parametrize(("shape", "tokens", "top_k", "per_pair", "pays"), [
    ("qwen3-30b-a3b", 1, 8, False, True), ("qwen3-30b-a3b", 1, 8, True, False), ("qwen3-30b-a3b", 2, 8, False, False),
    ("olmoe-1b-7b", 1, 2, True, True), ("olmoe-1b-7b", 1, 8, False, False),
    ("deepseek-v2-lite", 1, 1, True, True), ("deepseek-v2-lite", 1, 2, False, True),
    ("deepseek-v2-lite", 1, 2, True, False), ("deepseek-v2-lite", 1, 6, False, False),
    ("mixtral-8x7b", 1, 1, True, False),
])
def test_down_launch_is_dependent_where_both_grids_fit_on_the_sms(shape, tokens, top_k, per_pair, pays):
    """The untuned decode grids at real shapes on a 132-SM GPU, worked by hand: gate/up has a
    program per unit tile and routed pair (I / 64 of them a pair), down one per tile of H rows
    (2048 / 64 = 32), split of I (DeepSeek's 1408 in 2 steps of 1024, Mixtral's 14336 in 7 spans of
    2 steps) and, with the experts apart, routed expert. Qwen3 top-8 walked in turn 8 x 12 + 32 = 128
    fit, apart 96 + 32 x 8 = 352 do not; DeepSeek top-2 2 x 22 + 32 x 2 = 108 fit, apart 44 + 128 =
    172 do not; OLMoE top-8 8 x 16 + 32 = 160 do not; one Mixtral expert has 224 gate/up programs."""
    hidden, intermediate = REAL_SHAPES[shape]
    splits = {"deepseek-v2-lite": 2, "mixtral-8x7b": 7}.get(shape, 1)
    layout = ExpertLayout("int4", hidden, intermediate)
    config = dataclasses.replace(default_int4_config(hidden, intermediate), down_per_pair=per_pair)
    launches = TritonInt4MoEFFN(layout, DEVICE, config=config).decode_launches(tokens, top_k)
    up, down = launches.gate_up_grid, launches.down_grid
    assert up == (tokens * top_k, intermediate // 64)
    assert down == (tokens, hidden // 64, splits * (top_k if per_pair else 1))
    assert dependent.pays(math.prod(up), math.prod(down), sms=132) is pays


def test_int8_layouts_are_refused():
    with pytest.raises(ValueError, match="read int4 blobs, not 'int8-shared'"):
        TritonInt4MoEFFN(ExpertLayout("int8-shared", H, I), DEVICE, config=default_int4_config(H, I))


def test_int4_tuning_is_stored_apart_from_int8(tmp_path):
    tuned = KernelConfig(decode_max_pairs=8, gate_up_gemv=GemvConfig(128, 512, unroll=4, num_warps=2))
    path = save_configs(tuning_name("NVIDIA H200"), {(H, I): tuned}, {"written_by": "test"}, directory=tmp_path)
    assert path.name == "nvidia-h200-int4.json"
    assert load_int4_config("NVIDIA H200", H, I, directory=tmp_path) == tuned
    assert load_int4_config("NVIDIA H200", H, 2 * I, directory=tmp_path) == default_int4_config(H, 2 * I)
    assert load_int4_config("Other GPU", H, I, directory=tmp_path) == default_int4_config(H, I)
    entry = json.loads(path.read_text())
    for choice in ("dependent_launch", "down_per_pair"):  # a file written before there were the choices
        del entry["shapes"][f"{H}x{I}"][choice]
    path.write_text(json.dumps(entry))
    assert load_int4_config("NVIDIA H200", H, I, directory=tmp_path) == tuned
    assert tuned.dependent_launch and tuned.down_per_pair


# ---- GPU only: real shapes, zero-copy, allocation and sync -------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
REAL_SHAPES = {"mixtral-8x7b": (4096, 14336), "deepseek-v2-lite": (2048, 1408), "qwen3-30b-a3b": (2048, 768),
               "olmoe-1b-7b": (2048, 1024)}
REAL_CONFIGS = {  # launch shapes beside the stored tuning: two tiles a program, 8 warps, one warp, split 4,
    # and more warps than a step's lanes fill (threads sharing a lane's rows)
    "shared-lanes": KernelConfig(gate_up_gemv=GemvConfig(64, 1024, unroll=8, num_warps=8),
                                 down_gemv=GemvConfig(64, 256, unroll=8, num_warps=2, split=4)),
    "two-tiles": KernelConfig(gate_up_gemv=GemvConfig(128, 1024, unroll=4, num_warps=4),
                              down_gemv=GemvConfig(128, 1024, unroll=4, num_warps=4, split=4)),
    "eight-warps": KernelConfig(gate_up_gemv=GemvConfig(64, 2048, unroll=16, num_warps=8),
                                down_gemv=GemvConfig(64, 2048, unroll=2, num_warps=8, split=2)),
    "one-warp": KernelConfig(gate_up_gemv=GemvConfig(64, 256, unroll=8, num_warps=1, programs_per_sm=8),
                             down_gemv=GemvConfig(64, 256, unroll=8, num_warps=1, split=4),
                             gemm=GemmConfig(32, 64, 32, num_warps=4, num_stages=2)),
}


@pytest.fixture(scope="module")
def real_blobs():
    cache = {}

    def get(shape):
        if shape not in cache:
            cache.clear()  # one shape at a time
            layout = ExpertLayout("int4", *REAL_SHAPES[shape])
            cache[shape] = layout, random_blobs(layout, 8, seed=11, device="cuda")
        return cache[shape]

    return get


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tokens", [1, 4, 64])  # 2 and 8 routed pairs (decode), 128 (prefill)
@pytest.mark.parametrize("shape", REAL_SHAPES)
def test_real_shape_bf16_matches_fp32_reference(real_blobs, shape, tokens):
    layout, blobs = real_blobs(shape)
    ffn = make_moe_ffn("cuda", layout, F.silu)  # the stored (or default) configuration
    assert isinstance(ffn, TritonInt4MoEFFN)
    hidden = torch.randn(tokens, layout.hidden, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    index, weights = routing(tokens, 8, K, seed=tokens, device="cuda")
    out = torch.full((tokens, layout.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    ffn(hidden.bfloat16(), index, weights.bfloat16(), blobs, out=out)
    truth = moe_ffn_reference(hidden.bfloat16().float(), index, weights.bfloat16().float(), blobs, layout, F.silu)
    assert relative_error(out, truth) < 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cvt", CVTS)
@pytest.mark.parametrize("config", REAL_CONFIGS)
@pytest.mark.parametrize("shape", REAL_SHAPES)
def test_real_shape_launch_shapes_match_fp32_reference(real_blobs, shape, config, cvt):
    """Decode (2 routed pairs) and prefill (64) at real shapes under launch shapes the stored
    tuning may not use, with each decode conversion."""
    layout, blobs = real_blobs(shape)
    config = REAL_CONFIGS[config]
    config = dataclasses.replace(config, gate_up_gemv=dataclasses.replace(config.gate_up_gemv, cvt=cvt),
                                 down_gemv=dataclasses.replace(config.down_gemv, cvt=cvt))
    ffn = TritonInt4MoEFFN(layout, "cuda", config=config)
    for tokens in (1, 32):
        hidden = torch.randn(tokens, layout.hidden, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
        index, weights = routing(tokens, 8, K, seed=3, device="cuda")
        out = ffn(hidden.bfloat16(), index, weights.bfloat16(), blobs)
        truth = moe_ffn_reference(hidden.bfloat16().float(), index, weights.bfloat16().float(), blobs, layout, F.silu)
        assert relative_error(out, truth) < 1e-2


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("config", ["gemv-ragged", "gemv-steps"])
def test_half2_decode_matches_reference(small, config, tokens):
    """The "half2" conversion (inline PTX compiled; interpreted, the same f16 arithmetic) in the
    ragged launch shapes and in loops of several steps: fp16 sums within a group, so a bf16-level
    tolerance."""
    layout, blobs = small
    gemvs = DECODE_CONFIGS[config]
    config = dataclasses.replace(gemvs, gate_up_gemv=dataclasses.replace(gemvs.gate_up_gemv, cvt="half2"),
                                 down_gemv=dataclasses.replace(gemvs.down_gemv, cvt="half2"))
    hidden = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    index, weights = routing(tokens, E, K, seed=tokens)
    out = run_poisoned(poisoned_ffn(layout, config, tokens, torch.float32), hidden, index, weights, blobs)
    assert relative_error(out, moe_ffn_reference(hidden, index, weights, blobs, layout, F.silu)) < HALF2_TOL


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("shape", REAL_SHAPES)
def test_zero_copy_pinned_blob_gives_the_slot_result(real_blobs, shape, tokens):
    layout, blobs = real_blobs(shape)
    ffn = make_moe_ffn("cuda", layout, F.silu)
    pinned = list(blobs)
    pinned[3] = blobs[3].cpu().pin_memory()  # expert 3 missed: read over PCIe by the kernel
    hidden = torch.randn(tokens, layout.hidden, device="cuda", dtype=torch.bfloat16)
    index, weights = routing(tokens, 8, K, seed=2, device="cuda")
    index[0, 0] = 3 if index[0, 1] != 3 else index[0, 0]
    weights = weights.bfloat16()
    assert torch.equal(ffn(hidden, index, weights, pinned), ffn(hidden, index, weights, blobs))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("config", [None, "one-warp"])  # the stored tuning; split down, runs of gate/up tiles
def test_decode_step_allocates_nothing_and_never_syncs(real_blobs, config):
    layout, blobs = real_blobs("qwen3-30b-a3b")
    ffn = make_moe_ffn("cuda", layout, F.silu, num_experts=8, config=REAL_CONFIGS.get(config))
    bases = torch.tensor([b.data_ptr() for b in blobs], dtype=torch.int64, device="cuda")
    hidden = torch.randn(1, layout.hidden, device="cuda", dtype=torch.bfloat16)
    index, weights = routing(1, 8, K, seed=0, device="cuda")
    out = torch.empty_like(hidden)
    ffn.forward_bases(hidden, index, weights, bases, out=out)  # warm-up: compilation
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
    try:
        for _ in range(3):
            ffn.forward_bases(hidden, index, weights, bases, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before


@pytest.mark.gpu
@gpu
def test_split_decode_is_deterministic_across_calls_and_graph_replays(real_blobs):
    layout, blobs = real_blobs("deepseek-v2-lite")
    config = KernelConfig(gate_up_gemv=GemvConfig(64, 512, unroll=4, num_warps=2, programs_per_sm=4),
                          down_gemv=GemvConfig(64, 512, unroll=4, num_warps=2, split=3))
    ffn = TritonInt4MoEFFN(layout, "cuda", config=config, num_experts=8)
    bases = torch.tensor([b.data_ptr() for b in blobs], dtype=torch.int64, device="cuda")
    hidden = torch.randn(2, layout.hidden, device="cuda", dtype=torch.bfloat16)
    index, weights = routing(2, 8, K, seed=4, device="cuda")
    weights = weights.bfloat16()
    first = ffn.forward_bases(hidden, index, weights, bases).clone()
    truth = moe_ffn_reference(hidden.float(), index, weights.float(), blobs, layout, F.silu)
    assert relative_error(first, truth) < 1e-2
    for _ in range(10):
        assert torch.equal(ffn.forward_bases(hidden, index, weights, bases), first)
    out = torch.empty_like(hidden)
    graph = captured(lambda: ffn.forward_bases(hidden, index, weights, bases, out=out))
    for _ in range(10):
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, first)
    assert int(ffn._split_counts.count_nonzero()) == 0


@pytest.mark.gpu
@gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not dependent.supported_on(torch.device("cuda")),
                    reason="dependent launches need compute capability 9.0 and Triton 3.4")
@pytest.mark.parametrize(("shape", "per_pair"), [("qwen3-30b-a3b", True), ("olmoe-1b-7b", True),
                                               ("qwen3-30b-a3b", False), ("deepseek-v2-lite", False)])
def test_dependent_down_launch_gives_the_ordinary_launches_bits(real_blobs, shape, per_pair):
    """The down launch started while gate/up runs (one token, 2 routed experts, apart or walked in
    turn: both grids fit on the SMs) prefetches and waits for act: the same bits as two ordinary
    launches, for experts in slots and one read zero-copy, called and replayed in a CUDA graph. The
    act workspace is NaN before every call, so a down program reading it early would show."""
    layout, blobs = real_blobs(shape)
    config = load_int4_config(torch.cuda.get_device_name(), *REAL_SHAPES[shape])
    early, ordinary = (TritonInt4MoEFFN(layout, "cuda", num_experts=8, config=dataclasses.replace(
                           config, dependent_launch=flag, down_per_pair=per_pair))
                       for flag in (True, False))
    assert early.decode_launches(1, K).dependent and not ordinary.decode_launches(1, K).dependent
    pinned = list(blobs)
    pinned[3] = blobs[3].cpu().pin_memory()
    hidden = torch.randn(1, layout.hidden, device="cuda", dtype=torch.bfloat16)
    index = torch.tensor([[3, 5]], device="cuda")
    weights = torch.tensor([[0.7, 0.3]], device="cuda", dtype=torch.bfloat16)
    for experts in (blobs, pinned):
        bases = torch.tensor([b.data_ptr() for b in experts], dtype=torch.int64, device="cuda")
        want = ordinary.forward_bases(hidden, index, weights, bases).clone()
        early._decode_act.fill_(float("nan"))
        assert torch.equal(early.forward_bases(hidden, index, weights, bases), want)
        out = torch.empty_like(hidden)
        graph = captured(lambda: early.forward_bases(hidden, index, weights, bases, out=out))
        for _ in range(3):
            out.fill_(float("nan"))
            early._decode_act.fill_(float("nan"))
            graph.replay()
            assert torch.equal(out, want)
