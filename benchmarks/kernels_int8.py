"""Time the fused INT8 expert kernels against torch baselines, and tune their launches (issue #5).

For each expert shape (Mixtral-8x7B 4096/14336, DeepSeek-V2-Lite 2048/1408, Qwen3-30B-A3B 2048/768,
random INT8 weights, int8-shared, bf16 activations), on one GPU:

- one expert at batch 1: Mira's decode launches; achieved GB/s of blob bytes read against the
  design's 4.29 TB/s HBM figure (and the copy bandwidth measured in this run); torch bf16 FFN;
  naive torch INT8 dequantize-then-matmul; the read ceiling: a plain read of the same bytes in
  one launch and in two (`read_ceiling`);
- top-2 of 8 experts at batch 1 (one MoE layer's decode), Mira and torch bf16; Mira again with the
  experts spread over a --spread-gb pool, as a large model's slot pool spreads them;
- prefill: 512 tokens routed top-2 over a layer's 8 experts (random routing), Mira's grouped GEMM
  against torch bf16 "grouped matmul" (a loop over experts of bf16 matmuls, token lists computed
  outside the timed region);
- the two miss paths of one expert at batch 1: copy-then-compute (pinned blob -> slot, then the
  kernel) against zero-copy (the kernel reads the pinned blob), next to the pinned copy alone.

Timing: CUDA graphs of several calls on rotating inputs (the weights read per graph exceed the
L2 cache), replayed after warm-up; the figure is the median over replays of the time per call.
"Eager" figures time plain back-to-back Python calls (launch overhead included).

--autotune first times candidate launch configurations per shape (each checked against the
reference) and writes the best into mira/kernels/tuning/<device>.json (or --tuning-dir). The
decode launches are chosen by their time from HBM, except that among gate/up launches within
ZERO_COPY_TOLERANCE of the fastest the one reading a layer's pinned (missed) experts fastest
wins if it reads them ZERO_COPY_MIN_GAIN faster than the fastest does (one token routed to all 8
experts: as many pairs as top-6 / top-8 models route).

    python benchmarks/kernels_int8.py [--autotune] [--shapes mixtral-8x7b,...] [--out FILE]
    python benchmarks/kernels_int8.py --smoke     # tiny shapes, few repeats: checks the script runs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # --smoke on a CPU machine: the kernels run interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mira.bench.provenance import commit, context, utc_now  # noqa: E402
from mira.kernels.reference import moe_ffn_reference  # noqa: E402
from mira.kernels import triton_ffn  # noqa: E402
from mira.kernels.triton_ffn import TritonMoEFFN  # noqa: E402
from mira.kernels.tuning import (  # noqa: E402
    TUNING_DIR, GemmConfig, GemvConfig, KernelConfig, default_config, load_config, save_configs,
)
from mira.store.layout import ExpertLayout  # noqa: E402

SHAPES = {"mixtral-8x7b": (4096, 14336), "deepseek-v2-lite": (2048, 1408), "qwen3-30b-a3b": (2048, 768)}
SMOKE_SHAPES = {"smoke": (128, 96)}
HBM_DESIGN_BPS = 4.29e12  # DESIGN.md 3: device-to-device copy, bytes read + written
ROTATE_BYTES = 512 << 20  # weights read per graph replay: well past the 60 MB L2
PINNED_BYTES = 256 << 20
EXPERTS, TOP_K, PREFILL_TOKENS = 8, 2, 512
ZERO_COPY_TOLERANCE, ZERO_COPY_MIN_GAIN = 0.10, 0.02  # see autotune

GEMV_UP = [  # gate/up decode launch candidates
    GemvConfig(16, 256, unroll=2, cvt="prmt"), GemvConfig(8, 256, unroll=2, cvt="prmt"),
    GemvConfig(32, 128, unroll=2, cvt="prmt"), GemvConfig(8, 512, unroll=2, num_warps=8, cvt="prmt"),
    GemvConfig(4, 512, unroll=2, cvt="prmt"), GemvConfig(16, 256, unroll=4, cvt="prmt"),
    GemvConfig(16, 256, unroll=2, cvt="bits"), GemvConfig(16, 256, unroll=2, cvt="native"),
    GemvConfig(32, 256, num_stages=4, mma=True), GemvConfig(64, 128, num_stages=4, mma=True),
    GemvConfig(8, 256, unroll=2, cvt="prmt", programs_per_sm=4), GemvConfig(8, 256, unroll=2, cvt="prmt", programs_per_sm=8),
    GemvConfig(4, 512, unroll=2, cvt="prmt", programs_per_sm=4), GemvConfig(8, 512, unroll=2, cvt="prmt"),
    GemvConfig(8, 256, unroll=2, num_warps=8, cvt="prmt"), GemvConfig(4, 1024, unroll=2, cvt="prmt"),
    GemvConfig(4, 1024, unroll=1, cvt="prmt"), GemvConfig(16, 256, unroll=2, cvt="prmt", programs_per_sm=4),
]
GEMV_DOWN = [  # down decode launch candidates
    GemvConfig(8, 512, unroll=2, cvt="prmt"), GemvConfig(4, 512, unroll=2, cvt="prmt"),
    GemvConfig(16, 256, unroll=2, cvt="prmt"), GemvConfig(2, 1024, unroll=2, cvt="prmt"),
    GemvConfig(8, 512, unroll=2, cvt="bits"),
    GemvConfig(16, 512, num_stages=4, mma=True), GemvConfig(32, 256, num_stages=4, mma=True),
    GemvConfig(8, 256, unroll=2, cvt="prmt", split=4), GemvConfig(8, 256, unroll=1, cvt="prmt", split=4),
    GemvConfig(32, 256, unroll=1, cvt="prmt", split=8), GemvConfig(8, 128, unroll=2, num_warps=2, cvt="prmt", split=8),
    GemvConfig(8, 512, unroll=2, cvt="prmt", split=2), GemvConfig(16, 256, unroll=2, cvt="prmt", split=4),
    GemvConfig(16, 512, unroll=1, cvt="prmt", split=4), GemvConfig(32, 512, unroll=1, num_warps=8, cvt="prmt", split=4),
    GemvConfig(16, 512, unroll=2, cvt="prmt", split=4), GemvConfig(32, 512, unroll=2, num_warps=8, cvt="prmt", split=3),
]
GEMM = [
    GemmConfig(64, 128, 64, num_warps=8, num_stages=3), GemmConfig(128, 128, 64, num_warps=8, num_stages=3),
    GemmConfig(32, 128, 64, num_warps=4, num_stages=4), GemmConfig(128, 64, 64, num_warps=4, num_stages=3),
    GemmConfig(64, 128, 128, num_warps=8, num_stages=3), GemmConfig(128, 128, 64, num_warps=8, num_stages=4),
    GemmConfig(64, 256, 64, num_warps=8, num_stages=3), GemmConfig(128, 128, 128, num_warps=8, num_stages=3),
    GemmConfig(64, 128, 64, num_warps=4, num_stages=4), GemmConfig(128, 64, 128, num_warps=4, num_stages=3),
]


class Timer:
    """Median seconds per call: CUDA graphs of `calls` rotating calls on a GPU; wall clock on a CPU."""

    def __init__(self, device: torch.device, replays: int) -> None:
        self.device, self.replays = device, replays

    def graph(self, fn, calls: int) -> float:
        if self.device.type != "cuda":
            return self.eager(fn, calls)
        try:
            return self._graph(fn, calls)
        except RuntimeError as error:  # not capturable: time it eagerly instead, and say so
            print(f"  (graph capture failed, timing eagerly: {str(error)[:100]})", flush=True)
            torch.cuda.synchronize()
            return self.eager(fn, calls)

    def _graph(self, fn, calls: int) -> float:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(calls):
                fn(i)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / calls)
        del graph
        return statistics.median(times)

    def eager(self, fn, calls: int) -> float:
        for i in range(calls):
            fn(i)
        self._sync()
        times = []
        for _ in range(self.replays):
            t0 = time.perf_counter()
            for i in range(calls):
                fn(i)
            self._sync()
            times.append((time.perf_counter() - t0) / calls)
        return statistics.median(times)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def random_slots(layout: ExpertLayout, count: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """[count, nbytes] blobs: random INT8 weights, scales that keep activations O(1)."""
    slots = torch.randint(-127, 128, (count, layout.nbytes), generator=gen, device=device, dtype=torch.int8)
    slots = slots.view(torch.uint8)
    H, I = layout.hidden, layout.intermediate
    for name, section in layout.sections.items():
        if section.dtype == torch.int8:
            continue
        fan_in = I if name == "scale2" else H
        scales = (torch.rand(count, *section.shape, generator=gen, device=device) + 0.5) / (73 * fan_in**0.5)
        slots[:, section.offset : section.offset + section.nbytes].copy_(scales.to(torch.bfloat16).view(torch.uint8).view(count, -1))
    return slots


def table(blobs) -> torch.Tensor:
    device = next(b.device for b in blobs if b.is_cuda) if any(b.is_cuda for b in blobs) else blobs[0].device
    return torch.tensor([b.data_ptr() for b in blobs], dtype=torch.int64, device=device)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


class ShapeBench:
    """The workloads of one expert shape, built once and timed for any launch configuration."""

    def __init__(self, name: str, hidden: int, intermediate: int, device: torch.device, timer: Timer, smoke: bool):
        self.name, self.device, self.timer = name, device, timer
        self.layout = ExpertLayout("int8-shared", hidden, intermediate)
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        gen = torch.Generator(device=device).manual_seed(0)
        nbytes = self.layout.nbytes
        rotate = (8 << 20) if smoke else ROTATE_BYTES
        self.n_slots = max(EXPERTS, math.ceil(rotate / nbytes))
        self.slots = random_slots(self.layout, self.n_slots, device, gen)  # [N, nbytes]
        self.calls = 2 if smoke else min(self.n_slots, 64)
        H = hidden
        self.x1 = [torch.randn(1, H, generator=gen, device=device).to(self.dtype) for _ in range(self.calls)]
        self.one_index = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.one_weight = torch.ones(1, 1, dtype=self.dtype, device=device)
        self.one_tables = [table([self.slots[i % self.n_slots]]) for i in range(self.calls)]
        self.layer_tables = [table([self.slots[(EXPERTS * i + e) % self.n_slots] for e in range(EXPERTS)])
                             for i in range(self.calls)]
        self.top2 = []
        for i in range(self.calls):
            index = torch.randperm(EXPERTS, generator=gen, device=device)[:TOP_K].view(1, TOP_K)
            weight = torch.softmax(torch.randn(1, TOP_K, generator=gen, device=device), -1).to(self.dtype)
            self.top2.append((index, weight))
        tokens = 16 if smoke else PREFILL_TOKENS
        self.xp = torch.randn(tokens, H, generator=gen, device=device).to(self.dtype)
        logits = torch.randn(tokens, EXPERTS, generator=gen, device=device)
        top = logits.topk(TOP_K, dim=-1)
        self.p_index, self.p_weight = top.indices, torch.softmax(top.values, -1).to(self.dtype)
        self.out1 = torch.empty(1, H, dtype=self.dtype, device=device)
        self.outp = torch.empty(tokens, H, dtype=self.dtype, device=device)
        layer = [self.slots[e] for e in range(EXPERTS)]
        self.ref_one = moe_ffn_reference(self.x1[0].float(), self.one_index, self.one_weight.float(),
                                         [self.slots[0]], self.layout, F.silu)
        index, weight = self.top2[0]
        self.ref_top2 = moe_ffn_reference(self.x1[0].float(), index, weight.float(),
                                          [self.slots[(e) % self.n_slots] for e in range(EXPERTS)], self.layout, F.silu)
        self.ref_prefill = moe_ffn_reference(self.xp.float(), self.p_index, self.p_weight.float(), layer,
                                             self.layout, F.silu)

    # ---- Mira -------------------------------------------------------------------------------

    def ffn(self, config: KernelConfig) -> TritonMoEFFN:
        return TritonMoEFFN(self.layout, self.device, config=config, max_tokens=self.xp.shape[0], top_k=TOP_K,
                            dtype=self.dtype)

    def check(self, ffn: TritonMoEFFN, what: str) -> float:
        """Relative error of one call of workload `what` against the fp32 reference."""
        if what == "one":
            out = ffn.forward_bases(self.x1[0], self.one_index, self.one_weight, self.one_tables[0])
            return relative_error(out, self.ref_one)
        if what == "top2":
            index, weight = self.top2[0]
            return relative_error(ffn.forward_bases(self.x1[0], index, weight, self.layer_tables[0]), self.ref_top2)
        out = ffn.forward_bases(self.xp, self.p_index, self.p_weight, self.layer_tables[0])
        return relative_error(out, self.ref_prefill)

    def time_one(self, ffn: TritonMoEFFN) -> float:
        return self.timer.graph(lambda i: ffn.forward_bases(self.x1[i], self.one_index, self.one_weight,
                                                            self.one_tables[i], out=self.out1), self.calls)

    def time_top2(self, ffn: TritonMoEFFN, tables: list[torch.Tensor] | None = None) -> float:
        """Top-2 of a layer's experts at batch 1; `tables`: other address tables per call."""
        tables = tables or self.layer_tables

        def call(i):
            index, weight = self.top2[i]
            ffn.forward_bases(self.x1[i], index, weight, tables[i], out=self.out1)
        return self.timer.graph(call, self.calls)

    def time_top2_spread(self, ffn: TritonMoEFFN, pool_bytes: int) -> float | None:
        """time_top2 with every call's experts placed far apart in one pool of `pool_bytes`, as in
        the slot pool of a large model (Mixtral's is 45 GB), where an expert kernel ran 1.5x slower
        than here (profile-decode-mixtral-8x7b-all.json): does reading experts spread over tens of
        GB cost more than over a compact set of slots? None when the pool does not fit."""
        nbytes, used = self.layout.nbytes, EXPERTS * self.calls
        rows = pool_bytes // nbytes
        if rows < used:
            return None
        try:
            pool = torch.empty(rows, nbytes, dtype=torch.uint8, device=self.device)  # [R, B]
        except torch.OutOfMemoryError:
            return None
        positions = [i * (rows // used) for i in range(used)]  # evenly spread over the pool
        for i, row in enumerate(positions):
            pool[row].copy_(self.slots[i % self.n_slots])
        tables = [table([pool[positions[EXPERTS * c + e]] for e in range(EXPERTS)]) for c in range(self.calls)]
        seconds = self.time_top2(ffn, tables)
        del pool, tables
        return seconds

    def host_copies(self, count: int) -> torch.Tensor:
        """[count, nbytes] copies of the slots in host memory, pinned on a GPU machine."""
        host = torch.empty(count, self.layout.nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        for r in range(count):
            host[r].copy_(self.slots[r % self.n_slots])
        return host

    def time_layer_zero_copy(self, ffn: TritonMoEFFN) -> float:
        """One token routed to all EXPERTS experts of a layer, every one read from pinned host
        memory: a decode layer whose routed experts all missed, with as many routed pairs as the
        small-expert models have (top-6, top-8). The pinned copies are made on the first call."""
        if not hasattr(self, "_pinned_tables"):
            count = min(64, max(2 * EXPERTS, math.ceil(PINNED_BYTES / self.layout.nbytes)))
            self._pinned = self.host_copies(count)
            self._pinned_tables = [torch.tensor([self._pinned[(EXPERTS * i + e) % count].data_ptr() for e in range(EXPERTS)],
                                                dtype=torch.int64, device=self.device) for i in range(count // EXPERTS)]
        index = torch.arange(EXPERTS, device=self.device).view(1, EXPERTS)
        weight = torch.full((1, EXPERTS), 1 / EXPERTS, dtype=self.dtype, device=self.device)
        return self.timer.graph(lambda i: ffn.forward_bases(self.x1[i % self.calls], index, weight, self._pinned_tables[i],
                                                            out=self.out1), len(self._pinned_tables))

    def time_prefill(self, ffn: TritonMoEFFN, tokens: int | None = None) -> float:
        n = tokens or self.xp.shape[0]
        x, index, weight, out = self.xp[:n], self.p_index[:n], self.p_weight[:n], self.outp[:n]
        calls = 1 if self.layout.nbytes * EXPERTS > ROTATE_BYTES else min(self.calls, max(1, self.n_slots // EXPERTS))
        return self.timer.graph(lambda i: ffn.forward_bases(x, index, weight, self.layer_tables[i], out=out), calls)

    def time_eager_call(self, ffn: TritonMoEFFN) -> float:
        """Per call, the blob-list form as the runtime calls it, launch overhead included."""
        blobs = [self.slots[e] for e in range(EXPERTS)]

        def call(i):
            index, weight = self.top2[i]
            ffn(self.x1[i], index, weight, blobs, out=self.out1)
        return self.timer.eager(call, self.calls)

    # ---- torch baselines --------------------------------------------------------------------

    def torch_bf16(self) -> dict:
        H, I = self.layout.hidden, self.layout.intermediate
        gen = torch.Generator(device=self.device).manual_seed(1)
        per_expert = (2 * I * H + H * I) * 2
        count = max(EXPERTS, math.ceil(ROTATE_BYTES / per_expert)) if self.device.type == "cuda" else EXPERTS
        w13 = torch.randn(count, 2 * I, H, generator=gen, device=self.device).to(self.dtype) * 0.02
        w2 = torch.randn(count, H, I, generator=gen, device=self.device).to(self.dtype) * 0.02
        calls = min(count, 64)

        def expert(x, e):
            gate, up = (x @ w13[e].T).chunk(2, dim=-1)  # [T, I] each
            return (F.silu(gate) * up) @ w2[e].T  # [T, H]

        one = self.timer.graph(lambda i: expert(self.x1[i % self.calls], i % count), calls)

        def top2(i):
            index, weight = self.top2[i % self.calls]
            x = self.x1[i % self.calls]
            base = (EXPERTS * i) % count
            return (expert(x, base) * weight[0, 0] + expert(x, (base + 1) % count) * weight[0, 1])
        layer = self.timer.graph(top2, calls)
        lists = [torch.where(self.p_index == e) for e in range(EXPERTS)]  # host sync: outside the timing
        lists = [(tok, self.p_weight[tok, k, None]) for tok, k in lists]

        def prefill(i):
            out = self.outp
            out.zero_()
            for e, (tok, wts) in enumerate(lists):
                out.index_add_(0, tok, expert(self.xp[tok], e) * wts)
        grouped = self.timer.graph(prefill, 1)
        del w13, w2
        return {"one_expert_s": one, "top2_s": layer, "prefill_s": grouped}

    def torch_dequant(self) -> float:
        """Naive INT8: dequantize the blob to bf16 in torch, then the bf16 FFN (batch 1)."""
        views = [self.layout.views(self.slots[i % self.n_slots]) for i in range(self.calls)]

        def call(i):
            v = views[i]
            s = v["scale"].to(self.dtype)
            w13 = v["w13"].to(self.dtype) * s[None, :]  # [2I, H]
            w2 = v["w2"].to(self.dtype) * s[:, None]  # [H, I]
            gate, up = (self.x1[i] @ w13.T).chunk(2, dim=-1)
            return (F.silu(gate) * up) @ w2.T
        return self.timer.graph(call, self.calls)

    # ---- misses -----------------------------------------------------------------------------

    def misses(self, ffn: TritonMoEFFN, smoke: bool) -> dict:
        nbytes = self.layout.nbytes
        count = min(64, max(2, math.ceil(((1 << 20) if smoke else PINNED_BYTES) / nbytes)))
        host = self.host_copies(count)
        slot = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        slot_table = table([slot])
        host_tables = [torch.tensor([host[r].data_ptr()], dtype=torch.int64, device=self.device) for r in range(count)]
        x = self.x1[0]
        copy = self.timer.graph(lambda r: slot.copy_(host[r], non_blocking=True), count)

        def copy_then_compute(r):
            slot.copy_(host[r], non_blocking=True)
            ffn.forward_bases(x, self.one_index, self.one_weight, slot_table, out=self.out1)
        ctc = self.timer.graph(copy_then_compute, count)
        zero = self.timer.graph(lambda r: ffn.forward_bases(x, self.one_index, self.one_weight, host_tables[r],
                                                            out=self.out1), count)
        out_zero = ffn.forward_bases(x, self.one_index, self.one_weight, host_tables[0]).clone()
        out_slot = ffn.forward_bases(x, self.one_index, self.one_weight, table([self.slots[0]]))
        del host
        return {"pinned_copy_s": copy, "pinned_copy_GBps": nbytes / copy / 1e9,
                "copy_then_compute_s": ctc, "zero_copy_s": zero, "zero_copy_GBps": nbytes / zero / 1e9,
                "zero_copy_over_copy_bandwidth": copy / zero, "zero_copy_equals_slot": bool(torch.equal(out_zero, out_slot))}


def zero_copy_reader(results: list[tuple[float, object]], fastest, zero_copy_s):
    """Under a budget misses are read over PCIe (zero-copy), and those reads take most of a decode
    step: among the candidates of `results` ((seconds from HBM, candidate)) at most
    ZERO_COPY_TOLERANCE slower than the fastest, the one `zero_copy_s(candidate)` times fastest
    replaces `fastest` if it reads at least ZERO_COPY_MIN_GAIN faster (less is replay noise)."""
    quickest = min(t for t, _ in results)
    close = [c for t, c in results if t <= quickest * (1 + ZERO_COPY_TOLERANCE)]
    if not math.isfinite(quickest) or len(close) < 2:
        return fastest
    timed = {candidate: zero_copy_s(candidate) for candidate in close}
    reader = min(timed, key=timed.get)
    return reader if timed[reader] < timed[fastest] * (1 - ZERO_COPY_MIN_GAIN) else fastest


def autotune(bench: ShapeBench, log, smoke: bool = False) -> KernelConfig:
    """Coordinate search: gate/up decode launch, then down, then the GEMM; then the decode/GEMM
    crossover. Every candidate is checked against the reference before it is timed."""
    H, I = bench.layout.hidden, bench.layout.intermediate
    best = default_config(H, I)

    def score_decode(config):
        ffn = bench.ffn(config)
        err = max(bench.check(ffn, "one"), bench.check(ffn, "top2"))
        if not err < 2e-2:
            return math.inf, err
        return bench.time_one(ffn) + bench.time_top2(ffn) / 2, err

    def search(field, candidates, score):
        nonlocal best
        results = []
        for candidate in candidates:
            config = dataclasses.replace(best, **{field: candidate})
            try:
                t, err = score(config)
            except Exception as error:  # a configuration the compiler or the GPU refuses
                t, err = math.inf, repr(error)[:120]
            results.append((t, candidate))
            log(f"  {bench.name} {field} {candidate}: {t * 1e6:.1f} us (err {err})")
        t, winner = min(results, key=lambda r: r[0])
        if math.isfinite(t):
            best = dataclasses.replace(best, **{field: winner})
        return results

    pick = (lambda c: [c[0], c[-1]]) if smoke else (lambda c: c)  # noqa: E731
    up_results = search("gate_up_gemv", pick(GEMV_UP), score_decode)
    search("down_gemv", pick(GEMV_DOWN), score_decode)
    if bench.device.type == "cuda":
        def layer_zero_copy(candidate):
            t = bench.time_layer_zero_copy(bench.ffn(dataclasses.replace(best, gate_up_gemv=candidate)))
            log(f"  {bench.name} gate_up_gemv zero-copy, {EXPERTS} experts routed {candidate}: {t * 1e6:.1f} us")
            return t
        best = dataclasses.replace(best, gate_up_gemv=zero_copy_reader(up_results, best.gate_up_gemv, layer_zero_copy))

    def score_gemm(config):
        ffn = bench.ffn(dataclasses.replace(config, decode_max_pairs=0))
        err = bench.check(ffn, "prefill")
        return (bench.time_prefill(ffn) if err < 2e-2 else math.inf), err

    search("gemm", pick(GEMM), score_gemm)
    decode_ffn = bench.ffn(dataclasses.replace(best, decode_max_pairs=32))
    gemm_ffn = bench.ffn(dataclasses.replace(best, decode_max_pairs=0))
    crossover = 0
    for tokens in (1, 2) if smoke else (1, 2, 4, 8, 16):
        t_dec, t_gemm = bench.time_prefill(decode_ffn, tokens), bench.time_prefill(gemm_ffn, tokens)
        log(f"  {bench.name} {tokens} tokens: decode {t_dec * 1e6:.1f} us, gemm {t_gemm * 1e6:.1f} us")
        if t_dec <= t_gemm:
            crossover = tokens * TOP_K
        else:
            break
    return dataclasses.replace(best, decode_max_pairs=crossover)


@triton.jit
def _read_words(words_ptr, n_words, sink_ptr, BLOCK: tl.constexpr):
    """The fastest plain read we know: each program strides over the buffer's int32 words a
    block at a time and sums them (one store per program, so the loads are not dead)."""
    _sum_words(words_ptr, n_words, sink_ptr, BLOCK)


@triton.jit
def _read_words_at(table_ptr, n_words, sink_ptr, BLOCK: tl.constexpr):
    """`_read_words` of the buffer at the address table_ptr[0], as the kernels reach a blob (one
    in pinned host memory is read zero-copy, over PCIe)."""
    _sum_words(tl.multiple_of(tl.load(table_ptr).to(tl.pointer_type(tl.int32)), 16), n_words, sink_ptr, BLOCK)


@triton.jit
def _sum_words(words_ptr, n_words, sink_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, n_words, tl.num_programs(0) * BLOCK):
        offs = tl.max_contiguous(tl.multiple_of(start + tl.arange(0, BLOCK), BLOCK), BLOCK)
        acc += tl.load(words_ptr + offs, mask=offs < n_words, other=0, eviction_policy="evict_first")
    tl.store(sink_ptr + pid, tl.sum(acc))


def read_ceiling(bench: ShapeBench) -> dict:
    """How fast the GPU reads one expert's bytes from HBM with nothing else to do: the limit the
    decode launches are measured against (DESIGN.md 4 counts 4.29 TB/s, a copy's reads plus
    writes). In one launch, and split as the decode splits it (gate/up's 2I x H bytes, then the
    rest), since a launch boundary costs a ramp-down and a ramp-up."""
    programs = torch.cuda.get_device_properties(bench.device).multi_processor_count * 16
    words = bench.slots.view(torch.int32)  # [N, nbytes / 4]
    n_words, first = words.shape[1], 2 * bench.layout.intermediate * bench.layout.hidden // 4
    sink = torch.empty(programs, dtype=torch.int32, device=bench.device)

    def one(i):
        _read_words[(programs,)](words[i % bench.n_slots], n_words, sink, BLOCK=4096, num_warps=4)

    def two(i):
        row = words[i % bench.n_slots]
        _read_words[(programs,)](row, first, sink, BLOCK=4096, num_warps=4)
        _read_words[(programs,)](row[first:], n_words - first, sink, BLOCK=4096, num_warps=4)
    calls = min(bench.n_slots, 64)
    t_one, t_two = bench.timer.graph(one, calls), bench.timer.graph(two, calls)
    nbytes = bench.layout.nbytes
    return {"read_one_expert_s": t_one, "read_one_expert_TBps": nbytes / t_one / 1e12,
            "read_one_expert_two_launches_s": t_two, "read_one_expert_two_launches_TBps": nbytes / t_two / 1e12}


GROUPING_SIZES = [(1024, 8, 128), (4096, 64, 128), (4096, 128, 64), (32768, 128, 64)]  # pairs, experts, block_m


def grouping(device: torch.device, timer: Timer) -> list[dict]:
    """Prefill's grouping of routed pairs by expert, one program against the torch sort, at a few
    sizes (random top-8 routing: all 8 of 8 experts): the figures behind
    `triton_ffn.ONE_PROGRAM_GROUPING`. The two must give the same blocks."""
    rows = []
    for pairs, experts, block_m in GROUPING_SIZES:
        k = min(8, experts)
        index = torch.stack([torch.randperm(experts, device=device)[:k] for _ in range(pairs // k)]).view(-1)
        n_blocks = pairs // block_m + min(experts, pairs)
        ours = triton_ffn._group_in_one_program(index, experts, block_m, n_blocks)
        t_one = timer.graph(lambda i: triton_ffn._group_in_one_program(index, experts, block_m, n_blocks), 4)
        theirs = triton_ffn._group_by_sorting(index, experts, block_m, n_blocks)
        t_sort = timer.graph(lambda i: triton_ffn._group_by_sorting(index, experts, block_m, n_blocks), 4)
        rows.append({"pairs": pairs, "experts": experts, "block_m": block_m, "one_program_s": t_one, "torch_sort_s": t_sort,
                     "same_blocks": bool(torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1]))})
    return rows


def ceilings(device: torch.device, timer: Timer) -> dict:
    if device.type != "cuda":
        return {}
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    hbm = timer.graph(lambda i: b.copy_(a), 4)
    host = torch.empty(PINNED_BYTES, dtype=torch.uint8, pin_memory=True)
    h2d = timer.graph(lambda i: a[:PINNED_BYTES].copy_(host, non_blocking=True), 4)
    del a, b, host
    return {"hbm_copy_TBps_read_plus_write": 2 * (1 << 30) / hbm / 1e12, "pinned_h2d_GBps": PINNED_BYTES / h2d / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--autotune", action="store_true", help="tune launch configurations first and store them")
    parser.add_argument("--tuning-dir", type=Path, default=TUNING_DIR)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kernels-h200.json")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--spread-gb", type=float, default=40.0,
                        help="pool the top-2 'spread' figure places its experts across (default 40 GB)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and few repeats (CPU or GPU)")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    shapes = SMOKE_SHAPES if args.smoke else {name: SHAPES[name] for name in args.shapes.split(",")}
    timer = Timer(device, 2 if args.smoke else args.replays)
    log = lambda line: print(line, flush=True)  # noqa: E731

    result = {
        "command": "python " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
        "commit": commit(),
        "gpu": gpu,
        "date": utc_now(),
        **context(),
        "software": {"torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0]},
        "setup": {"scheme": "int8-shared", "activations": "bf16" if device.type == "cuda" else "fp32",
                  "experts_per_layer": EXPERTS, "top_k": TOP_K, "prefill_tokens": PREFILL_TOKENS,
                  "routing": "random (not a trained router)", "timing": "CUDA graphs over rotating inputs, median of replays"},
        "ceilings": ceilings(device, timer),
        "grouping": grouping(device, timer) if device.type == "cuda" else [],
        "shapes": {},
    }
    log(f"{gpu}; ceilings {result['ceilings']}")
    for row in result["grouping"]:
        log(f"  grouping {row['pairs']} pairs of {row['experts']} experts: one program {row['one_program_s'] * 1e6:.1f} us, "
            f"torch sort {row['torch_sort_s'] * 1e6:.1f} us, same blocks {row['same_blocks']}")
    tuned = {}
    for name, (hidden, intermediate) in shapes.items():
        bench = ShapeBench(name, hidden, intermediate, device, timer, args.smoke)
        if args.autotune:
            t0 = time.perf_counter()
            config = autotune(bench, log, args.smoke)
            tuned[hidden, intermediate] = config
            log(f"{name}: tuned in {time.perf_counter() - t0:.0f} s: {config}")
        else:
            config = load_config(gpu, hidden, intermediate, args.tuning_dir) if device.type == "cuda" else default_config(hidden, intermediate)
        ffn = bench.ffn(config)
        errors = {what: bench.check(ffn, what) for what in ("one", "top2", "prefill")}
        one, top2, prefill = bench.time_one(ffn), bench.time_top2(ffn), bench.time_prefill(ffn)
        figures = {
            "blob_bytes": bench.layout.nbytes,
            "config": config.to_json(),
            "relative_error_vs_fp32_reference": errors,
            "mira_one_expert_s": one,
            "mira_one_expert_GBps": bench.layout.nbytes / one / 1e9,
            "mira_one_expert_fraction_of_4.29TBps": bench.layout.nbytes / one / HBM_DESIGN_BPS,
            "mira_top2_s": top2,
            "mira_top2_eager_call_s": bench.time_eager_call(ffn),
            "mira_top2_spread_s": bench.time_top2_spread(ffn, int((0.02 if args.smoke else args.spread_gb) * 1e9)),
            "spread_pool_gb": 0.02 if args.smoke else args.spread_gb,
            "mira_prefill_s": prefill,
            "torch_dequant_then_matmul_one_expert_s": bench.torch_dequant(),
            **{f"torch_bf16_{k}": v for k, v in bench.torch_bf16().items()},
            **bench.misses(ffn, args.smoke),
            **(read_ceiling(bench) if device.type == "cuda" else {}),
        }
        figures["prefill_mira_over_torch_bf16"] = prefill / figures["torch_bf16_prefill_s"]
        result["shapes"][name] = {"hidden": hidden, "intermediate": intermediate, **figures}
        log(f"{name}: {json.dumps({k: v for k, v in figures.items() if k != 'config'})}")
        del bench, ffn
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if not args.smoke:  # after every shape, so that an interrupted run keeps what it measured
            if tuned:
                path = save_configs(gpu, tuned, {"written_by": result["command"], "date": result["date"],
                                                 "commit": result["commit"]}, args.tuning_dir)
                log(f"tuned configurations written to {path}")
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)


def print_table(result: dict) -> None:
    us = lambda s: f"{s * 1e6:9.1f}"  # noqa: E731
    print(f"\n{result['gpu']}  {result['date']}  ceilings: {result['ceilings']}")
    header = ("shape", "blob MB", "1 exp us", "GB/s", "%4.29T", "read us", "bf16 us", "deq us", "top2 us", "spread us", "bf16 top2",
              "eager us", "prefill us", "bf16 pre", "ratio", "copy GB/s", "cp+comp us", "zc us", "zc GB/s", "zc/cp")
    print(" ".join(f"{h:>10}" for h in header))
    for name, f in result["shapes"].items():
        row = (name[:10], f"{f['blob_bytes'] / 1e6:10.1f}", us(f["mira_one_expert_s"]), f"{f['mira_one_expert_GBps']:10.0f}",
               f"{100 * f['mira_one_expert_fraction_of_4.29TBps']:9.0f}%",
               us(f["read_one_expert_s"]) if "read_one_expert_s" in f else f"{'-':>9}", us(f["torch_bf16_one_expert_s"]),
               us(f["torch_dequant_then_matmul_one_expert_s"]), us(f["mira_top2_s"]),
               us(f["mira_top2_spread_s"]) if f.get("mira_top2_spread_s") is not None else f"{'-':>9}", us(f["torch_bf16_top2_s"]),
               us(f["mira_top2_eager_call_s"]), us(f["mira_prefill_s"]), us(f["torch_bf16_prefill_s"]),
               f"{f['prefill_mira_over_torch_bf16']:10.2f}", f"{f['pinned_copy_GBps']:10.1f}",
               us(f["copy_then_compute_s"]), us(f["zero_copy_s"]), f"{f['zero_copy_GBps']:10.1f}",
               f"{f['zero_copy_over_copy_bandwidth']:10.2f}")
        print(" ".join(f"{c:>10}" for c in row))


if __name__ == "__main__":
    main()
