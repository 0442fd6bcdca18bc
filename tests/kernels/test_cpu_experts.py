"""The CPU expert executor against the float64 PyTorch reference, within error bounds derived from
the dtypes it rounds to, and reading the store's blobs in place (or, for an INT8 expert of many
tokens, converting them once for dense products)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from mira.kernels import cpu_int4, make_moe_ffn
from mira.kernels.cpu_experts import COLUMN_COPY_COST, COMPUTE_DTYPE, DENSE_TOKENS, CpuExpertFFN
from mira.kernels.reference import expert_ffn, moe_ffn_reference
from mira.store.layout import ExpertLayout
from mira.store.quant import dequantize_expert, quantize_expert

# (H, I): multiples of 16 (the vectorised product) and not (the fp32 form), in either or both
SHAPES = [(64, 32), (128, 48), (96, 40), (40, 96), (72, 29), (130, 7)]
TOKENS = [1, 3, 17, DENSE_TOKENS]  # the last: INT8 experts take dense products
SCHEMES = [("int8-row", torch.int8), ("int8-shared", torch.int8), ("int4", torch.int8), ("none", torch.bfloat16),
           ("none", torch.float32)]
U32 = 2.0**-24  # unit roundoff of the fp32 accumulators
SILU_SLOPE = 1.1  # |d silu / dx| <= 1.1 everywhere; so is |d (x sigmoid(a x)) / dx| for any a > 0
ACT_ULPS = 4  # float32 roundings of evaluating an activation, at most
LIMIT, ALPHA = 1.0, 1.702  # the clamped SwiGLU below: clamps well inside the test's gate/up values


def clamped_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """A family's own gating (gpt-oss's form, gate rows first): [T, 2I] -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
    return (up + 1) * gate * torch.sigmoid(ALPHA * gate)


def shapes_of(scheme: str) -> list[tuple[int, int]]:
    """int4 stores whole tiles of 64 rows and groups of 64 columns (one or several)."""
    return [(64, 64), (128, 192), (192, 64)] if scheme == "int4" else SHAPES


