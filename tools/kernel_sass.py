"""What the decode GEMV launches compile to, read without a GPU (issue #5).

Compiles `_gate_up_gemv` and `_down_gemv` for a CUDA target (sm_90 by default) with the Triton
installed here, at one expert shape and a list of launch configurations, and reports from the
machine code (the `cuobjdump` that Triton ships): registers per thread, barriers (`BAR`) in the
whole kernel and inside its loops, shared-memory stores, and 16-byte weight loads (`LDG.E.EF.128`,
the evict-first loads of the INT8 tiles). The arguments that the JIT would specialize as multiples of 16
at this shape (pointers, strides, sizes, offsets) get the same hint here, so the code matches what
a launch compiles. Triton versions differ: the GPU machine's may schedule differently.

    python tools/kernel_sass.py [--hidden 4096 --intermediate 14336] [--arch 90] [--json] [--out FILE]

(Not under TRITON_INTERPRET=1, which replaces the kernels with interpreted functions.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mira.bench.provenance import result_header
from mira.kernels import triton_ffn
from mira.kernels.tuning import GemvConfig

CANDIDATES = {  # launch -> configurations (the stored H200 tuning)
    "gate_up": [GemvConfig(16, 256, unroll=2, cvt="prmt")],
    "down": [GemvConfig(16, 512, unroll=1, cvt="prmt", split=4)],
}
I32, DIV16 = "i32", [["tt.divisibility", 16]]


def compile_launch(launch: str, config: GemvConfig, hidden: int, intermediate: int, arch: int) -> bytes:
    """The cubin of one decode launch at this shape (int8-shared, bf16 activations, K = 2)."""
    if launch == "gate_up":
        fn = triton_ffn._gate_up_gemv
        signature = {"hidden_ptr": "*bf16", "stride_ht": I32, "index_ptr": "*i64", "bases_ptr": "*i64",
                     "act_ptr": "*fp32", "H": I32, "I": I32, "K": I32, "S_IN_OFF": I32, "B13_OFF": I32,
                     "ROWS": I32, "limits_ptr": "*i32"}
        constants = {"SCHEME": 0, "BLOCK_I": config.block_rows, "BLOCK_H": config.block_cols, "UNROLL": config.unroll,
                     "EVEN_H": hidden % (config.block_cols * config.unroll) == 0, "HAS_BIAS": False, "ALPHA": 1.0,
                     "LIMIT": 0.0, "UP_OFFSET": 0.0, "NAN_ABSENT": True, "CUT": False}
    else:
        fn = triton_ffn._down_gemv
        signature = {"act_ptr": "*fp32", "index_ptr": "*i64", "weights_ptr": "*bf16", "bases_ptr": "*i64",
                     "out_ptr": "*bf16", "stride_ot": I32, "partial_ptr": "*fp32", "count_ptr": "*i32",
                     "H": I32, "I": I32, "K": I32, "W2_OFF": I32, "S_OUT_OFF": I32, "B2_OFF": I32, "SPAN": I32,
                     "limits_ptr": "*i32"}
        span, splits = triton_ffn.split_span(intermediate, config)
        constants = {"BLOCK_H": config.block_rows, "BLOCK_I": config.block_cols, "UNROLL": config.unroll,
                     "SPLIT": splits, "EVEN_I": splits * span == intermediate, "HAS_BIAS": False, "NAN_ABSENT": True,
                     "CUT": False}
    constants["CVT"] = config.cvt
    constants["VEC"] = triton_ffn.partial_sum(config)
    # every argument but K (= 2) and a row count below 16 (ROWS = block_rows: one row block per
    # program) is a multiple of 16 at real shapes, as the JIT would find
    small = {"K"} | ({"ROWS"} if config.block_rows % 16 else set())
    hinted = {(fn.arg_names.index(name),): DIV16 for name in signature if name not in small}
    signature |= {name: "constexpr" for name in constants}
    source = ASTSource(fn, signature=signature, constexprs=constants, attrs=hinted)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).asm["cubin"]


def sass_figures(cubin: bytes) -> dict:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        sass = subprocess.run([str(tool), "--dump-sass", file.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([str(tool), "--dump-resource-usage", file.name], capture_output=True, text=True,
                               check=True).stdout
    registers = next(int(word[4:]) for word in usage.split() if word.startswith("REG:"))
    return {"registers": registers, "barriers": sass.count("BAR.SYNC"), "barriers_in_loops": _barriers_in_loops(sass),
            "shared_stores": sass.count(" STS"), "weight_loads_128": sass.count("LDG.E.EF.128")}


def _barriers_in_loops(sass: str) -> int:
    """Barriers between the target and the address of some backward branch (inside a loop)."""
    code = [(int(address, 16), text) for address, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(int(target, 16), address) for address, text in code
             for target in re.findall(r"BRA (?:`\()?0x([0-9a-f]+)", text) if int(target, 16) < address]
    return sum("BAR.SYNC" in text and any(start <= address <= end for start, end in loops) for address, text in code)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for Hopper (default)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--out", type=Path, help="also write the rows, with the result header, to this JSON file")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the kernels this tool compiles")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default the GPU machine's Triton uses
    rows = [{"launch": launch, "config": dataclasses.asdict(config),
             **sass_figures(compile_launch(launch, config, args.hidden, args.intermediate, args.arch))}
            for launch, configs in CANDIDATES.items() for config in configs]
    if args.out:
        command = " ".join(["python", "tools/kernel_sass.py", *sys.argv[1:]])
        result = {**result_header(command), "triton": triton.__version__, "target": f"sm_{args.arch}",
                  "shape": {"hidden": args.hidden, "intermediate": args.intermediate}, "rows": rows}
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'launch':8} {'rows x cols':>11} {'unroll':>6} {'regs':>5} {'BAR':>4} {'in loops':>8} "
          f"{'STS':>4} {'LDG.128 (weights)':>17}")
    for row in rows:
        config = row["config"]
        shape = f"{config['block_rows']} x {config['block_cols']}"
        print(f"{row['launch']:8} {shape:>11} {config['unroll']:>6} "
              f"{row['registers']:>5} {row['barriers']:>4} {row['barriers_in_loops']:>8} "
              f"{row['shared_stores']:>4} {row['weight_loads_128']:>17}")


if __name__ == "__main__":
    main()
