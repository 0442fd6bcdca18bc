"""The fused Triton expert kernels against the PyTorch reference (DESIGN.md 2.8; STYLE.md habit 4).

Without CUDA the kernels run in Triton's interpreter on the CPU (TRITON_INTERPRET=1, set below
before triton is imported) at small odd sizes. On a GPU the same tests run compiled, and the tests
marked `gpu` add the real expert shapes, a zero-copy read of a pinned host blob, and the
no-allocation / no-sync check of a decode step.

Every output and workspace is filled with NaN first, so an element a kernel fails to write fails
the comparison. Tolerances: fp32 hidden states must match the fp32 reference to 1e-5 (relative
norm); bf16 hidden states are compared with a float64 evaluation of the reference on the same
bf16 inputs. The interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest), which
roughly doubles the bf16 error on the CPU, hence its looser bound.

T tokens, E experts, K routed per token, H hidden, I expert intermediate.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton_language = pytest.importorskip("triton.language")
if os.environ.get("TRITON_INTERPRET") == "1" and type(triton_language.zeros).__name__ != "InterpretedFunction":
    # Triton reads TRITON_INTERPRET when triton.language is first imported (its own jit helpers
    # are decorated then); something imported it before this module could set the variable.
    raise RuntimeError(
        "triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on the CPU; "
        "set it at the top of tests/conftest.py (before anything imports triton) or in the environment"
    )

from mira.errors import MiraError
from mira.kernels import ReferenceMoEFFN, glu_of, make_moe_ffn  # noqa: E402
from mira.kernels.reference import moe_ffn_reference  # noqa: E402
from mira.kernels import triton_ffn  # noqa: E402
from mira.kernels.triton_ffn import TritonMoEFFN, group_by_expert  # noqa: E402
from mira.kernels.tuning import (  # noqa: E402
    GemmConfig, GemvConfig, KernelConfig, default_config, device_key, load_config, save_configs,
)
from mira.models.spec import GluForm  # noqa: E402
from mira.store.layout import ExpertLayout  # noqa: E402
from mira.store.quant import quantize_expert  # noqa: E402

from cuda_graphs import captured  # noqa: E402
from routing_cases import DEVICE, relative_error, routing  # noqa: E402
SCHEMES = ("int8-shared", "int8-row")
H, I, E, K = 96, 40, 8, 2  # odd on purpose: no block size divides I, and 64 does not divide H

FP32_TOL = 1e-5
BF16_TOL = 1e-2 if DEVICE == "cuda" else 2.5e-2

DECODE_CONFIGS = {
    # ragged H and I chunks (masked loads), both CUDA-core conversions
    "gemv-masked": KernelConfig(gate_up_gemv=GemvConfig(16, 64, unroll=1, cvt="bits"),
                                down_gemv=GemvConfig(8, 32, unroll=1, cvt="native")),
    # chunks x unroll divide H and I exactly (unmasked loads); the byte-permute conversion
    "gemv-even": KernelConfig(gate_up_gemv=GemvConfig(8, 32, unroll=3, cvt="prmt", num_warps=1),
                              down_gemv=GemvConfig(16, 8, unroll=5, cvt="bits", num_warps=1)),
    "mma": KernelConfig(gate_up_gemv=GemvConfig(16, 32, mma=True, num_stages=2),
                        down_gemv=GemvConfig(16, 16, mma=True, num_stages=2)),
    # gate/up: runs of row blocks per program (the interpreter counts 4 SMs: 1 token's 2 pairs get
    # 2 programs each, rows 0-31 and 32-39; 3 tokens' 6 pairs one program each, rows 0-39 in 3
    # blocks, the last ragged); down: the reduction split in 3 (spans of 16, the last ragged), the
    # last program to arrive adding the partials
    "gemv-split": KernelConfig(gate_up_gemv=GemvConfig(16, 32, unroll=1, programs_per_sm=1, cvt="prmt"),
                               down_gemv=GemvConfig(16, 8, unroll=2, split=3, cvt="bits")),
}
# the down launch's program walking a token's K experts in turn (down_per_pair false), split in 3
DECODE_CONFIGS["gemv-in-turn"] = dataclasses.replace(DECODE_CONFIGS["gemv-split"], down_per_pair=False)
PREFILL_CONFIGS = {  # decode_max_pairs=0 sends every call to the grouped GEMM
    "gemm-m16": KernelConfig(decode_max_pairs=0, gemm=GemmConfig(16, 32, 32, num_warps=4, num_stages=2)),
    "gemm-m32": KernelConfig(decode_max_pairs=0, gemm=GemmConfig(32, 16, 64, num_warps=4, num_stages=2)),
}


def quantized_blobs(layout: ExpertLayout, experts: int, seed: int, device: str = DEVICE) -> list[torch.Tensor]:
    """`experts` blobs quantized from random fp32 weights (the path real stores take)."""
    gen = torch.Generator().manual_seed(seed)
    H, I = layout.hidden, layout.intermediate
    blobs = []
    for _ in range(experts):
        w13 = torch.randn(2 * I, H, generator=gen) / H**0.5  # [2I, H]
        w2 = torch.randn(H, I, generator=gen) / I**0.5  # [H, I]
        blob = torch.empty(layout.nbytes, dtype=torch.uint8)
        layout.pack(quantize_expert(w13, w2, layout), blob)
        blobs.append(blob.to(device))
    return blobs


def random_blobs(layout: ExpertLayout, experts: int, seed: int, device: str) -> list[torch.Tensor]:
    """`experts` blobs of random INT8 weights and scales, made on the device (real shapes: fast)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    H, I = layout.hidden, layout.intermediate
    slots = torch.empty(experts, layout.nbytes, dtype=torch.uint8, device=device)
    for blob in slots:
        views = layout.views(blob)
        for name, view in views.items():
            if view.dtype == torch.int8:
                view.copy_(torch.randint(-127, 128, view.shape, generator=gen, device=device, dtype=torch.int8))
            else:  # ~ 1 / (std of a uniform int8 * sqrt(fan-in)): activations stay O(1)
                fan_in = I if name == "scale2" else H
                view.copy_((torch.rand(view.shape, generator=gen, device=device) + 0.5) / (73 * fan_in**0.5))
    return list(slots)


