"""The CPU/PCIe split of a layer's misses: hand-worked cases and brute force over every subset."""

import itertools
import math
import random

import pytest

from mira.cache.costmodel import (
    INLINE_LAYER_S, KEEP_LAYER_S, CpuPace, Cuts, DevicePace, HybridCosts, LinearCost, cpu_may_pay, cpu_pays,
    cpu_saving, lane_layer_s, lane_quota, paced_saving, share_keeps, split,
)

MB = 1 << 20


def costs(cpu_fixed=1e-3, cpu_per_token=0.0, bandwidth=MB / 1e-3, call=0.0, gpu=LinearCost(0.0, 0.0), latency=0.0):
    """Costs of 1 MB blobs; by default an expert takes 1 ms on either side."""
    return HybridCosts(blob_bytes=MB, cpu=LinearCost(cpu_fixed, cpu_per_token), cpu_call_s=call,
                       pcie_bytes_per_s=bandwidth, pcie_latency_s=latency, gpu=gpu)


def decode(experts):
    return [(e, 1) for e in experts]


def test_equal_rates_split_half_and_half():
    result = split(decode([3, 9, 12, 40]), MB, costs())
    assert len(result.cpu) == 2 and sorted(result.cpu + result.pcie) == [3, 9, 12, 40]
    assert result.cpu_s == pytest.approx(2e-3) and result.gpu_s == pytest.approx(2e-3)


def test_equal_rates_split_half_and_half_by_bytes_at_another_blob_size():
    result = split(decode(range(6)), 4 * MB, costs())
    assert len(result.cpu) == 3 and result.predicted_s == pytest.approx(12e-3)


def test_an_odd_count_on_a_tie_leaves_the_extra_miss_to_pcie():
    result = split(decode(range(5)), MB, costs())
    assert (len(result.cpu), len(result.pcie)) == (2, 3) and result.predicted_s == pytest.approx(3e-3)


def test_cpu_infinitely_slow_sends_everything_over_pcie():
    result = split(decode(range(4)), MB, costs(cpu_fixed=math.inf))
    assert result.cpu == [] and result.pcie == [0, 1, 2, 3] and result.gpu_s == pytest.approx(4e-3)


def test_pcie_infinitely_slow_or_absent_computes_everything_on_the_cpu():
    for bandwidth in (1e-300, None):
        result = split(decode(range(3)), MB, costs(bandwidth=bandwidth))
        assert result.cpu == [0, 1, 2] and result.pcie == []


def test_no_misses_is_an_empty_split():
    result = split([], MB, costs(), gpu_busy_s=1e-3)
    assert result.cpu == [] and result.pcie == [] and result.predicted_s == pytest.approx(1e-3)


def test_the_per_call_cost_keeps_a_small_share_off_the_cpu():
    # two misses of 1 ms each side; a CPU share costs 1.5 ms more: 2 ms all over PCIe beats 2.5 ms
    result = split(decode([0, 1]), MB, costs(call=1.5e-3))
    assert result.cpu == [] and result.predicted_s == pytest.approx(2e-3)
    # four misses: one CPU expert finishes at 2.5 ms, PCIe alone at 4 ms, two CPU experts at 3.5 ms
    result = split(decode(range(4)), MB, costs(call=1.5e-3))
    assert len(result.cpu) == 1 and result.predicted_s == pytest.approx(3e-3)


def test_the_gpu_sides_busy_time_moves_misses_to_the_cpu():
    result = split(decode(range(4)), MB, costs(), gpu_busy_s=2e-3)
    assert len(result.cpu) == 3 and result.predicted_s == pytest.approx(3e-3)


def test_prefill_stays_mostly_on_the_gpu_where_decode_splits():
    # an expert: CPU 2 ms + 0.1 ms per token, PCIe 3 ms whatever the tokens
    model = costs(cpu_fixed=2e-3, cpu_per_token=1e-4, bandwidth=MB / 3e-3)
    # decode: 5 x 2.1 ms on the CPU against 3 x 3 ms (10.5 ms); 4 CPU experts would leave 12 ms of PCIe
    assert len(split(decode(range(8)), MB, model).cpu) == 5
    prefill = [(e, 64 + e) for e in range(8)]  # 64..71 tokens: 8.4 ms and more each on the CPU
    result = split(prefill, MB, model)
    # the two with the fewest tokens: 8.4 + 8.5 ms against 6 x 3 ms = 18 ms; one: 21 ms; three: 25.5 ms
    assert result.cpu == [0, 1] and result.predicted_s == pytest.approx(18e-3)


