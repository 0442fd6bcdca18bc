"""Timing one configuration over a prompt set: TTFT, decode and end-to-end tokens/s, and for Mira
the cache's figures (tokens served by tier, PCIe bytes, prefetch precision and recall) and the
bound of DESIGN.md 4 for the routing the run had.

A configuration runs its whole prompt set once untimed (kernels compile, CUDA graphs are captured,
the cache fills), then `repeats` times timed: the figures are the repeats' medians with their
ranges, and the cache figures and bound are the last repeat's (each repeat routes the same). With
a CPU share, each repeat also gives the experts the CPU computed in it and its mean time per
expert, which show whether the CPU's side drifts from one repeat to the next."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from mira.kernels.machine import REFERENCE, machine
from mira.bench.bound import decode_bound
from mira.bench.variety import decode_route_changes
from mira.bench.prompts import FIRST_ID, BenchPrompt, prompt_ids
from mira.runtime import hostcpu
from mira.runtime.engine import MiraModel
from mira.runtime.tracing import RoutingRecorder
from mira.models.kvcache import kv_values_per_token
from mira.models.loader import looped_layers


class _Clock:
    """A generate() streamer that only notes when the prompt and each new token arrive."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class RandomContinuation(LogitsProcessor):
    """Greedy decoding that emits pseudo-random ids instead of the model's choice: the token at each
    position is drawn from (seed, position), so every configuration decodes the same ids.

    For synthetic models, whose own greedy output soon repeats one token: every configuration then
    decodes the same varied sequence. It was meant to keep decode routing varied too, and did not
    on the Qwen3-30B-A3B preset: its routing collapsed with depth whatever the ids (in
    bench-qwen3-30b-a3b-random-ids.json, as without random ids, about 1,300 expert lookups missed
    per run, and Belady's bound finds no decode miss), as nearly uniform attention filled every
    token's residual stream with one shared vector; the presets' query/key norm gains now keep it
    varied (mira.bench.synthetic.QK_NORM_GAIN). It overrides every other
    processor's scores, the minimum-length one's included: the synthetic presets have no
    end-of-sequence id, so no drawn id ends a run early.
    """

    def __init__(self, vocab_size: int, seed: int):
        self.vocab_size, self.seed = vocab_size, seed

    def token(self, position: int) -> int:
        return random.Random(self.seed * 1_000_003 + position).randrange(FIRST_ID, self.vocab_size)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        token = self.token(input_ids.shape[1])
        scores.fill_(float("-inf"))
        scores[:, token] = 0.0
        return scores


@dataclass
class Timing:
    """Sums over the prompts of one run."""

    prompts: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    decode_tokens: int = 0  # new tokens after the first
    decode_s: float = 0.0
    total_s: float = 0.0
    of_run: dict = field(default_factory=dict)  # figures of this run alone, kept beside its timings

    def add(self, prompt_tokens: int, new_tokens: int, start: float, times: list[float], end: float) -> None:
        self.prompts += 1
        self.prompt_tokens += prompt_tokens
        self.new_tokens += new_tokens
        self.total_s += end - start
        if len(times) >= 2:  # times[0]: the prompt was handed to the streamer; times[1]: first new token
            self.ttft_s.append(times[1] - start)
            self.decode_tokens += len(times) - 2
            self.decode_s += times[-1] - times[1]

    def summary(self) -> dict:
        return {
            "prompts": self.prompts, "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
            "ttft_s": round(sum(self.ttft_s) / len(self.ttft_s), 4) if self.ttft_s else None,
            "decode_tokens_per_s": round(self.decode_tokens / self.decode_s, 3) if self.decode_s else None,
            "e2e_tokens_per_s": round(self.new_tokens / self.total_s, 3) if self.total_s else None,
            "total_s": round(self.total_s, 3),
        }