def poisoned_ffn(layout: ExpertLayout, config: KernelConfig, tokens: int, dtype: torch.dtype) -> TritonMoEFFN:
    """A kernel object whose workspaces are all NaN."""
    ffn = TritonMoEFFN(layout, DEVICE, config=config, num_experts=E, max_tokens=tokens, top_k=K, dtype=dtype)
    ffn._decode_act.fill_(float("nan"))
    ffn._split_partials.fill_(float("nan"))
    for buffer in ffn._prefill.values():
        buffer.fill_(float("nan"))
    return ffn


def run_poisoned(ffn, hidden, index, weights, blobs) -> torch.Tensor:
    out = torch.full_like(hidden, float("nan"))
    result = ffn(hidden, index, weights, blobs, out=out)
    assert result is out
    return out


@pytest.fixture(scope="module", params=SCHEMES)
def small(request):
    layout = ExpertLayout(request.param, H, I)
    return layout, quantized_blobs(layout, E, seed=1)


@pytest.mark.parametrize("config", DECODE_CONFIGS)
@pytest.mark.parametrize("tokens", [1, 3])
def test_decode_matches_reference_fp32(small, tokens, config):
    layout, blobs = small
    hidden = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    index, weights = routing(tokens, E, K, seed=tokens)
    out = run_poisoned(poisoned_ffn(layout, DECODE_CONFIGS[config], tokens, torch.float32), hidden, index, weights, blobs)
    ref = moe_ffn_reference(hidden, index, weights, blobs, layout, F.silu)
    assert relative_error(out, ref) < FP32_TOL