def test_the_pcie_side_takes_the_longer_of_copy_and_kernel():
    model = costs(gpu=LinearCost(0.0, 1e-4), latency=1e-4)
    assert model.pcie_s(1) == pytest.approx(1.1e-3)  # the copy: latency + 1 MB at 1 MB/ms
    assert model.pcie_s(50) == pytest.approx(5e-3)  # the kernel: 50 tokens at 0.1 ms


def _brute_force(misses, model, busy):
    best = math.inf
    for size in range(len(misses) + 1):
        for chosen in itertools.combinations(misses, size):
            cpu = (model.cpu_call_s if chosen else 0.0) + sum(model.cpu_s(t) for _, t in chosen)
            pcie = busy + sum(model.pcie_s(t) for m, t in misses if (m, t) not in chosen)
            best = min(best, max(cpu, pcie))
    return best


def _random_model(rng, copy_bound):
    gpu = LinearCost(0.0, 0.0) if copy_bound else LinearCost(rng.uniform(0, 1e-3), rng.uniform(0, 2e-4))
    return costs(cpu_fixed=rng.uniform(1e-4, 3e-3), cpu_per_token=rng.uniform(0, 2e-4),
                 bandwidth=MB / rng.uniform(5e-4, 3e-3), call=rng.uniform(0, 5e-4), gpu=gpu,
                 latency=rng.uniform(0, 1e-4))


@pytest.mark.parametrize("seed", range(40))
def test_optimal_when_every_miss_costs_the_same_over_pcie(seed):
    """Copy-bound (decode or prefill, one blob size): the split equals the best of all 2^n subsets."""
    rng = random.Random(seed)
    model = _random_model(rng, copy_bound=True)
    misses = [(e, rng.randint(1, 40)) for e in rng.sample(range(64), rng.randint(1, 9))]
    busy = rng.uniform(0, 3e-3)
    result = split(misses, MB, model, busy)
    assert result.predicted_s == pytest.approx(_brute_force(misses, model, busy), rel=1e-12)
    assert result.cpu_s == pytest.approx((model.cpu_call_s if result.cpu else 0.0)
                                         + sum(model.cpu_s(t) for e, t in misses if e in result.cpu))


@pytest.mark.parametrize("seed", range(40))
def test_within_one_misss_cheaper_cost_of_the_optimum_otherwise(seed):
    rng = random.Random(1000 + seed)
    model = _random_model(rng, copy_bound=False)
    misses = [(e, rng.randint(1, 64)) for e in rng.sample(range(64), rng.randint(1, 9))]
    busy = rng.uniform(0, 3e-3)
    result = split(misses, MB, model, busy)
    optimum = _brute_force(misses, model, busy)
    slack = max(min(model.cpu_s(t), model.pcie_s(t)) for _, t in misses)
    assert optimum <= result.predicted_s + 1e-15 and result.predicted_s <= optimum + slack + 1e-15


def test_fit_recovers_a_line_and_clamps_a_falling_one():
    line = LinearCost.fit([1, 2, 4, 8], [3e-3 + 5e-4 * t for t in (1, 2, 4, 8)])
    assert line.fixed_s == pytest.approx(3e-3) and line.per_token_s == pytest.approx(5e-4)
    falling = LinearCost.fit([1, 2], [2e-3, 1e-3])
    assert falling.per_token_s == 0.0 and falling.fixed_s == pytest.approx(1.5e-3)
    assert LinearCost.fit([1], [7e-4]) == LinearCost(7e-4, 0.0)


def test_costs_round_trip_through_json():
    model = costs(cpu_per_token=1e-5, call=2e-5, gpu=LinearCost(1e-5, 1e-6), latency=3e-6)
    assert HybridCosts.from_json(model.to_json()) == model


