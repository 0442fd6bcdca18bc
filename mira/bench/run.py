"""`mira bench`: every configuration of one model over one prompt set, at every budget (paper V, VI).

Order of a run, for each quantization scheme in turn (its expert store opened once, and released
before the next scheme's is opened, so that two large stores never share host memory):

1. warm-up at the all-experts budget on calibration prompts (random ids, not the measured
   prompts): compiles the kernels, gives the slot plan's reserve, and, for the static policy
   without a --profile, the routing counts that place its experts (Fiddler-style offline
   popularity, from other prompts than the measured ones, and the mira policy's prior);
2. per budget, the Mira configurations: Mira+P (prefetch: trained heads if the store has them,
   else gate speculation), Mira without prefetch, LRU on demand, static popularity; each runs the
   prompt set once untimed and then `repeats` times (mira.bench.measure.repeated), or, with
   `interleave`, in turns: `repeats` rounds over the configurations, each turn a fresh model's
   untimed run and one timed run (mira.bench.measure.merged_turns), so that a host whose speed
   drifts during the run weighs on every configuration alike;
3. beam search at widths --beams with Mira+P at --beam-budget;

then the baselines, once, after the last store is released: transformers all on the GPU (where it fits), then
   transformers + accelerate offload at each budget.

Results are written after every configuration, so an interrupted run keeps what it measured, and
`resume=True` continues it: the runs already in the output file are kept and not measured again,
provided the file holds the same run (model, routing, prompt set, commit, device); its `segments`
list the invocations that measured it.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mira.bench import hf
from mira.bench.configs import BASELINES, MIRA_CONFIGS
from mira.bench.measure import merged_turns, repeated, run_mira, time_generation
from mira.bench.report import stolen_note
from mira.bench.prompts import BenchPrompt, fixed_prompts, prompt_ids
from mira.bench.provenance import result_header
from mira.bench.sources import Source
from mira.cache.budget import BudgetTooSmall, format_size, parse_size, share_shortfall, share_slots
from mira.cache.policy import Popularity
from mira.errors import MiraError
from mira.models.loader import routed_per_token
from mira.store.trace import RoutingTrace
from mira.runtime.config import RuntimeConfig
from mira.runtime.experts import MiraExperts
from mira.store.files import write_json_atomic

ALL = "all"
UNLIMITED = 1 << 50  # a budget no model reaches: every expert gets a slot
CALIBRATION = fixed_prompts(2, input_tokens=64, new_tokens=8)
CALIBRATION_ROWS = max(p.input_tokens + p.max_new_tokens for p in CALIBRATION)  # of a replayed trace


@dataclass
class BenchSetup:
    prompts: list[BenchPrompt]
    prompt_set: str
    budgets: list[str]  # "24GiB", "25%" (of the experts), "all"
    configs: list[str]  # MIRA_CONFIGS and BASELINES names
    beams: list[int] = field(default_factory=list)
    beam_budget: str = "24GiB"
    beam_new_tokens: int = 64
    offload_prompts: int = 1
    offload_new_tokens: int = 4
    offload_budgets: list[str] | None = None  # None: every budget but "all"
    profile: str | None = None  # a routing trace for the static policy and the mira policy's prior
    repeats: int = 3  # timed runs of every configuration, after one untimed
    interleave: bool = False  # the configurations of a budget timed in turns, a fresh model per turn
    schemes: list[str | None] = field(default_factory=lambda: [None])  # stores run one after the other;
    # None: the source's default (int8-shared, or a store's own)


def run_bench(source: Source, setup: BenchSetup, device: torch.device, out: Path, command: str,
              resume: bool = False) -> dict:
    every = setup.prompts + CALIBRATION
    max_context = max([_input_tokens(source, p) for p in every] + [64]) + max(
        [p.max_new_tokens for p in every] + ([setup.beam_new_tokens] if setup.beams else []))
    vocab = _vocab_size(source)
    positions = getattr(source.config, "max_position_embeddings", None)
    if positions and max_context > positions:
        raise MiraError(f"the longest prompt with its new tokens needs {max_context} tokens of context, beyond the "
                        f"{positions} positions of {source.label}; shorten --fixed or the prompts")
    if source.trace is not None:
        needed = CALIBRATION_ROWS + max(_input_tokens(source, p) + p.max_new_tokens for p in setup.prompts)
        if needed > source.trace.num_tokens:
            raise MiraError(f"the trace {source.trace.source} has {source.trace.num_tokens} tokens; the calibration "
                            f"({CALIBRATION_ROWS}) and the longest prompt with its new tokens need {needed}: replay "
                            "a longer trace or shorten --fixed")
    result = _header(source, setup, device, command)
    if resume and out.exists():
        result = _resumed(out, result)
    rows = result["runs"]
    done = {_run_key(row) for row in rows}

    def save() -> None:
        _write_json(out, result)

    first_budgets = None
    for scheme in [source.scheme_of(s) for s in setup.schemes]:
        stored = result.get("stores", {}).get(scheme, {})
        if "budgets" in stored and _all_done(setup, scheme, done):  # resumed: its store is not even made
            budgets = stored["budgets"]
        else:
            source.open_store(scheme)  # the previous store was released: one store in host memory at a time
            budgets = _scheme_runs(source, setup, device, max_context, vocab, result, done, save)
            source.release_store()
            free_memory(device)
        first_budgets = first_budgets or budgets
    if any(c in BASELINES for c in setup.configs):
        try:
            _baselines(source, setup, first_budgets, device, vocab, rows, save, done)
        except Exception as error:  # a baseline that breaks must not lose the runs measured so far
            rows.append({"config": "baselines", "budget": ALL, "skipped": f"failed: {error!r}"})
            print(_brief(rows[-1]), file=sys.stderr, flush=True)
    result["comparison"] = compare(rows)
    quant = compare_schemes(rows)
    if quant:
        result["quant_comparison"] = quant
    save()
    return result


def _scheme_runs(source: Source, setup: BenchSetup, device: torch.device, max_context: int, vocab: int,
                 result: dict, done: set[tuple], save) -> dict[str, int]:
    """Every Mira configuration (and beam width) at every budget on the open store, after a warm-up
    that compiles its kernels and gives its slot plan's reserve (and the static policy's profile);
    the store's figures go to result["stores"]. Returns the budgets in bytes (budgets given as a
    share of the experts, or "all", count this scheme's blob size; sizes are the same bytes for all)."""
    rows, scheme = result["runs"], source.scheme
    source.replay_from = 0  # with a routing trace: calibration replays its first rows, measured runs the next
    warm = source.mira(RuntimeConfig(vram_budget=UNLIMITED, max_context=max_context), None)
    calibrated = calibration_placement(source, warm, device)
    reserve = warm.plan.reserve_bytes if warm.plan else 0
    total_experts = warm.store.num_layers * warm.store.num_experts
    all_bytes = reserve + total_experts * warm.store.blob_bytes
    profile = calibrated
    if setup.profile:  # refused before any cell runs where it routes over another model's experts
        recorded = RoutingTrace.load(setup.profile)
        recorded.check_profile_of(warm.store.num_layers, warm.store.num_experts, source.label)
        profile = Popularity.of_trace(recorded)
    result["static_profile"] = setup.profile or "calibration prompts (random ids)"
    del warm
    free_memory(device)

    budgets = {label: _budget_bytes(label, reserve, total_experts, source.store.blob_bytes, all_bytes)
               for label in setup.budgets}
    result.setdefault("stores", {})[scheme] = {
        "blob_bytes": source.store.blob_bytes, "reserve_bytes": reserve, "all_experts_bytes": all_bytes,
        "budgets": budgets, "timings": getattr(source.store, "timings", None)}  # synthetic: fill, page-lock s
    source.replay_from = CALIBRATION_ROWS
    too_small = {label: _share_too_small(label, total_experts, source.store.num_experts) for label in budgets}

    def skipped(name: str, label: str, num_beams: int = 1) -> dict:
        return {"config": name, "quant": scheme, "budget": label, "budget_bytes": budgets[label],
                "num_beams": num_beams, "skipped": too_small[label]}

    for label, budget in budgets.items():
        names = [c for c in setup.configs if c in MIRA_CONFIGS and _key(c, label, quant=scheme) not in done]

        def measured(name: str, repeats: int) -> dict:
            return _mira_row(source, name, label, budget, setup.prompts, max_context, profile, vocab,
                             repeats=repeats)

        if too_small[label]:
            budget_rows = (skipped(name, label) for name in names)
        elif setup.interleave:
            turns = [[_turn(measured(name, 1), turn, setup.repeats) for name in names]
                     for turn in range(setup.repeats)]  # [round][config]
            budget_rows = (merged_turns(list(of_config)) for of_config in zip(*turns))
        else:
            budget_rows = (measured(name, setup.repeats) for name in names)
        for row in budget_rows:
            rows.append(row)
            print(_brief(row), file=sys.stderr, flush=True)
            save()
    if setup.beams and setup.beam_budget in budgets:
        label = setup.beam_budget
        beam_prompts = [BenchPrompt(None, 64, setup.beam_new_tokens)]
        for width in [w for w in setup.beams if _key("mira+p", label, w, True, scheme) not in done]:
            row = skipped("mira+p", label, width) if too_small[label] else _mira_row(
                source, "mira+p", label, budgets[label], beam_prompts, max_context, profile, vocab, num_beams=width,
                repeats=setup.repeats)
            rows.append(row | {"beam_search": True})
            print(_brief(rows[-1]), file=sys.stderr, flush=True)
            save()
    return budgets