def time_generation(generate: Callable, prompts: list[BenchPrompt], tokenizer, vocab_size: int, device,
                    num_beams: int = 1, on_prompt: Callable[[], None] | None = None,
                    random_continuation: bool = False) -> Timing:
    """Greedy (or beam) generation of every prompt at batch 1, exactly `max_new_tokens` each; with
    `random_continuation` (greedy only) the new tokens are RandomContinuation's ids."""
    timing = Timing()
    for number, prompt in enumerate(prompts):
        ids = prompt_ids(prompt, tokenizer, vocab_size, seed=number).to(device)
        if on_prompt is not None:
            on_prompt()
        clock = _Clock() if num_beams == 1 else None
        forced = LogitsProcessorList([RandomContinuation(vocab_size, number)]) if random_continuation else None
        if forced is not None and num_beams > 1:
            raise ValueError("random_continuation forces greedy decoding's ids; it does not apply to beam search")
        _synchronize(device)
        start = time.perf_counter()
        output = generate(ids, max_new_tokens=prompt.max_new_tokens, min_new_tokens=prompt.max_new_tokens,
                          do_sample=False, num_beams=num_beams, streamer=clock, pad_token_id=0,
                          logits_processor=forced)
        _synchronize(device)
        timing.add(ids.shape[1], output.shape[1] - ids.shape[1], start, clock.times if clock else [],
                   time.perf_counter())
    return timing


TIMED = ("ttft_s", "decode_tokens_per_s", "e2e_tokens_per_s", "total_s")


def repeated(run: Callable[[], Timing], repeats: int, after_untimed: Callable[[], None] | None = None) -> dict:
    """`run` once untimed (then `after_untimed`, if given), then `repeats` times: the last run's
    summary with each timed figure replaced by the median over the repeats, its range beside it
    (`<figure>_range`), and every repeat's figures (with its `Timing.of_run`) under `repeats`; on
    Linux also the share of the host's CPU time stolen from this machine over the timed runs and in
    each (`host_cpu_stolen`, mira.runtime.hostcpu)."""
    run()
    if after_untimed is not None:
        after_untimed()
    readings = [hostcpu.read()]
    timings = []
    for _ in range(repeats):
        timings.append(run())
        readings.append(hostcpu.read())
    summaries = [timing.summary() for timing in timings]
    result = dict(summaries[-1])
    for key in TIMED:
        values = [s[key] for s in summaries if s[key] is not None]
        if values:
            result[key] = round(statistics.median(values), 4)
            result[f"{key}_range"] = [min(values), max(values)]
    result["repeats"] = [{key: s[key] for key in TIMED} | timing.of_run for s, timing in zip(summaries, timings)]
    if readings[0] is not None:
        result["host_cpu_stolen"] = _rounded(hostcpu.stolen_share(readings[0], readings[-1]))
        for figures, before, after in zip(result["repeats"], readings, readings[1:]):
            figures["host_cpu_stolen"] = _rounded(hostcpu.stolen_share(before, after))
    return result


def merged_turns(turns: list[dict]) -> dict:
    """One configuration's row from its turns of an interleaved bench (each a fresh model's row of one
    timed run after its untimed one): the last turn's row with each timed figure replaced by the
    median over the turns and its range, every turn's figures under `repeats`, as `repeated` gives
    them, the host's stolen CPU share over all the turns (weighted by their time) and their wall time
    added; the per-layer CPU figures stay the last turn's. A turn that was skipped stands for all."""
    skipped = next((turn for turn in turns if turn.get("skipped")), None)
    if skipped is not None:
        return skipped
    row = dict(turns[-1])
    for key in TIMED:
        values = [turn[key] for turn in turns if turn.get(key) is not None]
        if values:
            row[key] = round(statistics.median(values), 4)
            row[f"{key}_range"] = [min(values), max(values)]
    row["repeats"] = [figures for turn in turns for figures in turn["repeats"]]
    stolen = [(turn["host_cpu_stolen"], turn["total_s"]) for turn in turns if turn.get("host_cpu_stolen") is not None]
    if stolen:
        row["host_cpu_stolen"] = _rounded(sum(share * s for share, s in stolen) / sum(s for _, s in stolen))
    row["wall_s"] = round(sum(turn["wall_s"] for turn in turns), 2)
    if "covers" in row.get("cpu_experts", {}):
        row["cpu_experts"] = row["cpu_experts"] | {"covers": "last turn"}
    return row