@pytest.mark.parametrize("seed", range(40))
def test_optimal_for_misses_of_equal_tokens(seed):
    """Decode's case (every miss alike), including a GPU side slower than the copies."""
    rng = random.Random(2000 + seed)
    model = _random_model(rng, copy_bound=seed % 2 == 0)
    tokens = rng.choice([1, 1, 3, 40])
    misses = [(e, tokens) for e in rng.sample(range(64), rng.randint(1, 9))]
    busy = rng.uniform(0, 3e-3)
    result = split(misses, MB, model, busy)
    assert result.predicted_s == pytest.approx(_brute_force(misses, model, busy), rel=1e-12)
    assert sorted(result.cpu + result.pcie) == sorted(e for e, _ in misses)


def test_one_miss_is_cut_where_both_sides_end_together():
    """1 ms each side for a whole expert, 10 parts. Read by share alone, half and half ends at 0.5 ms.
    With the CPU reading a third of the blob whatever its share (columns never pay): 1/3 + 2/3 * j/10
    = 1 - j/10 at j = 4, 0.6 ms. Both are far from the 1 ms of either side alone."""
    ideal = split(decode([7]), MB, costs(), cuts=Cuts(10, 0.0, 2.0))
    assert (ideal.cpu, ideal.pcie, ideal.cut) == ([], [], (7, 5))
    assert ideal.cpu_s == pytest.approx(0.5e-3) and ideal.gpu_s == pytest.approx(0.5e-3)
    third = split(decode([7]), MB, costs(), cuts=Cuts(10, 1 / 3, math.inf))
    assert third.cut == (7, 4) and third.predicted_s == pytest.approx(0.6e-3)
    assert split(decode([7]), MB, costs()).predicted_s == pytest.approx(1e-3)  # uncut


def test_a_cut_reads_its_down_columns_where_they_cost_less_than_the_whole():
    """The down matrix a third of the blob, its columns at twice their bytes: a share s costs
    2/3 s + 1/3 min(1, 2 s) of the blob, hand-worked: a quarter 1/6 + 1/6 = 1/3; a half 1/3 + 1/3;
    three quarters 1/2 + 1/3. A CPU at 2 ms a whole expert against PCIe's 1 ms, 4 parts: reading
    the whole down matrix, a quarter costs 2 (1/3 + 1/6) = 1 ms on the CPU, no sooner than PCIe alone
    (1 ms): no cut. Reading its columns, 2/3 ms against 0.75 ms on PCIe: 0.75 ms."""
    cuts = Cuts(4, 1 / 3, 2.0)
    assert [cuts.cpu_read(s) for s in (0.25, 0.5, 0.75)] == pytest.approx([1 / 3, 2 / 3, 5 / 6])
    whole_down = split(decode([5]), MB, costs(cpu_fixed=2e-3), cuts=Cuts(4, 1 / 3, math.inf))
    assert whole_down.cut is None and whole_down.predicted_s == pytest.approx(1e-3)
    columns = split(decode([5]), MB, costs(cpu_fixed=2e-3), cuts=cuts)
    assert columns.cut == (5, 1) and (columns.cpu_s, columns.gpu_s) == pytest.approx((2e-3 / 3, 0.75e-3))


def test_a_cut_is_taken_only_where_it_ends_sooner():
    """Two 1 ms misses end together whole, one on each side: no cut can do better (nor is one tried
    while both sides have a miss). A CPU at 2 ms per
    expert leaves both on PCIe whole (2 ms); cutting one, 0.2 j on the CPU against 1 + (1 - j/10) on
    PCIe, ends at 1.4 ms at j = 6 or 7 (the fewer on the CPU taken), against the 4/3 ms of a split at
    any share."""
    whole = split(decode([1, 2]), MB, costs(), cuts=Cuts(10, 0.0, 2.0))
    assert whole.cut is None and whole.predicted_s == pytest.approx(1e-3)
    slow = split(decode([1, 2]), MB, costs(cpu_fixed=2e-3), cuts=Cuts(10, 0.0, 2.0))
    assert (slow.cpu, slow.pcie, slow.cut) == ([], [2], (1, 6))
    assert slow.cpu_s == pytest.approx(1.2e-3) and slow.gpu_s == pytest.approx(1.4e-3)


