"""Mass-weighted Coverage@k (paper Fig. 9) against hand-worked cases."""

from __future__ import annotations

import numpy as np
import pytest

from mira.predict.coverage import coverage, top_experts


def _one(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float64)[None, None, :]  # [S=1, L=1, E]


def test_coverage_is_the_routed_mass_on_the_predicted_top_k():
    # two tokens, top-2: expert 0 got 2 slots, experts 1 and 2 one each (mass 1/2, 1/4, 1/4, 0)
    mass = _one([2, 1, 1, 0])
    scores = _one([0.1, 0.5, 0.3, 0.0])  # ranking 1, 2, 0, 3
    assert coverage(scores, mass, 1)[0] == pytest.approx(0.25)
    assert coverage(scores, mass, 2)[0] == pytest.approx(0.5)
    assert coverage(scores, mass, 3)[0] == pytest.approx(1.0)
    assert coverage(scores, mass, 4)[0] == pytest.approx(1.0)


def test_steps_are_averaged_weighted_by_their_tokens_and_layers_are_kept_apart():
    mass = np.array([[[1, 1, 0], [0, 0, 2]],   # step 0 (1 token): layer 0 on experts 0+1, layer 1 on expert 2
                     [[0, 3, 3], [6, 0, 0]]])  # step 1 (3 tokens)
    scores = np.array([[[9, 8, 0], [0, 9, 8]],
                       [[9, 8, 0], [0, 9, 8]]], dtype=float)  # always experts 0,1 at layer 0 and 1,2 at layer 1
    # layer 0: step 0 covers 1, step 1 covers 1/2; layer 1: step 0 covers 1, step 1 covers 0
    assert coverage(scores, mass, 2, weights=np.array([1, 3])) == pytest.approx([(1 + 3 * 0.5) / 4, 1 / 4])
    assert coverage(scores, mass, 2) == pytest.approx([0.75, 0.5])  # unweighted


def test_ties_go_to_the_lower_expert_id_and_empty_rows_cover_nothing():
    assert top_experts(np.array([1.0, 2.0, 2.0, 2.0]), 2).tolist() == [1, 2]
    assert coverage(_one([0, 0, 0, 0]), _one([0, 0, 1, 1]), 2)[0] == 0.0  # all tied: experts 0, 1 chosen
    assert coverage(_one([0, 0, 0, 1e-9]), _one([0, 0, 1, 1]), 2)[0] == pytest.approx(0.5)
    assert coverage(_one([1, 2, 3, 4]), _one([0, 0, 0, 0]), 2)[0] == 0.0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="k must be between 1 and 4"):
        coverage(_one([1, 2, 3, 4]), _one([1, 0, 0, 0]), 5)
    with pytest.raises(ValueError, match="must both be"):
        coverage(_one([1, 2, 3, 4]), _one([1, 0, 0]), 1)
    with pytest.raises(ValueError, match="positive sum"):
        coverage(_one([1, 2, 3, 4]), _one([1, 0, 0, 0]), 1, weights=np.zeros(1))


def test_the_coverage_table_says_which_steps_its_layer_columns_cover():
    from mira.predict.coverage import format_coverage

    def subset(layers):
        return {"@1": {"layers": layers, "mean": sum(layers) / 2}, "@2": {"layers": layers, "mean": sum(layers) / 2}}

    prompts_only = {"steps": 2, "decode_steps": 0, "tokens": 9,
                    "coverage": {"gate": {"prefill": subset([0.5, 0.25]), "all": subset([0.5, 0.25])}}}
    table = format_coverage(prompts_only)
    row = table.splitlines()[-2]  # the predictor's, above the footer
    assert row.startswith("gate speculation") and row.split()[-2:] == ["0.50", "0.25"]
    assert "per-layer columns: Coverage@2 on all steps (the traces have no decode step)" in table
    decoded = {**prompts_only, "decode_steps": 1,
               "coverage": {"gate": {"decode": subset([1.0, 0.0]), **prompts_only["coverage"]["gate"]}}}
    table = format_coverage(decoded)
    assert "per-layer columns: Coverage@2 on decode steps;" in table and table.splitlines()[-2].split()[-2:] == ["1.00",
                                                                                                          "0.00"]
