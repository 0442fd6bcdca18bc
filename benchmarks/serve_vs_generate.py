"""Decode tokens/s of one request through `mira generate`'s library call and through `mira serve`
(a separate process, read by a streaming client), so the server's overhead shows.

The request is greedy with exactly --max-new-tokens new tokens (min_tokens = max_tokens) in both,
and the server computes with as many CPU threads as the library here. Both models stay loaded and
the runs alternate (library, then server, each round), so drift in the machine's speed falls on
both alike. Decode tokens/s is (tokens - 1) / (last token's time - first token's time) in both: at
the streamer for the library (its text decoded as `mira generate` decodes it, then dropped), at
the client's server-sent events for the server (its own /metrics figure, taken like the library's,
is recorded beside it). The server sends text in batches (`--stream-interval`); the chunks per
answer are recorded. On Linux, where each request's time went, per token and over the whole
request, from /proc: how long the library's thread, the server's generating thread and its event
loop ran, waited for a CPU (other processes' load) and were blocked (the GIL, the device, the queue).

    python benchmarks/serve_vs_generate.py --device cuda --max-new-tokens 256 --runs 5
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mira  # noqa: E402
from mira.bench.provenance import result_header  # noqa: E402
from mira.runtime.generate import SamplingConfig, encode_messages, stream_generate  # noqa: E402
from mira.store.files import write_json_atomic  # noqa: E402

MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Explain how a hash map works, with an example in Python."}]
START_S = 600  # bound on the server's start (loading and converting a model)


@dataclass
class Server:
    """Where a running `mira serve` answers."""

    host: str
    port: int
    url: str
    pid: int


def summary(values: list[float]) -> dict:
    return {"runs": values, "median": statistics.median(values), "min": min(values), "max": max(values)}


def runtime_options(args: argparse.Namespace) -> list[str]:
    options = ["--device", args.device, "--threads", str(torch.get_num_threads())]
    options += ["--model", args.model] if args.model else []
    options += ["--vram-budget", args.vram_budget] if args.vram_budget else []
    options += ["--stream-interval", str(args.stream_interval)] if args.stream_interval is not None else []
    return options + ["--quiet"]


def thread_clocks(pid: int) -> dict[int, tuple[int, int]]:
    """{thread id: (ns it ran on a CPU, ns it was ready and waited for one)} of process `pid`, from
    /proc (Linux); {} where that cannot be read."""
    clocks = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            ran, waited = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[:2]
            clocks[int(tid)] = (int(ran), int(waited))
    except OSError:
        return {}
    return clocks


def time_split(wall_ns: int, before: dict, after: dict, tid: int, tokens: int) -> dict[str, float]:
    """Microseconds per token that thread `tid` ran, waited for a CPU (other processes' load), and
    was blocked (the rest: the GIL, the device, the job queue)."""
    ran = after[tid][0] - before.get(tid, (0, 0))[0]
    waited = after[tid][1] - before.get(tid, (0, 0))[1]
    return {"running": ran / tokens / 1e3, "waiting_for_a_cpu": waited / tokens / 1e3,
            "blocked": (wall_ns - ran - waited) / tokens / 1e3}


def library_run(model, ids: torch.Tensor, max_new_tokens: int) -> dict:
    """Decode tokens/s of one library call, and where its thread's time went."""
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, temperature=0)
    tid = threading.get_native_id()
    before, started = thread_clocks(os.getpid()), time.perf_counter_ns()
    report = stream_generate(model, ids, sampling, lambda text: None)
    wall, after = time.perf_counter_ns() - started, thread_clocks(os.getpid())
    assert report.new_tokens == max_new_tokens, report
    split = {"thread": time_split(wall, before, after, tid, max_new_tokens)} if after else {}
    return {"rate": report.decode_tokens_per_s, **split}


def served_run(server: Server, max_new_tokens: int) -> dict:
    """Decode tokens/s of one streamed request timed at the client (standard library only), the
    server's own figure for it, the chunks that carried its text, and where the time of the server's
    generating thread and event loop went."""
    body = {"messages": MESSAGES, "max_tokens": max_new_tokens, "min_tokens": max_new_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    before, started = thread_clocks(server.pid), time.perf_counter_ns()
    connection = http.client.HTTPConnection(server.host, server.port, timeout=START_S)
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    answer = connection.getresponse()
    assert answer.status == 200, answer.read()
    times, tokens = [], None
    for raw in answer:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            times.append(time.perf_counter())
    connection.close()
    wall, after = time.perf_counter_ns() - started, thread_clocks(server.pid)
    assert tokens == max_new_tokens, tokens
    reported = next(float(m.split()[1]) for m in _get(f"{server.url}/metrics").splitlines()
                    if m.startswith("mira_decode_tokens_per_second "))
    run = {"rate": (tokens - 1) / (times[-1] - times[0]), "reported": reported, "chunks": len(times)}
    if after:
        busiest = max((tid for tid in after if tid != server.pid),  # the generating thread
                      key=lambda tid: after[tid][0] - before.get(tid, (0, 0))[0])
        run["generating_thread"] = time_split(wall, before, after, busiest, tokens)
        run["event_loop"] = time_split(wall, before, after, server.pid, tokens)
    return run


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=START_S) as answer:
        return answer.read().decode()


