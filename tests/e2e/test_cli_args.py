"""Every argument is checked before any work: a bad one ends the command with one line,
`mira: error: ...`, naming the fix, exit status 1 (2 for what argparse refuses), nothing written
and nothing converted; no Python traceback reaches the user (`mira --debug` shows it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from mira.cli import main
from mira.errors import MiraError
from mira.runtime.threads import usable_cpus
from mira.store.cache import cache_dir
from tiny_models import make_checkpoint


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """`main` sets torch's thread count for the process it runs in: give the suite its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def cli(*argv: str) -> tuple[int, str, str]:
    """Run `mira argv` in this process: (exit status, stdout, stderr)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as stop:
            code = stop.code
    return code, out.getvalue(), err.getvalue()


def refused(code: int, err: str, status: int, *phrases: str) -> None:
    """The command ended with `status` and one line `mira: error: ...` holding every phrase."""
    assert code == status, err
    assert err.startswith("mira: error: ") and err.count("\n") == 1 and "internal error" not in err, err
    for phrase in phrases:
        assert phrase in err, err


def nothing_converted() -> bool:
    return not cache_dir().exists() or not any(cache_dir().iterdir())


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MIRA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


GENERATE = ("generate", "--prompt", "hi", "--device", "cpu", "--quiet")
CPUS = len(usable_cpus())
HELDOUT_TRACE = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "traces" / "heldout.npz"


@pytest.mark.parametrize("argv, phrases", [
    (("--max-new-tokens", "0"), ("--max-new-tokens", "not positive")),
    (("--max-context", "-3"), ("--max-context", "not positive")),
    (("--max-context", "0"), ("--max-context", "not positive")),
    (("--temperature", "-1"), ("--temperature", "negative")),
    (("--top-p", "2"), ("--top-p", "not in (0, 1]")),
    (("--top-p", "0"), ("--top-p", "not in (0, 1]")),
    (("--top-p", "nan"), ("--top-p", "not a finite number")),
    (("--profile", "/no/such/trace.npz"), ("--profile", "does not exist")),
    (("--vram-budget", "lots"), ("cannot read the size 'lots'", "25%")),
    (("--vram-budget", "150%"), ("not a share",)),
    (("--seed", str(2**64)), ("--seed", "out of range", str(2**64 - 1))),
    (("--threads", "0"), ("--threads", "not positive")),
    (("--cpu-threads", "0"), ("--cpu-threads", "not positive")),
    (("--cpu-threads=-1",), ("--cpu-threads", "not positive")),
    (("--threads", str(CPUS + 1)), ("--threads", f"{CPUS + 1} threads would share {CPUS} CPUs", f"at most {CPUS}")),
    (("--cpu-threads", str(CPUS * 8)), ("--cpu-threads", f"at most {CPUS}")),
    (("--cpu-experts", "some"), ("--cpu-experts", "invalid choice: 'some'")),
    (("--stats-json", "/no/such/dir/stats.json"), ("--stats-json", "does not exist")),
    (("--budget", "1GiB"), ("unrecognized arguments: --budget 1GiB",)),
])
def test_values_out_of_range_are_refused_while_parsing(argv, phrases, fresh_cache):
    code, _, err = cli(*GENERATE, *argv)
    refused(code, err, 2, *phrases, "see `mira generate --help`")
    assert nothing_converted()


def test_an_unknown_option_names_the_help_of_its_own_command(fresh_cache):
    code, _, err = cli("store", "ls", "--all")
    refused(code, err, 2, "unrecognized arguments: --all", "see `mira store ls --help`")
    code, _, err = cli("--verbose", "store", "ls")
    refused(code, err, 2, "unrecognized arguments: --verbose", "see `mira --help`")


def test_output_paths_are_checked_before_any_work(tmp_path, fresh_cache):
    code, _, err = cli(*GENERATE, "--stats-json", str(tmp_path))
    refused(code, err, 2, "is a directory")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    code, _, err = cli("trace", "--prompts", str(prompts), "--out", str(tmp_path / "gone" / "t.npz"), "--device", "cpu")
    refused(code, err, 2, "--out", "does not exist")
    code, _, err = cli("simulate", "--trace", str(tmp_path / "missing.npz"))
    refused(code, err, 2, "--trace", "does not exist")
    assert nothing_converted()


@pytest.mark.parametrize("argv, phrases", [
    (("--device", "nonsense"), ("unknown device 'nonsense'", "--device cpu, cuda or cuda:N")),
    (("--device", "cpu:3"), ("unknown device",)),
    (("--raw", "--prompt", ""), ("the prompt is empty; give some text with --prompt",)),
    (("--prefetch", "auto", "--residency", "auto", "--policy", "mira", "--max-context", "20000"),
     ("--max-context 20000 is beyond",)),  # the defaults, named, are no error: a later check speaks
    (("--temperature", "0", "--top-p", "0.5"), ("--top-p has no effect with --temperature 0",)),
    (("--policy", "lru"), ("--policy lru has no effect on the CPU without --vram-budget",)),
    (("--prefetch", "gate"), ("--prefetch gate has no effect on the CPU without --vram-budget",)),
    (("--residency", "lagged"), ("--residency lagged has no effect",)),
    (("--vram-budget", "25%", "--policy", "static"), ("--policy static", "pass --profile")),
    (("--vram-budget", "25%", "--cpu-experts", "all", "--residency", "lagged"),
     ("--cpu-experts all", "pass --residency inline")),
    (("--cpu-experts", "off", "--cpu-threads", "2"), ("--cpu-threads", "pass --cpu-experts auto, split or all")),
    (("--cpu-threads", "2"), ("--cpu-threads has no effect on the CPU", "pass --cpu-experts all")),
    (("--vram-budget", "25%", "--cpu-experts", "split"), ("--cpu-experts split", "pass --cpu-experts all")),
    (("--max-context", "20000"), ("--max-context 20000 is beyond the 2048 positions", "pass --max-context 2048")),
])
def test_options_that_cannot_act_are_refused_before_the_model_is_converted(argv, phrases, fresh_cache):
    code, _, err = cli(*GENERATE, *argv)
    refused(code, err, 1, *phrases)
    assert nothing_converted()


@pytest.mark.parametrize("argv, status, phrases", [
    (("serve", "--port", "70000"), 2, ("--port", "70000 is not a TCP port", "or 0 for any free port")),
    (("serve", "--port", "-1"), 2, ("--port", "-1 is not a TCP port")),
    (("serve", "--max-queue", "-3"), 2, ("--max-queue", "-3 is negative")),
    (("bench", "--fixed", "8", "--configs", "mira"), 1, ("cannot read --fixed '8'", "e.g. 64x256")),
    (("bench", "--fixed", "0x4", "--configs", "mira"), 1, ("--fixed '0x4' needs at least one prompt token",)),
    (("bench", "--fixed", "8x0", "--configs", "mira"), 1, ("two new tokens", "e.g. 64x256")),
    (("bench", "--fixed", "8x1", "--configs", "mira"), 1, ("two new tokens (decoding is timed after the first)",)),
    (("bench", "--out", "chart.png"), 2, ("--out", "chart.png is the name the chart would take")),
    (("bench", "--beams", "abc"), 1, ("--beams abc: 'abc' is not a beam width",)),
    (("bench", "--beams", "0"), 1, ("'0' is not a beam width",)),
    (("bench", "--beams", "2,2"), 1, ("--beams 2,2 names 2 twice",)),
    (("bench", "--beams", "2", "--budgets", "50%"), 1, ("--beam-budget 24GiB, which is not one of --budgets 50%",)),
    (("bench", "--beam-new-tokens", "0"), 2, ("--beam-new-tokens", "not positive")),
    (("bench", "--fixed-count", "0"), 2, ("--fixed-count", "not positive")),
    (("bench", "--repeats", "0"), 2, ("--repeats", "not positive")),
    (("bench", "--budgets", "nanGiB"), 1, ("cannot read the budget 'nanGiB'",)),
    (("bench", "--budgets", "0.5"), 1, ("cannot read the budget '0.5'",)),
    (("bench", "--configs", "mira,lru,mira"), 1, ("--configs names mira more than once",)),
    (("bench", "--budgets", "all,25%,all"), 1, ("--budgets names all more than once",)),
    (("bench", "--num-prompts", "3"), 1, ("--num-prompts takes the first prompts of --prompts",)),
    (("bench", "--device", "gpu"), 1, ("unknown device 'gpu'; pass --device cpu, cuda or cuda:N",)),
    (("bench", "--device", "cpu", "--cpu-threads", "2"), 1,
     ("--cpu-threads sets the threads", "none of --configs mira,lru,lru-lagged,lfu,static,hf-gpu,hf-offload has on cpu",
      "add mira-cpu-all")),
    (("bench", "--device", "cpu", "--cpu-threads", "2", "--configs", "mira-cpu-split,lru"), 1,
     ("none of --configs mira-cpu-split,lru has on cpu",)),
    (("train-predictor", "--traces", "/no/such/t.npz"), 2, ("--traces", "t.npz does not exist")),
    (("eval-predictor", "--traces", "/no/such/t.npz"), 2, ("--traces", "t.npz does not exist")),
    (("eval", "ppl", "--max-tokens", "0"), 2, ("--max-tokens", "not positive")),
    (("eval", "ppl", "--stride", "0"), 2, ("--stride", "not positive")),
    (("eval", "ppl", "--context", "0"), 2, ("--context", "not positive")),
    (("eval", "ppl", "--context", "5000"), 1, ("--context 5000 is beyond the 2048 positions", "pass --context 2048")),
    (("eval", "ppl", "--out", "/"), 2, ("--out", "is a directory")),
    (("bench", "--configs", "", "--fixed", "8x8"), 1, ("--configs and --budgets each need at least one name",)),
    (("bench", "--budgets", ",", "--fixed", "8x8"), 1, ("--configs and --budgets each need at least one name",)),
    (("bench", "--num-prompts", "0"), 2, ("--num-prompts", "not positive")),
    (("bench", "--heads", "/no/such/heads.safetensors"), 2, ("--heads", "heads.safetensors does not exist")),
    (("bench", "--profile", "/no/such/t.npz"), 2, ("--profile", "t.npz does not exist")),
    (("train-predictor", "--traces", str(HELDOUT_TRACE), "--quant", "int5"), 2, ("--quant", "invalid choice: 'int5'")),
    (("chat", "--raw"), 2, ("unrecognized arguments: --raw",)),
    (("serve", "--raw"), 2, ("unrecognized arguments: --raw",)),
    (("simulate", "--trace", str(HELDOUT_TRACE), "--slots", "32", "--calibrate", "100", "--profile",
      str(HELDOUT_TRACE)), 1, ("--calibrate takes the profile from the trace's first tokens", "pass one of them")),
    (("simulate", "--trace", str(HELDOUT_TRACE), "--slots", "4", "--stage-slots", "10"), 1,
     ("--stage-slots 10 is more than the 4 slots",)),
    (("simulate", "--trace", str(HELDOUT_TRACE), "--slots", "4", "--sweep", "8,16"), 2,
     ("--sweep: not allowed with argument --slots",)),
    (("simulate", "--trace", str(HELDOUT_TRACE), "--heads", str(HELDOUT_TRACE)), 1,
     ("--heads is read by --predictions trained alone",)),
    (("simulate", "--trace", str(HELDOUT_TRACE), "--policy", "belady", "--policy", "lru", "--profile",
      str(HELDOUT_TRACE)), 1, ("--policy belady, lru read none of it: add --policy static or --policy mira",)),
    (("simulate", "--trace", str(HELDOUT_TRACE), "--policy", "lru", "--predictions", "oracle"), 1,
     ("--predictions stages through the mira policy's STAGE rows; add --policy mira",)),
    (("generate", "--prompt", "hi", "--stats-json", "/proc/mira-stats.json"), 2, ("cannot be written",)),
    (("generate", "--prompt", "hi", "--stats-json", ""), 2, ("the path is empty",)),
    (("generate", "--prompt", "  ", "--device", "cpu"), 1, ("the prompt is empty; give some text with --prompt",)),
    (("generate", "--prompt", "hi", "--stats-json", f"{HELDOUT_TRACE}/stats.json"), 2,
     ("is a file, not a directory",)),
    (("train-predictor", "--traces", str(HELDOUT_TRACE), "--out", str(HELDOUT_TRACE)), 2,
     ("--out", "is a file; pass a directory")),
    (("convert", str(HELDOUT_TRACE.parent), "--out", f"{HELDOUT_TRACE}/store"), 2,
     ("--out", f"{HELDOUT_TRACE} is a file, not a directory")),
    (("convert", str(HELDOUT_TRACE.parent), "--out", "/proc/mira-store"), 2,
     ("--out", "cannot write in /proc (permission denied or a read-only file system)")),
])
def test_the_other_commands_refuse_bad_values_before_any_work(argv, status, phrases, fresh_cache):
    code, _, err = cli(*argv)
    refused(code, err, status, *phrases)
    assert nothing_converted()


@pytest.mark.parametrize("content, phrases", [
    (b"\xff\xfe not text\n", ("cannot read prompt file", "as UTF-8 text")),
    (b'{"prompt": "a"\n', ("the line is not valid JSON",)),
    (b'{"text": "a"}\n', ('a JSON line needs a "prompt" field',)),
    (b'{"prompt": null}\n', (':1: the "prompt" field is null; give the prompt\'s text as a JSON string',)),
    (b'hi\n{"prompt": 5}\n', (':2: the "prompt" field is 5',)),
])
def test_a_prompt_file_that_cannot_be_read_is_named_before_any_work(tmp_path, fresh_cache, content, phrases):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(content)
    code, _, err = cli("trace", "--prompts", str(prompts), "--out", str(tmp_path / "t.npz"))
    refused(code, err, 1, f"{prompts}", *phrases)
    assert nothing_converted() and not (tmp_path / "t.npz").exists()


def test_a_prompt_file_may_begin_with_a_byte_order_mark(tmp_path):
    from mira.runtime.tracing import read_prompts

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\nthere\n', encoding="utf-8-sig")  # as some editors save UTF-8
    assert prompts.read_bytes().startswith(b"\xef\xbb\xbf")
    assert read_prompts(prompts) == ["hi", "there"]


def test_a_file_system_error_is_one_line_naming_the_path(monkeypatch, tmp_path, fresh_cache):
    from mira.cli import predictor

    def refuse(args):
        raise PermissionError(13, "Permission denied", str(tmp_path / "heads"))

    monkeypatch.setattr(predictor, "_train", refuse)
    code, _, err = cli("train-predictor", "--traces", str(HELDOUT_TRACE))
    refused(code, err, 1, "Permission denied", str(tmp_path / "heads"), "check the path")


def test_a_bench_longer_than_the_context_names_its_own_flag(tmp_path, fresh_cache):
    out = tmp_path / "bench.json"
    code, _, err = cli("bench", "--device", "cpu", "--fixed", "3000x4", "--configs", "mira", "--budgets", "all",
                       "--quiet", "--out", str(out))
    last = err.splitlines()[-1]  # after the first use's conversion, which later runs reuse
    # 3000 prompt tokens and the calibration prompts' 8 new ones (beams would add theirs; none run)
    assert code == 1 and last.startswith("mira: error: the longest prompt with its new tokens needs 3008 tokens")
    assert "beyond the 2048 positions" in last and "shorten --fixed" in last and not out.exists()


def test_a_store_given_to_convert_is_named_a_store(stores, tmp_path):
    store = stores["mixtral", "int8-shared"]
    code, _, err = cli("convert", str(store), "--out", str(tmp_path / "again"))
    refused(code, err, 1, f"{store} is a Mira store, not a checkpoint", "pass it to --model")
    assert not (tmp_path / "again").exists()


def test_a_share_budget_means_in_generate_what_it_means_in_bench(stores, tmp_path):
    stats = tmp_path / "stats.json"
    code, _, err = cli("generate", "--model", str(stores["mixtral", "int8-shared"]), "--prompt", "hi", "--raw",
                       "--device", "cpu", "--vram-budget", "50%", "--max-new-tokens", "2", "--quiet",
                       "--stats-json", str(stats))
    assert code == 0, err
    report = json.loads(stats.read_text())
    assert report["slots"] == round(0.5 * 24) and report["policy"] == "mira"  # 3 MoE layers x 8 experts
    code, _, err = cli("bench", "--budgets", "10%,lots", "--device", "cpu", "--out", str(tmp_path / "b.json"))
    refused(code, err, 1, "cannot read the budget 'lots'", "25%", "all")
    assert not (tmp_path / "b.json").exists()


def test_in_place_experts_are_reported_as_no_policy(stores, tmp_path):
    stats = tmp_path / "stats.json"
    code, _, err = cli("generate", "--model", str(stores["olmoe", "int8-shared"]), "--prompt", "hi", "--raw",
                       "--device", "cpu", "--max-new-tokens", "2", "--quiet", "--stats-json", str(stats),
                       "--threads", "1")
    assert code == 0, err
    report = json.loads(stats.read_text())
    assert report["policy"] == "none: experts read in place" and report["cpu_threads"] == 1


def _edited_checkpoint(tmp_path: Path, family: str, **config) -> Path:
    checkpoint = make_checkpoint(family, tmp_path / "ckpt")
    data = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**data, **config}))
    return checkpoint


@pytest.mark.parametrize("family, config, phrases", [
    ("mixtral", {"num_local_experts": 10}, ("have no 'model.layers.0.block_sparse_moe.experts.8.w1.weight'",
                                            "promises 10 experts")),
    ("qwen3_moe", {"hidden_size": 32}, ("does not match its weights", "hidden size 32")),
    ("olmoe", {"vocab_size": 400}, ("does not match its weights", "model.embed_tokens.weight is [320, 64]")),
    ("olmoe", {"num_experts_per_tok": 20}, ("routes each token to 20 of 8 experts",)),
    ("mixtral", {"num_hidden_layers": "three"}, ("cannot read", "num_hidden_layers")),
    ("mixtral", {"hidden_size": 64.5}, ("cannot read", "hidden_size")),
])
def test_a_config_that_does_not_match_its_weights_is_refused_before_converting(tmp_path, fresh_cache, family, config,
                                                                               phrases, capsys):
    checkpoint = _edited_checkpoint(tmp_path, family, **config)
    code, _, err = cli("generate", "--model", str(checkpoint), "--prompt", "hi", "--device", "cpu", "--quiet")
    refused(code, err, 1, *phrases)
    assert "converting" not in err and nothing_converted()
    code, _, err = cli("convert", str(checkpoint), "--out", str(tmp_path / "store"), "--quiet")
    refused(code, err, 1, *phrases)
    assert sorted(os.listdir(tmp_path)) == ["cache", "ckpt"] or sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_an_unsupported_model_is_refused_without_announcing_a_conversion(tmp_path, fresh_cache):
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path / "llama")
    code, _, err = cli(*GENERATE, "--model", str(tmp_path / "llama"))
    refused(code, err, 1, "'llama' model", "supported architectures")
    assert nothing_converted()


def test_a_store_without_its_manifest_and_a_file_are_named_for_what_they_are(tmp_path, stores, fresh_cache):
    store = tmp_path / "store"
    shutil.copytree(stores["mixtral", "int8-shared"], store)
    (store / "manifest.json").unlink()
    code, _, err = cli(*GENERATE, "--model", str(store))
    refused(code, err, 1, "manifest.json is missing", f"mira convert MODEL_DIR --out {store}")
    assert "is the checkpoint complete" not in err and nothing_converted()
    code, _, err = cli(*GENERATE, "--model", str(store / "config.json"))
    refused(code, err, 1, "is a file, not a directory")
    code, _, err = cli("convert", str(store / "config.json"), "--out", str(tmp_path / "out"))
    refused(code, err, 1, "is a file, not a directory")


def test_debug_shows_the_traceback():
    with pytest.raises(MiraError, match="unknown device"):
        main(["--debug", *GENERATE, "--device", "nonsense"])


def test_a_closed_pipe_ends_generate_quietly(tmp_path):
    env = {**os.environ, "MIRA_CACHE": os.environ["MIRA_CACHE"]}
    generate = subprocess.Popen([sys.executable, "-m", "mira.cli", *GENERATE, "--max-new-tokens", "64"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    generate.stdout.read(1)
    generate.stdout.close()  # as `| head -c 1` does
    _, err = generate.communicate(timeout=300)
    assert generate.returncode == 128 + 13 and b"Traceback" not in err and b"error" not in err, err


# Values for each option that parse, and values that do not; None leaves the option out. Whether
# a parsed combination can run (a budget on the CPU, a context within the model's, a GPU) is for
# Mira to decide.
PARSED = {
    "--max-new-tokens": [None, "1", "3"],
    "--temperature": [None, "0", "0.7"],
    "--top-p": [None, "0.5", "1"],
    "--device": [None, "cpu", "cpu", "cpu:0", "cpu:1", "cuda", "cuda:1", "tpu", ""],
    "--max-context": [None, "8", "64", "256", "300"],
    "--vram-budget": [None, "10%", "50%", "100%", "64MiB", "1"],
    "--policy": [None, "mira", "lru", "static", "on-demand"],
    "--prefetch": [None, "gate", "off", "trained"],
    "--residency": [None, "lagged", "inline"],
    "--quant": [None, "int8-shared", "int8-row"],
    "--threads": [None, "1", "2"],
    "--cpu-experts": [None, "off", "all", "auto"],
    "--cpu-threads": [None, "1"],
    "--seed": [None, "3"],
}
UNPARSED = {
    "--max-new-tokens": ["0", "-1", "x", "2.5"],
    "--temperature": ["-1", "nan", "inf", "hot"],
    "--top-p": ["0", "2", "x"],
    "--max-context": ["0", "-3", "x"],
    "--vram-budget": ["0", "lots", "150%", "%", "-1GiB"],
    "--policy": ["bogus"],
    "--prefetch": ["x"],
    "--threads": ["0", "x"],
    "--cpu-experts": ["some"],
    "--cpu-threads": ["0", "-1"],
    "--seed": ["x"],
}
FLAGS = ["--raw", "--no-cuda-graphs"]


@st.composite
def generate_options(draw) -> dict[str, str | None]:
    """A value for every option: all parse in about half the draws, one does not in the others."""
    values = {name: draw(st.sampled_from(choices)) for name, choices in PARSED.items()}
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(UNPARSED)))
        values[name] = draw(st.sampled_from(UNPARSED[name]))
    return values


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=generate_options(),
       flags=st.lists(st.sampled_from(FLAGS), unique=True),
       prompt=st.sampled_from(["hi", "hi", "", " ", "-x"]),
       model=st.sampled_from(["store", "store", "store", "missing", "file"]),
       profile=st.sampled_from([None] * 6 + ["missing", "not-a-trace"]),
       stats=st.sampled_from([None, None, None, "ok", "ok", "dir", "missing-dir"]))
def test_any_generate_arguments_run_or_end_in_one_line_never_a_traceback(stores, tmp_path, values, flags, prompt,
                                                                          model, profile, stats):
    store = stores["qwen3_moe", "int8-shared"]
    models = {"store": str(store), "missing": str(tmp_path / "missing"), "file": str(store / "config.json")}
    files = {"missing": str(tmp_path / "missing.npz"), "not-a-trace": str(store / "config.json"),
             "ok": str(tmp_path / "stats.json"), "dir": str(tmp_path), "missing-dir": str(tmp_path / "no" / "s.json")}
    argv = ["generate", "--model", models[model], f"--prompt={prompt}", "--quiet", *flags]
    for name, value in values.items():
        if value is not None:
            argv.append(f"{name}={value}")
    for name, choice in (("--profile", profile), ("--stats-json", stats)):
        if choice is not None:
            argv.append(f"{name}={files[choice]}")
    code, _, err = cli(*argv)
    event(f"exit status {code}")
    assert "Traceback" not in err
    if code != 0:
        last = err.strip().splitlines()[-1] if err.strip() else ""
        assert code in (1, 2) and last.startswith("mira: error: ") and "internal error" not in last, (argv, err)
        assert err.count("mira: error:") == 1 and err.endswith("\n") and len(err.strip().splitlines()) <= 2, err


def test_paths_written_after_the_work_are_checked_before_it(tmp_path, fresh_cache):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    (tmp_path / "x.features.npz").mkdir()  # where --features would write beside --out x.npz
    code, _, err = cli("trace", "--prompts", str(prompts), "--out", str(tmp_path / "x.npz"), "--features", "--quiet")
    refused(code, err, 1, f"--features writes {tmp_path / 'x.features.npz'} beside the trace",
            "is a directory", "pass another --out")
    assert nothing_converted() and not (tmp_path / "x.npz").exists()
    code, _, err = cli("eval-predictor", "--traces", str(HELDOUT_TRACE), "--plot", str(tmp_path))
    refused(code, err, 2, "--plot", "is a directory; pass a file name")


def test_a_refused_rename_names_its_target_not_the_hidden_file_written_first(monkeypatch, fresh_cache):
    import mira.cli

    def busy(args):
        raise OSError(16, "Device or resource busy", "/out/.x.png.k3j.tmp", None, "/out/x.png")

    monkeypatch.setattr(mira.cli, "_simulate", busy)
    code, _, err = cli("simulate", "--trace", str(HELDOUT_TRACE))
    refused(code, err, 1, "Device or resource busy: /out/x.png; check the path")
    assert ".tmp" not in err


def test_a_bench_resumes_only_a_bench_result_of_the_same_settings(tmp_path):
    out = tmp_path / "b.json"
    common = ("bench", "--device", "cpu", "--fixed", "8x2", "--configs", "lru", "--budgets", "all", "--out", str(out),
              "--quiet", "--resume")
    assert cli(*common, "--repeats", "1")[0] == 0  # nothing to resume yet: a fresh run
    code, _, err = cli(*common, "--repeats", "2")
    refused(code, err, 1, f"cannot resume {out}: it holds another run (repeats 1, this run 2)")
    out.write_text("[1, 2]")
    code, _, err = cli(*common, "--repeats", "1")
    refused(code, err, 1, f"cannot resume from {out}: not a mira bench result")


def test_a_bench_of_a_store_refuses_the_baselines_before_measuring(stores):
    store = stores["mixtral", "int8-shared"]
    code, _, err = cli("bench", "--model", str(store), "--configs", "mira,hf-gpu", "--fixed", "8x2", "--budgets", "all",
                       "--device", "cpu", "--quiet")
    refused(code, err, 1, f"the baselines (hf-gpu) run the original checkpoint, which the store {store} does not keep")


def test_a_bench_refuses_a_profile_of_another_model_before_its_cells(tmp_path):
    mixtral = HELDOUT_TRACE.parent / "mixtral-8x7b-instruct-decode.npz"  # 32 layers x 8 experts
    out = tmp_path / "b.json"
    code, _, err = cli("bench", "--device", "cpu", "--fixed", "8x2", "--configs", "static", "--budgets", "50%",
                       "--profile", str(mixtral), "--out", str(out), "--quiet")
    assert code == 1 and "routes over 32 layers x 8 experts but mira-tiny-moe has 12 x 8" in err.splitlines()[-1]
    assert not out.exists()