@pytest.mark.parametrize("seed", range(30))
def test_a_cut_is_the_best_of_every_whole_split_and_every_cut(seed):
    """Alike misses: where the best whole split leaves a side idle, against every k whole on the
    CPU with or without one cut at every share; else that whole split, uncut."""
    rng = random.Random(3000 + seed)
    model = _random_model(rng, copy_bound=seed % 2 == 0)
    tokens = rng.choice([1, 1, 3])
    misses = [(e, tokens) for e in rng.sample(range(64), rng.randint(1, 6))]
    busy = rng.uniform(0, 3e-3)
    cuts = Cuts(rng.choice([2, 7, 28]), rng.choice([0.0, 1 / 3, 0.5]), rng.choice([1.0, 2.0, math.inf]))
    n, c, p = len(misses), model.cpu_s(tokens, MB), model.pcie_s(tokens, MB)
    best = _brute_force(misses, model, busy)
    for k in range(n):
        for j in range(1, cuts.parts):
            share = j / cuts.parts
            down = cuts.down * (1 if cuts.column_cost * share >= 1 else cuts.column_cost * share)
            cpu = model.cpu_call_s + k * c + model.cpu_s(tokens, round(MB * ((1 - cuts.down) * share + down)))
            gpu = busy + (n - k - 1) * p + model.pcie_s(tokens, round(MB * (1 - share)))
            best = min(best, max(cpu, gpu))
    whole = split(misses, MB, model, busy)
    result = split(misses, MB, model, busy, cuts)
    if whole.cpu and whole.pcie:
        assert result == whole
    else:
        assert result.predicted_s == pytest.approx(best, rel=1e-9)
    cut = [result.cut[0]] if result.cut else []
    assert sorted(result.cpu + result.pcie + cut) == sorted(e for e, _ in misses)


def test_a_cut_is_priced_by_the_cut_costs_and_the_whole_split_by_the_others():
    """Hand-worked, one miss, the CPU reading nothing whole (4 parts): PCIe 1 ms a miss, and the
    whole split at a CPU of 1 ms leaves it on PCIe (a tie goes to fewer CPU experts): 1 ms. Cut
    costs with the CPU at 1 ms: half on each side, 0.5 ms. At 3 ms: a quarter on the CPU,
    0.75 ms each side. At 10 ms even a quarter (2.5 ms) is slower than PCIe alone: no cut."""
    cuts = Cuts(4, 0.0, 2.0)
    assert split(decode([0]), MB, costs(), cuts=cuts).predicted_s == pytest.approx(0.5e-3)
    slow = split(decode([0]), MB, costs(), cuts=cuts, cut_costs=costs(cpu_fixed=3e-3))
    assert slow.cut == (0, 1) and (slow.cpu_s, slow.gpu_s) == pytest.approx((0.75e-3, 0.75e-3))
    slower = split(decode([0]), MB, costs(), cuts=cuts, cut_costs=costs(cpu_fixed=10e-3))
    assert slower.cut is None and slower.pcie == [0] and slower.predicted_s == pytest.approx(1e-3)


def test_a_cut_needs_two_parts_a_share_below_one_and_columns_no_cheaper_than_their_bytes():
    for parts, down, column_cost in ((1, 0.0, 2.0), (4, 1.0, 2.0), (4, -0.1, 2.0), (4, 0.3, 0.5)):
        with pytest.raises(ValueError, match="parts"):
            Cuts(parts, down, column_cost)


def test_the_pace_is_the_running_geometric_ratio_of_measured_over_calibrated():
    """Hand-worked: weight 1/2, ratios 4 then 1 -> log pace (ln 4) / 2 then (ln 4) / 4: pace sqrt(2)."""
    pace = CpuPace(learn=0.5, forget=0.0)
    pace.observe(4e-3, 1e-3)
    assert pace.scale == pytest.approx(2.0)
    pace.observe(1e-3, 1e-3)
    assert pace.scale == pytest.approx(math.sqrt(2))
    pace.observe(0.0, 1e-3)  # nothing measured: no evidence
    assert pace.scale == pytest.approx(math.sqrt(2))