def _turn(row: dict, turn: int, turns: int) -> dict:
    """A turn's row of an interleaved bench, its brief printed as progress."""
    print(f"{_brief(row)} (turn {turn + 1} of {turns})", file=sys.stderr, flush=True)
    return row


def calibration_placement(source: Source, model, device: torch.device) -> Popularity:
    """The calibration prompts generated on `model` (which also compiles its kernels; with a trace,
    replaying its rows from `source.replay_from`) and the routing they gave: the static policy's
    placement and the mira policy's prior where no profile is given."""
    time_generation(model.generate, CALIBRATION, None, _vocab_size(source), device,
                    random_continuation=_random_continuation(source))
    return Popularity.of_routing(model.cache.telemetry.counts[:, :, 0].reshape(-1),
                                 routed_per_token(source.config), model.store.num_layers)


def config_model(source: Source, name: str, budget: int, profile: Popularity, max_context: int):
    """The model of MIRA_CONFIGS[name] at `budget` bytes (`profile` places the static policy and is
    the mira policy's prior).

    Raises:
        MiraError: the configuration cannot run at this budget (e.g. too small for one layer's experts).
    """
    config = RuntimeConfig(vram_budget=budget, max_context=max_context).with_overrides(**MIRA_CONFIGS[name])
    return source.mira(config, profile)