def sized(scheme: str, H: int, I: int) -> tuple[int, int]:
    """(H, I), each rounded up to whole tiles and groups of 64 for int4."""
    return (-(-H // 64) * 64, -(-I // 64) * 64) if scheme == "int4" else (H, I)


def make_blobs(layout: ExpertLayout, experts: int, seed: int) -> list[torch.Tensor]:
    """Random experts whose hidden channels differ in size (as trained ones do), so int8-shared's
    scale vector varies from channel to channel; biases, when the layout has them, of the outputs' size."""
    g = torch.Generator().manual_seed(seed)
    H, I = layout.hidden, layout.intermediate
    rows13 = 2 * I if layout.gated else I
    blobs = []
    for _ in range(experts):
        channel_gain = torch.exp(torch.randn(H, generator=g))  # [H]
        w13 = torch.randn(rows13, H, generator=g) / math.sqrt(H) * channel_gain
        w2 = torch.randn(H, I, generator=g) / math.sqrt(I) * channel_gain[:, None]
        b13, b2 = torch.randn(rows13, generator=g), torch.randn(H, generator=g)
        blob = torch.empty(layout.nbytes, dtype=torch.uint8)
        layout.pack(quantize_expert(w13, w2, layout, b13, b2), blob)
        blobs.append(blob)
    return blobs


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def compute_dtype(layout: ExpertLayout, views: dict) -> torch.dtype:
    """The dtype the executor's products take: the weights' own (none), float32 (int4 where torch's
    INT4 matmul cannot read the blob), else bf16."""
    if layout.scheme == "none":
        return views["w13"].dtype
    if layout.scheme == "int4" and not cpu_int4.torch_reads_blobs():
        return torch.float32
    return COMPUTE_DTYPE


def expert_bound(x: torch.Tensor, views: dict, layout: ExpertLayout, gate=None) -> torch.Tensor:
    """A first-order bound [T, H] on |executor - exact| for one expert, from where the executor
    rounds: activations to the compute dtype (and, int8-shared, x * s once more), int4's weights
    dequantized in float32 (times s, plus z), the gate/up outputs, the bias added in float32, the activation evaluated
    in float32 and rounded to the compute dtype, the down outputs, each within one unit roundoff u of
    its dtype, plus fp32 accumulation (K * u32 of the sum of magnitudes); doubled for second-order terms.
    Dense products (an INT8 expert of DENSE_TOKENS tokens or more) round their outputs once more
    where a row scale multiplies them after the product: int8-row's gate/up, and every INT8 down."""
    w13, w2 = dequantize_expert(views, layout)  # float64, exact
    compute = compute_dtype(layout, views)
    u = unit_roundoff(compute)
    xd = x.double()
    H, I = layout.hidden, layout.intermediate
    weight_roundings = 2 if layout.scheme == "int4" else 0
    dense = layout.scheme in ("int8-shared", "int8-row") and x.shape[0] >= DENSE_TOKENS
    output_roundings13 = 2 if dense and layout.scheme == "int8-row" else 1
    input_roundings = (0 if torch.finfo(compute).eps <= torch.finfo(x.dtype).eps else 1) + (
        1 if layout.scheme == "int8-shared" else 0)
    gate_up = xd @ w13.T  # [T, 2I]
    err13 = ((input_roundings + output_roundings13) * u + (H + weight_roundings) * U32) * (xd.abs() @ w13.abs().T)
    if layout.bias:
        gate_up = gate_up + views["b13"].double()
        err13 = err13 + U32 * gate_up.abs()
    if gate is not None:  # clamped_swiglu: clamps are 1-Lipschitz
        g, up = gate_up.chunk(2, dim=-1)
        e_g, e_up = err13.chunk(2, dim=-1)
        g, up = g.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
        glu = g * torch.sigmoid(ALPHA * g)
        h = (up + 1) * glu
        err_h = SILU_SLOPE * e_g * (up + 1).abs() + glu.abs() * e_up
    elif layout.gated:
        g, up = gate_up.chunk(2, dim=-1)
        e_g, e_up = err13.chunk(2, dim=-1)
        h = F.silu(g) * up  # [T, I]
        err_h = SILU_SLOPE * e_g * up.abs() + F.silu(g).abs() * e_up
    else:
        h = F.silu(gate_up)
        err_h = SILU_SLOPE * err13
    err_h = err_h + (u + ACT_ULPS * U32) * h.abs()
    y_mag = h.abs() @ w2.abs().T  # [T, H]
    err_y = err_h @ w2.abs().T + ((2 if dense else 1) * u + (I + weight_roundings) * U32) * y_mag
    out_mag = y_mag
    if layout.bias:
        out_mag = y_mag + views["b2"].double().abs()
        err_y = err_y + U32 * out_mag
    return 2 * (err_y + unit_roundoff(x.dtype) * out_mag)


@pytest.mark.parametrize("scheme,weight_dtype,shape", [(*s, shape) for s in SCHEMES for shape in shapes_of(s[0])])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_expert_matches_float64_reference(scheme, weight_dtype, shape, tokens, x_dtype):
    H, I = shape
    layout = ExpertLayout(scheme, H, I, weight_dtype)
    blob = make_blobs(layout, 1, seed=H * 1000 + I)[0]
    views = layout.views(blob)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens)).to(x_dtype)
    y = CpuExpertFFN(layout, F.silu).expert(x, views)
    assert y.dtype == x_dtype and y.shape == (tokens, H)
    assert_matches_reference(y, x, views, layout)


def assert_matches_reference(y: torch.Tensor, x: torch.Tensor, views: dict, layout: ExpertLayout, gate=None,
                             units=None) -> None:
    """y is the expert's output on x (its `units` only, when given) within the derived bound of the
    float64 reference, and no less accurate than the reference itself run in the executor's compute
    dtype (a tighter, statistical check: the bound is a worst case that real roundings stay far
    inside). The whole expert's bound also bounds a part: it sums the magnitudes of more terms."""
    exact = expert_ffn(x.double(), views, layout, F.silu, gate, units)  # the reference in float64
    error = (y.double() - exact).abs()
    bound = expert_bound(x, views, layout, gate)
    assert (error <= bound).all(), f"worst error / bound {(error / bound).max():.2f}"
    compute = compute_dtype(layout, views)
    in_dtype = expert_ffn(x.to(compute), views, layout, F.silu, gate, units).to(x.dtype).double()
    assert error.max() <= 3 * (in_dtype - exact).abs().max()


# (gated, bias, gate) beyond the plain SwiGLU layout
VARIANTS = {"bias": (True, True, None), "ungated": (False, False, None), "ungated+bias": (False, True, None),
            "gate": (True, False, clamped_swiglu), "gate+bias": (True, True, clamped_swiglu)}