def test_a_paced_out_cpu_is_pulled_back_to_the_calibration():
    """A pace that prices the CPU out of a two-miss decode layer (each side 1 ms as calibrated):
    each layer it is passed over pulls it towards 1 until the CPU is given a miss again."""
    base = costs()
    pace = CpuPace(learn=1.0, forget=0.5)
    pace.observe(3e-3, 1e-3)  # the CPU at 3 ms: slower than both misses over PCIe (2 ms)
    misses = [(0, 1), (1, 1)]
    passed = 0
    while not split(misses, MB, pace.costs(base)).cpu:
        pace.passed_over()
        passed += 1
    # log pace ln 3 * 0.5^k; the CPU takes one miss once its 1 ms * pace < 2 ms: 3^(0.5^k) < 2 at k = 1
    assert passed == 1 and pace.scale == pytest.approx(math.sqrt(3))
    paced = pace.costs(base)
    assert paced.cpu(1) == pytest.approx(math.sqrt(3) * 1e-3) and paced.pcie_s(1) == pytest.approx(base.pcie_s(1))


def test_the_pace_scales_the_per_call_cost_too():
    pace = CpuPace(learn=1.0)
    pace.observe(3e-3, 1.5e-3)
    paced = pace.costs(costs(cpu_per_token=2e-4, call=1e-4))
    assert (paced.cpu.fixed_s, paced.cpu.per_token_s, paced.cpu_call_s) == pytest.approx((2e-3, 4e-4, 2e-4))
    with pytest.raises(ValueError, match="learn is a weight"):
        CpuPace(learn=1.5)
    # a pace set where a run's ended prices as the learnt one does, and learns on from there
    at = CpuPace.at(2.0)
    set_at = at.costs(costs(cpu_per_token=2e-4, call=1e-4))
    assert (set_at.cpu.fixed_s, set_at.cpu.per_token_s, set_at.cpu_call_s) == pytest.approx((2e-3, 4e-4, 2e-4))
    at.passed_over()
    assert at.scale == pytest.approx(2.0 ** 0.99)
    with pytest.raises(ValueError, match="positive ratio"):
        DevicePace.at(0.0)


def test_the_device_pace_scales_copies_and_kernels_and_moves_misses_to_the_cpu():
    """Hand-worked: two decode misses, the CPU at 2.5 ms each, PCIe at 1.1 ms (1 ms of bytes, 0.1 of
    latency). As calibrated both go over PCIe (2.2 ms; one on the CPU ends at 2.5). With the
    device's side at twice its calibration PCIe alone takes 4.4 ms, and one miss on the CPU ends
    at 2.5 ms (the other at 2.2 on the device)."""
    base = costs(cpu_fixed=2.5e-3, latency=1e-4, gpu=LinearCost(1e-4, 1e-5))
    misses = [(0, 1), (1, 1)]
    assert split(misses, MB, base).cpu == []
    pace = DevicePace(learn=1.0)
    pace.observe(4e-3, 2e-3)
    paced = pace.costs(base)
    assert paced.pcie_s(1) == pytest.approx(2 * base.pcie_s(1)) and paced.gpu(7) == pytest.approx(2 * base.gpu(7))
    assert paced.cpu == base.cpu and paced.cpu_call_s == base.cpu_call_s
    chosen = split(misses, MB, paced)
    assert (chosen.cpu, chosen.pcie) == ([0], [1])
    assert (chosen.cpu_s, chosen.gpu_s) == pytest.approx((2.5e-3, 2 * base.pcie_s(1)))
    assert DevicePace().costs(costs(bandwidth=None)).pcie_bytes_per_s is None  # no GPU: nothing to scale


def test_a_cpu_share_pays_only_where_it_saves_more_than_running_inline_costs():
    """Hand-worked from the H200's calibrations. Mixtral-8x7B (176 MB experts, top-2): the CPU 3.06 ms
    per expert and 0.2 ms per call, PCIe 3.25 ms: one miss each side ends at 3.26 ms where PCIe
    alone takes 6.5 ms. Qwen3-30B-A3B (4.7 MB, top-8): 63 us, 0.2 ms, 91 us: the best split (four
    each side) ends at 0.452 ms where PCIe alone takes 0.728 ms, 0.276 ms sooner, under INLINE_LAYER_S."""
    mixtral = HybridCosts(blob_bytes=MB, cpu=LinearCost(3.06e-3, 0.0), cpu_call_s=0.2e-3, pcie_bytes_per_s=MB / 3.25e-3)
    assert cpu_pays(mixtral, top_k=2, blob_bytes=MB)
    qwen = HybridCosts(blob_bytes=MB, cpu=LinearCost(63e-6, 0.0), cpu_call_s=0.2e-3, pcie_bytes_per_s=MB / 91e-6)
    assert split(decode(range(8)), MB, qwen).predicted_s == pytest.approx(0.2e-3 + 4 * 63e-6)
    assert 8 * 91e-6 - (0.2e-3 + 4 * 63e-6) < INLINE_LAYER_S
    assert not cpu_pays(qwen, top_k=8, blob_bytes=MB)
    # experts of 8x the bytes and time: five on the CPU end at 2.72 ms against 5.82 ms, 3.1 ms sooner
    assert cpu_pays(qwen, top_k=8, blob_bytes=8 * MB)


