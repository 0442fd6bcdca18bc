"""The expert FFN of a MoE layer computed from INT8 blobs (paper IV-F; DESIGN.md 2.8).

`make_moe_ffn` chooses the implementation once, at construction (never per call):

- the fused Triton kernels (`mira.kernels.triton_ffn`; `mira.kernels.triton_int4` for `int4`) on a
  CUDA device, for gated experts whose gating has a closed form (SwiGLU, GeGLU with the tanh GELU,
  or a family's clamped or softcapped variant: mira.models.spec.GluForm) and ungated ones with the
  squared ReLU, with or without biases, on the `int8-shared`, `int8-row` or `int4` schemes;
- on the CPU for bf16 and fp16 states, the CPU executor (`CpuMoEFFN` over
  `mira.kernels.cpu_experts`: weight-only products that read the blobs in place, dense ones for an
  INT8 expert of many tokens; `CpuMoEFFN.bind` lays an int4 store's codes out for this CPU);
- otherwise the plain PyTorch reference (`mira.kernels.reference`), which is also the CPU path in
  float32 and the ground truth the kernels are tested against.

Both are called as `ffn(hidden [T, H], top_k_index [T, K], top_k_weights [T, K], blobs, out=None,
limits=None)`: `blobs` has one entry per expert of the layer, the expert's uint8 blob (a row of the
device slot buffer, or its blob in the pinned host store, which the Triton kernels read directly
over PCIe) or None when it is not routed. The result is [T, H] in hidden's dtype, written into `out`
when given. `limits` [E] cuts experts: each computes only its intermediate units below its limit
(the CPU computes the rest; `cut_granule` says which limits an implementation takes).
The fused kernels also take the blobs' addresses as a device table (`TritonMoEFFN.forward_bases`),
which the runtime keeps per layer (mira.cache.tables) instead of passing the list.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence

import torch

from mira.errors import MiraError
from mira.kernels import cpu_int4
from mira.kernels.cpu_experts import CpuExpertFFN
from mira.kernels.reference import moe_ffn_reference
from mira.models.spec import GELU_TANH, GluForm
from mira.store.layout import ExpertLayout
from mira.store.store import ExpertStore

BACKENDS = ("auto", "triton", "reference")
# A MoE layer call of at most this many tokens is a decode step: the experts module and the
# predictors serve it from buffers allocated once, so it allocates no device memory (DESIGN.md
# 2.5). Larger calls (prefill) allocate their own. 16 covers batch-1 and small-batch decode.
DECODE_TOKENS = 16


class ReferenceMoEFFN:
    """`moe_ffn_reference` with the layout and activation bound, and an optional `out`."""

    cut_granule = 1  # any cut point (`limits`)

    def __init__(self, layout: ExpertLayout, act: Callable | None, gate: Callable | None = None,
                 absent_zero: bool = False) -> None:
        self.layout = layout
        self.act = act
        self.gate = gate
        self.absent = "zero" if absent_zero else "raise"

    def __call__(
        self,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        blobs: Sequence[torch.Tensor | None],
        *,
        out: torch.Tensor | None = None,
        limits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`limits` [E]: expert e computes only its intermediate units [0, limits[e]) (a cut expert)."""
        if hidden.device.type != "cpu":  # a routed expert without a slot is read from the host store: copy it over
            blobs = list(blobs)
            for expert in top_k_index.unique().tolist():
                if blobs[expert] is not None:
                    blobs[expert] = blobs[expert].to(hidden.device, non_blocking=True)
        result = moe_ffn_reference(hidden, top_k_index, top_k_weights, blobs, self.layout, self.act, self.gate,
                                   self.absent, None if limits is None else limits.tolist())
        if out is None:
            return result
        out.copy_(result)
        return out


class CpuMoEFFN:
    """The expert FFN of a CPU-only run in bf16 or fp16: the CPU executor, whose products read each
    routed expert's INT8 or INT4 blob once, where the reference would first convert the whole expert
    to the states' dtype. It computes experts whole (no `cut_granule`: the runtime cuts none)."""

    def __init__(self, layout: ExpertLayout, act: Callable | None, gate: Callable | None = None,
                 absent_zero: bool = False) -> None:
        self.executor = CpuExpertFFN(layout, act, gate)
        self.absent_zero = absent_zero

    def bind(self, store: ExpertStore, progress: bool = False) -> None:
        """Serve `store`'s experts. Where this CPU's torch INT4 matmul takes another layout than the
        stored tiles, an int4 store's codes are rewritten into it once, in host memory
        (`cpu_int4.adapt_codes`), so that its products read the blobs in place; the reference and the
        GPU kernels can then no longer read that store."""
        if store.layout.scheme == "int4" and cpu_int4.adapts_codes():
            cpu_int4.adapt_codes(store, progress)
            executor = self.executor
            self.executor = CpuExpertFFN(executor.layout, executor.act, executor.gate, torch_codes=True)

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 blobs: Sequence[torch.Tensor | None], *, out: torch.Tensor | None = None,
                 limits: torch.Tensor | None = None) -> torch.Tensor:
        """As `ReferenceMoEFFN`, without `limits`."""
        if limits is not None:
            raise ValueError("the CPU executor computes experts whole; it takes no limits")
        experts = top_k_index.unique().tolist()  # ascending
        if self.absent_zero:
            experts = [expert for expert in experts if blobs[expert] is not None]
        return self.executor(hidden, top_k_index, top_k_weights, blobs, experts, out=out)


