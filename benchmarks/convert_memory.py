"""Peak memory of `mira convert` on a checkpoint of a few hundred MB (issue #2).

Writes a random Mixtral-architecture checkpoint (bf16, sharded), converts it in a child process
while sampling that process's memory every 5 ms from /proc, and reports the peaks of anonymous
memory (what conversion holds; also above a baseline process that only imports the code and builds
the meta-device skeleton) and file-backed memory (pages of the memory-mapped shards, page
cache the kernel can drop), next to the size of one layer's experts and of the whole checkpoint.

    python benchmarks/convert_memory.py [--layers 4 --hidden 1024 --intermediate 2048]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from mira.bench.provenance import result_header
from transformers import MixtralConfig, MixtralForCausalLM

MiB = 1 << 20


def _status(pid: int) -> dict[str, int]:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def _measure(command: list[str]) -> tuple[dict[str, int], float]:
    start = time.perf_counter()
    child = subprocess.Popen(command)
    peaks: dict[str, int] = {}
    while child.poll() is None:
        try:
            for key, value in _status(child.pid).items():
                peaks[key] = max(peaks.get(key, 0), value)
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.005)
    if child.wait() != 0:
        raise SystemExit(f"{command} failed")
    return peaks, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="mira-convert-mem-"))
    config = MixtralConfig(vocab_size=8192, hidden_size=args.hidden, intermediate_size=args.intermediate,
                           num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                           num_local_experts=args.experts, dtype="bfloat16")
    model = MixtralForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(work / "model", max_shard_size="100MB")
    del model
    checkpoint_bytes = sum(p.stat().st_size for p in (work / "model").glob("*.safetensors"))
    layer_int8 = args.experts * 3 * args.hidden * args.intermediate

    # the same imports and the meta-device skeleton, without converting: what any run of Python,
    # torch and transformers holds before conversion starts
    baseline, _ = _measure([sys.executable, "-c", "import sys; from transformers import AutoConfig; "
                            "from mira.models.loader import moe_skeleton_layers; "
                            "moe_skeleton_layers(AutoConfig.from_pretrained(sys.argv[1]))", str(work / "model")])
    peaks, seconds = _measure([sys.executable, "-m", "mira.cli", "convert", str(work / "model"),
                               "--out", str(work / "store"), "--quiet"])
    figures = {
        "checkpoint_mib": checkpoint_bytes / MiB,
        "one_layer_int8_experts_mib": layer_int8 / MiB,
        "one_expert_float64_mib": 3 * args.hidden * args.intermediate * 8 / MiB,
        "imports_and_skeleton_anon_mib": baseline["RssAnon"] / MiB,
        "peak_anon_mib": peaks["RssAnon"] / MiB,
        "peak_anon_above_that_mib": (peaks["RssAnon"] - baseline["RssAnon"]) / MiB,
        "peak_file_backed_mib": peaks["RssFile"] / MiB,
        "peak_rss_mib": peaks["VmRSS"] / MiB,
        "seconds": seconds,
    }
    for key, value in figures.items():
        print(f"{key:32s} {value:10.1f}")
    result = {
        **result_header(" ".join(sys.argv)),
        "setup": vars(args),
        "figures": figures,
    }
    out = Path(__file__).parent / "results" / "convert-memory.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