def test_a_cpu_share_pays_by_its_expected_saving_at_the_budgets_miss_rate():
    """Mixtral-8x7B as above: one miss goes over PCIe (3.25 ms against 3.26 on the CPU), two save
    6.5 - 3.26 = 3.24 ms. Each routed expert missing with probability p, both miss with p^2: at
    p = 0.51 (126 of 256 slots, 24 GiB) 0.2601 * 3.24 = 0.84 ms, under INLINE_LAYER_S; at p = 0.79
    (53 slots, 12 GiB) 0.6241 * 3.24 = 2.02 ms."""
    mixtral = HybridCosts(blob_bytes=MB, cpu=LinearCost(3.06e-3, 0.0), cpu_call_s=0.2e-3,
                          pcie_bytes_per_s=MB / 3.25e-3)
    assert not split(decode([0]), MB, mixtral).cpu
    assert 0.51 ** 2 * 3.24e-3 < INLINE_LAYER_S < 0.79 ** 2 * 3.24e-3
    assert not cpu_pays(mixtral, top_k=2, blob_bytes=MB, miss_rate=0.51)
    assert cpu_pays(mixtral, top_k=2, blob_bytes=MB, miss_rate=0.79)
    assert not cpu_pays(mixtral, top_k=2, blob_bytes=MB, miss_rate=0.0)
    with pytest.raises(ValueError, match="probability"):
        cpu_pays(mixtral, top_k=2, blob_bytes=MB, miss_rate=1.5)


def test_a_share_is_judged_again_at_the_paces_decoding_learnt():
    """Mixtral-8x7B as above, each routed expert missing with p = 0.55. At the calibration two misses
    (p^2 = 0.3025) save 3.24 ms, 0.980 ms a layer: the share keeps its place. With the device's side
    1.3x slower (a miss 4.225 ms over PCIe beside the CPU's traffic), two misses end at 4.225 ms, one
    a side, where PCIe alone at its calibration takes 6.5 ms: 2.275 ms saved; a lone miss goes to the
    CPU (3.26 ms against 4.225) and loses 0.01 ms against 3.25 alone (2p(1 - p) = 0.495). So 0.3025 *
    2.275 - 0.495 * 0.01 = 0.683 ms, under KEEP_LAYER_S. A CPU twice as slow for cut jobs prices only
    splits with a cut: without cuts it changes nothing."""
    mixtral = HybridCosts(blob_bytes=MB, cpu=LinearCost(3.06e-3, 0.0), cpu_call_s=0.2e-3,
                          pcie_bytes_per_s=MB / 3.25e-3)
    calibrated = paced_saving(mixtral, CpuPace(), CpuPace(), None, 2, MB, 0.55)
    assert calibrated == pytest.approx(0.3025 * 3.24e-3) and share_keeps(calibrated)
    slower = paced_saving(mixtral, CpuPace(), CpuPace.at(2.0), DevicePace.at(1.3), 2, MB, 0.55)
    assert slower == pytest.approx(0.3025 * 2.275e-3 - 0.495 * 0.01e-3) and not share_keeps(slower)
    assert share_keeps(KEEP_LAYER_S) and not share_keeps(KEEP_LAYER_S - 1e-6)


