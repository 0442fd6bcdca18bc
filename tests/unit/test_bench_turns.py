"""An interleaved bench's rows: one configuration's turns merged as `repeated` summarises repeats,
checked on hand-made turns."""

from mira.bench.measure import merged_turns


def turn(decode: float, total: float, stolen: float | None, wall: float, lookups: int) -> dict:
    row = {"config": "mira", "budget": "25%", "ttft_s": 0.5, "decode_tokens_per_s": decode, "e2e_tokens_per_s": decode,
           "total_s": total, "wall_s": wall, "lookups": {"miss": lookups},
           "cpu_experts": {"mode": "split", "covers": "timed runs", "layers": []},
           "repeats": [{"decode_tokens_per_s": decode, "total_s": total}]}
    if stolen is not None:
        row["host_cpu_stolen"] = stolen
    return row


def test_turns_merge_into_medians_and_ranges_with_every_turn_listed_and_the_last_turns_counters():
    turns = [turn(7.0, 10.0, 0.01, 40.0, 5), turn(9.0, 8.0, None, 35.0, 6), turn(8.0, 9.0, 0.04, 38.0, 7)]
    row = merged_turns(turns)
    assert row["decode_tokens_per_s"] == 8.0 and row["decode_tokens_per_s_range"] == [7.0, 9.0]
    assert row["total_s"] == 9.0 and row["total_s_range"] == [8.0, 10.0]
    assert row["ttft_s_range"] == [0.5, 0.5]
    assert [r["decode_tokens_per_s"] for r in row["repeats"]] == [7.0, 9.0, 8.0]
    # stolen share over the turns that read it, weighted by their time: (0.01 * 10 + 0.04 * 9) / 19
    assert row["host_cpu_stolen"] == round(0.46 / 19, 4)
    assert row["wall_s"] == 113.0
    assert row["lookups"] == {"miss": 7}  # counters stay the last turn's
    assert row["cpu_experts"]["covers"] == "last turn" and turns[-1]["cpu_experts"]["covers"] == "timed runs"


def test_a_skipped_turn_stands_for_the_configuration():
    skipped = {"config": "mira", "budget": "25%", "skipped": "too small for one layer's experts"}
    assert merged_turns([turn(7.0, 10.0, None, 40.0, 5), skipped]) == skipped