@pytest.mark.parametrize("scheme,weight_dtype,variant", [
    (*s, v) for s in SCHEMES for v in VARIANTS])
@pytest.mark.parametrize("shape", [(64, 32), (96, 40)])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [5, DENSE_TOKENS])
def test_biases_ungated_experts_and_a_familys_gate_match_the_reference(scheme, weight_dtype, variant, shape, x_dtype,
                                                                        tokens):
    gated, bias, gate = VARIANTS[variant]
    H, I = sized(scheme, *shape)
    layout = ExpertLayout(scheme, H, I, weight_dtype, gated=gated, bias=bias)
    views = layout.views(make_blobs(layout, 1, seed=H + I)[0])
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(I)).to(x_dtype)
    y = CpuExpertFFN(layout, F.silu, gate=gate).expert(x, views)
    assert y.dtype == x_dtype and y.shape == (tokens, H)
    assert_matches_reference(y, x, views, layout, gate)


@pytest.mark.parametrize("scheme,weight_dtype,variant", [
    (*s, v) for s in SCHEMES for v in ("plain", *VARIANTS) if s[0] != "int4"])  # int4 experts are not cut
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("first", [16, 40])  # the CPU's part: 2/3 of the units (whole W2), 1/6 (its columns)
def test_a_cut_experts_cpu_part_matches_the_reference_part(scheme, weight_dtype, variant, tokens, first):
    """From a cut point on, the executor computes those intermediate units only (the down bias is
    the other part's): against the float64 reference of the same units, whose two parts add up to
    the whole expert. A part of 8 units reduces its INT8 columns through the fp32 product."""
    gated, bias, gate = VARIANTS.get(variant, (True, False, None))
    H, I = 64, 48
    layout = ExpertLayout(scheme, H, I, weight_dtype, gated=gated, bias=bias)
    views = layout.views(make_blobs(layout, 1, seed=first + I)[0])
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
    y = CpuExpertFFN(layout, F.silu, gate=gate).expert(x, views, first)
    assert_matches_reference(y, x, views, layout, gate, units=(first, I))
    xd = x.double()
    parts = [expert_ffn(xd, views, layout, F.silu, gate, units) for units in ((0, first), (first, I))]
    torch.testing.assert_close(parts[0] + parts[1], expert_ffn(xd, views, layout, F.silu, gate), rtol=1e-12,
                               atol=1e-12)
    whole = expert_ffn(xd, views, layout, F.silu, gate)
    assert (parts[1] - whole).abs().max() > 1e-3 * whole.abs().max()  # a part is not the whole


def _down_weight(layout: ExpertLayout, blob: torch.Tensor, first: int, **executor) -> torch.Tensor:
    """The weight of the down product a cut's CPU part from unit `first` makes."""
    with _RecordWeights() as recorded:
        CpuExpertFFN(layout, F.silu, **executor).expert(torch.randn(1, layout.hidden), layout.views(blob), first)
    return recorded.weights[-1]


@pytest.mark.parametrize("scheme,weight_dtype", [s for s in SCHEMES if s[0] != "int4"])
@pytest.mark.parametrize("first", [8, 24, 28, 32])  # I = 40: the CPU's part 0.8, 0.4, 0.3 and 0.2 of the units
def test_a_cuts_down_product_reads_its_columns_where_they_cost_less_than_the_whole(scheme, weight_dtype, first):
    """Hand-worked, I = 40: INT8 columns cost three reads of their bytes (`COLUMN_COPY_COST`), so
    parts of 0.8 and 0.4 multiply the blob's whole W2 in place, and parts of 0.3 and 0.2 a
    contiguous copy of exactly their columns; float weights are multiplied strided in place, at
    every share."""
    H, I = 96, 40
    layout = ExpertLayout(scheme, H, I, weight_dtype)
    blob = make_blobs(layout, 1, seed=first)[0]
    w2 = layout.views(blob)["w2"]
    down = _down_weight(layout, blob, first)
    in_blob = down.untyped_storage().data_ptr() == blob.untyped_storage().data_ptr()
    if scheme != "none" and first in (8, 24):
        assert in_blob and down.data_ptr() == w2.data_ptr() and down.shape == (H, I)
    else:
        assert down.shape == (H, I - first) and torch.equal(down, w2[:, first:])
        assert in_blob == (scheme == "none") and down.is_contiguous() == (scheme != "none")


