"""The fused kernels on experts with biases and a family's own gating, and with absent experts
that add zero, against the PyTorch reference running the family's own `_apply_gate`.

gpt-oss is the case: biases on both projections, gate and up rows interleaved in its checkpoint
(Mira stores them gate first), and a clamped SwiGLU with its alpha, limit and up offset. The
reference calls transformers' GptOssExperts._apply_gate itself (mira.models.spec.FamilyGate); the
kernels compute the closed form Mira recognised in it (GluForm). Hidden states are scaled so that
gate and up values cross the clamp limit on both sides. Inkling 2's softcapped SwiGLU, Gemma 4's
GeGLU and Nemotron-H's ungated squared ReLU follow.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, as in test_triton_ffn);
the `gpu` tests add real shapes in bf16.

T tokens, E experts, K routed per token, H hidden, I expert intermediate.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton.language")

from transformers import GptOssConfig  # noqa: E402
from transformers.activations import ACT2FN  # noqa: E402

from mira.errors import MiraError  # noqa: E402
from mira.kernels import fused_unsupported, glu_of, make_moe_ffn, ungated_form  # noqa: E402
from mira.kernels.reference import expert_ffn, moe_ffn_reference  # noqa: E402
from mira.kernels.triton_ffn import TritonMoEFFN  # noqa: E402
from mira.kernels.triton_int4 import TritonInt4MoEFFN  # noqa: E402
from mira.kernels.tuning import GemmConfig, GemvConfig, KernelConfig  # noqa: E402
from mira.models.spec import GELU_TANH, GluForm, anatomy  # noqa: E402
from mira.store.layout import ExpertLayout  # noqa: E402
from mira.store.quant import quantize_expert  # noqa: E402

from routing_cases import DEVICE, relative_error, routing  # noqa: E402
H, I, E, K = 96, 40, 6, 2
HIDDEN_GAIN = 8.0  # hidden states this large put gate and up outputs beyond gpt-oss's limit of 7
FP32_TOL = 1e-5
SCHEMES = ("int8-shared", "int8-row", "int4")
KERNELS = {"int8-shared": TritonMoEFFN, "int8-row": TritonMoEFFN, "int4": TritonInt4MoEFFN}

CONFIGS = {
    "gemv": KernelConfig(gate_up_gemv=GemvConfig(16, 64, unroll=1, cvt="bits"),
                         down_gemv=GemvConfig(16, 64, unroll=1, split=2, cvt="bits")),
    # the down reduction split in 2 spans, of 32 and 8 (the bias must be added once per row, not per span;
    # "gemv" above asks for 2 but its block of 64 covers I = 40 in one)
    "gemv-split": KernelConfig(gate_up_gemv=GemvConfig(16, 64, unroll=1, cvt="bits"),
                               down_gemv=GemvConfig(16, 32, unroll=1, split=2, cvt="bits")),
    "mma": KernelConfig(gate_up_gemv=GemvConfig(16, 32, mma=True, num_stages=2),
                        down_gemv=GemvConfig(16, 16, mma=True, num_stages=2)),
    "gemm": KernelConfig(decode_max_pairs=0, gemm=GemmConfig(16, 32, 32, num_warps=4, num_stages=2)),
}
INT4_CONFIGS = {  # whole tiles of 64 rows; "gemv-split" splits I = 128 in two spans of one group each
    "gemv": KernelConfig(gate_up_gemv=GemvConfig(64, 64, unroll=1), down_gemv=GemvConfig(64, 128, unroll=1)),
    "gemv-split": KernelConfig(gate_up_gemv=GemvConfig(64, 64, unroll=1),
                               down_gemv=GemvConfig(64, 64, unroll=1, split=2)),
    "gemm": KernelConfig(decode_max_pairs=0, gate_up_gemv=GemvConfig(64, 64), down_gemv=GemvConfig(64, 64),
                         gemm=GemmConfig(16, 64, 32, num_warps=4, num_stages=2)),
}
CASES = [(scheme, config) for scheme in SCHEMES for config in CONFIGS if not (scheme == "int4" and config == "mma")]


def sizes(scheme: str) -> tuple[int, int]:
    """(H, I) of the tests' experts: int4's are whole tiles and groups of 64."""
    return (128, 128) if scheme == "int4" else (H, I)


def config_of(scheme: str, name: str) -> KernelConfig:
    return (INT4_CONFIGS if scheme == "int4" else CONFIGS)[name]


def gpt_oss_gate(hidden: int = H, intermediate: int = I, experts: int = E):
    """transformers' own gpt-oss gating, as Mira reads it from the family's Experts module."""
    config = GptOssConfig(hidden_size=hidden, intermediate_size=intermediate, num_local_experts=experts,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                          vocab_size=64)
    return anatomy(config).spec.gate_function()


def biased_blobs(layout: ExpertLayout, experts: int, seed: int, device: str = DEVICE) -> list[torch.Tensor]:
    """`experts` blobs quantized from random weights on the device, with random float32 biases."""
    gen = torch.Generator(device=device).manual_seed(seed)
    H, I = layout.hidden, layout.intermediate
    rows13 = 2 * I if layout.gated else I
    blobs = []
    for _ in range(experts):
        w13 = torch.randn(rows13, H, generator=gen, device=device) / H**0.5  # [2I, H] (ungated: [I, H])
        w2 = torch.randn(H, I, generator=gen, device=device) / I**0.5  # [H, I]
        b13 = torch.randn(rows13, generator=gen, device=device)  # [2I]
        b2 = torch.randn(H, generator=gen, device=device)  # [H]
        blob = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        layout.pack(quantize_expert(w13, w2, layout, b13, b2), blob)
        blobs.append(blob)
    return blobs


@pytest.fixture(scope="module")
def gate():
    return gpt_oss_gate()


@pytest.fixture(scope="module", params=SCHEMES)
def store(request):
    layout = ExpertLayout(request.param, *sizes(request.param), bias=True)
    return layout, biased_blobs(layout, E, seed=3)


def test_gpt_oss_gating_is_recognised_in_closed_form(gate):
    assert gate.form == GluForm(alpha=1.702, limit=7.0, up_offset=1.0)
    probe = torch.linspace(-12, 12, 50, dtype=torch.float64)[None].repeat(3, 2)  # [3, 2 * 50]: g | u
    assert torch.allclose(gate.form(*probe.chunk(2, dim=-1)), gate(probe))


@pytest.mark.parametrize(("scheme", "config"), CASES)
@pytest.mark.parametrize("tokens", [1, 3, 37])
def test_biases_and_clamped_swiglu_match_the_familys_own_gating(gate, scheme, config, tokens):
    layout = ExpertLayout(scheme, *sizes(scheme), bias=True)
    blobs = biased_blobs(layout, E, seed=5)
    hidden = HIDDEN_GAIN * torch.randn(tokens, layout.hidden, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    index, weights = routing(tokens, E, K, seed=tokens)
    ffn = KERNELS[scheme](layout, DEVICE, config=config_of(scheme, config), glu=gate.form)
    out = ffn(hidden, index, weights, blobs)
    ref = moe_ffn_reference(hidden, index, weights, blobs, layout, None, gate)
    assert relative_error(out, ref) < FP32_TOL


@pytest.mark.parametrize("name", ["gelu_pytorch_tanh", "gelu_new", "quick_gelu"])
def test_gelu_activations_are_recognised_in_closed_form_and_the_exact_one_is_not(name):
    act = ACT2FN[name]
    form = glu_of(act, None)
    assert form == glu_of(name, None) and form is not None
    probe = torch.linspace(-20, 20, 401, dtype=torch.float64)
    assert torch.allclose(form(probe, torch.ones_like(probe)), act(probe), rtol=1e-9, atol=1e-12)
    assert glu_of("gelu", None) is None and glu_of(ACT2FN["gelu"], None) is None  # erf: the reference computes it
    assert glu_of("relu", None) is None


@pytest.mark.parametrize(("scheme", "config"), CASES)
@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_geglu_with_the_tanh_gelu_matches_the_activation_in_the_reference(scheme, config, tokens, bias):
    """Gemma 4's experts: GELU's tanh approximation of the gate times up, computed by the kernels
    as g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)) and by the reference with transformers' own
    activation."""
    layout = ExpertLayout(scheme, *sizes(scheme), bias=bias)
    blobs = biased_blobs(layout, E, seed=13)
    hidden = 2.0 * torch.randn(tokens, layout.hidden, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    index, weights = routing(tokens, E, K, seed=tokens + 1)
    act = ACT2FN["gelu_pytorch_tanh"]
    ffn = make_moe_ffn(DEVICE, layout, act, backend="triton", config=config_of(scheme, config), num_experts=E)
    assert isinstance(ffn, KERNELS[scheme]) and ffn._after_up["CUBIC"] == GELU_TANH.cubic
    out = ffn(hidden, index, weights, blobs)
    ref = moe_ffn_reference(hidden, index, weights, blobs, layout, act)
    assert relative_error(out, ref) < FP32_TOL


def inkling2_gate(gate_cap: float, up_cap: float):
    """transformers' own Inkling 2 gating (a SwiGLU whose linear gate factor and up are softcapped,
    the sigmoid seeing the raw gate), at these caps, as Mira reads it from the family's Experts module."""
    pytest.importorskip("transformers.models.inkling2", reason="this transformers has no Inkling 2")
    from tiny_families import tiny_config

    config = tiny_config("inkling2_text")
    config.mlp_gate_softcap, config.mlp_up_softcap = gate_cap, up_cap
    return anatomy(config).spec.gate_function()