def _rounded(share: float | None) -> float | None:
    return None if share is None else round(share, 4)


def run_mira(model: MiraModel, prompts: list[BenchPrompt], vocab_size: int, num_beams: int = 1,
             random_continuation: bool = False, repeats: int = 3) -> dict:
    """Time `model` over `prompts` (`repeated`) and report its cache figures and the bound (batch 1
    runs only, not for a looped model, whose routing no trace holds) of the last repeat;
    `random_continuation` as for time_generation (greedy only)."""
    before: dict = {}
    recorder = RoutingRecorder(model) if num_beams == 1 and looped_layers(model.hf_model.config) is None else None

    def run() -> Timing:
        before.update(_cache_figures(model))
        if recorder is not None:
            recorder.reset()
        cpu_before = _cpu_share(model)
        timing = time_generation(model.generate, prompts, model.tokenizer, vocab_size, model.device, num_beams,
                                 on_prompt=recorder.next_sequence if recorder is not None else None,
                                 random_continuation=random_continuation and num_beams == 1)
        if cpu_before is not None:
            experts, cuts, compute_s = (after - first for after, first in zip(_cpu_share(model), cpu_before))
            touched = experts + cuts  # whole or in part
            timing.of_run = {"cpu_experts": experts, "cpu_cuts": cuts,
                             "cpu_compute_ms_per_expert": round(1e3 * compute_s / touched, 4) if touched else None}
            timing.of_run.update(model.hybrid.paces())  # at the run's end
        return timing

    # the CPU share's per-layer times cover the timed runs: the untimed one compiles kernels (a cut's
    # variant first at its first cut), which would land in one layer's call
    restart = model.hybrid.restart_telemetry if model.hybrid is not None else None
    if recorder is None:
        timing = repeated(run, repeats, restart)
        return {**timing, "num_beams": num_beams, **_difference(_cache_figures(model), before),
                "cpu_experts": _cpu_share_table(model)}
    with recorder:
        timing = repeated(run, repeats, restart)
    result = {**timing, **_difference(_cache_figures(model), before), "cpu_experts": _cpu_share_table(model)}
    trace = recorder.trace()
    on_gpu = model.device.type == "cuda"
    figures = machine(torch.cuda.get_device_name(model.device)) if on_gpu else machine()
    costs = model.hybrid.costs if model.hybrid is not None else None
    bound = decode_bound(trace, model.cache.pool.num_slots, model.store.blob_bytes,
                         _weight_bytes_per_step(model.hf_model), _kv_bytes_per_token(model.hf_model), figures,
                         cpu_bytes_per_s=model.store.blob_bytes / costs.cpu_s(1, model.store.blob_bytes)
                         if costs is not None else None)
    # off a GPU the bound's bytes are this run's, its bandwidths the reference GPU's: no limit of this machine
    result["bound"] = bound if on_gpu else {**bound, "figures_of": f"{REFERENCE}, not this {model.device.type}"}
    result["decode_route_changes"] = decode_route_changes(trace)
    if timing.get("decode_tokens_per_s") and on_gpu:
        result["achieved_over_bound"] = round(1 / timing["decode_tokens_per_s"] / bound["bound_s_per_step"], 3)
    return result


def _cpu_share_table(model: MiraModel) -> dict:
    """The CPU's share of the misses, per layer and per kind of job, over the timed runs (`run_mira`
    restarts its telemetry after the untimed one; `covers` says so)."""
    table = model.stats()["cpu_experts"]
    if model.hybrid is not None:
        table["covers"] = "timed runs"
    return table