def glu_of(act: Callable | str | None, gate: Callable | None) -> GluForm | None:
    """The closed form of the experts' gating the fused kernels compute: act(gate) * up for an
    activation of `ACTIVATION_FORMS`, a family gating's own form (mira.models.spec.FamilyGate.form);
    else None."""
    if gate is not None:
        return getattr(gate, "form", None)
    return activation_form(act) if act is not None else None


ACTIVATION_FORMS = (GluForm(), GELU_TANH, GluForm(alpha=1.702))  # SiLU, GELU's tanh approximation, quick GELU
PROBE = torch.linspace(-12, 12, 97, dtype=torch.float64)  # where these forms part, and then some


def activation_form(act: Callable | str) -> GluForm | None:
    """The form of `ACTIVATION_FORMS` whose gate factor is `act` (a callable, or a name of
    transformers' ACT2FN), tried in float64 on values well past where the forms part: None for any
    other activation (the exact, erf GELU among them)."""
    values = _probed(act)
    if values is None:
        return None
    return next((form for form in ACTIVATION_FORMS
                 if torch.allclose(form(PROBE, torch.ones_like(PROBE)), values, rtol=1e-6, atol=1e-9)), None)


def _probed(act: Callable | str) -> torch.Tensor | None:
    """`act` (a callable, or a name of transformers' ACT2FN) on `PROBE`; None for an unknown name
    or an activation that takes more than a tensor."""
    if isinstance(act, str):
        from transformers.activations import ACT2FN

        if act not in ACT2FN:
            return None
        act = ACT2FN[act]
    try:
        return act(PROBE).to(torch.float64)
    except Exception:
        return None


def fused_unsupported(layout: ExpertLayout, act: Callable | str | None, gate: Callable | None) -> str | None:
    """What of these experts the fused kernels do not compute (None: they compute all of it)."""
    if layout.scheme not in ("int8-shared", "int8-row", "int4"):
        return f"{layout.scheme} blobs"
    if not layout.gated:
        return None if gate is None and act is not None and ungated_form(act) is not None else \
            f"ungated experts with the activation {act!r}"
    if glu_of(act, gate) is None:
        return f"the gating {gate!r}" if gate is not None else f"the activation {act!r}"
    return None


def ungated_form(act: Callable | str) -> str | None:
    """"relu2" where `act` (a callable, or a name of transformers' ACT2FN) is the squared ReLU, the
    activation of ungated experts the fused kernels compute (Nemotron-H's); else None."""
    values = _probed(act)
    return "relu2" if values is not None and torch.allclose(values, PROBE.clamp(min=0) ** 2) else None


def make_moe_ffn(
    device: torch.device | str,
    layout: ExpertLayout,
    act: Callable | str | None,
    *,
    gate: Callable | None = None,
    backend: str = "auto",
    absent_zero: bool = False,
    dtype: torch.dtype | None = None,
    **triton_options,
) -> Callable[..., torch.Tensor]:
    """The expert FFN for this device, blob layout and activation, chosen once.

    Args:
        device: where the layer runs.
        layout: the blob layout of the store.
        act: the experts' activation: a callable such as `F.silu`, or a name of transformers'
            ACT2FN (a config's `hidden_act`, e.g. "silu"); None with `gate`.
        gate: the family's own gating of the gate-and-up output (mira.models.spec.FamilyGate); the
            kernels compute its closed form where it has one (`glu_of`), else the reference runs it.
        backend: "auto" (Triton where it applies and is installed, else `CpuMoEFFN` on a CPU device for
            bf16 and fp16 states and the reference elsewhere), "triton" (raise if it does not apply; on
            a CPU device it needs TRITON_INTERPRET=1) or "reference".
        absent_zero: a routed expert without a blob (address 0) adds zero, its weights unread: another
            executor computes it (the CPU's share of a layer's misses). Else the kernels give NaN rows
            for it and the reference raises.
        dtype: the states' dtype the layer is called in (None: unknown; the CPU then takes the
            reference); the Triton kernels' too.
        **triton_options: passed to `TritonMoEFFN` (config, num_experts, max_tokens, top_k) when the
            Triton path is chosen.

    Returns:
        A callable `ffn(hidden, top_k_index, top_k_weights, blobs, *, out=None) -> [T, H]`.

    Raises:
        ValueError: an unknown backend.
        MiraError: backend="triton" for experts the fused kernels do not compute (`fused_unsupported`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    unsupported = fused_unsupported(layout, act, gate)
    if backend == "triton" and unsupported is not None:
        raise MiraError(f"the fused kernels do not compute {unsupported}; use backend='auto' or 'reference'")
    installed = importlib.util.find_spec("triton") is not None
    if backend == "triton" or (backend == "auto" and unsupported is None and device.type == "cuda" and installed):
        options = dict(glu=glu_of(act, gate) or GluForm(), ungated=None if layout.gated else ungated_form(act),
                       absent_zero=absent_zero, dtype=dtype, **triton_options)
        if layout.scheme == "int4":
            from mira.kernels.triton_int4 import TritonInt4MoEFFN

            return TritonInt4MoEFFN(layout, device, **options)
        from mira.kernels.triton_ffn import TritonMoEFFN  # imports triton only when it is used

        return TritonMoEFFN(layout, device, **options)
    if act is not None and not callable(act):
        from transformers.activations import ACT2FN

        act = ACT2FN[act]
    if backend == "auto" and device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return CpuMoEFFN(layout, act, gate, absent_zero)
    return ReferenceMoEFFN(layout, act, gate, absent_zero)
