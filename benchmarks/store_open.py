"""Time `ExpertStore.open` on a store of N GB: serial against parallel, page-locked or not (issue #5).

Writes a store of random expert blobs (DeepSeek-V2-Lite's expert shape by default: 64 experts of
8.7 MB per layer file, as many layers as N GB needs) into a temporary folder, with the manifest and
layer files `mira convert` writes, then opens it with 1 and with P reader threads, with the files
in the page cache ("warm") and dropped from it by posix_fadvise ("cold": read from disk). With
CUDA it also opens page-locked (`pin=True`), and times the two ways of page-locking the whole
store alone: torch's pinned allocator (`torch.empty(..., pin_memory=True)`, what opening did
before; it rounds the size up to a power of two) and `cudaHostRegister` of a filled buffer (what
it does now). Prints a table and writes benchmarks/results/store-open-<h200|cpu>.json.

    python benchmarks/store_open.py [--gb 8] [--workers 8] [--shape deepseek-v2-lite] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from mira.store.files import sha256_file
from mira.store.layout import ExpertLayout
from mira.store.manifest import FORMAT_VERSION, Manifest
from mira.store.store import MAX_WORKERS, ExpertStore
from mira.bench.provenance import result_header

SHAPES = {"mixtral-8x7b": (4096, 14336, 8), "deepseek-v2-lite": (2048, 1408, 64), "qwen3-30b-a3b": (2048, 768, 128)}
GB = 10**9


def write_store(root: Path, gigabytes: float, shape: str) -> Path:
    """A store of int8-shared blobs totalling about `gigabytes` GB: one random layer drawn once and
    written as every layer file, its first 8 bytes numbering the layer (so no two files are equal)."""
    hidden, intermediate, experts = SHAPES[shape]
    layout = ExpertLayout("int8-shared", hidden, intermediate)
    layers = max(1, math.ceil(gigabytes * GB / (experts * layout.nbytes)))
    generator = torch.Generator().manual_seed(0)
    blobs = torch.randint(0, 256, (experts, layout.nbytes), dtype=torch.uint8, generator=generator)  # [E, B]
    store = root / "store"
    (store / "experts").mkdir(parents=True)
    manifest = Manifest(FORMAT_VERSION, "mixtral", f"synthetic:{shape}", f"synthetic:{shape}", list(range(layers)),
                        experts, layout.to_json(), files={})
    files = {}
    for layer in range(layers):
        blobs[0, :8] = torch.tensor(list(layer.to_bytes(8, "little")), dtype=torch.uint8)
        rel = manifest.expert_file(layer)
        save_file({"experts": blobs}, str(store / rel), metadata={"format": "pt"})
        files[rel] = sha256_file(store / rel)
    (store / "config.json").write_text(json.dumps({"note": "store_open benchmark"}))
    files["config.json"] = sha256_file(store / "config.json")
    Manifest(**{**manifest.__dict__, "files": files}).write(store)
    os.sync()
    return store


def drop_from_page_cache(store: Path) -> None:
    """Ask the kernel to forget the store's file pages (no root needed for files we can open)."""
    for path in store.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def time_open(store: Path, workers: int, pin: bool, cold: bool) -> float:
    if cold:
        drop_from_page_cache(store)
    else:
        ExpertStore.open(store, progress=False, workers=MAX_WORKERS)  # fill the page cache
        gc.collect()
    start = time.perf_counter()
    opened = ExpertStore.open(store, pin=pin, progress=False, workers=workers)
    seconds = time.perf_counter() - start
    del opened
    gc.collect()  # unlocks and frees the blobs before the next run
    return seconds


def time_page_locking(nbytes: int) -> dict:
    """Seconds to page-lock `nbytes` of host memory both ways, and the bytes torch's allocator locked."""
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})  # (newer torch versions)
    before = stats().get("allocated_bytes.current", 0)
    start = time.perf_counter()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pin_memory_s = time.perf_counter() - start
    locked_bytes = stats().get("allocated_bytes.current", 0) - before
    del pinned  # (its block stays cached, locked, in torch's pinned allocator)
    filled = torch.ones(nbytes, dtype=torch.uint8)  # pages resident, as after reading the store
    cudart = torch.cuda.cudart()
    start = time.perf_counter()
    error = int(cudart.cudaHostRegister(filled.data_ptr(), nbytes, 0))
    register_s = time.perf_counter() - start
    cudart.cudaHostUnregister(filled.data_ptr())
    if error:
        raise RuntimeError(f"cudaHostRegister failed: cudaError {error}")
    return {"pin_memory_s": pin_memory_s, "pin_memory_locked_gb": locked_bytes / GB if locked_bytes else None,
            "host_register_s": register_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=8.0, help="store size in GB (10^9 bytes)")
    parser.add_argument("--workers", type=int, default=min(MAX_WORKERS, os.cpu_count() or 1),
                        help="reader threads of the parallel runs")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="deepseek-v2-lite")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the store (default: a temp dir)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    machine = "h200" if cuda else "cpu"

    with tempfile.TemporaryDirectory(prefix="mira-store-open-", dir=args.dir) as tmp:
        start = time.perf_counter()
        store = write_store(Path(tmp), args.gb, args.shape)
        write_s = time.perf_counter() - start
        manifest = Manifest.read(store)
        nbytes = len(manifest.moe_layers) * manifest.num_experts * manifest.expert_layout.nbytes
        runs = []
        for pin in ([False, True] if cuda else [False]):
            for cache in ("cold", "warm"):
                for workers in sorted({1, args.workers}):
                    seconds = time_open(store, workers, pin, cache == "cold")
                    runs.append({"pin": pin, "cache": cache, "workers": workers, "seconds": round(seconds, 3),
                                 "gb_per_s": round(nbytes / GB / seconds, 2)})
                    print(f"pin={pin!s:5} {cache:4} workers={workers:2d}: {seconds:7.2f} s  "
                          f"{nbytes / GB / seconds:6.2f} GB/s", flush=True)
        locking = time_page_locking(nbytes) if cuda else None

    print(f"\nstore {nbytes / GB:.2f} GB ({len(manifest.moe_layers)} layer files of {manifest.num_experts} "
          f"{args.shape} experts), written in {write_s:.1f} s")
    print(f"{'pin':5} {'cache':5} {'workers':>7} {'seconds':>8} {'GB/s':>6}")
    for run in runs:
        print(f"{run['pin']!s:5} {run['cache']:5} {run['workers']:7d} {run['seconds']:8.2f} {run['gb_per_s']:6.2f}")
    if locking:
        print(f"page-locking {nbytes / GB:.2f} GB alone: torch.empty(pin_memory=True) {locking['pin_memory_s']:.2f} s "
              f"(locked {locking['pin_memory_locked_gb']} GB), cudaHostRegister of a filled buffer "
              f"{locking['host_register_s']:.2f} s")
    result = {
        **result_header(" ".join([Path(sys.executable).name, *sys.argv]), "cuda" if cuda else None),
        "setup": {"gb": args.gb, "store_bytes": nbytes, "shape": args.shape, "layer_files": len(manifest.moe_layers),
                  "parallel_workers": args.workers, "torch": torch.__version__},
        "figures": {"write_s": round(write_s, 2), "open": runs, "page_locking": locking},
    }
    out = Path(__file__).parent / "results" / f"store-open-{machine}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