def test_a_column_cost_given_to_the_executor_decides_its_down_read():
    """The benchmark's A/B: columns at one read of their bytes are taken at every share, at an
    infinite cost never."""
    H, I = 96, 40
    layout = ExpertLayout("int8-shared", H, I)
    blob = make_blobs(layout, 1, seed=5)[0]
    assert _down_weight(layout, blob, 8, column_cost=1.0).shape == (H, I - 8)
    assert _down_weight(layout, blob, 32, column_cost=math.inf).shape == (H, I)
    assert CpuExpertFFN(layout, F.silu).column_cost == COLUMN_COPY_COST


def test_a_cut_point_outside_the_intermediate_units_is_refused():
    layout = ExpertLayout("int8-shared", 64, 32)
    views = layout.views(make_blobs(layout, 1, seed=3)[0])
    with pytest.raises(ValueError, match=r"\[0, 32\)"):
        CpuExpertFFN(layout, F.silu).expert(torch.randn(1, 64), views, 32)


def test_an_int4_cut_is_refused():
    """The INT4 kernels cut no expert, so a cut int4 expert is a caller's error, not a part computed."""
    layout = ExpertLayout("int4", 64, 64)
    views = layout.views(make_blobs(layout, 1, seed=3)[0])
    with pytest.raises(ValueError, match="computed whole"):
        CpuExpertFFN(layout, F.silu).expert(torch.randn(1, 64), views, 16)


def test_the_checks_catch_a_gate_or_a_bias_left_out():
    """The executor without the family's gate, or reading a layout without its biases, is caught."""
    H, I = 64, 64
    layout = ExpertLayout("int4", H, I, bias=True)
    views = layout.views(make_blobs(layout, 1, seed=7)[0])
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(7))
    with pytest.raises(AssertionError):
        assert_matches_reference(CpuExpertFFN(layout, F.silu).expert(x, views), x, views, layout, clamped_swiglu)
    no_bias = ExpertLayout("int4", H, I)
    y = CpuExpertFFN(no_bias, F.silu, gate=clamped_swiglu).expert(x, {k: v for k, v in views.items() if k[0] != "b"})
    with pytest.raises(AssertionError):
        assert_matches_reference(y, x, views, layout, clamped_swiglu)


def test_activations_off_the_vector_alignment_are_served():
    """A row view that starts 2 bytes into its buffer (the vectorised product needs 32) still computes."""
    H, I = 64, 32
    layout = ExpertLayout("int8-row", H, I)
    views = layout.views(make_blobs(layout, 1, seed=5)[0])
    buffer = torch.randn(3 * H + 1).bfloat16()
    x = buffer[1:].view(3, H)
    assert x.data_ptr() % 32
    assert_matches_reference(CpuExpertFFN(layout, F.silu).expert(x, views), x, views, layout)


