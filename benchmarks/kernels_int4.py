"""Time the fused INT4 expert kernels (mira.kernels.triton_int4) on one GPU, next to the INT8 ones.

Per expert shape (default Mixtral-8x7B, 4096 x 14336; random codes, group scales and zeros; bf16
activations):

- one expert at batch 1 from HBM: the INT4 decode launches; the INT8 (int8-shared) ones on the same
  shape in the same run; on a GPU each launch's device time too (torch's profiler, eager calls); a plain read of the INT4 blob's bytes in one launch (the read ceiling);
  GB/s of blob bytes and the share of the design's 4.29 TB/s (DESIGN.md 3);
- a decode's layer from HBM: one token routed to the model's top-k experts (MODEL_TOP_K);
- zero-copy: the same expert read by the kernel straight from pinned host memory, against a copy
  of the same bytes from pinned memory into a device slot: the kernel's share of the copy bandwidth,
  beside the share of a plain read of those bytes in one launch (what a kernel's reads could reach),
  and of reads in the decode launches' pattern (a program per tile of codes, 4 lanes a group, with
  and without the groups' scales and zeros), which tells the codes' reads from the scales' apart;
- on a GPU, the gate/up launch's reads alone from HBM, in its grid (a program per unit tile: its
  gate tile, then its up tile; with and without the scales): what its access pattern allows; and
  the same reads split over H (SPLIT_READS);
- prefill: 512 tokens routed top-2 over a layer's 8 experts (random routing), INT4 and INT8.

Every figure is measured --repeats times, each the median of --replays replays of a CUDA graph of
calls on rotating inputs (the bytes read per replay exceed the L2 cache); the JSON keeps every
repeat with their median and range. --autotune first tries a few launch configurations (decode
gate/up, then down, each also with the "fold" and "half2" conversions, then the prefill GEMM; each
checked against the reference) and writes the
fastest into mira/kernels/tuning/<device>-int4.json (or --tuning-dir). A decode launch is chosen
by one expert's time plus the top-k layer's over K, from HBM (kernels_int8.py's score; a decode
launches a layer's K experts together), except that among those within
ZERO_COPY_TOLERANCE of the fastest the one reading a pinned expert fastest wins if it reads it
ZERO_COPY_MIN_GAIN faster (kernels_int8.py's rule: under a budget the misses, read zero-copy, take
most of a decode step).

    python benchmarks/kernels_int4.py [--autotune] [--shapes mixtral-8x7b,...] [--out FILE]
    python benchmarks/kernels_int4.py --smoke   # a tiny shape, few repeats: checks the script runs (CPU too)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_int8 import (  # noqa: E402
    HBM_DESIGN_BPS, PINNED_BYTES, ROTATE_BYTES, Timer, _read_words, _read_words_at, random_slots, zero_copy_reader,
)

import triton  # noqa: E402  (after kernels, which sets TRITON_INTERPRET without a GPU)
import triton.language as tl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mira.bench.provenance import commit, context, machine, utc_now  # noqa: E402
from mira.kernels.reference import moe_ffn_reference  # noqa: E402
from mira.kernels.triton_ffn import TritonMoEFFN  # noqa: E402
from mira.kernels.triton_int4 import (  # noqa: E402
    TritonInt4MoEFFN, default_int4_config, load_int4_config, tuning_name,
)
from mira.kernels.tuning import (  # noqa: E402
    TUNING_DIR, GemmConfig, GemvConfig, default_config, load_config, save_configs,
)
from mira.store.int4 import TILE  # noqa: E402
from mira.store.layout import ExpertLayout  # noqa: E402

SHAPES = {"mixtral-8x7b": (4096, 14336), "deepseek-v2-lite": (2048, 1408), "qwen3-30b-a3b": (2048, 768),
          "olmoe-1b-7b": (2048, 1024)}
SMOKE_SHAPES = {"smoke": (64, 64)}
EXPERTS, TOP_K, PREFILL_TOKENS = 8, 2, 512
# the models' own top-k: a decode call routes one token to this many experts at every MoE layer
MODEL_TOP_K = {"mixtral-8x7b": 2, "deepseek-v2-lite": 6, "qwen3-30b-a3b": 8, "olmoe-1b-7b": 8}
GOALS = {"mixtral-8x7b": {"one_expert_s": 30e-6}}  # the goal for one Mixtral-shaped INT4 expert
ZERO_COPY_GOAL = 0.90  # of the pinned copy's bandwidth

GATE_UP = [  # gate/up decode launch candidates (INT4 meanings: mira.kernels.triton_int4)
    GemvConfig(64, 1024, unroll=8, num_warps=4), GemvConfig(64, 1024, unroll=4, num_warps=4),
    GemvConfig(64, 1024, unroll=16, num_warps=4), GemvConfig(64, 512, unroll=8, num_warps=2),
    GemvConfig(64, 256, unroll=8, num_warps=1), GemvConfig(64, 2048, unroll=8, num_warps=8),
    GemvConfig(128, 1024, unroll=4, num_warps=4),
    # longer-lived programs walking runs of tiles (fewer, each with more of a pinned expert to read)
    GemvConfig(64, 512, unroll=8, num_warps=2, programs_per_sm=8),
    GemvConfig(64, 256, unroll=16, num_warps=1, programs_per_sm=16),
]
DOWN = [  # down decode launch candidates: Mixtral's H has only 64 tiles, so most split I
    GemvConfig(64, 1024, unroll=8, num_warps=4, split=7), GemvConfig(64, 1024, unroll=8, num_warps=4, split=14),
    GemvConfig(64, 1024, unroll=4, num_warps=4, split=7), GemvConfig(64, 1024, unroll=16, num_warps=4, split=7),
    GemvConfig(64, 512, unroll=8, num_warps=2, split=7), GemvConfig(64, 512, unroll=8, num_warps=2, split=14),
    GemvConfig(64, 512, unroll=8, num_warps=2, split=28), GemvConfig(64, 256, unroll=8, num_warps=1, split=28),
    GemvConfig(64, 2048, unroll=8, num_warps=8, split=7), GemvConfig(128, 1024, unroll=4, num_warps=4, split=7),
    GemvConfig(64, 1024, unroll=8, num_warps=4, split=4), GemvConfig(64, 1024, unroll=8, num_warps=4),
]
# gate/up reads alone, split over H (split, lanes, warps): the shapes of the split gate/up launches
# (5afef31's history), so that what their reads alone take stands beside what the launches took
SPLIT_READS = [(2, 64, 8), (4, 64, 4), (8, 32, 4), (8, 16, 1)]
CVT_VARIANTS = ("fold", "half2")  # conversions other than "bits", tried on each decode launch's first candidates
GATE_UP += [dataclasses.replace(c, cvt=cvt) for cvt in CVT_VARIANTS for c in GATE_UP[:4]]
DOWN += [dataclasses.replace(c, cvt=cvt) for cvt in CVT_VARIANTS for c in DOWN[:8]]
# twice the warps of a step's lanes (threads share a lane's rows): about half the registers a thread,
# so that grids of one tile a program keep more warps on each SM (half2, the conversion tuned)
GATE_UP += [GemvConfig(64, 1024, unroll=unroll, num_warps=8, cvt="half2") for unroll in (8, 16)]
DOWN += [GemvConfig(64, 256, unroll=8, num_warps=2, split=28, cvt="half2"),
         GemvConfig(64, 512, unroll=8, num_warps=4, split=14, cvt="half2"),
         GemvConfig(64, 512, unroll=8, num_warps=4, split=28, cvt="half2")]
# short rows (H or I of 2048 and less: Qwen3-30B-A3B, OLMoE, DeepSeek-V2-Lite): few tiles a matrix, so
# each program takes a whole row of H in one step with every load in flight, or I split more finely
GATE_UP += [GemvConfig(64, cols, unroll=unroll, num_warps=warps, cvt="half2")
            for cols, unroll, warps in ((2048, 16, 8), (2048, 8, 8), (2048, 16, 16), (1024, 16, 4), (512, 16, 4))]
DOWN += [GemvConfig(64, cols, unroll=unroll, num_warps=warps, split=split, cvt="half2")
         for cols, unroll, warps, split in ((256, 16, 1, 8), (256, 16, 2, 8), (256, 8, 1, 8), (512, 16, 4, 4),
                                            (1024, 16, 8, 1), (1024, 16, 4, 2))]
GEMM = [  # prefill launch candidates (block_n whole tiles; a K step stays inside one group: block_k is cut to it)
    GemmConfig(64, 128, 64, num_warps=8, num_stages=3), GemmConfig(128, 128, 64, num_warps=8, num_stages=3),
    GemmConfig(64, 64, 64, num_warps=4, num_stages=3), GemmConfig(128, 64, 64, num_warps=4, num_stages=3),
    GemmConfig(64, 128, 64, num_warps=4, num_stages=4), GemmConfig(32, 128, 64, num_warps=4, num_stages=4),
    GemmConfig(64, 256, 64, num_warps=8, num_stages=3), GemmConfig(64, 128, 32, num_warps=4, num_stages=4),
]


def random_int4_slots(layout: ExpertLayout, count: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """[count, nbytes] INT4 blobs: random codes; group scales that keep activations O(1) and zeros
    within a scale of 0."""
    slots = torch.randint(0, 256, (count, layout.nbytes), generator=gen, device=device, dtype=torch.uint8)
    for name, fan_in in (("sz13", layout.hidden), ("sz2", layout.intermediate)):
        section = layout.sections[name]  # bf16 [N, R, 2]: (s, z) per group and row
        s = (torch.rand(count, *section.shape[:2], generator=gen, device=device) + 0.5) / (4.6 * fan_in**0.5)
        z = s * (2 * torch.rand(count, *section.shape[:2], generator=gen, device=device) - 1)
        values = torch.stack((s, z), dim=-1).to(torch.bfloat16)
        slots[:, section.offset:section.offset + section.nbytes].copy_(values.view(torch.uint8).view(count, -1))
    return slots


@triton.jit
def _read_tile(words, sz, R, C, LANES: tl.constexpr, SCALES: tl.constexpr):
    """The sum of one tile's codes (int32 words at `words` [1, 8] of its first column) and, with
    SCALES, of its rows' (s, z) words (at `sz` [1, 64]), read as the decode launches read them: LANES
    lanes a step (4 per group, each a column a sub-step: 128 contiguous bytes per 4 lanes)."""
    lane = tl.arange(0, LANES)
    codes = tl.zeros([LANES, 8], dtype=tl.int32)
    values = tl.zeros([LANES, 64], dtype=tl.int32)
    for g0 in range(0, C // 64, LANES // 4):
        group = g0 + lane // 4
        in_cols = group < C // 64
        for k in tl.static_range(16):  # the loads issued together, as an unrolled decode step's
            col = group * 64 + lane % 4 + 4 * k
            codes += tl.load(words + col[:, None] * 8, mask=in_cols[:, None], other=0)
        if SCALES:
            values += tl.load(sz + group[:, None] * R, mask=in_cols[:, None], other=0)
    return tl.sum(codes) + tl.sum(values)


@triton.jit
def _read_tiles_at(table_ptr, W_OFF, SZ_OFF, R, C, sink_ptr, LANES: tl.constexpr, SCALES: tl.constexpr):
    """Reads one tiled matrix ([R, C / 2] bytes) of the blob at table_ptr[0] as the decode launches
    do, without their arithmetic: a program per tile (`_read_tile`)."""
    base = tl.load(table_ptr)
    tile = tl.program_id(0)
    words = (base + W_OFF).to(tl.pointer_type(tl.int32)) + tile * (8 * C) + tl.arange(0, 8)[None, :]
    sz = (base + SZ_OFF).to(tl.pointer_type(tl.int32)) + tile * 64 + tl.arange(0, 64)[None, :]
    tl.store(sink_ptr + tile, _read_tile(words, sz, R, C, LANES, SCALES).to(tl.float32))


@triton.jit
def _read_unit_tiles_at(table_ptr, W_OFF, SZ_OFF, I, H, sink_ptr, LANES: tl.constexpr, SCALES: tl.constexpr,
                        SPLIT: tl.constexpr):
    """Reads w13 ([2I, H / 2] bytes) of the blob at table_ptr[0] as the gate/up decode launch does
    with one unit tile a program: its gate tile, then its up tile I / TILE tiles further; with
    SPLIT > 1, program (unit, s) reads columns [s H / SPLIT, (s + 1) H / SPLIT) of both."""
    base = tl.load(table_ptr)
    unit = tl.program_id(0)
    split = tl.program_id(1)
    total = 0
    for half in tl.static_range(2):
        tile = unit + half * (I // 64)
        words = (base + W_OFF).to(tl.pointer_type(tl.int32)) + tile * (8 * H) + tl.arange(0, 8)[None, :] \
            + split * (H // SPLIT * 8)
        sz = (base + SZ_OFF).to(tl.pointer_type(tl.int32)) + tile * 64 + tl.arange(0, 64)[None, :] \
            + split * (H // SPLIT // 64 * 2 * I)
        total += _read_tile(words, sz, 2 * I, H // SPLIT, LANES, SCALES)
    tl.store(sink_ptr + unit * SPLIT + split, total.to(tl.float32))


def addresses(rows, device) -> torch.Tensor:
    return torch.tensor([row.data_ptr() for row in rows], dtype=torch.int64, device=device)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "repeats": values}


class Workload:
    """One scheme's blobs of one shape and the calls timed on them."""

    def __init__(self, layout: ExpertLayout, slots: torch.Tensor, inputs: dict, timer: Timer):
        self.layout, self.slots, self.timer = layout, slots, timer
        self._pinned: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # made by `pinned`
        self.inputs = inputs
        device = slots.device
        n, calls = slots.shape[0], inputs["calls"]
        self.one_tables = [addresses([slots[i % n]], device) for i in range(calls)]
        self.layer_tables = [addresses([slots[(EXPERTS * i + e) % n] for e in range(EXPERTS)], device)
                             for i in range(calls)]

    def one_expert(self, ffn) -> float:
        x, index, weight, out = (self.inputs[k] for k in ("x1", "one_index", "one_weight", "out1"))
        return self.timer.graph(lambda i: ffn.forward_bases(x[i], index, weight, self.one_tables[i], out=out),
                                self.inputs["calls"])

    def launch_times(self, ffn, calls: int = 32) -> dict[str, float]:
        """Seconds per launch of one expert's decode at batch 1, by kernel (CUDA only): the device time
        the profiler records for each kernel over `calls` eager calls on rotating blobs, after one to
        compile. Where the expert's time goes, launch by launch."""
        x, index, weight, out = (self.inputs[k] for k in ("x1", "one_index", "one_weight", "out1"))
        ffn.forward_bases(x[0], index, weight, self.one_tables[0], out=out)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            for i in range(calls):
                ffn.forward_bases(x[i % len(x)], index, weight, self.one_tables[i % len(self.one_tables)], out=out)
            torch.cuda.synchronize()
        return {event.key: event.device_time / 1e6 for event in profile.key_averages() if "gemv" in event.key}

    def decode_score(self, ffn) -> tuple[float, dict[str, float]]:
        """A decode launch's score, the INT8 autotune's: one expert's seconds plus the top-k layer's
        over K, each from HBM (and both times). The layer is what a decode runs; one expert, whose
        few programs favour more warps each, keeps a near tie at the layer from costing it."""
        one, layer = self.one_expert(ffn), self.top_k_layer(ffn)
        return one + layer / self.inputs["k_index"].shape[1], {"one_expert_s": one, "top_k_layer_s": layer}

    def prefill_score(self, ffn) -> tuple[float, dict[str, float]]:
        """A prefill launch's score: the layer's prefill seconds (no other figures)."""
        return self.prefill(ffn), {}

    def top_k_layer(self, ffn) -> float:
        """One token routed to the shape's top-k experts, distinct blobs from HBM: the call a decode
        makes at every MoE layer."""
        x, index, weight, out = (self.inputs[k] for k in ("x1", "k_index", "k_weight", "out1"))
        return self.timer.graph(lambda i: ffn.forward_bases(x[i], index, weight, self.layer_tables[i], out=out),
                                self.inputs["calls"])

    def check_decode(self, ffn) -> float:
        """The larger relative error of one expert and of the top-k layer against the reference."""
        top_k = self._check_layer(ffn, self.inputs["x1"][0], self.inputs["k_index"], self.inputs["k_weight"])
        return max(self.check_one(ffn), top_k)

    def check_one(self, ffn) -> float:
        x, index, weight = self.inputs["x1"][0], self.inputs["one_index"], self.inputs["one_weight"]
        ref = moe_ffn_reference(x.float(), index, weight.float(), [self.slots[0]], self.layout, F.silu)
        return relative_error(ffn.forward_bases(x, index, weight, self.one_tables[0]), ref)

    def prefill(self, ffn) -> float:
        x, index, weight, out = self.inputs["xp"], self.inputs["p_index"], self.inputs["p_weight"], self.inputs["outp"]
        calls = max(1, min(self.inputs["calls"], self.slots.shape[0] // EXPERTS))
        return self.timer.graph(lambda i: ffn.forward_bases(x, index, weight, self.layer_tables[i], out=out), calls)

    def check_prefill(self, ffn) -> float:
        return self._check_layer(ffn, self.inputs["xp"], self.inputs["p_index"], self.inputs["p_weight"])

    def _check_layer(self, ffn, x, index, weight) -> float:
        """Relative error of a call on the first layer table's experts against the float32 reference."""
        layer = [self.slots[e % self.slots.shape[0]] for e in range(EXPERTS)]
        ref = moe_ffn_reference(x.float(), index, weight.float(), layer, self.layout, F.silu)
        return relative_error(ffn.forward_bases(x, index, weight, self.layer_tables[0]), ref)

    def read_ceiling(self) -> float:
        """A plain read of one blob's bytes in one launch (the fastest read we know, from kernels_int8.py)."""
        programs, sink = self._read_grid()
        words = self.slots.view(torch.int32)
        n = self.slots.shape[0]
        return self.timer.graph(lambda i: _read_words[(programs,)](words[i % n], words.shape[1], sink, BLOCK=4096,
                                                                   num_warps=4), self.inputs["calls"])

    def zero_copy_read(self, smoke: bool) -> float:
        """The same plain read of one pinned blob's bytes, zero-copy: a read ceiling over PCIe."""
        programs, sink = self._read_grid()
        _, host_tables = self.pinned(smoke)
        n_words = self.layout.nbytes // 4
        return self.timer.graph(lambda r: _read_words_at[(programs,)](host_tables[r], n_words, sink, BLOCK=4096,
                                                                      num_warps=4), len(host_tables))

    def zero_copy_tile_read(self, smoke: bool, scales: bool, lanes: int = 64) -> float:
        """`_read_tiles_at` over a pinned blob, zero-copy: w13 then w2, in two launches as the decode's."""
        _, host_tables = self.pinned(smoke)
        sections, H, I = self.layout.sections, self.layout.hidden, self.layout.intermediate
        parts = [(sections["w13"].offset, sections["sz13"].offset, 2 * I, H),
                 (sections["w2"].offset, sections["sz2"].offset, H, I)]
        sink = torch.empty(max(2 * I, H) // TILE, dtype=torch.float32, device=self.slots.device)

        def read(r):
            for w, sz, rows, cols in parts:
                _read_tiles_at[(rows // TILE,)](host_tables[r], w, sz, rows, cols, sink, LANES=lanes, SCALES=scales,
                                                num_warps=lanes // 16)
        return self.timer.graph(read, len(host_tables))

    def gate_up_tile_read(self, scales: bool, lanes: int = 64, warps: int = 8, split: int = 1) -> float:
        """`_read_unit_tiles_at` over the blobs in device slots: the gate/up launch's reads alone, from
        HBM, in its grid (one unit tile a program, or `split` programs over H; the stored tuning's
        lanes and warps by default)."""
        I, H = self.layout.intermediate, self.layout.hidden
        sink = torch.empty(I // TILE * split, dtype=torch.float32, device=self.slots.device)
        w, sz = self.layout.sections["w13"].offset, self.layout.sections["sz13"].offset
        return self.timer.graph(lambda i: _read_unit_tiles_at[(I // TILE, split)](
            self.one_tables[i], w, sz, I, H, sink, LANES=lanes, SCALES=scales, SPLIT=split, num_warps=warps),
            self.inputs["calls"])

    def _read_grid(self) -> tuple[int, torch.Tensor]:
        """The plain reads' program count and their sink [programs]."""
        device = self.slots.device
        programs = torch.cuda.get_device_properties(device).multi_processor_count * 16
        return programs, torch.empty(programs, dtype=torch.int32, device=device)

    def pinned(self, smoke: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Copies of the first blobs in pinned host memory (made on the first call) and their tables."""
        if self._pinned is None:
            nbytes, device = self.layout.nbytes, self.slots.device
            count = min(16, max(4, math.ceil(((1 << 20) if smoke else PINNED_BYTES) / nbytes)))
            host = torch.empty(count, nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
            for r in range(count):
                host[r].copy_(self.slots[r % self.slots.shape[0]])
            self._pinned = host, [addresses([host[r]], device) for r in range(count)]
        return self._pinned

    def zero_copy_time(self, ffn, smoke: bool) -> float:
        """The kernel computing one expert read straight from its pinned blob."""
        _, host_tables = self.pinned(smoke)
        x, index, weight, out = (self.inputs[k] for k in ("x1", "one_index", "one_weight", "out1"))
        return self.timer.graph(lambda r: ffn.forward_bases(x[0], index, weight, host_tables[r], out=out),
                                len(host_tables))

    def zero_copy(self, ffn, smoke: bool) -> tuple[float, float, bool]:
        """(pinned copy of one blob into a slot, the kernel reading the pinned blob, same result as from a slot)."""
        host, host_tables = self.pinned(smoke)
        slot = torch.empty(self.layout.nbytes, dtype=torch.uint8, device=self.slots.device)
        copy = self.timer.graph(lambda r: slot.copy_(host[r], non_blocking=True), len(host_tables))
        zero = self.zero_copy_time(ffn, smoke)
        x, index, weight = self.inputs["x1"][0], self.inputs["one_index"], self.inputs["one_weight"]
        same = torch.equal(ffn.forward_bases(x, index, weight, host_tables[0]),
                           ffn.forward_bases(x, index, weight, self.one_tables[0]))
        return copy, zero, same


def make_inputs(hidden: int, device: torch.device, dtype: torch.dtype, calls: int, gen: torch.Generator,
                smoke: bool, decode_top_k: int = TOP_K) -> dict:
    tokens = 16 if smoke else PREFILL_TOKENS
    logits = torch.randn(tokens, EXPERTS, generator=gen, device=device)
    top = logits.topk(TOP_K, dim=-1)
    return {"calls": calls,
            "x1": [torch.randn(1, hidden, generator=gen, device=device).to(dtype) for _ in range(calls)],
            "one_index": torch.zeros(1, 1, dtype=torch.long, device=device),
            "one_weight": torch.ones(1, 1, dtype=dtype, device=device),
            "out1": torch.empty(1, hidden, dtype=dtype, device=device),
            "xp": torch.randn(tokens, hidden, generator=gen, device=device).to(dtype),
            "p_index": top.indices, "p_weight": torch.softmax(top.values, -1).to(dtype),
            "outp": torch.empty(tokens, hidden, dtype=dtype, device=device),
            "k_index": torch.arange(decode_top_k, device=device).view(1, decode_top_k),
            "k_weight": torch.softmax(torch.randn(1, decode_top_k, generator=gen, device=device), -1).to(dtype)}


def autotune(work: Workload, ffn_for, log, smoke: bool):
    """Coordinate search over the decode launches by `decode_score` from HBM (near ties going to the
    faster zero-copy reader of one expert, `zero_copy_reader`), then over the prefill launches by a
    layer's prefill time; returns the config and every candidate's figures."""
    H, I = work.layout.hidden, work.layout.intermediate
    best = default_int4_config(H, I)
    tried = []
    for field, candidates, check, timed in (("gate_up_gemv", GATE_UP, work.check_decode, work.decode_score),
                                            ("down_gemv", DOWN, work.check_decode, work.decode_score),
                                            ("gemm", GEMM, work.check_prefill, work.prefill_score)):
        results = []
        for candidate in (candidates[:2] if smoke else candidates):
            config = dataclasses.replace(best, **{field: candidate})
            try:
                ffn = ffn_for(config)
                error = check(ffn)
                seconds, figures = timed(ffn) if error < 2e-2 else (math.inf, {})
            except Exception as failure:  # a configuration the compiler or the GPU refuses
                error, seconds, figures = repr(failure)[:160], math.inf, {}
            results.append((seconds, candidate))
            tried.append({"field": field, "config": dataclasses.asdict(candidate), "seconds": seconds, **figures,
                          "relative_error": error})
            log(f"  {field} {candidate}: {seconds * 1e6:.1f} us (error {error})")
        seconds, winner = min(results, key=lambda r: r[0])
        if math.isfinite(seconds):
            if field != "gemm" and work.slots.device.type == "cuda":  # misses are read zero-copy
                winner = _zero_copy_winner(work, ffn_for, best, field, winner, results, tried[-len(results):], log,
                                           smoke)
            best = dataclasses.replace(best, **{field: winner})
    return best, tried


def _zero_copy_winner(work: Workload, ffn_for, best, field: str, fastest, results: list, entries: list[dict], log,
                      smoke: bool):
    """`zero_copy_reader` over one decode launch's candidates (`fastest` from HBM), each timed
    reading a pinned expert (kept in its `tried` entry)."""
    def zero_copy_s(candidate):
        seconds = work.zero_copy_time(ffn_for(dataclasses.replace(best, **{field: candidate})), smoke)
        entries[[c for _, c in results].index(candidate)]["zero_copy_seconds"] = seconds
        log(f"  {field} zero-copy {candidate}: {seconds * 1e6:.1f} us")
        return seconds
    return zero_copy_reader(results, fastest, zero_copy_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="mixtral-8x7b", help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--autotune", action="store_true",
                        help="try decode and prefill launch configurations first and store the best")
    parser.add_argument("--tuning-dir", type=Path, default=TUNING_DIR)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kernels-int4-h200.json")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape and few repeats (CPU or GPU)")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = SMOKE_SHAPES if args.smoke else {name: SHAPES[name] for name in args.shapes.split(",")}
    repeats = 3 if args.smoke else args.repeats
    timer = Timer(device, 2 if args.smoke else args.replays)
    log = lambda line: print(line, flush=True)  # noqa: E731
    started = time.perf_counter()
    result = {
        "command": "python " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
        "commit": commit(), "machine": machine(device), "gpu": gpu, "date": utc_now(), **context(),
        "software": {"torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0]},
        "setup": {"activations": str(dtype).removeprefix("torch."), "experts_per_layer": EXPERTS, "top_k": TOP_K,
                  "prefill_tokens": PREFILL_TOKENS, "weights": "random codes, group scales and zeros (not a checkpoint)",
                  "timing": f"{repeats} repeats, each the median of {timer.replays} CUDA-graph replays over rotating "
                            "inputs; per-call seconds"},
        "shapes": {},
    }
    tuned = {}
    for name, (hidden, intermediate) in shapes.items():
        gen = torch.Generator(device=device).manual_seed(0)
        layout4, layout8 = ExpertLayout("int4", hidden, intermediate), ExpertLayout("int8-shared", hidden, intermediate)
        rotate = (4 << 20) if args.smoke else ROTATE_BYTES
        slots4 = random_int4_slots(layout4, max(EXPERTS, math.ceil(rotate / layout4.nbytes)), device, gen)
        slots8 = random_slots(layout8, max(EXPERTS, math.ceil(rotate / layout8.nbytes)), device, gen)
        calls = 2 if args.smoke else min(64, slots4.shape[0])
        decode_top_k = MODEL_TOP_K.get(name, TOP_K)
        inputs = make_inputs(hidden, device, dtype, calls, gen, args.smoke, decode_top_k)
        work4, work8 = Workload(layout4, slots4, inputs, timer), Workload(layout8, slots8, inputs, timer)

        def ffn4(config, layout4=layout4):
            return TritonInt4MoEFFN(layout4, device, config=config, max_tokens=inputs["xp"].shape[0], top_k=TOP_K,
                                    dtype=dtype)

        tried = []
        if args.autotune:
            config, tried = autotune(work4, ffn4, log, args.smoke)
            tuned[hidden, intermediate] = config
        elif device.type == "cuda":
            config = load_int4_config(gpu, hidden, intermediate, args.tuning_dir)
        else:
            config = default_int4_config(hidden, intermediate)
        config8 = (load_config(gpu, hidden, intermediate) if device.type == "cuda"
                   else default_config(hidden, intermediate))
        ffn = ffn4(config)
        ffn8 = TritonMoEFFN(layout8, device, config=config8, max_tokens=inputs["xp"].shape[0], top_k=TOP_K, dtype=dtype)
        errors = {"one_expert": work4.check_one(ffn), "decode": work4.check_decode(ffn),
                  "prefill": work4.check_prefill(ffn),
                  "int8_one_expert": work8.check_one(ffn8)}
        one = [work4.one_expert(ffn) for _ in range(repeats)]
        one8 = [work8.one_expert(ffn8) for _ in range(repeats)]
        layer = [work4.top_k_layer(ffn) for _ in range(repeats)]
        misses = [work4.zero_copy(ffn, args.smoke) for _ in range(repeats)]
        fraction = [copy / zero for copy, zero, _ in misses]
        prefill = [work4.prefill(ffn) for _ in range(repeats)]
        prefill8 = [work8.prefill(ffn8) for _ in range(repeats)]
        figures = {
            "hidden": hidden, "intermediate": intermediate, "blob_bytes": layout4.nbytes,
            "int8_blob_bytes": layout8.nbytes, "config": config.to_json(), "int8_config": config8.to_json(),
            "relative_error_vs_fp32_reference": errors,
            "one_expert_s": spread(one),
            "one_expert_GBps": layout4.nbytes / statistics.median(one) / 1e9,
            "one_expert_fraction_of_4.29TBps": layout4.nbytes / statistics.median(one) / HBM_DESIGN_BPS,
            "int8_one_expert_s": spread(one8),
            "decode_top_k": decode_top_k, "top_k_layer_s": spread(layer),
            "int4_over_int8_one_expert": statistics.median(one) / statistics.median(one8),
            "pinned_copy_s": spread([copy for copy, _, _ in misses]),
            "zero_copy_s": spread([zero for _, zero, _ in misses]),
            "zero_copy_GBps": layout4.nbytes / statistics.median([zero for _, zero, _ in misses]) / 1e9,
            "zero_copy_fraction_of_copy_bandwidth": spread(fraction),
            "zero_copy_equals_slot": all(same for _, _, same in misses),
            "prefill_s": spread(prefill), "int8_prefill_s": spread(prefill8),
            "autotune": tried,
        }
        if device.type == "cuda":
            figures["decode_launch_s"] = work4.launch_times(ffn)
            figures["int8_decode_launch_s"] = work8.launch_times(ffn8)
            read = [work4.read_ceiling() for _ in range(repeats)]
            figures["read_one_blob_s"] = spread(read)
            read_zero = [work4.zero_copy_read(args.smoke) for _ in range(repeats)]
            figures["zero_copy_read_s"] = spread(read_zero)
            figures["zero_copy_read_fraction_of_copy_bandwidth"] = spread(
                [copy / read for (copy, _, _), read in zip(misses, read_zero)])
            for key, scales in (("codes", False), ("codes_and_scales", True)):
                figures[f"gate_up_tile_read_{key}_s"] = spread([work4.gate_up_tile_read(scales) for _ in range(repeats)])
            for split, lanes, warps in SPLIT_READS:  # the same reads with the reduction over H split
                figures[f"gate_up_tile_read_split{split}_{lanes}lanes_{warps}warps_s"] = spread(
                    [work4.gate_up_tile_read(True, lanes, warps, split) for _ in range(repeats)])
            codes_bytes = layout4.sections["w13"].nbytes + layout4.sections["w2"].nbytes
            for key, scales, nbytes in (("codes", False, codes_bytes), ("codes_and_scales", True, layout4.nbytes)):
                tiles_read = [work4.zero_copy_tile_read(args.smoke, scales) for _ in range(repeats)]
                figures[f"zero_copy_tile_read_{key}_s"] = spread(tiles_read)
                figures[f"zero_copy_tile_read_{key}_fraction_of_copy_bandwidth"] = spread(
                    [nbytes / read / (layout4.nbytes / copy) for (copy, _, _), read in zip(misses, tiles_read)])
        zero_copy = statistics.median(fraction)
        goals = {"zero_copy_fraction_of_copy_bandwidth": {"goal": ZERO_COPY_GOAL, "measured": zero_copy,
                                                          "met": zero_copy >= ZERO_COPY_GOAL}}
        for key, goal in GOALS.get(name, {}).items():
            goals[key] = {"goal": goal, "measured": statistics.median(one), "met": statistics.median(one) <= goal}
        figures["goals"] = goals
        result["shapes"][name] = figures
        log(f"{name}: one INT4 expert {statistics.median(one) * 1e6:.1f} us "
            f"({min(one) * 1e6:.1f}-{max(one) * 1e6:.1f}; "
            f"{figures['one_expert_GBps']:.0f} GB/s), INT8 {statistics.median(one8) * 1e6:.1f} us; top-{decode_top_k} "
            f"INT4 layer {statistics.median(layer) * 1e6:.1f} us; zero-copy "
            f"{statistics.median(fraction):.3f} of the copy ({min(fraction):.3f}-{max(fraction):.3f}); prefill "
            f"{statistics.median(prefill) * 1e6:.0f} us against INT8 {statistics.median(prefill8) * 1e6:.0f} us; "
            f"errors {errors}")
        if "decode_launch_s" in figures:
            log(f"{name}: decode launches, INT4 " + ", ".join(
                f"{kernel} {seconds * 1e6:.1f} us" for kernel, seconds in figures["decode_launch_s"].items())
                + "; INT8 " + ", ".join(f"{kernel} {seconds * 1e6:.1f} us"
                                       for kernel, seconds in figures["int8_decode_launch_s"].items()))
        if "zero_copy_read_fraction_of_copy_bandwidth" in figures:
            plain = figures["zero_copy_read_fraction_of_copy_bandwidth"]
            log(f"{name}: a plain zero-copy read of the INT4 blob: {plain['median']:.3f} of the copy "
                f"({plain['min']:.3f}-{plain['max']:.3f})")
            for key in ("codes", "codes_and_scales"):
                tiles_read = figures[f"zero_copy_tile_read_{key}_fraction_of_copy_bandwidth"]
                log(f"{name}: zero-copy reads in the decode's pattern, {key.replace('_', ' ')}: "
                    f"{tiles_read['median']:.3f} of the copy ({tiles_read['min']:.3f}-{tiles_read['max']:.3f})")
        del work4, work8, slots4, slots8, ffn, ffn8
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["wall_s"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {args.out} in {result['wall_s']} s")
    if tuned and not args.smoke:
        path = save_configs(tuning_name(gpu), tuned, {"written_by": result["command"], "date": result["date"],
                                                      "commit": result["commit"]}, args.tuning_dir)
        log(f"tuned configurations written to {path}")


if __name__ == "__main__":
    main()
