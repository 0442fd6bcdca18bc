"""What a family's Experts class declares, read from transformers itself (paper IV-A).

The model of a config is built on the meta device (no memory) with its own Experts classes; the
first Experts module found gives the sizes (from its 3D parameters) and the layout flags that
`use_experts_implementation` set on it. Mira stores every expert in one canonical layout, whatever
the family's: w13 [2I, H] with the gate rows first, then the up rows ([I, H] up rows only for
ungated experts); w2 [H, I]; biases b13 [2I] and b2 [H].

E experts, H hidden, I expert intermediate, T tokens.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from mira.errors import MiraError
from mira.models.interface import (causal_lm_class, check_not_wrapped, is_experts_class, moe_families,
                                   moe_integration, route_norm_of)

LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ExpertsSpec:
    """The layout and arithmetic of one family's experts.

    gated: a gate projection (gate_up_proj) beside the up projection, else up_proj only.
    concatenated: the family's gate_up_proj holds the gate rows then the up rows; else they alternate.
    transposed: the family's tensors are [E, in, out] rather than [E, out, in].
    bias: gate_up_proj_bias (or up_proj_bias) and down_proj_bias.
    post_norm: a norm after each expert (has_post_expert_norm).
    custom_gate: the family has its own `_apply_gate` (e.g. a clamped SwiGLU), not act(gate) * up.
    route_norm: the attribute of the module that normalises each route's output with its expert's
        weights before the weighted sum (Ergo's `post_expert_norm`), where the class wraps the interface so.
    """

    experts_class: type
    num_experts: int
    hidden: int
    intermediate: int
    gated: bool
    concatenated: bool
    transposed: bool
    bias: bool
    post_norm: bool
    custom_gate: bool
    module: nn.Module  # one Experts module on the meta device: its act_fn and _apply_gate are the family's
    route_norm: str | None = None

    @property
    def up_name(self) -> str:
        """The family's name of the (gate and) up projection parameter."""
        return "gate_up_proj" if self.gated else "up_proj"

    @property
    def param_names(self) -> tuple[str, ...]:
        names = (self.up_name, "down_proj")
        return names + tuple(f"{name}_bias" for name in names) if self.bias else names

    def ffn_functions(self) -> tuple[Callable | None, Callable | None]:
        """(activation, gating) for mira.kernels.make_moe_ffn: the family's own `_apply_gate`, else its
        act_fn."""
        if self.custom_gate:
            return None, self.gate_function()
        return self.activation(), None

    def activation(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The activation of the gate (or, ungated, of the up projection)."""
        act = getattr(self.module, "act_fn", None)
        if act is None:
            raise MiraError(f"{self.experts_class.__name__} has no act_fn; Mira cannot tell its activation")
        return act

    def gate_function(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The family's own gating of w13's output [T, 2I] (gate rows first) -> [T, I]; None when it
        is act(gate) * up."""
        if not self.custom_gate:
            return None
        return FamilyGate(self.module, self.concatenated)


@dataclass(frozen=True)
class GluForm:
    """A gated activation in closed form, as the fused kernels compute it:
    cap(g) * sigmoid(alpha * (g + cubic * g^3)) * (cap(u) + up_offset), with g = min(gate, limit)
    and u = clamp(up, -limit, limit) when there is a limit, and cap(x) = c tanh(x / c) at
    gate_cap / up_cap when set (Inkling 2's softcapped SwiGLU: the sigmoid sees the uncapped
    gate). SwiGLU is the default; gpt-oss's clamped SwiGLU is (1.702, 7, 1); GeGLU with the tanh
    GELU is `GELU_TANH` (0.5 x (1 + tanh(y)) is x * sigmoid(2y)).
    """

    alpha: float = 1.0
    limit: float | None = None
    up_offset: float = 0.0
    cubic: float = 0.0
    gate_cap: float | None = None
    up_cap: float | None = None

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit is not None:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
        inner = gate + self.cubic * gate**3 if self.cubic else gate
        linear = _softcap(gate, self.gate_cap)
        return linear * torch.sigmoid(self.alpha * inner) * (_softcap(up, self.up_cap) + self.up_offset)


def _softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else cap * torch.tanh(x / cap)


GELU_TANH = GluForm(alpha=2 * math.sqrt(2 / math.pi), cubic=0.044715)  # GeGLU, tanh GELU (Gemma 4's experts)


# The module attributes a family's own gating reads its constants from (gpt-oss: alpha, limit;
# MiniMax-M3, HY-V4: swiglu_alpha, swiglu_limit; DeepSeek-V4: limit), and those of its submodules
# that softcap (Inkling 2: act_fn.gate_softcap.softcap, act_fn.up_softcap.softcap).
_ALPHA_NAMES = ("alpha", "swiglu_alpha")
_LIMIT_NAMES = ("limit", "swiglu_limit")
_CAP_NAMES = ("softcap",)


def _floats(module: nn.Module, names: tuple[str, ...]) -> set[float]:
    return {float(v) for name in names if isinstance(v := getattr(module, name, None), (int, float))}


def _caps(module: nn.Module) -> set[float]:
    """The softcaps of the module's submodules."""
    return {cap for sub in module.modules() for cap in _floats(sub, _CAP_NAMES) if 0 < cap < math.inf}


def glu_form(gate: Callable[[torch.Tensor], torch.Tensor], module: nn.Module) -> GluForm | None:
    """The closed form of a family's gating, when it has one: each GluForm built from the
    module's constants is tried on gate-and-up values in float64 that cross every limit and cap;
    the first that gives the gating's own output is it. None: only the family's code computes it."""
    alphas = {1.0} | _floats(module, _ALPHA_NAMES)
    limits = {limit for limit in _floats(module, _LIMIT_NAMES) if 0 < limit < math.inf}
    caps = _caps(module)
    reach = max(limits | caps, default=1.0) * 2 + 2
    probe = torch.linspace(-reach, reach, 64, dtype=torch.float64)
    gate_up = torch.cat((probe.repeat_interleave(64)[None], probe.repeat(64)[None]), dim=-1)  # every (g, u) pair
    try:
        expected = gate(gate_up).to(torch.float64)
    except Exception:  # a gating that needs more than its input is not a closed form
        return None
    g, u = gate_up.chunk(2, dim=-1)
    cap_choices = [None, *sorted(caps)]
    for alpha, limit, up_offset, gate_cap, up_cap in itertools.product(
            sorted(alphas), [None, *sorted(limits)], (0.0, 1.0), cap_choices, cap_choices):
        form = GluForm(alpha, limit, up_offset, gate_cap=gate_cap, up_cap=up_cap)
        if torch.allclose(form(g, u), expected, rtol=1e-5, atol=1e-6):  # a float32 step in the family's code
            return form
    return None


class FamilyGate:
    """A family's `_apply_gate`, fed in the family's own row order (Mira keeps gate rows first).

    form: its closed form (`glu_form`), which the fused kernels compute; None when it has none.
    """

    def __init__(self, module: nn.Module, concatenated: bool):
        self.module = module
        self.concatenated = concatenated
        self.form = glu_form(self, module)

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not self.concatenated:  # [T, 2I] gate|up -> [T, 2I] g0 u0 g1 u1 ...
            gate, up = gate_up.chunk(2, dim=-1)
            gate_up = torch.stack((gate, up), dim=-1).flatten(-2)
        return self.module._apply_gate(gate_up)

    def __repr__(self) -> str:
        return f"{type(self.module).__name__}._apply_gate"


@dataclass(frozen=True)
class ModelAnatomy:
    """A config's model on the meta device and where its Experts modules sit."""

    model: nn.Module
    sites: dict[str, int]  # module name of each Experts module -> its decoder layer
    spec: ExpertsSpec


def anatomy(config: PretrainedConfig, source: str = "the model") -> ModelAnatomy:
    """Build `config`'s model on the meta device and read its experts.

    Raises:
        MiraError: no causal LM, no Experts module using the experts interface, one wrapping it in a
            forward of its own other than a per-route norm, mixed Experts classes, or an Experts module
            outside a numbered decoder layer.
    """
    moe_integration()
    model_class = causal_lm_class(config)
    with torch.device("meta"):
        try:
            model = model_class._from_config(config)
        except Exception as error:  # transformers raises many kinds for a config it cannot build
            raise MiraError(f"transformers cannot build {source} from its config.json ({error}); "
                            "fix config.json") from None
    sites, found, modules = {}, {}, {}
    for name, module in model.named_modules():
        check_not_wrapped(type(module), source)
        if is_experts_class(type(module)):
            match = LAYER_INDEX.search(f".{name}.")
            if match is None:
                raise MiraError(f"cannot tell the decoder layer of experts module {name} of {source}")
            sites[name] = int(match.group(1))
            found.setdefault(type(module), module)
            modules[sites[name]] = module
    if not found:
        supported = ", ".join(family.model_type for family in moe_families())
        raise MiraError(f"{source} is a {config.model_type!r} model, which Mira does not support: it has no routed "
                        f"experts in transformers' experts interface; supported architectures (config.json "
                        f"model_type, see `mira models`): {supported}")
    if len(found) > 1:
        names = ", ".join(sorted(cls.__name__ for cls in found))
        raise MiraError(f"{source} mixes Experts classes ({names}); Mira runs one Experts class per model")
    (module,) = found.values()
    spec = spec_of(module)
    if spec.custom_gate:
        refuse_per_layer_gating(modules, source)
    return ModelAnatomy(model, sites, spec)


def refuse_per_layer_gating(modules: dict[int, nn.Module], source: str = "the model") -> None:
    """Raises MiraError where the Experts modules of different decoder layers gate with different
    constants (alpha, limit, softcaps: a per-layer clamped SwiGLU): Mira computes one gating, the first
    layer's, for every MoE layer."""
    constants = {layer: tuple((name, getattr(module, name, None)) for name in (*_ALPHA_NAMES, *_LIMIT_NAMES)
                              if hasattr(module, name)) + tuple(("softcap", cap) for cap in sorted(_caps(module)))
                 for layer, module in sorted(modules.items())}
    if len(set(constants.values())) > 1:
        shown = "; ".join(f"layer {layer}: " + (", ".join(f"{n}={v}" for n, v in values) or "none")
                          for layer, values in list(constants.items())[:4])
        raise MiraError(f"{source} gates its MoE layers with different constants ({shown}, ...); Mira computes one "
                        "gating for every MoE layer, so it cannot run this model yet")


def spec_of(module: nn.Module) -> ExpertsSpec:
    """The spec of one Experts module (of a class decorated with `use_experts_implementation`).

    Raises:
        MiraError: tensors whose shapes do not fit the interface's layout.
    """
    gated = getattr(module, "has_gate", True)
    transposed = getattr(module, "is_transposed", False)
    up = getattr(module, "gate_up_proj" if gated else "up_proj")  # [E, 2I, H], or [E, H, 2I] transposed
    down = module.down_proj  # [E, H, I], or [E, I, H] transposed
    num_experts, up_out, hidden = up.shape if not transposed else (up.shape[0], up.shape[2], up.shape[1])
    intermediate = up_out // 2 if gated else up_out
    expected = (num_experts, hidden, intermediate) if not transposed else (num_experts, intermediate, hidden)
    if tuple(down.shape) != expected:
        raise MiraError(f"{type(module).__name__} has down_proj {tuple(down.shape)}, not {expected}; Mira cannot "
                        "read its layout")
    default_gate = getattr(moe_integration(), "_default_apply_gate", None)
    return ExpertsSpec(
        experts_class=type(module), num_experts=num_experts, hidden=hidden, intermediate=intermediate, gated=gated,
        concatenated=getattr(module, "is_concatenated", True), transposed=transposed,
        bias=getattr(module, "has_bias", False), post_norm=getattr(module, "has_post_expert_norm", False),
        custom_gate=gated and getattr(type(module), "_apply_gate", default_gate) is not default_gate, module=module,
        route_norm=route_norm_of(type(module)))