def _mira_row(source: Source, name: str, label: str, budget: int, prompts: list[BenchPrompt], max_context: int,
              profile: Popularity, vocab: int, num_beams: int = 1, repeats: int = 3) -> dict:
    row = {"config": name, "quant": source.scheme, "budget": label, "budget_bytes": budget, "num_beams": num_beams}
    try:
        model = config_model(source, name, budget, profile, max_context)
    except BudgetTooSmall as error:
        return {**row, "skipped": f"{error.shortfall}; --budgets of at least {format_size(error.needed, up=True)} "
                                  f"runs it"}
    except MiraError as error:
        return {**row, "skipped": str(error)}
    row["prefetcher"] = _prefetcher(model)
    start = time.perf_counter()
    row.update(run_mira(model, prompts, vocab, num_beams, random_continuation=num_beams == 1 and
                        _random_continuation(source), repeats=repeats))
    row["wall_s"] = round(time.perf_counter() - start, 2)
    row["residency"] = model.stats()["residency"]  # what "auto" chose: lagged or inline
    row["decode_steps_replayed"] = model.decode_graphs.replays if model.decode_graphs is not None else 0
    del model
    free_memory(source.device)
    return row


def _prefetcher(model) -> str | None:
    """The class name of the model's predictor (None without prefetching)."""
    for module in model.hf_model.modules():
        if isinstance(module, MiraExperts):
            return type(module.predictor).__name__ if module.predictor is not None else None
    return None