def test_inkling2_softcapped_swiglu_is_recognised_in_closed_form():
    gate = inkling2_gate(2.0, 3.0)
    assert gate.form == GluForm(gate_cap=2.0, up_cap=3.0)
    probe = torch.linspace(-12, 12, 50, dtype=torch.float64)[None].repeat(3, 2)  # [3, 2 * 50]: g | u
    assert torch.allclose(gate.form(*probe.chunk(2, dim=-1)), gate(probe), rtol=1e-6)
    assert inkling2_gate(4.0, 25.0).form == GluForm(gate_cap=4.0, up_cap=25.0)  # the family's defaults


@pytest.mark.parametrize(("scheme", "config"), CASES)
@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_softcapped_swiglu_matches_the_familys_own_gating(scheme, config, tokens, bias):
    """Inkling 2's experts at caps of 2 (gate) and 3 (up), which the hidden scale crosses on both
    sides: the kernels compute cap * tanh(x / cap) through a sigmoid, the reference calls the family's
    own `_apply_gate`."""
    gate = inkling2_gate(2.0, 3.0)
    layout = ExpertLayout(scheme, *sizes(scheme), bias=bias)
    blobs = biased_blobs(layout, E, seed=23)
    hidden = HIDDEN_GAIN * torch.randn(tokens, layout.hidden, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    index, weights = routing(tokens, E, K, seed=tokens + 3)
    ffn = make_moe_ffn(DEVICE, layout, None, gate=gate, backend="triton", config=config_of(scheme, config), num_experts=E)
    assert isinstance(ffn, KERNELS[scheme]) and (ffn._after_up["GATE_CAP"], ffn._after_up["UP_CAP"]) == (2.0, 3.0)
    out = ffn(hidden, index, weights, blobs)
    ref = moe_ffn_reference(hidden, index, weights, blobs, layout, None, gate)
    assert relative_error(out, ref) < FP32_TOL


@pytest.mark.parametrize(("scheme", "config"), CASES)
@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_ungated_experts_with_the_squared_relu_match_the_reference(scheme, config, tokens, bias):
    """Nemotron-H's experts: up rows only, then the squared ReLU, computed by the kernels without
    the gate rows' loads and by the reference with transformers' own activation."""
    layout = ExpertLayout(scheme, *sizes(scheme), gated=False, bias=bias)
    blobs = biased_blobs(layout, E, seed=17)
    hidden = torch.randn(tokens, layout.hidden, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    index, weights = routing(tokens, E, K, seed=tokens + 2)
    act = ACT2FN["relu2"]
    ffn = make_moe_ffn(DEVICE, layout, act, backend="triton", config=config_of(scheme, config), num_experts=E)
    assert isinstance(ffn, KERNELS[scheme]) and ffn._after_up["GATED"] is False
    out = ffn(hidden, index, weights, blobs)
    ref = moe_ffn_reference(hidden, index, weights, blobs, layout, act)
    assert relative_error(out, ref) < FP32_TOL


def test_ungated_experts_of_another_activation_are_left_to_the_reference():
    layout = ExpertLayout("int8-shared", H, I, gated=False)
    assert ungated_form("relu2") == ungated_form(ACT2FN["relu2"]) == "relu2"
    assert ungated_form("relu") is None and ungated_form("silu") is None
    assert fused_unsupported(layout, "relu2", None) is None
    assert fused_unsupported(layout, "silu", None) == "ungated experts with the activation 'silu'"
    with pytest.raises(MiraError, match="do not compute ungated experts with the activation 'silu'"):
        make_moe_ffn(DEVICE, layout, "silu", backend="triton")
    with pytest.raises(ValueError, match="squared ReLU only"):
        TritonMoEFFN(layout, DEVICE, config=CONFIGS["gemv"])


def test_the_clamp_is_reached(gate, store):
    """The hidden scale above really drives gate and up values past the limit on both sides."""
    layout, blobs = store
    hidden = HIDDEN_GAIN * torch.randn(37, layout.hidden, generator=torch.Generator().manual_seed(37)).to(DEVICE)
    captured = []
    expert_ffn(hidden.double(), layout.views(blobs[0]), layout, None, lambda gu: captured.append(gu) or gate(gu))
    values = captured[0]
    assert (values > 7).any() and (values < -7).any()


@pytest.mark.parametrize(("scheme", "config"), CASES)
def test_absent_experts_add_zero_when_asked(gate, scheme, config):
    """With absent_zero, an expert whose address is 0 adds nothing (the CPU computes it), biases
    and up offset included: the result equals the reference over the present experts only."""
    layout = ExpertLayout(scheme, *sizes(scheme), bias=True)
    blobs = biased_blobs(layout, E, seed=7)
    blobs[2] = blobs[4] = None
    tokens = 5
    hidden = HIDDEN_GAIN * torch.randn(tokens, layout.hidden, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    index = torch.tensor([[0, 2], [2, 4], [4, 1], [3, 5], [2, 1]], device=DEVICE)  # token 1: both absent
    weights = torch.rand(tokens, K, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    ffn = make_moe_ffn(DEVICE, layout, None, gate=gate, backend="triton", absent_zero=True,
                       config=config_of(scheme, config))
    out = ffn(hidden, index, weights, blobs)
    ref = moe_ffn_reference(hidden, index, weights, blobs, layout, None, gate, absent="zero")
    assert torch.equal(out[1], torch.zeros(layout.hidden, device=DEVICE))
    assert relative_error(out, ref) < FP32_TOL
    with pytest.raises(ValueError, match="no blob"):
        moe_ffn_reference(hidden, index, weights, blobs, layout, None, gate)


def test_reference_backend_skips_absent_experts_too(gate, store):
    layout, blobs = store
    blobs = list(blobs)
    blobs[1] = None
    hidden = torch.randn(2, layout.hidden, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    index = torch.tensor([[0, 1], [1, 3]], device=DEVICE)
    weights = torch.full((2, K), 0.5, device=DEVICE)
    ffn = make_moe_ffn(DEVICE, layout, None, gate=gate, backend="reference", absent_zero=True)
    out = ffn(hidden, index, weights, blobs)
    only_present = torch.tensor([[3]], device=DEVICE)  # token 1's expert 3 alone, at its weight
    expected = moe_ffn_reference(hidden[1:], only_present, weights[1:, 1:], blobs, layout, None, gate)
    assert relative_error(out[1:], expected) < FP32_TOL


GPT_OSS_20B = dict(hidden=2880, intermediate=2880, experts=32, top_k=4)


def assert_bf16_matches_fp32_reference(layout: ExpertLayout, experts: int, top_k: int, tokens: int, seed: int,
                                       act=None, gate=None, gain: float = 1.0) -> None:
    """The FFN make_moe_ffn picks on the GPU, the fused kernels, in bf16 against the float32 reference."""
    blobs = biased_blobs(layout, experts, seed=seed, device="cuda")
    gen = torch.Generator().manual_seed(tokens)
    hidden = gain * torch.randn(tokens, layout.hidden, generator=gen)
    index = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).cuda()
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1).cuda()
    ffn = make_moe_ffn("cuda", layout, act, gate=gate, backend="auto", num_experts=experts)
    assert isinstance(ffn, KERNELS[layout.scheme])
    out = ffn(hidden.cuda().bfloat16(), index, weights.bfloat16(), blobs)
    ref = moe_ffn_reference(hidden.cuda().bfloat16().float(), index, weights.bfloat16().float(), blobs, layout,
                            act, gate)
    assert relative_error(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 4, 64])  # 4 and 16 routed pairs (decode), 256 (prefill)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_gpt_oss_20b_shape_bf16_matches_fp32_reference(scheme, tokens):
    H, I, E, K = (GPT_OSS_20B[k] for k in ("hidden", "intermediate", "experts", "top_k"))
    assert_bf16_matches_fp32_reference(ExpertLayout(scheme, H, I, bias=True), E, K, tokens, seed=11,
                                       gate=gpt_oss_gate(H, I, E), gain=HIDDEN_GAIN)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 4, 64])  # decode and prefill
