"""Decode speed of the bundled model on the CPU with and without another process spinning on a core.

torch starts one compute thread per CPU, and its threads wait for one another after every
operation: with a core taken by another process, the thread sharing it holds every operation up.
Mira chooses its thread count from the idle physical cores (mira/runtime/threads.py). This runs
`mira generate` on the bundled model (greedy, 64 new tokens) in a fresh process:

  idle                 nothing else running, threads chosen by Mira
  spinning             one `while True: pass` process running, threads chosen by Mira
  spinning, 2 threads  the same with --threads 2 (torch's own choice on a 2-CPU machine)

and `mira convert` of the bundled model in the same three settings; each >= 3 times, median and
range. Other load on the machine spoils the figures: each run records the CPUs found busy just
before it (which include the spinner's).

    python benchmarks/cpu_contention.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mira.bench.provenance import result_header
from mira.runtime.engine import BUNDLED_MODEL
from mira.runtime.threads import busy_cpus

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "cpu-contention.json"
PROMPT = "How do I sort a list in Python?"
NEW_TOKENS = 64
SETTINGS = {"idle": (False, None), "spinning": (True, None), "spinning, 2 threads": (True, 2)}


def generate(cache: str, threads: int | None, stats: Path) -> dict:
    command = [sys.executable, "-m", "mira.cli", "generate", "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS),
               "--temperature", "0", "--device", "cpu", "--quiet", "--stats-json", str(stats)]
    command += ["--threads", str(threads)] if threads else []
    run = subprocess.run(command, capture_output=True, text=True, env=_env(cache))
    if run.returncode:
        raise SystemExit(run.stderr)
    report = json.loads(stats.read_text())
    return {"decode_tokens_per_s": report["generation"]["decode_tokens_per_s"], "threads": report["cpu_threads"],
            "new_tokens": report["generation"]["new_tokens"]}


def convert(work: Path, threads: int | None) -> dict:
    out = work / f"store-{time.monotonic_ns()}"
    command = [sys.executable, "-m", "mira.cli", "convert", str(BUNDLED_MODEL), "--out", str(out), "--quiet"]
    command += ["--threads", str(threads)] if threads else []
    start = time.perf_counter()
    run = subprocess.run(command, capture_output=True, text=True, env=_env(str(work)))
    if run.returncode:
        raise SystemExit(run.stderr)
    return {"wall_s": time.perf_counter() - start}


def _env(cache: str) -> dict:
    env = {**os.environ, "MIRA_CACHE": cache}
    env.pop("OMP_NUM_THREADS", None)  # Mira chooses, unless --threads
    return env


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    results: dict = {}
    with tempfile.TemporaryDirectory() as cache:
        generate(cache, None, Path(cache) / "warm.json")  # converts the bundled model into the cache once
        for name, (spin, threads) in SETTINGS.items():
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if spin else None
            try:
                time.sleep(0.5)
                runs, busy = {"generate": [], "convert": []}, []
                for _ in range(args.repeats):
                    busy.append(round(busy_cpus(cpus, interval=0.5), 2))
                    runs["generate"].append(generate(cache, threads, Path(cache) / "stats.json"))
                    runs["convert"].append(convert(Path(cache), threads))
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
            results[name] = {
                "busy_cpus_before_runs": busy,
                "threads": sorted({run["threads"] for run in runs["generate"]}),
                "decode_tokens_per_s": summary([run["decode_tokens_per_s"] for run in runs["generate"]]),
                "convert_wall_s": summary([run["wall_s"] for run in runs["convert"]]),
            }
            print(f"{name}: {results[name]['threads']} threads, decode "
                  f"{results[name]['decode_tokens_per_s']['median']:.1f} tokens/s, convert "
                  f"{results[name]['convert_wall_s']['median']:.1f} s (busy CPUs before runs {busy})")
    idle = results["idle"]["decode_tokens_per_s"]["median"]
    ratio = idle / results["spinning"]["decode_tokens_per_s"]["median"]
    print(f"idle / spinning decode: {ratio:.2f}x")
    result = {**result_header("python benchmarks/cpu_contention.py"
                              + (f" --repeats {args.repeats}" if args.repeats != 3 else "")),
              "setup": f"mira generate on the bundled model, CPU, greedy, {NEW_TOKENS} new tokens, prompt "
                       f"{PROMPT!r}; mira convert of the bundled model; {len(cpus)} CPUs",
              "settings": {name: {"spinning_process": spin, "threads_option": threads}
                           for name, (spin, threads) in SETTINGS.items()},
              "results": results, "idle_over_spinning_decode": ratio}
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
