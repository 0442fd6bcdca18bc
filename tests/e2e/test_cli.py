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
    assert "cpu int8-row lru 24/24 expert slots" in generated.stderr


def test_errors_are_one_line_with_exit_code_1(tmp_path):
    missing = _mira("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi", "--device", "cpu")
    assert missing.returncode == 1
    assert missing.stderr.startswith("mira: error: model path") and missing.stderr.count("\n") == 1
    bad_size = _mira("generate", "--prompt", "hi", "--vram-budget", "lots")
    assert bad_size.returncode == 2 and "cannot read the size 'lots'" in bad_size.stderr


def test_help_explains_every_command():
    top = _mira("--help")
    assert top.returncode == 0 and "convert" in top.stdout and "generate" in top.stdout
    gen = _mira("generate", "--help")
    for flag in ("--model", "--prompt", "--max-new-tokens", "--device", "--vram-budget", "--quant", "--policy",
                 "--temperature", "--top-p", "--seed", "--raw", "--stats-json"):
        assert flag in gen.stdout
