"""Quantization and blob layout against hand-worked cases and float64 arithmetic."""

import pytest
import torch

from mira.store.layout import ExpertLayout
from mira.store.quant import _scale_from_amax, dequantize_expert, quantize_expert

H, I = 48, 20


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(2 * I, H, generator=g) * 0.05
    w2 = torch.randn(H, I, generator=g) * 0.05
    w13[3, 7] = 1.5  # an outlier
    w13[:, 11] = 0.0  # an all-zero input channel
    w2[11, :] = 0.0
    return w13, w2


def _pack(scheme: str, w13: torch.Tensor, w2: torch.Tensor) -> tuple[ExpertLayout, dict]:
    layout = ExpertLayout(scheme, H, I)
    blob = torch.empty(layout.nbytes, dtype=torch.uint8)
    layout.pack(quantize_expert(w13, w2, layout), blob)
    return layout, layout.views(blob)


@pytest.mark.parametrize("scheme", ["int8-shared", "int8-row"])
def test_every_dequantized_weight_is_within_half_a_step(scheme):
    w13, w2 = _weights()
    layout, views = _pack(scheme, w13, w2)
    d13, d2 = dequantize_expert(views, layout)
    if scheme == "int8-shared":
        step13 = views["scale"].double()[None, :].expand(2 * I, H)
        step2 = views["scale"].double()[:, None].expand(H, I)
    else:
        step13 = views["scale13"].double()[:, None].expand(2 * I, H)
        step2 = views["scale2"].double()[:, None].expand(H, I)
    assert ((d13 - w13.double()).abs() <= step13 / 2).all()
    assert ((d2 - w2.double()).abs() <= step2 / 2).all()
    assert d13[:, 11].abs().max() == 0 and d2[11].abs().max() == 0


def test_shared_scale_is_the_channel_max_over_all_three_matrices():
    w13, w2 = _weights()
    _, views = _pack("int8-shared", w13, w2)
    amax = torch.maximum(w13.abs().amax(0), w2.abs().amax(1)).double()
    scale = views["scale"].double()
    nonzero = amax > 0
    assert (scale[nonzero] >= amax[nonzero] / 127).all()  # rounded up: no weight clips
    assert (scale[nonzero] <= amax[nonzero] / 127 * (1 + 2**-7)).all()  # by at most one bf16 step
    assert views["w13"][3, 7] == 127  # the outlier defines its channel's scale


def test_scale_rounding_up_hand_worked():
    # 1 + 2^-10 lies between the bf16 neighbours 1 and 1 + 2^-7: rounding up gives the larger.
    amax = torch.tensor([127 * (1 + 2**-10), 127.0, 0.0], dtype=torch.float64)
    assert _scale_from_amax(amax).double().tolist() == [1 + 2**-7, 1.0, 1.0]


def test_none_scheme_is_lossless_and_layout_sections_are_aligned():
    w13, w2 = _weights()
    layout, views = _pack("none", w13, w2)
    layout32 = ExpertLayout("none", H, I, torch.float32)
    blob = torch.empty(layout32.nbytes, dtype=torch.uint8)
    layout32.pack(quantize_expert(w13, w2, layout32), blob)
    assert torch.equal(layout32.views(blob)["w13"], w13) and torch.equal(layout32.views(blob)["w2"], w2)


def test_layout_offsets_hand_worked():
    # int8-shared, H=48, I=20: w13 40x48 = 1920 B at 0; w2 48x20 = 960 B at 1920; scale 96 B at
    # 1920 + 1024 (960 rounded up to 128) = 2944; total 3040 rounded up to 3072.
    layout = ExpertLayout("int8-shared", H, I)
    assert {n: s.offset for n, s in layout.sections.items()} == {"w13": 0, "w2": 1920, "scale": 2944}
    assert layout.nbytes == 3072


def test_layout_round_trips_through_json_and_rejects_a_wrong_blob():
    layout = ExpertLayout("int8-row", H, I)
    assert ExpertLayout.from_json(layout.to_json()) == layout
    with pytest.raises(ValueError, match="uint8 blob"):
        layout.views(torch.empty(layout.nbytes + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        ExpertLayout("int3", H, I)
