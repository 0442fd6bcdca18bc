"""The command line as a user runs it: a fresh process, text out, errors as one line and exit 1."""

import json
import os
import shutil
import subprocess
import sys


def _mira(*args, env=None):
    entry = shutil.which("mira")  # the installed console script; else the module (same code)
    command = [entry, *args] if entry else [sys.executable, "-m", "mira.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def test_generate_from_a_checkpoint_directory_converts_it_once_and_streams_text(checkpoints, tmp_path):
    env = {"MIRA_CACHE": str(tmp_path / "cache")}
    stats = tmp_path / "stats.json"
    args = ("generate", "--model", str(checkpoints["mixtral"]), "--prompt", "hi", "--max-new-tokens", "8",
            "--device", "cpu", "--temperature", "0", "--stats-json", str(stats))
    first = _mira(*args, env=env)
    assert first.returncode == 0, first.stderr
    assert "converting" in first.stderr and str(tmp_path / "cache") in first.stderr
    assert "TTFT" in first.stderr and "tokens/s" in first.stderr
    assert first.stdout.strip()
    report = json.loads(stats.read_text())
    assert report["generation"]["new_tokens"] == 8 and report["quant"] == "int8-shared"
    assert report["cache"]["tokens_routed"] > 0
    second = _mira(*args, env=env)
    assert second.returncode == 0 and "converting" not in second.stderr
    assert second.stdout == first.stdout  # greedy: the same text again, from the cached store


def test_convert_then_generate_from_the_store(checkpoints, tmp_path):
    store = tmp_path / "store"
    converted = _mira("convert", str(checkpoints["qwen3_moe"]), "--out", str(store), "--quant", "int8-row", "--quiet")
    assert converted.returncode == 0, converted.stderr
    assert "3 MoE layers x 8 experts, int8-row" in converted.stdout
    generated = _mira("generate", "--model", str(store), "--prompt", "hello", "--max-new-tokens", "4",
                      "--vram-budget", "64MiB", "--raw", "--quiet")
    assert generated.returncode == 0, generated.stderr
    assert "cpu float32, int8-row, all-resident policy, 24/24 expert slots" in generated.stderr


def test_generate_in_bf16_on_the_cpu_says_so(stores):
    generated = _mira("generate", "--model", str(stores["qwen3_moe", "int8-shared"]), "--device", "cpu", "--dtype",
                      "bfloat16", "--prompt", "hello", "--max-new-tokens", "4", "--raw", "--quiet")
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.strip() and "cpu bfloat16, int8-shared" in generated.stderr


def test_one_new_token_has_no_decode_rate_and_its_stats_are_strict_json(tmp_path):
    stats = tmp_path / "stats.json"
    run = _mira("generate", "--prompt", "Hi", "--max-new-tokens", "1", "--device", "cpu", "--stats-json", str(stats),
                env={"MIRA_CACHE": str(tmp_path / "cache")})
    assert run.returncode == 0, run.stderr
    assert "| decode - (1 new tokens" in run.stderr and "nan" not in run.stderr

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    generation = json.loads(stats.read_text(), parse_constant=refuse)["generation"]
    assert generation["new_tokens"] == 1 and generation["decode_tokens_per_s"] is None and generation["ttft_s"] > 0


def test_errors_are_one_line_with_exit_code_1(tmp_path):
    missing = _mira("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi", "--device", "cpu")
    assert missing.returncode == 1
    assert missing.stderr.startswith("mira: error: model path") and missing.stderr.count("\n") == 1
    bad_size = _mira("generate", "--prompt", "hi", "--vram-budget", "lots")
    assert bad_size.returncode == 2 and "cannot read the size 'lots'" in bad_size.stderr
    for label in ("lots", "0G", "150%"):  # refused before any model is loaded, naming what --budgets takes
        bad_budget = _mira("bench", "--budgets", f"25%,{label}", "--fixed", "8x4", "--configs", "mira")
        assert bad_budget.returncode == 1 and bad_budget.stderr.count("\n") == 1
        assert bad_budget.stderr.startswith(f"mira: error: cannot read the budget '{label}'")


def test_version_is_the_installed_package_s():
    from importlib.metadata import version

    shown = _mira("--version")
    assert shown.returncode == 0 and shown.stdout.split() == ["mira", version("mira")]


def test_help_explains_every_command():
    top = _mira("--help")
    assert top.returncode == 0 and "convert" in top.stdout and "generate" in top.stdout
    gen = _mira("generate", "--help")
    for flag in ("--model", "--prompt", "--max-new-tokens", "--device", "--vram-budget", "--quant", "--policy",
                 "--temperature", "--top-p", "--seed", "--raw", "--stats-json"):
        assert flag in gen.stdout


_HELP_OF_EVERY_COMMAND = """
import argparse, contextlib, io, sys
from mira.cli import build_parser, main

def commands(parser, path=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name)
                yield from commands(sub, (*path, name))

harness = ("eval", "lm-eval")  # its --help is lm-evaluation-harness's own, which loads torch
helps = [[*c, "--help"] for c in commands(build_parser()) if c != harness]
for argv in [["--help"], ["--version"], *helps, ["generate", "--top-p", "2"]]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
print(" ".join(m for m in ("torch", "transformers") if m in sys.modules) or "none")
"""


def test_help_and_refused_arguments_load_neither_torch_nor_transformers():
    # they would take seconds to start: the commands load the machinery when they run, not to parse
    loaded = subprocess.run([sys.executable, "-c", _HELP_OF_EVERY_COMMAND], capture_output=True, text=True,
                            timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == ["none"]


def test_trace_then_simulate_replays_the_recorded_routing(checkpoints, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "sort a list"}\nhello there\n')
    trace_file = tmp_path / "t.npz"
    traced = _mira("trace", "--model", str(checkpoints["olmoe"]), "--prompts", str(prompts), "--out", str(trace_file),
                   "--max-new-tokens", "6", "--device", "cpu", "--raw", "--quiet",
                   env={"MIRA_CACHE": str(tmp_path / "cache")})
    assert traced.returncode == 0, traced.stderr
    from mira.store.trace import RoutingTrace

    trace = RoutingTrace.load(trace_file)
    assert trace.num_layers == 3 and trace.top_k == 2 and trace.num_experts == 8
    seq = trace.seq_id.tolist()
    assert seq == sorted(seq) and set(seq) == {0, 1}  # two sequences, in order
    for sequence in (0, 1):
        prefill = trace.is_prefill[trace.seq_id == sequence]
        assert prefill[0] and not prefill[-1]  # each starts with its prompt, ends generating
    assert int((~trace.is_prefill).sum()) == 2 * 5  # 6 new tokens: the first comes from the prompt step
    simulated = _mira("simulate", "--trace", str(trace_file), "--slots", "8", "--json")
    assert simulated.returncode == 0, simulated.stderr
    results = {r["policy"]: r for r in map(json.loads, simulated.stdout.splitlines())}
    assert set(results) == {"mira", "lru", "lfu", "static", "on-demand", "belady"}
    assert all(r["accesses"] == results["belady"]["accesses"] for r in results.values())
    assert results["belady"]["misses"] <= min(results[p]["misses"] for p in ("mira", "lru", "lfu", "on-demand"))
    table = _mira("simulate", "--trace", str(trace_file), "--sweep", "8,16", "--policy", "lru", "--policy", "belady")
    assert table.returncode == 0 and table.stdout.count("lru") == 2


def test_the_bundled_model_answers_on_topic_by_default(tmp_path):
    result = _mira("generate", "--prompt", "How do I sort a list in Python?", "--max-new-tokens", "16",
                   "--temperature", "0", "--device", "cpu", "--quiet", env={"MIRA_CACHE": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "mira-tiny-moe" in result.stderr  # converted on first use from the package's own copy
    words = result.stdout.lower()
    assert "sort" in words and "python" in words and "list" in words


def _four_token_trace_with_features(tmp_path):
    """4 decode tokens, 3 MoE layers, top-1 of 4: layers 0 and 1 route expert 0 (uids 0, 4) every
    token, layer 2 alternates experts 2 and 3 (uids 10, 11). The recorded gate speculation for
    layer 2 names the expert layer 2 then routes (a perfect predictor)."""
    import numpy as np

    from mira.predict.features import FeatureSet, features_path, step_counts
    from mira.store.trace import RoutingTrace

    ids = np.array([[[0], [0], [2 + t % 2]] for t in range(4)], dtype=np.int16)
    trace = RoutingTrace(ids, 4)
    path = tmp_path / "t.npz"
    trace.save(path)
    step_start = np.arange(5)
    speculation = np.zeros((4, 1, 4), np.float32)
    speculation[np.arange(4), 0, ids[:, 2, 0]] = 1.0
    FeatureSet(step_start, np.zeros((4, 3, 2), np.float16), np.zeros((4, 3, 4), np.float32),
               step_counts(trace, step_start), speculation, 1, "hand-made").save(features_path(path))
    return path


def test_simulate_replays_recorded_predictions_hand_worked(tmp_path):
    trace = _four_token_trace_with_features(tmp_path)
    base = ("simulate", "--trace", str(trace), "--slots", "3", "--stage-slots", "3", "--expert-bytes", "1000", "--json")

    def run(*extra):
        result = _mira(*base, *extra)
        assert result.returncode == 0, result.stderr
        return {r["policy"]: r for r in map(json.loads, result.stdout.splitlines())}

    # Without prefetch, 3 STAGE slots (no HOT). The profile is the trace itself (no --profile): mira
    # starts from its placement, the most routed uids 0, 4 and 10 (10 and 11 tie; the lower uid goes
    # first). Layer 2's experts then take turns: 11, at tokens 1 and 3, is worth hardly more than 10,
    # far from the one blob an admission moves: served from the host twice, never admitted.
    off = run("--policy", "mira", "--policy", "belady")
    assert (off["mira"]["preloaded"], off["mira"]["misses"], off["mira"]["admissions"]) == (3, 2, 0)
    assert (off["mira"]["copies"], off["mira"]["pcie_bytes"]) == (2, 2000)
    # Belady starts from the best contents, the first uids routed (0, 4 and 10, as mira's placement
    # here), and serves 11 from the host twice: the bound on every policy's copies.
    assert (off["belady"]["preloaded"], off["belady"]["misses"]) == (3, 2)
    assert off["mira"]["copies"] >= off["belady"]["misses"]
    # A perfect predictor names layer 2's expert at layer 0: 10 at tokens 0 and 2 (resident: nothing
    # to stage), 11 at tokens 1 and 3, copied into a stage row and read from it: no miss at all, two
    # prefetch copies. The policy sees what it saw without prefetching (11 a miss it never admits);
    # every access is a STAGE hit (its resident experts all sit in STAGE, and 11 in a stage row).
    for predictor in ("gate", "oracle"):
        on = run("--policy", "mira", "--predictions", predictor)["mira"]
        assert (on["misses"], on["prefetch_issued"], on["prefetch_used"], on["admissions"]) == (0, 2, 2, 0)
        assert (on["prefetch_wasted"], on["hits_stage"], on["copies"], on["pcie_bytes"]) == (0, 12, 2, 2000)
    # The previous step's routing of layer 2 is always the other expert: token 0 (no history yet,
    # ties to expert 0) stages uid 8, never routed; token 1 names the resident 10 and misses 11;
    # token 2 stages 11 while 10 is routed; token 3 names 10 and misses 11 again: 2 + 2 copies.
    previous = run("--policy", "mira", "--predictions", "previous")["mira"]
    assert (previous["misses"], previous["prefetch_issued"], previous["prefetch_wasted"]) == (2, 2, 2)
    assert (previous["admissions"], previous["copies"]) == (0, 4)
    assert previous["copies"] >= off["belady"]["misses"]
    # --calibrate 2: tokens 0 and 1 are the profile (uids 0 and 4 twice, 10 and 11 once: 0, 4 and 10
    # placed) and 2 and 3 are replayed, with the predictions computed on the whole recording: 10 at
    # token 2 is resident, 11 at token 3 is staged and read from its stage row
    # only mira stages: the other policies replay as without predictions
    both = run("--policy", "mira", "--policy", "lru", "--predictions", "gate")
    assert both["mira"]["prefetch_issued"] == 2 and "prefetch_issued" not in both["lru"]
    assert both["lru"]["misses"] == run("--policy", "lru")["lru"]["misses"]
    calibrated = run("--policy", "mira", "--calibrate", "2", "--predictions", "gate")["mira"]
    assert (calibrated["tokens"], calibrated["preloaded"], calibrated["misses"]) == (2, 3, 0)
    assert (calibrated["prefetch_issued"], calibrated["prefetch_used"], calibrated["copies"]) == (1, 1, 1)


def test_simulate_reads_predictions_from_a_file_and_names_the_fix_for_bad_ones(tmp_path):
    import numpy as np

    trace = _four_token_trace_with_features(tmp_path)
    oracle = np.full((4, 3, 1), -1)
    oracle[:, 2, 0] = [2, 3, 2, 3]
    np.savez(tmp_path / "p.npz", predictions=oracle)
    base = ("simulate", "--trace", str(trace), "--slots", "3", "--stage-slots", "3", "--policy", "mira")
    table = _mira(*base, "--predictions", str(tmp_path / "p.npz"))
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()
    assert "  misses  HOT hits  STAGE hits  admissions  prefetches  PCIe GB" in header
    cells = row.split()
    assert (cells[7], cells[11]) == ("0", "2")  # misses and prefetches, as the perfect gate gave them
    no_heads = _mira(*base, "--predictions", "trained")
    assert no_heads.returncode == 1 and "pass --heads" in no_heads.stderr
    np.savez(tmp_path / "short.npz", predictions=oracle[:2])
    short = _mira(*base, "--predictions", str(tmp_path / "short.npz"))
    assert short.returncode == 1 and "needs integers [4, 3, P]" in short.stderr
    bad = {"flat": (oracle[:, :, 0], "are int64 (4, 3);"), "empty": (oracle[:, :, :0], "are int64 (4, 3, 0);"),
           "beyond": (oracle + 3, "hold ids from 2 to 6;"), "below": (oracle - 1, "hold ids from -2 to 2;")}
    for name, (predictions, says) in bad.items():
        np.savez(tmp_path / f"{name}.npz", predictions=predictions)
        refused = _mira(*base, "--predictions", str(tmp_path / f"{name}.npz"))
        assert refused.returncode == 1 and says in refused.stderr and "each an expert id below 4 or -1" in \
            refused.stderr, refused.stderr
    np.save(tmp_path / "array.npy", oracle)
    npy = _mira(*base, "--predictions", str(tmp_path / "array.npy"))
    assert npy.returncode == 1 and "a single .npy array, not an .npz archive" in npy.stderr, npy.stderr
