"""`mira bench --quant int8-shared,int4`: one run measures every configuration on each scheme's store,
budgets given as sizes hold as many of each scheme's experts as fit, and the result compares them."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import numpy as np
import pytest
from transformers import MixtralConfig

from mira.cli import main
from mira.store.trace import RoutingTrace

LAYERS, EXPERTS, TOP_K, H, I = 3, 8, 2, 64, 512
# one blob, section by section, each section starting on a 128-byte boundary (mira.store.layout):
INT8_SHARED_BLOB = 2 * I * H + H * I + 2 * H  # w13 int8 [2I, H], w2 int8 [H, I], scale bf16 [H]
INT4_BLOB = (2 * I * H // 2 + H * I // 2  # w13 and w2 at two codes per byte
             + 2 * 2 * (2 * I + H * (I // 64)))  # scale and zero, bf16: one group per row of w13, I/64 per row of w2
BUDGET = "1.5MiB"


def _tiny(tmp_path):
    config = MixtralConfig(vocab_size=128, hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                           num_experts_per_tok=TOP_K, max_position_embeddings=128, tie_word_embeddings=False)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(config.to_json_string())
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(LAYERS)])
                    for _ in range(120)]).astype(np.int16)  # [T, L, K], distinct experts per token and layer
    RoutingTrace(ids, EXPERTS, source="routing.npz").save(tmp_path / "routing.npz")
    return tmp_path / "tiny", tmp_path / "routing.npz"


def test_one_run_measures_both_schemes_with_their_own_slot_counts_bounds_and_ratio(tmp_path):
    model, routing = _tiny(tmp_path)
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "mira.cli", "bench", "--synthetic", str(model), "--routing", str(routing),
         "--device", "cpu", "--quant", "int8-shared,int4", "--budgets", f"{BUDGET},all", "--configs", "mira,static",
         "--fixed", "8x4", "--repeats", "1", "--out", str(out), "--quiet"],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["quant"] == ["int8-shared", "int4"]
    rows = {(r["config"], r["quant"], r["budget"]): r for r in result["runs"]}
    assert set(rows) == {(c, q, b) for c in ("mira", "static") for q in ("int8-shared", "int4")
                         for b in (BUDGET, "all")}
    stores = result["stores"]
    assert stores["int8-shared"]["blob_bytes"] == INT8_SHARED_BLOB and stores["int4"]["blob_bytes"] == INT4_BLOB
    reserve = stores["int4"]["reserve_bytes"]
    assert stores["int8-shared"]["reserve_bytes"] == reserve  # the scheme changes the experts only
    budget = int(1.5 * (1 << 20))
    total = LAYERS * EXPERTS
    for scheme, blob in (("int8-shared", INT8_SHARED_BLOB), ("int4", INT4_BLOB)):
        for config in ("mira", "static"):
            assert rows[config, scheme, BUDGET]["budget_bytes"] == budget
            assert rows[config, scheme, BUDGET]["slots"] == (budget - reserve) // blob
            assert rows[config, scheme, "all"]["slots"] == total
            assert rows[config, scheme, "all"]["budget_bytes"] == reserve + total * blob
    # the reserve holds a KV cache for 72 tokens (the calibration prompts' 64 and 8 new): 1.2 MiB left, 13 or 23 blobs
    assert rows["mira", "int8-shared", BUDGET]["slots"] == 13 and rows["mira", "int4", BUDGET]["slots"] == 23

    # the bound counts each scheme's blob: the same replayed routing, 3 decode steps x 3 layers x 2 experts
    for config in ("mira", "static"):
        for b in (BUDGET, "all"):
            int8, int4 = rows[config, "int8-shared", b]["bound"], rows[config, "int4", b]["bound"]
            assert int8["hbm_bytes"] - int4["hbm_bytes"] == 3 * LAYERS * TOP_K * (INT8_SHARED_BLOB - INT4_BLOB)
            for bound, blob in ((int8, INT8_SHARED_BLOB), (int4, INT4_BLOB)):
                assert bound["pcie_bytes"] == bound["belady_misses"] * blob
    # every run replayed the same rows: the same routed tokens
    assert len({sum(r["tokens_served"].values()) for r in result["runs"]}) == 1

    ratios = result["quant_comparison"]
    for b in (BUDGET, "all"):
        for config in ("mira", "static"):
            int8 = rows[config, "int8-shared", b]["decode_tokens_per_s"]
            int4 = rows[config, "int4", b]["decode_tokens_per_s"]
            assert ratios[b][config] == {"int8-shared": int8, "int4": int4,
                                         "int4_over_int8-shared": round(int4 / int8, 3)}
    assert set(result["comparison"]) == {f"{b}, {q}" for b in (BUDGET, "all") for q in ("int8-shared", "int4")}
    assert result["comparison"][f"{BUDGET}, int4"]["best_baseline"] == "static"
    assert "int4 / int8-shared" in run.stdout
    assert (tmp_path / "bench.png").stat().st_size > 0


def cli(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, err.getvalue()


@pytest.mark.parametrize("quant, phrase", [
    ("int5", "unknown quantization scheme int5; choose from int8-shared, int8-row, int4, none"),
    ("int4,int4", "names a scheme twice"),
    ("none", "pass --quant with int8-shared, int8-row, int4, not none"),
])
def test_a_scheme_the_bench_cannot_run_is_refused_before_anything_is_written(tmp_path, quant, phrase):
    model, _ = _tiny(tmp_path)
    out = tmp_path / "bench.json"
    code, err = cli("bench", "--synthetic", str(model), "--device", "cpu", "--quant", quant, "--out", str(out))
    assert code == 1 and err.startswith("mira: error: ") and phrase in err and err.count("\n") == 1
    assert not out.exists()


def test_a_store_is_refused_more_than_its_own_scheme(mixtral_store, tmp_path):
    out = tmp_path / "bench.json"
    code, err = cli("bench", "--model", str(mixtral_store), "--device", "cpu", "--quant", "int8-shared,int4",
                    "--out", str(out))
    assert code == 1 and "holds one quantization scheme; pass the model directory" in err
    code, err = cli("bench", "--model", str(mixtral_store), "--device", "cpu", "--quant", "int4", "--out", str(out))
    assert code == 1 and "holds int8-shared experts, not int4" in err
    assert not out.exists()


def test_each_store_is_gone_before_the_next_is_made_and_a_resumed_run_skips_finished_schemes(tmp_path, monkeypatch):
    """Two large stores need not fit in host memory together: the int8-shared store has been collected
    when the int4 one is filled. A resumed run whose int8-shared runs are all measured makes only the
    int4 store."""
    import gc
    import weakref

    from mira.bench import sources

    made = []  # (scheme, weak reference) in the order the stores were made
    alive_at_fill = []
    build = sources.synthetic_store

    def recording(config, num_layers, scheme, *args, **kwargs):
        gc.collect()
        alive_at_fill.append([s for s, ref in made if ref() is not None])
        store = build(config, num_layers, scheme, *args, **kwargs)
        made.append((scheme, weakref.ref(store)))
        return store

    monkeypatch.setattr(sources, "synthetic_store", recording)
    model, routing = _tiny(tmp_path)
    out = tmp_path / "bench.json"
    common = ["bench", "--synthetic", str(model), "--routing", str(routing), "--device", "cpu", "--fixed", "8x3",
              "--repeats", "1", "--configs", "mira", "--out", str(out), "--quiet"]
    assert cli(*common, "--quant", "int8-shared,int4", "--budgets", BUDGET)[0] == 0
    assert [s for s, _ in made] == ["int8-shared", "int4"] and alive_at_fill == [[], []]
    first = json.loads(out.read_text())

    made.clear()
    alive_at_fill.clear()
    assert cli(*common, "--quant", "int8-shared,int4", "--budgets", f"{BUDGET},all", "--resume")[0] == 0
    assert [s for s, _ in made] == ["int8-shared", "int4"]  # both have an 'all' run to measure
    made.clear()
    assert cli(*common, "--quant", "int8-shared,int4", "--budgets", f"{BUDGET},all", "--resume")[0] == 0
    assert made == []  # nothing left to measure: no store made
    resumed = json.loads(out.read_text())
    assert resumed["runs"][:2] == first["runs"]
    assert [(r["quant"], r["budget"]) for r in resumed["runs"]] == [
        ("int8-shared", BUDGET), ("int4", BUDGET), ("int8-shared", "all"), ("int4", "all")]
    assert resumed["stores"]["int4"]["budgets"] == {BUDGET: int(1.5 * (1 << 20)),
                                                    "all": resumed["stores"]["int4"]["all_experts_bytes"]}