def _baselines(source: Source, setup: BenchSetup, budgets: dict[str, int], device: torch.device, vocab: int,
               rows: list[dict], save, done: set[tuple]) -> None:
    """Append the baselines' runs to `rows` (saving after each); those keyed in `done` are not run."""
    offload_budgets = [label for label in budgets if label != ALL and _key("hf-offload", label) not in done
                       and (setup.offload_budgets is None or label in setup.offload_budgets)]
    run_gpu = "hf-gpu" in setup.configs and _key("hf-gpu", ALL) not in done
    run_offload = "hf-offload" in setup.configs and bool(offload_budgets)
    if not run_gpu and not run_offload:
        return
    dtype = hf.compute_dtype(source.config, device)
    nbytes = hf.parameter_bytes(source.config, dtype)
    on_device = hf.fits_on_device(nbytes, device)
    if not on_device and not hf.fits_in_host(nbytes):
        rows.extend({"config": name, "budget": ALL, "skipped": f"the {format_size(nbytes)} model fits neither the "
                     "device nor host memory"} for name, run in zip(BASELINES, (run_gpu, run_offload)) if run)
        return
    model = source.full_model(device if on_device else torch.device("cpu"))
    if run_gpu:
        row = {"config": "hf-gpu", "budget": ALL, "budget_bytes": nbytes, "device": device.type,
               "dtype": str(dtype).removeprefix("torch.")}  # on the CPU, transformers alone there
        if on_device:
            row.update(repeated(lambda: time_generation(model.generate, setup.prompts, source.tokenizer, vocab, device,
                                random_continuation=_random_continuation(source)), setup.repeats))
        else:
            row["skipped"] = f"the {format_size(nbytes)} {row['dtype']} model does not fit in device memory"
        rows.append(row)
        print(_brief(row), file=sys.stderr, flush=True)
        save()
    if run_offload and device.type != "cuda":
        rows.append({"config": "hf-offload", "budget": ALL, "skipped": "offloading needs a CUDA device"})
    if run_offload and device.type == "cuda" and importlib.util.find_spec("accelerate") is None:
        rows.append({"config": "hf-offload", "budget": ALL, "skipped": "accelerate is not installed (pip install "
                     "accelerate)"})
    elif run_offload and device.type == "cuda":
        if not hf.fits_in_host(nbytes if on_device else 0):
            rows.append({"config": "hf-offload", "budget": ALL, "skipped": "host memory too small for the model"})
            return
        model = model.to("cpu")
        free_memory(device)
        prompts = [BenchPrompt(p.text, p.input_tokens, min(p.max_new_tokens, setup.offload_new_tokens))
                   for p in setup.prompts[: setup.offload_prompts]]
        for label in offload_budgets:
            budget = budgets[label]
            row = {"config": "hf-offload", "budget": label, "budget_bytes": budget}
            with hf.offloaded(model, budget, device) as dispatched:
                row["parameters_by_device"] = hf.device_map_summary(dispatched)
                row.update(repeated(lambda: time_generation(dispatched.generate, prompts, source.tokenizer, vocab,
                                    device, random_continuation=_random_continuation(source)), setup.repeats))
            rows.append(row)
            print(_brief(row), file=sys.stderr, flush=True)
            save()
    del model
    free_memory(device)


BASELINE_CONFIGS = ("lru", "lru-lagged", "lfu", "static", *BASELINES)


def compare(rows: list[dict]) -> dict:
    """Per budget (and scheme, when rows of several ran: cells "BUDGET, SCHEME"), `mira` (what `mira
    generate` runs) against the fastest baseline's median decode tokens/s on the same store, and
    mira's achieved/bound (beam-search and skipped rows left out; the baselines without a scheme,
    transformers' own weights, count in every scheme's cells)."""
    rows = _timed(rows)
    schemes = list(dict.fromkeys(r["quant"] for r in rows if r.get("quant"))) or [None]
    out = {}
    for budget in dict.fromkeys(r["budget"] for r in rows):
        for scheme in schemes:
            here = {r["config"]: r for r in rows if r["budget"] == budget and r.get("quant") in (scheme, None)}
            baselines = [c for c in BASELINE_CONFIGS if c in here]
            if "mira" not in here or not baselines:
                continue
            best = max(baselines, key=lambda c: here[c]["decode_tokens_per_s"])
            mira = here["mira"]["decode_tokens_per_s"]
            cell = budget if len(schemes) == 1 else f"{budget}, {scheme}"
            out[cell] = {"mira": mira, "best_baseline": best,
                         "best_baseline_tokens_per_s": here[best]["decode_tokens_per_s"],
                         "mira_over_best_baseline": round(mira / here[best]["decode_tokens_per_s"], 3),
                         "mira_achieved_over_bound": here["mira"].get("achieved_over_bound")}
            if here[best].get("device") == "cpu":  # hf-gpu where there is no GPU: transformers on the CPU
                out[cell]["best_baseline_ran_on"] = f"cpu, {here[best]['dtype']}"
            if scheme is not None:
                out[cell]["quant"] = scheme
    return out


