"""What the decode GEMV launches compile to, read without a GPU (issue #5).

Compiles the decode launches of one scheme for a CUDA target (sm_90 by default) with the Triton
installed here, at one expert shape: `_gate_up_gemv` and `_down_gemv` (int8-shared) at a list of
launch configurations, or `_gate_up_gemv4` and `_down_gemv4` (int4) at the stored H200 tuning.
It reports from the machine code (the `cuobjdump` that Triton ships): registers per thread,
barriers (`BAR`) in the whole kernel and inside its loops, shared-memory stores, loads with an
evict-first hint (`LDG.E.EF`; `LDG.E.EF.128`: the INT8 tiles' 16-byte ones), the instructions
inside loops with the f16 pair multiply-adds among them (`HFMA2`: INT4's products and high-nibble
conversions), which tell the arithmetic a loop step costs beside its bookkeeping, and the
instructions and barriers of each innermost loop (one step of a reduction, without the code
around it; a step with barriers keeps a program's warps in lock-step). The
arguments that the JIT would specialize as multiples of 16 at this shape (pointers, strides,
sizes, offsets) get the same hint here, so the code matches what a launch compiles. Triton
versions differ: the GPU machine's may schedule differently.

    python tools/kernel_sass.py [--scheme int8|int4] [--hidden 4096 --intermediate 14336] [--arch 90]
                                [--launch gate_up:2048:16 ...] [--json] [--out FILE]

--launch compiles INT4 launches of one's choosing instead of the stored ones: LAUNCH:COLS:WARPS[:SPLIT]
(a split for down only), one tile of rows, all 16 sub-steps of a group unrolled, "half2" codes (as
`default_int4_config` has them).

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
from mira.kernels import triton_ffn, triton_int4
from mira.kernels.tuning import GemvConfig
from mira.store.files import write_json_atomic

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
                     "LIMIT": 0.0, "UP_OFFSET": 0.0, "CUBIC": 0.0,
                     "GATE_CAP": 0.0, "UP_CAP": 0.0, "GATED": True, "NAN_ABSENT": True,
                     "CUT": False}
    else:
        fn = triton_ffn._down_gemv
        signature = {"act_ptr": "*fp32", "index_ptr": "*i64", "weights_ptr": "*bf16", "bases_ptr": "*i64",
                     "out_ptr": "*bf16", "stride_ot": I32, "partial_ptr": "*fp32", "count_ptr": "*i32",
                     "H": I32, "I": I32, "K": I32, "W2_OFF": I32, "S_OUT_OFF": I32, "B2_OFF": I32, "SPAN": I32,
                     "limits_ptr": "*i32"}
        span, splits = triton_ffn.split_span(intermediate, config)
        constants = {"BLOCK_H": config.block_rows, "BLOCK_I": config.block_cols, "UNROLL": config.unroll,
                     "PARTS": 2 * splits, "PER_PAIR": True, "EVEN_I": splits * span == intermediate,
                     "HAS_BIAS": False, "NAN_ABSENT": True, "CUT": False}  # K = 2 apart (KernelConfig.down_per_pair)
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


def compile_launch4(launch: str, config: GemvConfig, hidden: int, intermediate: int, arch: int) -> bytes:
    """The cubin of one INT4 decode launch at this shape (bf16 activations, K = 2, SwiGLU)."""
    if launch == "gate_up":
        fn = triton_int4._gate_up_gemv4
        signature = {"hidden_ptr": "*bf16", "stride_ht": I32, "index_ptr": "*i64", "bases_ptr": "*i64",
                     "act_ptr": "*fp32", "H": I32, "I": I32, "K": I32, "SZ13_OFF": I32, "B13_OFF": I32,
                     "TILES": I32, "MAGIC": I32}
        constants = {"HAS_BIAS": False, "ALPHA": 1.0, "LIMIT": 0.0, "UP_OFFSET": 0.0, "CUBIC": 0.0,
                     "GATE_CAP": 0.0, "UP_CAP": 0.0, "GATED": True, "NAN_ABSENT": True, "DEPENDENT": False}
    else:
        fn = triton_int4._down_gemv4
        signature = {"act_ptr": "*fp32", "index_ptr": "*i64", "weights_ptr": "*bf16", "bases_ptr": "*i64",
                     "out_ptr": "*bf16", "stride_ot": I32, "partial_ptr": "*fp32", "count_ptr": "*i32",
                     "H": I32, "I": I32, "K": I32, "W2_OFF": I32, "SZ2_OFF": I32, "B2_OFF": I32, "SPAN": I32,
                     "MAGIC": I32}
        splits = triton_ffn.split_span(intermediate, dataclasses.replace(config, unroll=1))[1]
        constants = {"PARTS": 2 * splits, "PER_PAIR": True, "HAS_BIAS": False, "NAN_ABSENT": True,
                     "DEPENDENT": False}  # the K = 2 experts apart (KernelConfig.down_per_pair)
    constants |= {"BLOCK_T": config.block_rows // triton_int4.TILE, "LANES": triton_int4._lanes(config),
                  "UNROLL": config.unroll, "CVT": config.cvt}
    small = {"K", "TILES", "MAGIC"}  # K = 2, tiles a program and 2**23's bits: no multiples of 16
    hinted = {(fn.arg_names.index(name),): DIV16 for name in signature if name not in small}
    signature |= {name: "constexpr" for name in constants}
    source = ASTSource(fn, signature=signature, constexprs=constants, attrs=hinted)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).asm["cubin"]


def int4_candidates(hidden: int, intermediate: int) -> dict[str, list[GemvConfig]]:
    """The INT4 launches as the H200's stored tuning has them at this shape (its defaults elsewhere)."""
    config = triton_int4.load_int4_config("NVIDIA H200", hidden, intermediate)
    return {"gate_up": [config.gate_up_gemv], "down": [config.down_gemv]}


