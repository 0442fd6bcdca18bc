"""Decode tokens/s of one request through `mira generate`'s library call and through `mira serve`
(a separate process, read by a streaming client), so the server's overhead shows.

The request is greedy with exactly --max-new-tokens new tokens (min_tokens = max_tokens) in both.
The library runs first in this process, its model is then freed, and the server is started as
`mira serve` with the same runtime options. Decode tokens/s is (tokens - 1) / (last token's time -
first token's time) in both: at the streamer for the library, at the client's server-sent events
for the server (its own /metrics figure is recorded beside it).

    python benchmarks/serve_vs_generate.py --device cuda --max-new-tokens 256 --runs 5
"""

from __future__ import annotations

import argparse
import gc
import http.client
import json
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
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


def summary(values: list[float]) -> dict:
    return {"runs": values, "median": statistics.median(values), "min": min(values), "max": max(values)}


def runtime_options(args: argparse.Namespace) -> list[str]:
    options = ["--device", args.device] if args.device else []
    options += ["--model", args.model] if args.model else []
    options += ["--vram-budget", args.vram_budget] if args.vram_budget else []
    return options + ["--quiet"]


def library_rates(args: argparse.Namespace) -> list[float]:
    from mira.cache.budget import parse_size

    model = mira.load(args.model, device=args.device, progress=False,
                      vram_budget=parse_size(args.vram_budget) if args.vram_budget else None)
    ids = encode_messages(model, MESSAGES)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, temperature=0)
    rates = []
    for run in range(args.warmup + args.runs):
        report = stream_generate(model, ids, sampling, lambda text: None)
        assert report.new_tokens == args.max_new_tokens, report
        if run >= args.warmup:
            rates.append(report.decode_tokens_per_s)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rates


def streamed_rate(host: str, port: int, max_new_tokens: int) -> float:
    """Decode tokens/s of one streamed request, timed at the client (standard library only)."""
    body = {"messages": MESSAGES, "max_tokens": max_new_tokens, "min_tokens": max_new_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    connection = http.client.HTTPConnection(host, port, timeout=START_S)
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
    assert tokens == max_new_tokens, tokens
    return (tokens - 1) / (times[-1] - times[0])


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=START_S) as answer:
        return answer.read().decode()


def server_rates(args: argparse.Namespace) -> tuple[list[float], list[float]]:
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
        client_rates, server_reported = [], []
        for run in range(args.warmup + args.runs):
            rate = streamed_rate(host.strip("[]"), int(port), args.max_new_tokens)
            reported = next(float(m.split()[1]) for m in _get(f"{url}/metrics").splitlines()
                            if m.startswith("mira_decode_tokens_per_second "))
            if run >= args.warmup:
                client_rates.append(rate)
                server_reported.append(reported)
        return client_rates, server_reported
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory, hub id or store (default: the bundled model)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--vram-budget", help="as for mira generate, e.g. 12GiB")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5, help="timed runs of each (at least 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first (CUDA graphs are captured then)")
    parser.add_argument("--out", type=Path, help="JSON to write (default benchmarks/results/serve-vs-generate-"
                                                 "<device>.json)")
    args = parser.parse_args()
    if args.runs < 3:
        parser.error("--runs must be at least 3")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.device = device
    library = library_rates(args)
    client, reported = server_rates(args)
    ratio = statistics.median(client) / statistics.median(library)
    result = result_header("python " + " ".join(sys.argv), device) | {
        "model": args.model or "mira-tiny-moe (bundled)",
        "request": {"messages": MESSAGES, "new_tokens": args.max_new_tokens, "greedy": True},
        "runs": args.runs, "warmup": args.warmup,
        "decode_tokens_per_s": {"generate_library": summary(library), "serve_streaming_client": summary(client),
                                "serve_metrics": summary(reported)},
        "serve_over_generate": ratio,
        "within_5_percent": ratio >= 0.95,
    }
    out = args.out or ROOT / "benchmarks" / "results" / f"serve-vs-generate-{device.split(':')[0]}.json"
    write_json_atomic(out, result)
    print(f"decode tokens/s, median (range) of {args.runs}: generate {statistics.median(library):.1f} "
          f"({min(library):.1f}-{max(library):.1f}), serve {statistics.median(client):.1f} "
          f"({min(client):.1f}-{max(client):.1f}; the server's own figure {statistics.median(reported):.1f}); "
          f"serve/generate {ratio:.3f}; wrote {out}")


if __name__ == "__main__":
    main()