REFERENCE_SCHEME = "int8-shared"  # the scheme the others are compared with, when it ran


def compare_schemes(rows: list[dict]) -> dict:
    """Per budget and configuration that ran on more than one scheme: each scheme's median decode
    tokens/s and, for each other scheme, its ratio to the reference (int8-shared when it ran, else
    the first scheme), under "<scheme>_over_<reference>". Empty when one scheme ran."""
    rows = [r for r in _timed(rows) if r.get("quant")]
    schemes = list(dict.fromkeys(r["quant"] for r in rows))
    if len(schemes) < 2:
        return {}
    reference = REFERENCE_SCHEME if REFERENCE_SCHEME in schemes else schemes[0]
    out: dict = {}
    for r in rows:
        out.setdefault(r["budget"], {}).setdefault(r["config"], {})[r["quant"]] = r["decode_tokens_per_s"]
    for configs in out.values():
        for name, speeds in list(configs.items()):
            if len(speeds) < 2 or reference not in speeds:
                del configs[name]
                continue
            for scheme in [s for s in schemes if s in speeds and s != reference]:
                speeds[f"{scheme}_over_{reference}"] = round(speeds[scheme] / speeds[reference], 3)
    return {budget: configs for budget, configs in out.items() if configs}


def _timed(rows: list[dict]) -> list[dict]:
    """The greedy runs that were measured (no beam search, no skipped run, a decode figure)."""
    return [r for r in rows if not r.get("beam_search") and not r.get("skipped") and r.get("decode_tokens_per_s")]


def _random_continuation(source: Source) -> bool:
    """Whether greedy runs decode RandomContinuation's ids (mira.bench.measure): for synthetic models."""
    return source.synthetic


def _decoding(source: Source) -> str:
    if _random_continuation(source):
        return ("greedy runs emit pseudo-random ids, the same in every configuration (a synthetic model's own "
                "greedy output repeats one token, and its routing with it); beam search decodes the model's own")
    return "greedy (beam search where num_beams > 1)"


def _all_done(setup: BenchSetup, scheme: str, done: set[tuple]) -> bool:
    """Whether every Mira run of `scheme` that `setup` asks for is among the runs `done`."""
    wanted = [_key(c, label, quant=scheme) for label in setup.budgets for c in setup.configs if c in MIRA_CONFIGS]
    if setup.beams and setup.beam_budget in setup.budgets:
        wanted += [_key("mira+p", setup.beam_budget, width, True, scheme) for width in setup.beams]
    return all(key in done for key in wanted)


def _run_key(row: dict) -> tuple:
    """What identifies a run within a bench result: configuration, budget, beam width, beam search,
    quantization scheme (None for the baselines, which run transformers' own weights)."""
    return _key(row["config"], row["budget"], row.get("num_beams", 1), bool(row.get("beam_search")), row.get("quant"))


def _key(config: str, budget: str, num_beams: int = 1, beam_search: bool = False, quant: str | None = None) -> tuple:
    return config, budget, num_beams, beam_search, quant


SAME_RUN = ("model", "routing", "decoding", "prompt_set", "prompts", "commit", "device", "interleave", "repeats",
            "profile", "cpu_threads")