def int4_launch(text: str) -> tuple[str, GemvConfig]:
    """`LAUNCH:COLS:WARPS[:SPLIT]` -> (launch, an INT4 GEMV configuration as `default_int4_config`'s)."""
    launch, *numbers = text.split(":")
    if launch not in ("gate_up", "down") or len(numbers) not in (2, 3) or not all(n.isdigit() for n in numbers):
        raise argparse.ArgumentTypeError(f"{text!r}: give gate_up or down, block columns, warps and an optional "
                                         "split, e.g. gate_up:2048:16 or down:512:8:2")
    cols, warps, split = (*map(int, numbers), 1)[:3]
    if launch == "gate_up" and split > 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the INT4 gate/up launch is not split over H; drop the split")
    return launch, triton_int4.decode_gemv(cols, warps, split)


def sass_figures(cubin: bytes) -> dict:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        sass = subprocess.run([str(tool), "--dump-sass", file.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([str(tool), "--dump-resource-usage", file.name], capture_output=True, text=True,
                               check=True).stdout
    registers = next(int(word[4:]) for word in usage.split() if word.startswith("REG:"))
    in_loops, innermost = _in_loops(sass)
    return {"registers": registers, "barriers": sass.count("BAR.SYNC"),
            "barriers_in_loops": sum("BAR.SYNC" in text for text in in_loops),
            "shared_stores": sass.count(" STS"), "weight_loads_128": sass.count("LDG.E.EF.128"),
            "evict_first_loads": sass.count("LDG.E.EF"),
            "instructions_in_loops": len(in_loops),
            "instructions_in_innermost_loops": [len(body) for body in innermost],
            "barriers_in_innermost_loops": [sum("BAR.SYNC" in text for text in body) for body in innermost],
            "half2_fmas_in_loops": sum(re.search(r"(^|\s)HFMA2[ .]", text) is not None for text in in_loops)}


def _in_loops(sass: str) -> tuple[list[str], list[list[str]]]:
    """The instructions between the target and the address of some backward branch (inside a loop),
    each once (nested loops too), with its predicate where it has one; and the body of each innermost
    loop (one that holds no other), in address order: what one step of a loop costs."""
    code = [(int(address, 16), text) for address, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(int(target, 16), address) for address, text in code
             for target in re.findall(r"BRA (?:`\()?0x([0-9a-f]+)", text) if int(target, 16) < address]
    innermost = sorted(loop for loop in loops
                       if not any(other != loop and loop[0] <= other[0] and other[1] <= loop[1] for other in loops))
    return ([text for address, text in code if any(start <= address <= end for start, end in loops)],
            [[text for address, text in code if start <= address <= end] for start, end in innermost])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", choices=("int8", "int4"), default="int8",
                        help="int8: the int8-shared launches at CANDIDATES; int4: the INT4 launches as stored "
                             "(or --launch)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for Hopper (default)")
    parser.add_argument("--launch", type=int4_launch, action="append", default=[],
                        help="an INT4 launch to compile instead of the stored ones, LAUNCH:COLS:WARPS[:SPLIT] "
                             "(gate_up or down; repeat for more), e.g. gate_up:2048:16")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--out", type=Path, help="also write the rows, with the result header, to this JSON file")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the kernels this tool compiles")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default the GPU machine's Triton uses
    candidates, compile_one = CANDIDATES, compile_launch
    if args.launch and args.scheme != "int4":
        parser.error("--launch compiles INT4 launches: add --scheme int4")
    if args.scheme == "int4":
        candidates, compile_one = int4_candidates(args.hidden, args.intermediate), compile_launch4
        if args.launch:
            candidates = {launch: [config for name, config in args.launch if name == launch]
                          for launch in ("gate_up", "down")}
    rows = [{"launch": launch, "config": dataclasses.asdict(config),
             **sass_figures(compile_one(launch, config, args.hidden, args.intermediate, args.arch))}
            for launch, configs in candidates.items() for config in configs]
    if args.out:
        command = " ".join(["python", "tools/kernel_sass.py", *sys.argv[1:]])
        result = {**result_header(command), "triton": triton.__version__, "target": f"sm_{args.arch}",
                  "scheme": args.scheme, "shape": {"hidden": args.hidden, "intermediate": args.intermediate},
                  "rows": rows}
        write_json_atomic(args.out, result)
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'launch':8} {'rows x cols':>11} {'unroll':>6} {'warps':>5} {'split':>5} {'regs':>5} {'BAR':>4} "
          f"{'in loops':>8} {'STS':>4} {'LDG.128 (weights)':>17} {'loop instr':>10} {'HFMA2':>6}  innermost loops")
    for row in rows:
        config = row["config"]
        shape = f"{config['block_rows']} x {config['block_cols']}"
        print(f"{row['launch']:8} {shape:>11} {config['unroll']:>6} {config['num_warps']:>5} {config['split']:>5} "
              f"{row['registers']:>5} {row['barriers']:>4} {row['barriers_in_loops']:>8} "
              f"{row['shared_stores']:>4} {row['weight_loads_128']:>17} {row['instructions_in_loops']:>10} "
              f"{row['half2_fmas_in_loops']:>6}  "
              + ", ".join(f"{n} ({b} BAR)" for n, b in zip(row["instructions_in_innermost_loops"],
                                                          row["barriers_in_innermost_loops"])))


if __name__ == "__main__":
    main()
