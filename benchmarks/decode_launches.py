"""Eager decode calls of one expert at batch 1, INT4 then int8-shared, on rotating blobs: a workload
for a kernel profiler, which times each launch alone (nothing here is timed).

Nsight Compute's view of the decode launches (occupancy, issue rate, stall reasons) is what tells a
latency-bound launch from a bandwidth-bound one; `h200_suite.sh ncu-int4` runs this under `ncu`,
profiling the launches of the last two INT4 calls and the first two INT8 ones. The launch
configurations are the tuning's in --tuning-dir (default mira/kernels/tuning; a directory with one
candidate's file profiles that candidate; a scheme without a file there takes its defaults) on a GPU,
the defaults elsewhere (where Triton runs in its interpreter and the shape is tiny).

    python benchmarks/decode_launches.py [--shape mixtral-8x7b] [--calls 12] [--tuning-dir DIR]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_int8 import random_slots  # noqa: E402  (sets TRITON_INTERPRET without a GPU)
from kernels_int4 import SHAPES, addresses, random_int4_slots  # noqa: E402

from mira.kernels.triton_ffn import TritonMoEFFN  # noqa: E402
from mira.kernels.triton_int4 import TritonInt4MoEFFN, default_int4_config, load_int4_config  # noqa: E402
from mira.kernels.tuning import TUNING_DIR, default_config, load_config  # noqa: E402
from mira.store.layout import ExpertLayout  # noqa: E402

ROTATE_BYTES = 2 << 30  # blobs cycled through on a GPU: more than its L2 holds, so each call reads HBM
TINY = (256, 512)  # hidden, intermediate without a GPU


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mixtral-8x7b", choices=sorted(SHAPES))
    parser.add_argument("--calls", type=int, default=12, help="decode calls per scheme")
    parser.add_argument("--tuning-dir", type=Path, default=TUNING_DIR, help="where the launch configurations are read")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
    hidden, intermediate = SHAPES[args.shape] if cuda else TINY
    gen = torch.Generator(device=device).manual_seed(0)
    for scheme in ("int4", "int8-shared"):
        layout = ExpertLayout(scheme, hidden, intermediate)
        count = max(2, math.ceil(ROTATE_BYTES / layout.nbytes)) if cuda else 2
        if scheme == "int4":
            slots = random_int4_slots(layout, count, device, gen)
            config = (load_int4_config(gpu, hidden, intermediate, args.tuning_dir) if cuda
                      else default_int4_config(hidden, intermediate))
            ffn = TritonInt4MoEFFN(layout, device, config=config, max_tokens=16, top_k=2, dtype=dtype)
        else:
            slots = random_slots(layout, count, device, gen)
            config = (load_config(gpu, hidden, intermediate, args.tuning_dir) if cuda
                      else default_config(hidden, intermediate))
            ffn = TritonMoEFFN(layout, device, config=config, max_tokens=16, top_k=2, dtype=dtype)
        x = torch.randn(1, hidden, generator=gen, device=device).to(dtype)  # [1, H]
        index = torch.zeros(1, 1, dtype=torch.long, device=device)  # [T, K]: the table's one expert
        weight = torch.ones(1, 1, dtype=dtype, device=device)
        out = torch.empty(1, hidden, dtype=dtype, device=device)
        for call in range(args.calls):
            ffn.forward_bases(x, index, weight, addresses([slots[call % count]], device), out=out)
        if cuda:
            torch.cuda.synchronize()
        print(f"{scheme}: {args.calls} decode calls of a {hidden} x {intermediate} expert, {config}", flush=True)


if __name__ == "__main__":
    main()