def test_the_checks_catch_a_scale_on_the_wrong_side():
    """int8-shared's vector applied per gate/up row instead of per input channel is caught."""
    H, I = 64, 32
    layout = ExpertLayout("int8-shared", H, I)
    views = layout.views(make_blobs(layout, 1, seed=3)[0])
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(3))
    wrong = torch._weight_int8pack_mm(x.bfloat16(), views["w13"], torch.cat([views["scale"]] * (2 * I // H)))
    gate, up = wrong.float().chunk(2, dim=-1)
    y = torch._weight_int8pack_mm((F.silu(gate) * up).bfloat16(), views["w2"], views["scale"]).float()
    with pytest.raises(AssertionError):
        assert_matches_reference(y, x, views, layout)


@pytest.mark.parametrize("scheme,weight_dtype,cut", [(*s, cut) for s in SCHEMES for cut in (None, 10, 20)
                                                     if not (s[0] == "int4" and cut)])  # int4 experts are not cut
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_layer_subsets_add_up_to_the_reference_layer(scheme, weight_dtype, tokens, cut):
    """Two disjoint expert sets computed apart (the CPU's and the GPU's share) sum to the whole layer;
    with a cut, the CPU's first expert from unit `cut` on only (of 29: the whole W2 read, or its
    columns), and the reference's layer call with that expert's limit at `cut` computes the rest."""
    (H, I), E, K = sized(scheme, 72, 29), 6, 2
    layout = ExpertLayout(scheme, H, I, weight_dtype)
    blobs = make_blobs(layout, E, seed=tokens)
    g = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, H, generator=g).bfloat16()
    top_k_index = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])  # [T, K]
    top_k_weights = torch.softmax(torch.randn(tokens, K, generator=g), dim=-1)  # [T, K]
    ffn = CpuExpertFFN(layout, F.silu)
    routed = top_k_index.unique().tolist()
    first, second = routed[::2], routed[1::2]
    out = torch.full((tokens, H), float("nan"), dtype=torch.float32)  # a sentinel: every row must be written
    part = ffn(hidden, top_k_index, top_k_weights, blobs, first, out=out, cut=(first[0], cut) if cut else None)
    assert part is out and not out.isnan().any()
    total = out.double() + ffn(hidden, top_k_index, top_k_weights, blobs, second).double()
    exact = moe_ffn_reference(hidden.double(), top_k_index, top_k_weights.double(), blobs, layout, F.silu)
    if cut:
        limits = [I] * E
        limits[first[0]] = cut
        only = [blob if expert == first[0] else None for expert, blob in enumerate(blobs)]
        rest = moe_ffn_reference(hidden.double(), top_k_index, top_k_weights.double(), only, layout, F.silu, None,
                                 "zero", limits)
        total += rest
        assert (rest.abs().sum(dim=-1) > 0).any() and not torch.allclose(total - rest, exact)
    bound = torch.zeros(tokens, H, dtype=torch.float64)
    for expert in routed:
        token_idx, k_pos = torch.where(top_k_index == expert)
        per_expert = expert_bound(hidden[token_idx], layout.views(blobs[expert]), layout)
        bound.index_add_(0, token_idx, per_expert * top_k_weights[token_idx, k_pos, None].double())
    bound += 2 * unit_roundoff(torch.bfloat16) * exact.abs()  # each partial sum leaves in bf16
    assert ((total - exact).abs() <= bound).all()
    if weight_dtype != torch.float32:  # computed in bf16, like the reference run on bf16 states
        in_bf16 = moe_ffn_reference(hidden, top_k_index, top_k_weights.bfloat16(), blobs, layout, F.silu).double()
        assert (total - exact).abs().max() <= 3 * (in_bf16 - exact).abs().max()


def test_rows_of_no_computed_expert_are_zero_and_unrouted_experts_cost_nothing():
    H, I = 64, 32
    layout = ExpertLayout("int8-row", H, I)
    blobs = make_blobs(layout, 4, seed=1)
    hidden = torch.randn(3, H)
    top_k_index = torch.tensor([[0, 1], [1, 2], [0, 2]])
    weights = torch.full((3, 2), 0.5)
    out = torch.full((3, H), float("nan"))
    CpuExpertFFN(layout, F.silu)(hidden, top_k_index, weights, [blobs[0], None, None, blobs[3]], [0, 3], out=out)
    assert (out[1] == 0).all() and (out[0] != 0).any() and (out[2] != 0).any()


def test_an_expert_without_blob_is_refused():
    layout = ExpertLayout("int8-row", 64, 32)
    with pytest.raises(ValueError, match="expert 1"):
        CpuExpertFFN(layout, F.silu)(torch.randn(1, 64), torch.tensor([[1]]), torch.ones(1, 1), [None, None], [1])