def _cpu_share(model: MiraModel) -> tuple[int, int, float] | None:
    """Experts the CPU worker has computed so far, whole and in part (cut), and its seconds on them
    (None without a CPU share): the figures of one run are the difference, which shows drift over
    the repeats."""
    if model.hybrid is None:
        return None
    model.hybrid.collect()  # the last layer's job is recorded when the next one starts
    telemetry = model.hybrid.telemetry
    return sum(telemetry.experts), sum(telemetry.cuts), sum(telemetry.compute_s)


def _difference(after: dict, before: dict) -> dict:
    """The cache figures of one run: counters after it less those before (ratios recomputed)."""
    out = {}
    for key, value in after.items():
        if isinstance(value, dict):
            out[key] = _difference(value, before.get(key, {}))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key not in _RATIOS:
            out[key] = round(value - before.get(key, 0), 3) if isinstance(value, float) else value - before.get(key, 0)
        else:
            out[key] = value
    prefetch = out.get("prefetch")
    if prefetch is not None and "lookups" in out:
        issued, used, misses = prefetch["issued"], prefetch["used"], out["lookups"]["miss"]
        out["prefetch_precision"] = round(used / issued, 4) if issued else None
        out["prefetch_recall"] = round(used / (used + misses), 4) if issued else None
    return out


_RATIOS = ("slots", "hit_rate", "prefetch_precision", "prefetch_recall")


def _cache_figures(model: MiraModel) -> dict:
    stats = model.stats()
    cache, prefetch = stats["cache"], stats["prefetch"]
    # inline, each miss is one copy into a slot or one read of the pinned blob by the kernel; lagged,
    # always that read, and an admission after it one more copy; a staged expert, once admitted, too
    misses = cache["lookups"]["miss"]
    cpu = stats["cpu_experts"]  # misses computed on the CPU cross no PCIe, nor do the CPU's parts of cut ones
    on_cpu = cpu.get("experts", 0) + cpu.get("cut_share", 0.0)
    lagged = stats["residency"] == "lagged"
    admitted_again = cache["bytes_to_device"] if lagged else prefetch["admitted"] * model.store.blob_bytes
    on_gpu = model.device.type == "cuda"  # on the CPU, slots are RAM and nothing crosses PCIe
    pcie = round((misses - on_cpu) * model.store.blob_bytes) + admitted_again + cache["prefetch_bytes"] if on_gpu else 0
    issued = prefetch["issued"]
    return {
        "slots": stats["slots"],
        "tokens_served": cache["tokens_served"],
        "lookups": cache["lookups"],
        "copies": cache["copies"],  # on-demand copies into slots (admissions)
        "cpu_tokens": cpu.get("tokens", 0),  # tokens of missed experts computed on the CPU
        "cpu_lookups": cpu.get("experts", 0),
        "pcie_gb": round(pcie / 1e9, 3),
        "prefetch": prefetch,
        # precision: staged copies that their layer used; recall: of the experts that crossed PCIe
        # to be used, the share that a prefetch brought ahead of time
        "prefetch_precision": round(prefetch["used"] / issued, 4) if issued else None,
        "prefetch_recall": round(prefetch["used"] / (prefetch["used"] + misses), 4) if issued else None,
    }


def _weight_bytes_per_step(hf_model) -> int:
    """Non-expert bytes a decode step reads: every parameter but the input embedding table."""
    embedding = hf_model.get_input_embeddings().weight
    tied = embedding is hf_model.get_output_embeddings().weight
    total = sum(p.nbytes for p in hf_model.parameters())
    return total if tied else total - embedding.nbytes + embedding[0].nbytes


def _kv_bytes_per_token(hf_model) -> int:
    return kv_values_per_token(hf_model.config) * hf_model.dtype.itemsize


def _synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