@contextmanager
def serving(args: argparse.Namespace) -> Iterator[Server]:
    """`mira serve` in a process of its own, answering on a free port of 127.0.0.1."""
    command = [sys.executable, "-m", "mira.cli", "serve", "--port", "0", *runtime_options(args)]
    server = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + START_S
        line = ""
        while "serving" not in line:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"mira serve did not start: {line}{server.stderr.read()}")
            line = server.stderr.readline()
        url = line.split(" at ")[1].split()[0].removesuffix("/v1")
        host, port = url.removeprefix("http://").rsplit(":", 1)
        while True:  # the socket listens before uvicorn runs
            try:
                _get(f"{url}/health")
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.1)
        yield Server(host.strip("[]"), int(port), url, server.pid)
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    from mira.cache.budget import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory, hub id or store (default: the bundled model)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--vram-budget", help="as for mira generate, e.g. 12GiB (each of the two loads gets it)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5, help="timed rounds (at least 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (CUDA graphs are captured then)")
    parser.add_argument("--stream-interval", type=int, metavar="MS", help="the server's (default: its own)")
    parser.add_argument("--out", type=Path, help="JSON to write (default benchmarks/results/serve-vs-generate-"
                                                 "<device>.json)")
    args = parser.parse_args()
    if args.runs < 3:
        parser.error("--runs must be at least 3")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    library, served = [], []
    with serving(args) as server:
        model = mira.load(args.model, device=args.device, progress=False,
                          vram_budget=parse_size(args.vram_budget) if args.vram_budget else None)
        ids = encode_messages(model, MESSAGES)
        for run in range(args.warmup + args.runs):
            library_figures = library_run(model, ids, args.max_new_tokens)
            served_figures = served_run(server, args.max_new_tokens)
            if run >= args.warmup:
                library.append(library_figures)
                served.append(served_figures)
    generate, client = [r["rate"] for r in library], [r["rate"] for r in served]
    ratio = statistics.median(client) / statistics.median(generate)
    splits_by_thread = {"generate_thread": [r["thread"] for r in library if "thread" in r],
                        "serve_generating_thread": [r["generating_thread"] for r in served if "event_loop" in r],
                        "serve_event_loop": [r["event_loop"] for r in served if "event_loop" in r]}
    result = result_header("python " + " ".join(sys.argv), args.device) | {
        "model": args.model or "mira-tiny-moe (bundled)",
        "request": {"messages": MESSAGES, "new_tokens": args.max_new_tokens, "greedy": True},
        "runs": args.runs, "warmup": args.warmup, "order": "alternating: library, then server, each round",
        "server_options": runtime_options(args),
        "decode_tokens_per_s": {"generate_library": summary(generate), "serve_streaming_client": summary(client),
                                "serve_metrics": summary([r["reported"] for r in served])},
        "serve_over_generate_by_round": summary([c / g for c, g in zip(client, generate)]),
        "serve_text_chunks": summary([r["chunks"] for r in served]),
        "us_per_token": {name: {part: summary([split[part] for split in splits]) for part in splits[0]}
                         for name, splits in splits_by_thread.items() if splits},
        "serve_over_generate": ratio,
        "within_5_percent": ratio >= 0.95,
    }
    out = args.out or ROOT / "benchmarks" / "results" / f"serve-vs-generate-{args.device.split(':')[0]}.json"
    write_json_atomic(out, result)
    print(f"decode tokens/s, median (range) of {args.runs}: generate {statistics.median(generate):.1f} "
          f"({min(generate):.1f}-{max(generate):.1f}), serve {statistics.median(client):.1f} "
          f"({min(client):.1f}-{max(client):.1f}; the server's own figure "
          f"{result['decode_tokens_per_s']['serve_metrics']['median']:.1f}; "
          f"{result['serve_text_chunks']['median']:.0f} text chunks); serve/generate {ratio:.3f}; wrote {out}")
    for name, parts in result["us_per_token"].items():
        print(f"  {name}, us per token: " + ", ".join(f"{part} {figures['median']:.1f}"
                                                     for part, figures in parts.items()))


if __name__ == "__main__":
    main()
