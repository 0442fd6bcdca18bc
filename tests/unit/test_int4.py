"""The int4 scheme (mira.store.int4) against hand-worked cases and a brute-force float64 search."""

import itertools

import pytest
import torch

from mira.cache.budget import plan_slots
from mira.store import int4
from mira.store.layout import ExpertLayout
from mira.store.quant import dequantize_expert, quantize_expert


def test_a_tiles_byte_holds_a_row_and_the_row_32_below_it_column_by_column():
    codes = torch.zeros(128, 4, dtype=torch.uint8)  # two tiles of 64 rows, 4 columns
    codes[0, 0], codes[32, 0], codes[5, 1], codes[63, 3], codes[64, 2], codes[96 + 7, 2] = 1, 2, 3, 15, 4, 9
    packed = int4.pack_tiles(codes)
    assert packed.shape == (128, 2)
    flat = packed.view(2, 4, 32)  # [tile, column, j]
    assert flat[0, 0, 0] == 0x21  # rows 0 (low) and 32 (high) of column 0
    assert flat[0, 1, 5] == 0x03 and flat[0, 3, 31] == 0xF0  # row 63 is the high nibble of j = 31
    assert flat[1, 2, 0] == 0x04 and flat[1, 2, 7] == 0x90
    assert int((flat != 0).sum()) == 5
    assert torch.equal(int4.unpack_tiles(packed), codes)


def test_hand_worked_dequantization():
    codes = torch.full((64, 64), 8, dtype=torch.uint8)
    codes[0, :4] = torch.tensor([1, 2, 3, 15], dtype=torch.uint8)
    sz = torch.zeros(1, 64, 2, dtype=torch.bfloat16)  # one group of 64 columns: (s, z) per row
    sz[0, 0] = torch.tensor([0.5, -1.0])
    sz[0, 1] = torch.tensor([2.0, 0.25])
    got = int4.dequantize_matrix(int4.pack_tiles(codes), sz, torch.float64)
    assert got[0, :5].tolist() == [(1 - 8) * 0.5 - 1, (2 - 8) * 0.5 - 1, (3 - 8) * 0.5 - 1, (15 - 8) * 0.5 - 1, -1.0]
    assert (got[1] == 0.25).all() and (got[2:] == 0).all()


@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_representable_groups_come_back_exactly(group, zero_points):
    """Weights that are codes times a bf16 scale (plus a bf16 zero) are found again, error 0."""
    gen = torch.Generator().manual_seed(group)
    rows, cols = 64, 3 * group
    step = torch.tensor([0.25, 0.0078125, 3.0]).repeat_interleave(group)  # one scale per group
    if zero_points:
        codes = torch.randint(0, 16, (rows, cols), generator=gen).float()
        codes[:, ::group] = 0  # every group spans the full code range, so no clipping wins
        codes[:, 1::group] = 15
        weights = codes * step - 2.0
    else:
        codes = torch.randint(-7, 8, (rows, cols), generator=gen).float()  # -8 would be past amax / 7
        codes[:, ::group] = 7  # the largest magnitude is at +7 steps
        codes[:, 1::group] = -7
        weights = codes * step
    packed, sz = int4.quantize_matrix(weights, group, zero_points)
    assert torch.equal(int4.dequantize_matrix(packed, sz, torch.float64), weights.double())


def _brute_force_symmetric(weights: torch.Tensor, group: int) -> torch.Tensor:
    """Per group, the least squared error over the clipping factors, in float64, one group at a time."""
    errors = []
    for row in weights.double():
        for g in row.split(group):
            best = None
            for shrink in int4.SHRINK:
                s = float(torch.tensor(g.abs().max().item() * shrink / 7).bfloat16())
                s = s if s > 0 else 1.0
                q = torch.clamp(torch.round(g / s), -8, 7)
                err = float(((q * s - g) ** 2).sum())
                best = err if best is None else min(best, err)
            errors.append(best)
    return torch.tensor(errors, dtype=torch.float64)


def _group_errors(weights, group, zero_points):
    packed, sz = int4.quantize_matrix(weights, group, zero_points)
    deq = int4.dequantize_matrix(packed, sz, torch.float64)
    return torch.stack([((d - w) ** 2).sum() for dr, wr in zip(deq, weights.double())
                        for d, w in zip(dr.split(group), wr.split(group))])


def test_symmetric_clipping_search_finds_the_least_error_of_every_group():
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(64, 192, generator=gen) * 0.05  # three groups of 64 per row
    weights[2, 10] = 0.9  # an outlier: clipping pays off in its group
    got = _group_errors(weights, 64, False)
    assert torch.allclose(got, _brute_force_symmetric(weights, 64), rtol=1e-5, atol=1e-12)