def test_split_down_resets_its_counts(small):
    """A split down launch's arrival counts are back at zero after a call, so the next call (other
    tokens here) is summed again, in the same order: equal to a fresh object's result."""
    layout, blobs = small
    config = DECODE_CONFIGS["gemv-split"]
    ffn = poisoned_ffn(layout, config, 3, torch.float32)
    assert ffn._split_counts.numel() == config.decode_max_pairs * 6  # most tokens x row blocks (H 96 / 16)
    first = torch.randn(3, H, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    second = torch.randn(2, H, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    index, weights = routing(3, E, K, seed=11)
    run_poisoned(ffn, first, index, weights, blobs)
    assert int(ffn._split_counts.count_nonzero()) == 0
    again = run_poisoned(ffn, second, index[:2], weights[:2], blobs)
    fresh = run_poisoned(poisoned_ffn(layout, config, 3, torch.float32), second, index[:2], weights[:2], blobs)
    assert torch.equal(again, fresh)


CUT_CONFIGS = {
    "gemv-masked": DECODE_CONFIGS["gemv-masked"],
    "gemv-split": DECODE_CONFIGS["gemv-split"],
    # down split in 5 spans of 8 that divide I exactly (unmasked loads; the tuned Mixtral form)
    "gemv-even-split": KernelConfig(gate_up_gemv=GemvConfig(8, 32, unroll=3, cvt="prmt", num_warps=1),
                                    down_gemv=GemvConfig(16, 8, unroll=1, split=5, cvt="bits", num_warps=1)),
}


@pytest.mark.parametrize("config", CUT_CONFIGS)
@pytest.mark.parametrize("tokens", [1, 3])
def test_cut_experts_compute_their_units_below_the_limit(small, tokens, config):
    """Decode with two routed experts cut (units [0, limit) only, the CPU computing the rest) equals
    the reference's layer with the same limits, and differs from the whole layer."""
    layout, blobs = small
    ffn = poisoned_ffn(layout, CUT_CONFIGS[config], tokens, torch.float32)
    granule = ffn.cut_granule
    assert granule < I
    hidden = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    index, weights = routing(tokens, E, K, seed=tokens)
    limits = [I] * E
    for expert, cut in zip(index[0].tolist(), (granule, I - I % granule if I % granule else I - granule)):
        limits[expert] = cut
    out = torch.full_like(hidden, float("nan"))
    bases = ffn._address_table(blobs)
    ffn.forward_bases(hidden, index, weights, bases, out=out,
                      limits=torch.tensor(limits, dtype=torch.int32, device=DEVICE))
    ref = moe_ffn_reference(hidden, index, weights, blobs, layout, F.silu, limits=limits)
    assert relative_error(out, ref) < FP32_TOL
    assert relative_error(out, moe_ffn_reference(hidden, index, weights, blobs, layout, F.silu)) > 1e-2


def test_configurations_that_cannot_cut_refuse_limits(small):
    """Tensor-core decode products have no cut granule, and prefill never cuts: both refuse limits."""
    layout, blobs = small
    hidden = torch.randn(37, H).to(DEVICE)
    index, weights = routing(37, E, K, seed=1)
    limits = torch.full((E,), I, dtype=torch.int32, device=DEVICE)
    mma = TritonMoEFFN(layout, DEVICE, config=DECODE_CONFIGS["mma"], num_experts=E)
    assert mma.cut_granule is None
    with pytest.raises(ValueError, match="cut"):
        mma.forward_bases(hidden[:1], index[:1], weights[:1], mma._address_table(blobs), limits=limits)
    gemv = TritonMoEFFN(layout, DEVICE, config=DECODE_CONFIGS["gemv-masked"], num_experts=E)
    with pytest.raises(ValueError, match="cut"):
        gemv.forward_bases(hidden, index, weights, gemv._address_table(blobs), limits=limits)


@pytest.mark.parametrize("config", PREFILL_CONFIGS)
@pytest.mark.parametrize("tokens", [1, 3, 37])
def test_prefill_matches_reference_fp32(small, tokens, config):
    layout, blobs = small
    hidden = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    index, weights = routing(tokens, E, K, seed=tokens)
    out = run_poisoned(poisoned_ffn(layout, PREFILL_CONFIGS[config], tokens, torch.float32), hidden, index, weights, blobs)
    ref = moe_ffn_reference(hidden, index, weights, blobs, layout, F.silu)
    assert relative_error(out, ref) < FP32_TOL


@pytest.mark.parametrize(("config", "tokens"), [("gemv-masked", 3), ("mma", 3), ("gemv-split", 3), ("gemm-m16", 3),
                                               ("gemm-m16", 37)])
def test_bf16_hidden_matches_float64_reference(small, tokens, config):
    layout, blobs = small
    cfg = {**DECODE_CONFIGS, **PREFILL_CONFIGS}[config]
    hidden = torch.randn(tokens, H, generator=torch.Generator().manual_seed(7)).to(DEVICE, torch.bfloat16)
    index, weights = routing(tokens, E, K, seed=7)
    weights = weights.bfloat16()
    out = run_poisoned(poisoned_ffn(layout, cfg, tokens, torch.bfloat16), hidden, index, weights, blobs)
    assert out.dtype == torch.bfloat16
    truth = moe_ffn_reference(hidden.double(), index, weights.double(), blobs, layout, F.silu)
    assert relative_error(out, truth) < BF16_TOL


@pytest.mark.parametrize(("config", "tokens"), [("gemv-even", 8), ("gemv-split", 8), ("gemm-m16", 37)])
def test_repeated_experts(small, config, tokens):
    """Every token routed to experts 3 and 5 (in either order); in the GEMM one expert's 37
    pairs span three blocks."""
    layout, blobs = small
    cfg = {**DECODE_CONFIGS, **PREFILL_CONFIGS}[config]
    hidden = torch.randn(tokens, H, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    index = torch.tensor([[3, 5], [5, 3]] * (tokens // 2) + [[3, 5]] * (tokens % 2), device=DEVICE)  # [T, K]
    weights = torch.rand(tokens, K, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    out = run_poisoned(poisoned_ffn(layout, cfg, tokens, torch.float32), hidden, index, weights, blobs)
    ref = moe_ffn_reference(hidden, index, weights, blobs, layout, F.silu)
    assert relative_error(out, ref) < FP32_TOL


@pytest.mark.parametrize("tokens", [1, 37])
def test_default_config_serves_decode_and_prefill(small, tokens):
    layout, blobs = small
    ffn = TritonMoEFFN(layout, DEVICE, config=default_config(H, I))
    hidden = torch.randn(tokens, H, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    index, weights = routing(tokens, E, K, seed=5)
    out = run_poisoned(ffn, hidden, index, weights, blobs)
    ref = moe_ffn_reference(hidden, index, weights, blobs, layout, F.silu)
    assert relative_error(out, ref) < FP32_TOL


@pytest.mark.parametrize("config", ["gemv-masked", "mma", "gemm-m16"])
def test_routed_expert_without_blob_yields_nan_rows(small, config):
    layout, blobs = small
    blobs = list(blobs)
    blobs[2] = None
    tokens = 3
    index = torch.tensor([[0, 1], [2, 4], [4, 6]], device=DEVICE)
    weights = torch.full((tokens, K), 0.5, device=DEVICE)
    hidden = torch.randn(tokens, H, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    ffn = TritonMoEFFN(layout, DEVICE, config={**DECODE_CONFIGS, **PREFILL_CONFIGS}[config])
    out = ffn(hidden, index, weights, blobs)
    assert torch.isnan(out[1]).all()
    assert torch.isfinite(out[[0, 2]]).all()
    ref = moe_ffn_reference(hidden[[0, 2]], index[[0, 2]], weights[[0, 2]], blobs, layout, F.silu)
    assert relative_error(out[[0, 2]], ref) < FP32_TOL


def test_forward_bases_matches_the_blob_list(small):
    layout, blobs = small
    ffn = TritonMoEFFN(layout, DEVICE, config=DECODE_CONFIGS["gemv-masked"])
    bases = torch.tensor([b.data_ptr() for b in blobs], dtype=torch.int64, device=DEVICE)
    hidden = torch.randn(2, H, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    index, weights = routing(2, E, K, seed=4)
    assert torch.equal(ffn.forward_bases(hidden, index, weights, bases), ffn(hidden, index, weights, blobs))


def test_zero_tokens_returns_empty(small):
    layout, blobs = small
    ffn = TritonMoEFFN(layout, DEVICE, config=DECODE_CONFIGS["gemv-masked"])
    out = ffn(torch.empty(0, H, device=DEVICE), torch.empty(0, K, dtype=torch.long, device=DEVICE),
              torch.empty(0, K, device=DEVICE), blobs)
    assert out.shape == (0, H)


def test_wrong_blob_size_is_refused(small):
    layout, blobs = small
    ffn = TritonMoEFFN(layout, DEVICE, config=DECODE_CONFIGS["gemv-masked"])
    bad = list(blobs)
    bad[1] = torch.zeros(layout.nbytes - 1, dtype=torch.uint8, device=DEVICE)
    index, weights = routing(1, E, K, seed=0)
    with pytest.raises(ValueError, match="expert 1's blob"):
        ffn(torch.zeros(1, H, device=DEVICE), index, weights, bad)


@pytest.mark.parametrize("one_program", [True, False], ids=["one-program", "torch-sort"])
def test_group_by_expert_places_every_pair_once_in_its_experts_blocks(one_program, monkeypatch):
    monkeypatch.setattr(triton_ffn, "ONE_PROGRAM_GROUPING", 1 << 62 if one_program else 0)  # one path for every size
    gen = torch.Generator().manual_seed(0)
    index = torch.randint(0, E, (53,), generator=gen)
    index[:20] = 6  # one expert over several blocks
    block_m = 8
    sorted_pair, block_expert = group_by_expert(index, E, block_m)
    P = index.numel()
    assert sorted_pair.numel() == block_expert.numel() * block_m
    blocks = sorted_pair.view(-1, block_m)
    seen = []
    for block, expert in zip(blocks.tolist(), block_expert.tolist()):
        pairs = [p for p in block if p != P]
        if expert < 0:
            assert not pairs
            continue
        assert pairs and all(index[p] == expert for p in pairs)
        assert pairs == sorted(pairs)
        seen += pairs
    assert sorted(seen) == list(range(P))
    used = block_expert[block_expert >= 0]
    assert torch.all(used[1:] >= used[:-1])  # experts in ascending order


def test_factory_chooses_reference_on_cpu_and_for_other_activations_or_schemes():
    shared = ExpertLayout("int8-shared", H, I)
    assert isinstance(make_moe_ffn("cpu", shared, F.silu), ReferenceMoEFFN)
    assert isinstance(make_moe_ffn("cuda", shared, F.gelu), ReferenceMoEFFN)
    assert isinstance(make_moe_ffn("cuda", ExpertLayout("none", H, I, torch.bfloat16), "silu"), ReferenceMoEFFN)
    assert glu_of(torch.nn.SiLU(), None) == glu_of("silu", None) == GluForm() and glu_of(F.gelu, None) is None
    with pytest.raises(MiraError, match="do not compute the activation"):
        make_moe_ffn("cpu", shared, F.gelu, backend="triton")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        make_moe_ffn("cpu", shared, F.silu, backend="cutlass")


def test_factory_triton_backend_matches_reference_backend(small):
    layout, blobs = small
    fused = make_moe_ffn(DEVICE, layout, torch.nn.SiLU(), backend="triton")
    plain = make_moe_ffn(DEVICE, layout, "silu", backend="reference")
    assert isinstance(fused, TritonMoEFFN)
    hidden = torch.randn(3, H, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    index, weights = routing(3, E, K, seed=9)
    out = torch.full_like(hidden, float("nan"))
    assert plain(hidden, index, weights, blobs, out=out) is out
    assert relative_error(fused(hidden, index, weights, blobs), out) < FP32_TOL


def test_tuning_file_round_trip_and_default(tmp_path):
    tuned = KernelConfig(decode_max_pairs=8, gate_up_gemv=GemvConfig(32, 128, unroll=4, cvt="prmt"),
                         down_gemv=GemvConfig(16, 256, mma=True), gemm=GemmConfig(128, 64, 32))
    tmp_path = tmp_path / "tuning"  # a directory not made yet: an autotune writing to a fresh place
    path = save_configs("NVIDIA H200", {(H, I): tuned}, {"written_by": "test"}, directory=tmp_path)
    assert path.name == "nvidia-h200.json" and device_key("NVIDIA H200") == "nvidia-h200"
    assert load_config("NVIDIA H200", H, I, directory=tmp_path) == tuned
    other = KernelConfig(decode_max_pairs=4)
    save_configs("NVIDIA H200", {(H, 2 * I): other}, {"written_by": "test"}, directory=tmp_path)  # merged
    assert load_config("NVIDIA H200", H, I, directory=tmp_path) == tuned
    assert load_config("NVIDIA H200", H, 2 * I, directory=tmp_path) == other
    assert [p.name for p in tmp_path.iterdir()] == ["nvidia-h200.json"]  # no temporary left
    assert load_config("NVIDIA H200", H, 3 * I, directory=tmp_path) == default_config(H, 3 * I)
    assert load_config("Some Other GPU", H, I, directory=tmp_path) == default_config(H, I)
    path.write_text(json.dumps({"shapes": {f"{H}x{I}": {"gemm": {}}}}))
    with pytest.raises(ValueError, match="--autotune"):
        load_config("NVIDIA H200", H, I, directory=tmp_path)


# ---- GPU only: real shapes, zero-copy, allocation and sync -------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
REAL_SHAPES = {"mixtral-8x7b": (4096, 14336), "deepseek-v2-lite": (2048, 1408), "qwen3-30b-a3b": (2048, 768)}


@pytest.fixture(scope="module")
def real_blobs():
    cache = {}

    def get(scheme, shape):
        if (scheme, shape) not in cache:
            cache.clear()  # one shape at a time: a Mixtral layer is 1.4 GB
            layout = ExpertLayout(scheme, *REAL_SHAPES[shape])
            cache[scheme, shape] = layout, random_blobs(layout, E, seed=11, device="cuda")
        return cache[scheme, shape]

    return get


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tokens", [1, 4, 64])  # 2 and 8 routed pairs (decode), 128 (prefill)
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", REAL_SHAPES)
def test_real_shape_bf16_matches_fp32_reference(real_blobs, shape, scheme, tokens):
    layout, blobs = real_blobs(scheme, shape)
    ffn = make_moe_ffn("cuda", layout, F.silu)  # the stored (tuned) configuration
    assert isinstance(ffn, TritonMoEFFN)
    hidden = torch.randn(tokens, layout.hidden, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    index, weights = routing(tokens, E, K, seed=tokens, device="cuda")
    out = torch.full((tokens, layout.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    ffn(hidden.bfloat16(), index, weights.bfloat16(), blobs, out=out)
    truth = moe_ffn_reference(hidden.bfloat16().float(), index, weights.bfloat16().float(), blobs, layout, F.silu)
    assert relative_error(out, truth) < 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("shape", REAL_SHAPES)
def test_zero_copy_pinned_blob_gives_the_slot_result(real_blobs, shape, tokens):
    layout, blobs = real_blobs("int8-shared", shape)
    ffn = make_moe_ffn("cuda", layout, F.silu)
    pinned = list(blobs)
    pinned[3] = blobs[3].cpu().pin_memory()  # expert 3 missed: read over PCIe by the kernel
    hidden = torch.randn(tokens, layout.hidden, device="cuda", dtype=torch.bfloat16)
    index, weights = routing(tokens, E, K, seed=2, device="cuda")
    index[0, 0] = 3 if index[0, 1] != 3 else index[0, 0]
    weights = weights.bfloat16()
    assert torch.equal(ffn(hidden, index, weights, pinned), ffn(hidden, index, weights, blobs))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", REAL_SHAPES)
def test_a_cut_pinned_expert_gives_its_units_below_the_limit(real_blobs, shape):
    """The tuned decode GEMVs cut a missed expert read over PCIe: its units below the limit, as the
    reference computes them."""
    layout, blobs = real_blobs("int8-shared", shape)
    ffn = make_moe_ffn("cuda", layout, F.silu, num_experts=E)
    granule = ffn.cut_granule
    pinned = list(blobs)
    pinned[3] = blobs[3].cpu().pin_memory()
    hidden = torch.randn(1, layout.hidden, device="cuda", dtype=torch.bfloat16)
    index, weights = routing(1, E, K, seed=2, device="cuda")
    index[0, 0] = 3 if index[0, 1] != 3 else index[0, 0]
    weights = weights.bfloat16()
    limits = [layout.intermediate] * E
    limits[3] = (layout.intermediate // granule // 2) * granule
    out = ffn.forward_bases(hidden, index, weights, ffn._address_table(pinned),
                            limits=torch.tensor(limits, dtype=torch.int32, device="cuda"))
    truth = moe_ffn_reference(hidden.float(), index, weights.float(), blobs, layout, F.silu, limits=limits)
    assert relative_error(out, truth) < 1e-2


@pytest.mark.gpu
@gpu
def test_pageable_host_blob_is_refused():
    layout = ExpertLayout("int8-shared", H, I)
    blobs = quantized_blobs(layout, E, seed=1, device="cuda")
    blobs[0] = blobs[0].cpu()
    ffn = make_moe_ffn("cuda", layout, F.silu)
    index, weights = routing(1, E, K, seed=0, device="cuda")
    with pytest.raises(ValueError, match="pinned"):
        ffn(torch.zeros(1, H, device="cuda"), index, weights, blobs)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("keep_table", [False, True], ids=["blob-list", "device-table"])
def test_decode_step_allocates_nothing_and_never_syncs(real_blobs, keep_table):
    layout, blobs = real_blobs("int8-shared", "qwen3-30b-a3b")
    ffn = make_moe_ffn("cuda", layout, F.silu, num_experts=E)
    bases = torch.tensor([b.data_ptr() for b in blobs], dtype=torch.int64, device="cuda")
    hidden = torch.randn(1, layout.hidden, device="cuda", dtype=torch.bfloat16)
    index, weights = routing(1, E, K, seed=0, device="cuda")
    out = torch.empty_like(hidden)

    def step():
        if keep_table:
            ffn.forward_bases(hidden, index, weights, bases, out=out)
        else:
            ffn(hidden, index, weights, blobs, out=out)

    step()  # warm-up: compilation, first-call allocations
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before


@pytest.mark.gpu
@gpu
def test_split_decode_is_deterministic_across_calls_and_graph_replays(real_blobs):
    """Runs of rows in gate/up and a split down launch, compiled, at a real shape: the last program
    to arrive adds the partials in a fixed order and resets its count, so every call and every
    replay of a captured call gives the same bits, and they match the reference."""
    layout, blobs = real_blobs("int8-shared", "qwen3-30b-a3b")
    config = KernelConfig(gate_up_gemv=GemvConfig(8, 256, unroll=2, programs_per_sm=4, cvt="prmt"),
                          down_gemv=GemvConfig(8, 256, unroll=2, split=4, cvt="prmt"))
    ffn = TritonMoEFFN(layout, "cuda", config=config, num_experts=E)
    bases = torch.tensor([b.data_ptr() for b in blobs], dtype=torch.int64, device="cuda")
    hidden = torch.randn(2, layout.hidden, device="cuda", dtype=torch.bfloat16)
    index, weights = routing(2, E, K, seed=4, device="cuda")
    weights = weights.bfloat16()
    out = torch.empty_like(hidden)
    first = ffn.forward_bases(hidden, index, weights, bases).clone()
    truth = moe_ffn_reference(hidden.float(), index, weights.float(), blobs, layout, F.silu)
    assert relative_error(first, truth) < 1e-2
    for _ in range(20):
        assert torch.equal(ffn.forward_bases(hidden, index, weights, bases), first)
    graph = captured(lambda: ffn.forward_bases(hidden, index, weights, bases, out=out))
    for _ in range(20):
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, first)
    assert int(ffn._split_counts.count_nonzero()) == 0