@pytest.mark.parametrize("scheme,weight_dtype", SCHEMES)
@pytest.mark.parametrize("tokens", [1, 5])
def test_a_cpu_only_runs_layer_is_exact_in_float32_and_the_executors_in_bf16(scheme, weight_dtype, tokens):
    """`make_moe_ffn` on the CPU: for float32 states (or an unknown dtype) the reference's exact
    arithmetic, for bf16 ones the executor's products, within the executor's bound of the float64
    reference; an expert without a blob adds zero where another executor computes it, and is refused
    elsewhere; the executor computes experts whole."""
    (H, I), E, K = sized(scheme, 64, 32), 5, 2
    layout = ExpertLayout(scheme, H, I, weight_dtype)
    blobs = make_blobs(layout, E, seed=3)
    g = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, H, generator=g)
    top_k_index = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])  # [T, K]
    top_k_weights = torch.softmax(torch.randn(tokens, K, generator=g), dim=-1)  # [T, K]
    reference = moe_ffn_reference(hidden, top_k_index, top_k_weights, blobs, layout, F.silu)
    for exact in (make_moe_ffn("cpu", layout, F.silu), make_moe_ffn("cpu", layout, F.silu, dtype=torch.float32)):
        assert torch.equal(exact(hidden, top_k_index, top_k_weights, blobs), reference)
    ffn = make_moe_ffn("cpu", layout, F.silu, dtype=torch.bfloat16)
    states = hidden.bfloat16()
    got = ffn(states, top_k_index, top_k_weights, blobs)
    routed = top_k_index.unique().tolist()
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, CpuExpertFFN(layout, F.silu)(states, top_k_index, top_k_weights, blobs, routed))
    exact = moe_ffn_reference(states.double(), top_k_index, top_k_weights.double(), blobs, layout, F.silu)
    bound = torch.zeros(tokens, H, dtype=torch.float64)
    for expert in routed:
        token_idx, k_pos = torch.where(top_k_index == expert)
        per_expert = expert_bound(states[token_idx], layout.views(blobs[expert]), layout)
        bound.index_add_(0, token_idx, per_expert * top_k_weights[token_idx, k_pos, None].double())
    assert ((got.double() - exact).abs() <= bound + unit_roundoff(torch.bfloat16) * exact.abs()).all()
    absent = [None if expert == routed[0] else blob for expert, blob in enumerate(blobs)]
    rest = make_moe_ffn("cpu", layout, F.silu, absent_zero=True, dtype=torch.bfloat16)(states, top_k_index,
                                                                                      top_k_weights, absent)
    assert torch.equal(rest, CpuExpertFFN(layout, F.silu)(states, top_k_index, top_k_weights, blobs, routed[1:]))
    with pytest.raises(ValueError, match=f"expert {routed[0]}"):
        ffn(states, top_k_index, top_k_weights, absent)
    assert getattr(ffn, "cut_granule", None) is None
    with pytest.raises(ValueError, match="whole"):
        ffn(states, top_k_index, top_k_weights, blobs, limits=torch.full((E,), I // 2))


class _RecordWeights(TorchFunctionMode):
    """Records the weight argument of every INT8 and dense product the executor makes."""

    def __init__(self):
        super().__init__()
        self.weights = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch._weight_int8pack_mm, F.linear):
            self.weights.append(args[1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("scheme,weight_dtype", [s for s in SCHEMES if s[0] != "int4"])
def test_weights_are_read_in_place_from_the_blob(scheme, weight_dtype):
    """No second copy of the weights: every product's weight is a view at its section's address."""
    H, I = 96, 40
    layout = ExpertLayout(scheme, H, I, weight_dtype)
    blob = make_blobs(layout, 1, seed=0)[0]
    with _RecordWeights() as recorded:
        CpuExpertFFN(layout, F.silu)(torch.randn(2, H), torch.tensor([[0], [0]]), torch.ones(2, 1), [blob], [0])
    base = blob.data_ptr()
    expected = [base + layout.sections["w13"].offset, base + layout.sections["w2"].offset]
    assert [w.data_ptr() for w in recorded.weights] == expected
    assert all(w.untyped_storage().data_ptr() == blob.untyped_storage().data_ptr() for w in recorded.weights)


@pytest.mark.parametrize("scheme", ["int8-shared", "int8-row"])
def test_an_int8_expert_of_many_tokens_converts_its_codes_once_for_dense_products(scheme):
    """Below DENSE_TOKENS a token's products read the blob in place; from it on, two dense products
    take bf16 weights equal to the codes, in buffers that the next such call reuses."""
    H, I = 96, 40
    layout = ExpertLayout(scheme, H, I)
    blobs = make_blobs(layout, 2, seed=1)
    ffn = CpuExpertFFN(layout, F.silu)
    with _RecordWeights() as few:
        ffn.expert(torch.randn(DENSE_TOKENS - 1, H), layout.views(blobs[0]))
    assert [w.dtype for w in few.weights] == [torch.int8, torch.int8]
    buffers = []
    for blob in blobs:
        with _RecordWeights() as many:
            ffn.expert(torch.randn(DENSE_TOKENS, H), layout.views(blob))
        views = layout.views(blob)
        assert [w.dtype for w in many.weights] == [COMPUTE_DTYPE, COMPUTE_DTYPE]
        assert torch.equal(many.weights[0].float(), views["w13"].float())
        assert torch.equal(many.weights[1].float(), views["w2"].float())
        buffers.append([w.data_ptr() for w in many.weights])
    assert buffers[0] == buffers[1]


class _RecordInt4Products(TorchDispatchMode):
    """Records the codes of every product torch's INT4 matmul makes."""

    def __init__(self):
        super().__init__()
        self.codes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._weight_int4pack_mm_for_cpu.default:
            self.codes.append(args[1])
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not cpu_int4.torch_reads_blobs(), reason="torch's INT4 matmul on this CPU takes another layout")
def test_int4_products_read_the_blobs_codes_in_place():
    """No second copy of the weights: torch's INT4 matmul takes each section of the blob as it is."""
    H, I = 128, 192
    layout = ExpertLayout("int4", H, I)
    blob = make_blobs(layout, 1, seed=2)[0]
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(2))
    with _RecordInt4Products() as recorded:
        CpuExpertFFN(layout, F.silu).expert(x, layout.views(blob))
    base = blob.data_ptr()
    assert [c.data_ptr() for c in recorded.codes] == [base + layout.sections[n].offset for n in ("w13", "w2")]


class _RecordUnpacked(TorchFunctionMode):
    """Records the codes the fallback unpacks and the weights of every float32 product."""

    def __init__(self):
        super().__init__()
        self.codes, self.weights = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__and__:
            self.codes.append(args[0])
        if func is torch.matmul:
            self.weights.append(args[1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("block_tiles", [1, 2])
def test_int4_fallback_reads_its_codes_in_place_and_dequantizes_tiles_at_a_time(monkeypatch, block_tiles):
    """Where torch's INT4 matmul reads another layout: no second copy of the weights either, the codes
    unpacked are blocks of whole tiles of the blob's own sections, and every product's weight is one
    block of at most BLOCK_ELEMENTS; blocks that split the rows (and a last shorter block) still give
    the reference's output."""
    H, I = 128, 192
    monkeypatch.setattr(cpu_int4, "torch_reads_blobs", lambda: False)
    monkeypatch.setattr(cpu_int4, "BLOCK_ELEMENTS", block_tiles * 64 * I)
    layout = ExpertLayout("int4", H, I)
    blob = make_blobs(layout, 1, seed=2)[0]
    views = layout.views(blob)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(2))
    with _RecordUnpacked() as recorded:
        y = CpuExpertFFN(layout, F.silu).expert(x, views)
    assert_matches_reference(y, x, views, layout)
    base, storage = blob.data_ptr(), blob.untyped_storage().data_ptr()
    for name, rows, columns in (("w13", 2 * I, H), ("w2", H, I)):
        section = base + layout.sections[name].offset
        step = 64 * max(1, block_tiles * I // columns)  # whole tiles of rows per block
        expected = [section + start * columns // 2 for start in range(0, rows, step)]
        assert [c.data_ptr() for c in recorded.codes if section <= c.data_ptr() < section + rows * columns // 2] \
            == expected
    assert all(c.untyped_storage().data_ptr() == storage for c in recorded.codes)
    assert max(w.numel() for w in recorded.weights) <= block_tiles * 64 * I


@pytest.fixture(scope="module")
def bundled_store():
    """The bundled model's trained experts in the default scheme (int8-shared), from the session's
    store cache (shared with the tests that load the bundled model)."""
    from mira.runtime.engine import BUNDLED_MODEL
    from mira.store.cache import cache_store
    from mira.store.store import ExpertStore

    return ExpertStore.open(cache_store(BUNDLED_MODEL, "int8-shared", progress=False, name=BUNDLED_MODEL.name),
                            progress=False)


def test_bundled_models_store_matches_the_reference(bundled_store):
    """Trained experts read in place from a real store's buffer, first, middle and last MoE layer."""
    store = bundled_store
    layout, E, tokens = store.layout, store.num_experts, 5
    ffn = CpuExpertFFN(layout, F.silu)
    g = torch.Generator().manual_seed(0)
    for layer in (0, store.num_layers // 2, store.num_layers - 1):
        blobs = [store.blob(layer, e) for e in range(E)]
        hidden = torch.randn(tokens, layout.hidden, generator=g).bfloat16()
        index = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(tokens)])  # [T, 2]
        weights = torch.softmax(torch.randn(tokens, 2, generator=g), dim=-1)
        out = ffn(hidden, index, weights, blobs, range(E), out=torch.empty(tokens, layout.hidden))
        exact = moe_ffn_reference(hidden.double(), index, weights.double(), blobs, layout, F.silu)
        bound = torch.zeros_like(exact)
        for expert in index.unique().tolist():
            token_idx, k_pos = torch.where(index == expert)
            per_expert = expert_bound(hidden[token_idx], layout.views(blobs[expert]), layout)
            bound.index_add_(0, token_idx, per_expert * weights[token_idx, k_pos, None].double())
        assert ((out.double() - exact).abs() <= bound).all(), f"layer {layer}"
        in_bf16 = moe_ffn_reference(hidden, index, weights.bfloat16(), blobs, layout, F.silu).double()
        assert (out.double() - exact).abs().max() <= 3 * (in_bf16 - exact).abs().max(), f"layer {layer}"


def test_views_are_made_once_per_blob_address_and_follow_a_new_blob():
    """A slot's row or a store's blob is a new tensor at every read: its views are kept per address,
    so repeated reads of one blob add none."""
    layout = ExpertLayout("int8-shared", 64, 32)
    store = torch.stack(make_blobs(layout, 2, seed=9))  # [E, B]
    ffn = CpuExpertFFN(layout, F.silu)
    views = ffn.views(store[0])
    assert ffn.views(store[0]) is views and views["w13"].data_ptr() == store[0].data_ptr()
    assert ffn.views(store[1])["w13"].data_ptr() == store[1].data_ptr()
    for _ in range(3):
        ffn.views(store[0]), ffn.views(store[1])
    assert len(ffn._views) == 2


@pytest.mark.parametrize("scheme,weight_dtype", SCHEMES)
def test_a_one_token_call_sums_what_a_many_token_call_does(scheme, weight_dtype):
    """Decode calls (one token) take a path of fewer operations; each of its rows is what the
    general path gives for the same token (summed in fp32 in another order: within fp32 rounding)."""
    (H, I), E, K = sized(scheme, 72, 30), 6, 3
    layout = ExpertLayout(scheme, H, I, weight_dtype)
    blobs = make_blobs(layout, E, seed=11)
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(1, H, generator=g).bfloat16()
    top_k_index = torch.randperm(E, generator=g)[:K][None]  # [1, K]
    top_k_weights = torch.softmax(torch.randn(1, K, generator=g), dim=-1)
    experts = [0, 1, 2, 3, 4]  # the routed ones among them, and some routed to no token
    ffn = CpuExpertFFN(layout, F.silu)
    one = ffn(hidden, top_k_index, top_k_weights, blobs, experts, out=torch.empty(1, H))
    two = ffn(hidden.repeat(2, 1), top_k_index.repeat(2, 1), top_k_weights.repeat(2, 1), blobs, experts,
              out=torch.empty(2, H))
    assert one.abs().sum() > 0
    torch.testing.assert_close(one, two[:1], rtol=1e-6, atol=1e-6)


class _RecordCalls(TorchFunctionMode):
    """Records the torch calls that run an operation (a worker thread gives its GIL up at each of
    them), leaving out reads of a tensor's attributes, data pointer and values, and indexing."""

    SKIPPED = {"__get__", "__getitem__", "is_contiguous", "data_ptr", "numel", "tolist"}

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name not in self.SKIPPED:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("first", [0, 64])  # I = 80: whole, and a cut's part of 0.2 reading its columns
def test_a_decode_call_joins_splits_and_copies_nothing_it_need_not(first):
    """Hand-worked, int8-shared, one token into a float32 out: the scale folded into x, the gate/up
    product (a cut's gate and up rows: two), gate to float32, act, times up, the cut's columns copied,
    h to bf16, the down product, the weighted sum written into out. Nothing joins the cut's two
    parts, nothing copies the sum."""
    H, I = 96, 80
    layout = ExpertLayout("int8-shared", H, I)
    blobs = make_blobs(layout, 2, seed=first)
    ffn = CpuExpertFFN(layout, F.silu)
    hidden, route, weights = torch.randn(1, H).bfloat16(), torch.tensor([[0, 1]]), torch.tensor([[0.7, 0.3]])
    cut = (0, first) if first else None
    out = torch.empty(1, H)
    ffn(hidden, route, weights, blobs, [0], out=out, cut=cut)  # views made once, then recorded
    with _RecordCalls() as recorded:
        ffn(hidden, route, weights, blobs, [0], out=out, cut=cut)
    products = ["_weight_int8pack_mm", "_weight_int8pack_mm", "float", "silu", "mul"] if first else \
        ["_weight_int8pack_mm", "chunk", "float", "silu", "mul"]
    columns = ["copy_"] if first else []
    assert recorded.names == ["zero_", "mul", *products, *columns, "to", "_weight_int8pack_mm", "add_"]