def test_a_cpu_share_saves_against_the_pcie_alternative_as_priced_apart():
    """Mixtral-8x7B as above at p = 0.5. Priced alike, a lone miss stays on PCIe (3.25 ms against
    3.26 on the CPU) and saves nothing; two (p^2 = 0.25) end at 3.26 ms against 6.5: 0.81 ms. With
    the PCIe-only alternative at 2.5 ms a miss (the device's side faster without the CPU's memory
    traffic beside it), two save 5.0 - 3.26 = 1.74 ms: 0.435 ms; the lone miss still saves nothing,
    since a split that leaves the CPU nothing is no share."""
    mixtral = HybridCosts(blob_bytes=MB, cpu=LinearCost(3.06e-3, 0.0), cpu_call_s=0.2e-3,
                          pcie_bytes_per_s=MB / 3.25e-3)
    assert cpu_saving(mixtral, top_k=2, blob_bytes=MB, miss_rate=0.5) == pytest.approx(0.25 * 3.24e-3)
    faster = HybridCosts(blob_bytes=MB, cpu=mixtral.cpu, cpu_call_s=0.2e-3, pcie_bytes_per_s=MB / 2.5e-3)
    assert cpu_saving(mixtral, top_k=2, blob_bytes=MB, miss_rate=0.5, alone=faster) == pytest.approx(0.25 * 1.74e-3)
    # cut in quarters, a lone miss is halved (1.73 ms, 1.52 saved: 0.5 * 1.52 + 0.81 = 1.57 ms); with
    # a cut's CPU side at twice the pace, halving ends at 0.2 + 3.06 = 3.26 ms and a quarter at
    # max(0.2 + 1.53, 0.75 * 3.25) = 2.4375 ms: 0.5 * 0.8125 + 0.81 = 1.216 ms (two misses take no cut)
    quarters = Cuts(parts=4, down=0.0, column_cost=2.0)
    slow = HybridCosts(blob_bytes=MB, cpu=LinearCost(2 * 3.06e-3, 0.0), cpu_call_s=0.2e-3, pcie_bytes_per_s=MB / 3.25e-3)
    assert cpu_saving(mixtral, 2, MB, 0.5, cuts=quarters) == pytest.approx(0.5 * 1.52e-3 + 0.25 * 3.24e-3)
    assert cpu_saving(mixtral, 2, MB, 0.5, cuts=quarters, cut_costs=slow) == pytest.approx(
        0.5 * 0.8125e-3 + 0.25 * 3.24e-3)
    with pytest.raises(ValueError, match="probability"):
        cpu_saving(mixtral, top_k=2, blob_bytes=MB, miss_rate=-0.1)


def test_a_cut_counts_in_what_a_cpu_share_saves():
    """Mixtral-8x7B as above, a miss cut into 4 parts (the CPU reading only its parts): a lone miss
    cut in half ends at max(0.2 + 3.06 / 2, 3.25 / 2) = 1.73 ms against PCIe alone's 3.25, 1.52 ms
    sooner, where whole it stays on PCIe (3.26 ms on the CPU). At p = 0.51 one miss comes with
    2 p (1 - p) = 0.4998: 0.4998 * 1.52 + 0.2601 * 3.24 = 1.60 ms, over INLINE_LAYER_S, where whole
    splits alone save 0.84 ms."""
    mixtral = HybridCosts(blob_bytes=MB, cpu=LinearCost(3.06e-3, 0.0), cpu_call_s=0.2e-3,
                          pcie_bytes_per_s=MB / 3.25e-3)
    halves = Cuts(parts=4, down=0.0, column_cost=2.0)
    lone = split(decode([0]), MB, mixtral, cuts=halves)
    assert lone.cut == (0, 2) and lone.predicted_s == pytest.approx(0.2e-3 + 3.06e-3 / 2)
    assert 0.4998 * (3.25e-3 - lone.predicted_s) + 0.2601 * 3.24e-3 > INLINE_LAYER_S
    assert cpu_pays(mixtral, top_k=2, blob_bytes=MB, miss_rate=0.51, cuts=halves)
    assert not cpu_pays(mixtral, top_k=2, blob_bytes=MB, miss_rate=0.51)