def _resumed(path: Path, fresh: dict) -> dict:
    """The result in `path`, to be continued by the invocation whose header is `fresh`: its measured
    runs kept (skipped ones dropped, to be tried again), budgets and configurations merged, and the
    invocation added to its segments.

    Raises:
        MiraError: the file cannot be read, or holds another run (SAME_RUN differs).
    """
    try:
        previous = json.loads(path.read_text())
        if not isinstance(previous, dict) or not isinstance(previous.get("runs"), list):
            raise ValueError("not a mira bench result")
    except (OSError, ValueError) as error:
        raise MiraError(f"cannot resume from {path}: {error}; pass another --out or drop --resume") from None
    for field_name in SAME_RUN:
        if previous.get(field_name) != fresh.get(field_name):
            raise MiraError(
                f"cannot resume {path}: it holds another run ({field_name} {previous.get(field_name)!r}, this run "
                f"{fresh.get(field_name)!r}); pass another --out, or drop --resume to start over")
    previous["runs"] = [row for row in previous["runs"] if not row.get("skipped")]
    for key in ("budgets", "configs", "quant"):
        previous[key] += [name for name in fresh[key] if name not in previous[key]]
    segment = ("command", "date", "machine", "context")
    first = {key: previous[key] for key in segment if key in previous}
    previous["segments"] = previous.get("segments", [first]) + [{key: fresh[key] for key in segment if key in fresh}]
    return previous


def _share_too_small(label: str, total_experts: int, per_layer: int) -> str | None:
    """Why a budget given as a share of the experts cannot run (None: it is a size, or it can)."""
    shortfall = label.endswith("%") and share_shortfall(float(label[:-1]) / 100, total_experts, per_layer)
    if not shortfall:
        return None
    reason, least = shortfall
    return f"{reason}; a share of {least}% or more fits"


def _budget_bytes(label: str, reserve: int, total_experts: int, blob_bytes: int, all_bytes: int) -> int:
    """"all", "25%" (of the experts, beyond the reserve) or a size such as "24GiB"."""
    if label == ALL:
        return all_bytes
    if label.endswith("%"):
        slots = share_slots(float(label[:-1]) / 100, total_experts)
        return reserve + slots * blob_bytes
    return parse_size(label)


def _input_tokens(source: Source, prompt: BenchPrompt) -> int:
    return prompt_ids(prompt, source.tokenizer, _vocab_size(source), 0).shape[1]


def _vocab_size(source: Source) -> int:
    """The model's vocabulary (a multimodal config keeps it in its text config)."""
    return source.config.get_text_config().vocab_size


def free_memory(device: torch.device) -> None:
    """Collect dropped models and return the device's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _brief(row: dict) -> str:
    name = f"{row['config']}/{row['quant']}" if row.get("quant") else row["config"]
    if row.get("skipped"):
        return f"{name} at {row['budget']}: skipped ({row['skipped']})"
    beams = f" beams={row['num_beams']}" if row.get("num_beams", 1) > 1 else ""
    return (f"{name} at {row['budget']}{beams}: TTFT {row.get('ttft_s')} s, decode "
            f"{row.get('decode_tokens_per_s')} tok/s, e2e {row.get('e2e_tokens_per_s')} tok/s{stolen_note(row)}")


def _header(source: Source, setup: BenchSetup, device: torch.device, command: str) -> dict:
    return {
        **result_header(command, device),
        "model": source.label,
        "routing": source.routing,
        **({"replay": {"calibration_rows": [0, CALIBRATION_ROWS], "measured_rows_from": CALIBRATION_ROWS,
                       "note": "predictors that read hidden states (gate speculation, trained heads) see the "
                               "model's own states, not those the trace came from: their prefetching is not judged "
                               "here"}} if source.trace is not None else {}),
        "decoding": _decoding(source),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "prompt_set": setup.prompt_set,
        "prompts": [{"input_tokens": _input_tokens(source, p), "max_new_tokens": p.max_new_tokens}  # as encoded
                    for p in setup.prompts],
        "budgets": setup.budgets,
        "configs": setup.configs,
        "quant": [source.scheme_of(scheme) for scheme in setup.schemes],
        "repeats": setup.repeats,
        **({"profile": setup.profile} if setup.profile else {}),
        **({"cpu_threads": source.cpu_threads} if source.cpu_threads else {}),
        **({"interleave": True} if setup.interleave else {}),
        "runs": [],
    }


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, data)