def test_zero_point_search_is_no_worse_than_plain_min_max_and_than_symmetric():
    gen = torch.Generator().manual_seed(1)
    weights = torch.randn(64, 256, generator=gen) * 0.05 + 0.01 * torch.rand(64, 1, generator=gen)
    weights[3, 100] = -0.7
    searched = _group_errors(weights, 64, True)
    plain = []  # min-max range, no clipping, float64
    for row in weights.double():
        for g in row.split(64):
            lo, hi = g.min(), g.max()
            s = float(((hi - lo) / 15).float().bfloat16())
            z = float((lo + 8 * s).float().bfloat16())  # the weight of code 8
            q = torch.clamp(torch.round((g - z) / s) + 8, 0, 15)
            plain.append(float(((s * (q - 8) + z - g) ** 2).sum()))
    assert (searched <= torch.tensor(plain) * (1 + 1e-6)).all()
    assert searched.sum() < torch.tensor(plain).sum()  # the outlier's group gains
    assert searched.sum() < _group_errors(weights, 64, False).sum()


def test_all_zero_and_constant_groups():
    weights = torch.zeros(64, 64)
    weights[1] = 0.3
    for zero_points in (False, True):
        packed, sz = int4.quantize_matrix(weights, 32, zero_points)
        deq = int4.dequantize_matrix(packed, sz, torch.float64)
        assert deq[0].abs().max() == 0
        assert torch.allclose(deq[1], torch.full((64,), 0.3, dtype=torch.float64), rtol=4e-3)


def test_expert_round_trip_through_the_layout_and_its_size():
    H, I = 128, 64
    layout = ExpertLayout("int4", H, I)
    gen = torch.Generator().manual_seed(2)
    w13, w2 = torch.randn(2 * I, H, generator=gen), torch.randn(H, I, generator=gen)
    blob = torch.empty(layout.nbytes, dtype=torch.uint8)
    layout.pack(quantize_expert(w13, w2, layout), blob)
    d13, d2 = dequantize_expert(layout.views(blob), layout)
    tensors = int4.quantize(w13, w2)
    e13, e2 = int4.dequantize(tensors, torch.float64)
    assert torch.equal(d13, e13) and torch.equal(d2, e2)
    for d, w in ((d13, w13), (d2, w2)):
        assert 0 < ((d - w.double()).norm() / w.norm()).item() < 0.15
    n = H // int4.GROUP * 2 * I + I // int4.GROUP * H  # groups: a bf16 scale and zero each
    expected = H * I * 3 // 2 + n * 2 * 2
    assert expected <= layout.nbytes < expected + 128 * len(layout.sections)  # sections 128-byte aligned
    assert ExpertLayout.from_json(layout.to_json()) == layout


def test_sizes_of_part_tiles_are_refused():
    with pytest.raises(ValueError, match="must be multiples of 64; use an int8 scheme"):
        ExpertLayout("int4", 96, 64)
    with pytest.raises(ValueError, match="whole tiles of 64 rows"):
        int4.quantize_matrix(torch.zeros(32, 64))


def test_budgets_count_int4_blobs():
    """A Mixtral-shaped int4 blob is a little over half an int8 one: a budget holds about twice the slots."""
    H, I = 4096, 14336
    int8, four = ExpertLayout("int8-shared", H, I).nbytes, ExpertLayout("int4", H, I).nbytes
    assert 0.5 < four / int8 < 0.6
    budget, reserve = 24 << 30, 3 << 30
    plans = {name: plan_slots(budget, reserve, 0, 0, nbytes, 8, 256, 4096) for name, nbytes in
             (("int8", int8), ("int4", four))}
    assert plans["int4"].slots == (budget - reserve) // four
    assert plans["int4"].slots >= 1.7 * plans["int8"].slots


def test_sections_list_every_variant():
    for group, zero_points in itertools.product((32, 64, 128), (False, True)):
        specs = int4.sections(256, 512, group)
        assert [(name, shape) for name, _, shape in specs] == [
            ("w13", (1024, 128)), ("w2", (256, 256)), ("sz13", (256 // group, 1024, 2)), ("sz2", (512 // group, 256, 2))]
        tensors = int4.quantize(torch.randn(1024, 256), torch.randn(256, 512), group, zero_points)
        assert {name: tuple(t.shape) for name, t in tensors.items()} == {name: shape for name, _, shape in specs}
        if not zero_points:
            assert (tensors["sz13"][..., 1] == 0).all()  # symmetric: every zero is 0