def test_experts_too_small_to_pay_on_any_link_skip_the_calibration():
    """A split saves at most PCIe alone's time. At 1 GB/s (slower than any GPU link) a layer's misses
    (int8-shared blobs) take: the bundled model's 2 x 0.197 MB, 0.39 ms, under INLINE_LAYER_S;
    Qwen3-30B-A3B's 8 x 4.72 MB, 37.8 ms; Mixtral-8x7B's 2 x 176 MB, 352 ms. So only the first is
    decided without calibrating; and no calibration could have the CPU pay where this says no."""
    assert not cpu_may_pay(top_k=2, blob_bytes=197_120)
    assert cpu_may_pay(top_k=8, blob_bytes=4_722_688) and cpu_may_pay(top_k=2, blob_bytes=176_168_960)
    fastest_cpu = HybridCosts(blob_bytes=MB, cpu=LinearCost(0.0, 0.0), cpu_call_s=0.0, pcie_bytes_per_s=1e9)
    for top_k, blob in ((2, 197_120), (2, 600_000), (4, 240_000)):  # every miss free on the CPU, PCIe at 1 GB/s
        assert cpu_pays(fastest_cpu, top_k, blob) == cpu_may_pay(top_k, blob)


def test_lane_quota_hand_worked():
    # two routed experts, each missing half the time: 0, 1, 2 misses with chances 1/4, 1/2, 1/4
    # quota 0: 1/2 * 1 + 1/4 * 2 = 1.0 (PCIe alone, 1 s a miss)
    # lanes 1, 0.5 s an expert, 0.1 s a round trip; quota 1: 1/4 * 0.1 + 1/2 * 0.6 + 1/4 * max(0.6, 1) = 0.575
    # quota 2: 1/4 * 0.1 + 1/2 * 0.6 + 1/4 * 1.1 = 0.6
    assert lane_quota(2, 0.5, 1, 0.5, 0.1, 1.0) == 1
    # 1.5 s an expert: quota 1 costs 1/4 * 0.1 + 1/2 * 1.6 + 1/4 * 1.6 = 1.225 and quota 2 1.6, PCIe alone 1.0
    assert lane_quota(2, 0.5, 1, 1.5, 0.1, 1.0) == 0
    # both always miss; two lanes, 1 s an expert: quotas 1 and 2 both take 1.1 s against 2 s, the smaller wins
    assert lane_quota(2, 1.0, 2, 1.0, 0.1, 1.0) == 1
    # the same with a slower link: quota 2 (1.1 s) beats quota 1 (max(1.1, 1.5))
    assert lane_quota(2, 1.0, 2, 1.0, 0.1, 1.5) == 2


def test_lane_layer_s_hand_worked():
    # the first case above: PCIe alone 1.0 s, quota 1 0.575 s, quota 2 0.6 s
    assert lane_layer_s(2, 0.5, 1, 0.5, 0.1, 1.0, quota=0) == pytest.approx(1.0)
    assert lane_layer_s(2, 0.5, 1, 0.5, 0.1, 1.0, quota=1) == pytest.approx(0.575)
    assert lane_layer_s(2, 0.5, 1, 0.5, 0.1, 1.0, quota=2) == pytest.approx(0.6)
    # two lanes take both misses at once: 1/4 * 0.1 + 3/4 * 0.6
    assert lane_layer_s(2, 0.5, 2, 0.5, 0.1, 1.0, quota=2) == pytest.approx(0.475)


def test_lane_quota_matches_a_brute_force_expectation():
    rng = random.Random(5)
    for _ in range(200):
        top_k, lanes = rng.randint(1, 8), rng.randint(1, 4)
        rate, lane_s, call_s, pcie_s = rng.random(), rng.uniform(0.1, 3), rng.uniform(0, 0.5), rng.uniform(0.1, 3)

        def expected(quota):
            total = 0.0
            for missed in itertools.product((0, 1), repeat=top_k):  # every pattern of misses
                m = sum(missed)
                chance = rate ** m * (1 - rate) ** (top_k - m)
                taken = min(quota, m)
                cpu = -(-taken // lanes) * lane_s + call_s if quota else 0.0
                total += chance * max(cpu, (m - taken) * pcie_s)
            return total

        best = min(expected(q) for q in range(top_k + 1))
        quota = lane_quota(top_k, rate, lanes, lane_s, call_s, pcie_s)
        assert expected(quota) == pytest.approx(best)


def test_lane_quota_refuses_a_miss_rate_that_is_no_probability():
    with pytest.raises(ValueError, match="probability"):
        lane_quota(2, 1.5, 1, 1.0, 0.0, 1.0)