@pytest.mark.parametrize(("scheme", "activation", "gated"), [
    ("int8-shared", "gelu_pytorch_tanh", True), ("int4", "gelu_pytorch_tanh", True),  # Gemma 4's GeGLU
    *[(scheme, "relu2", False) for scheme in SCHEMES],  # Nemotron-H's ungated experts
])
def test_real_size_geglu_and_ungated_experts_bf16_match_fp32_reference(scheme, activation, gated, tokens):
    """At Qwen3-30B-A3B's expert size (hidden 2048, intermediate 768)."""
    assert_bf16_matches_fp32_reference(ExpertLayout(scheme, 2048, 768, gated=gated), 16, 4, tokens, seed=19,
                                       act=ACT2FN[activation])


class FormGate:
    """A family gating given by its closed form alone (the device's transformers may lack the family)."""

    def __init__(self, form: GluForm):
        self.form = form

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.form(*gate_up.chunk(2, dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 4, 64])  # decode and prefill
@pytest.mark.parametrize("scheme", SCHEMES)
def test_real_size_softcapped_swiglu_bf16_matches_fp32_reference(scheme, tokens):
    """Inkling 2's gating at its default caps (4 on the gate's linear factor, 25 on up), at
    Qwen3-30B-A3B's expert size, hidden states large enough to cross the gate's cap."""
    assert_bf16_matches_fp32_reference(ExpertLayout(scheme, 2048, 768, bias=True), 16, 4, tokens, seed=29,
                                       gate=FormGate(GluForm(gate_cap=4.0, up_cap=25.0)), gain=HIDDEN_GAIN)
