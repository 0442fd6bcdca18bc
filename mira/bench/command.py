"""`mira bench`: arguments in, mira.bench.run called, table / JSON / PNG out."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from mira.bench.configs import BASELINES, DEFAULT_CONFIGS, MIRA_CONFIGS
from mira.bench.presets import PRESETS
from mira.store.schemes import SCHEMES

DEFAULT_BUDGETS = "8GiB,12GiB,24GiB,48GiB,all"


def add_command(subparsers) -> None:
    from mira.cli_args import existing_file, positive_int, thread_count

    bench = subparsers.add_parser(
        "bench", help="TTFT and tokens/s at several VRAM budgets, against baselines and the physical bound",
        description="Run a prompt set through every configuration at every VRAM budget and report, per run: "
                    "TTFT, decode and end-to-end tokens/s, tokens served by tier (HOT/STAGE/miss), GB moved over "
                    "PCIe, prefetch precision and recall, and the decode bound max(HBM bytes / HBM bandwidth, "
                    "Belady's PCIe bytes / PCIe bandwidth, as measured for the GPU) with achieved/bound (a decode "
                    "step's time over the bound's: 1 at the limit, higher is slower). Configurations: mira+p (prefetch: "
                    "trained heads when given or in the store, else gate speculation; inline, staging through the "
                    "policy's STAGE slots), mira+p-lagged (the same prefetch staged on the device under lagged "
                    "residency: no host sync, steps replayed from CUDA graphs), mira+gate (prefetch by gate "
                    "speculation, inline), mira (what `mira generate` does: no prefetch, residency auto, "
                    "--cpu-experts auto: on CUDA the calibrated split of the misses with the CPU, inline, where "
                    "it pays, else lagged), mira-gpu (the same with --cpu-experts off: no CPU share), "
                    "mira-device-calibrated (mira with the device's side of each split priced at its calibration, "
                    "not at the pace decoding measures), "
                    "mira-cpu-split (the calibrated split wherever there are misses, where auto's rule would "
                    "leave the CPU out too), mira-cpu-all (every miss computed on the CPU, inline), mira-cpu-graph "
                    "(--cpu-experts graph: lagged, replayed steps, each layer's quota of misses chosen on the "
                    "device for CPU lanes), mira-cpu-graph-1 (the same on one lane of every CPU thread), "
                    "mira-inline (inline: one host sync "
                    "per MoE layer, each miss copied in once), mira-lagged (always "
                    "lagged: no host sync, decode steps replayed from CUDA graphs, an admitted miss crosses PCIe "
                    "twice), mira-eager (no CUDA graphs, also "
                    "with every expert resident), lru (on demand, LRU, inline: mixtral-offloading's way), "
                    "lru-lagged, lfu (on demand, least frequently used, inline), static (popularity placement; "
                    "lagged, as it never admits a miss), mira-settle-now and static-settle-now (mira and static "
                    "with each step settled right after its launch, not at the next step's start), "
                    "mira-token-first and static-token-first (mira and static decoding in transformers' own loop, "
                    "which reads each token back before it launches the next step), hf-gpu "
                    "(transformers, whole model on the GPU in bf16, where it fits) and hf-offload (transformers + accelerate device_map with "
                    "max_memory = the budget; pip install accelerate). Greedy, batch 1, exactly each prompt's new-token count.")
    source = bench.add_mutually_exclusive_group()
    source.add_argument("--model", help="Hugging Face model directory or Mira store (default: the bundled model)")
    source.add_argument("--synthetic", metavar="PRESET|CONFIG.json",
                        help=f"a random model at a published model's shapes, built in memory (no disk, no download): "
                             f"a preset ({', '.join(sorted(PRESETS))}) or any Hugging Face config.json of a supported "
                             f"family. Its routing is random (every output says 'synthetic routing') unless --routing "
                             f"replays a trace. Its greedy runs decode pseudo-random ids, the same in every "
                             f"configuration, instead of its own output, which repeats one token")
    bench.add_argument("--routing", metavar="TRACE.npz",
                       help="route every MoE layer as this recorded trace did (real routing at the model's shapes): "
                            "the calibration prompts replay its first rows, every measured prompt the rows after "
                            "them. Its layer, expert and top-k counts must be the model's. Predictors that read "
                            "hidden states (gate speculation, trained heads) cannot be judged in a replay")
    bench.add_argument("--quant", metavar="SCHEME[,SCHEME]",
                       help=f"expert quantization schemes out of {', '.join(SCHEMES)}, each run in this run on a "
                            f"store of its own, one after the other (default int8-shared, or a store's own scheme); "
                            f"every row names its scheme, budgets given as sizes hold as many of the scheme's "
                            f"experts as fit, and with two schemes the comparison gives each one's decode tokens/s "
                            f"over int8-shared's")
    bench.add_argument("--prompts", metavar="FILE.jsonl",
                       help="prompt set: JSON lines with prompt, input_tokens and max_new_tokens (write one from "
                            "held-out ShareGPT with `python tools/bench_prompts.py`); default: the fixed setting")
    bench.add_argument("--num-prompts", type=positive_int, help="use the first N prompts of --prompts (default all)")
    bench.add_argument("--fixed", default="64x256", metavar="INxOUT",
                       help="the fixed setting without --prompts: INxOUT tokens, random ids (default 64x256)")
    bench.add_argument("--fixed-count", type=positive_int, default=1, help="prompts in the fixed setting (default 1)")
    bench.add_argument("--budgets", default=DEFAULT_BUDGETS,
                       help=f"comma-separated VRAM budgets: sizes (24GiB), shares of the experts beyond the "
                            f"reserve (25%%), or 'all' (every expert resident); default {DEFAULT_BUDGETS}")
    bench.add_argument("--configs", default=DEFAULT_CONFIGS,
                       help=f"comma-separated configurations out of {', '.join([*MIRA_CONFIGS, *BASELINES])} "
                            f"(default: {DEFAULT_CONFIGS}: mira as `mira generate` runs it, and the baselines; "
                            f"the other mira variants are for experiments)")
    bench.add_argument("--heads", metavar="FILE", type=existing_file,
                       help="trained predictor heads (`mira train-predictor`) for mira+p (default: the store's own, "
                            "else gate speculation)")
    bench.add_argument("--profile", metavar="TRACE", type=existing_file,
                       help="routing trace placing the static policy's experts (default: routing counts of "
                            "calibration prompts run first)")
    bench.add_argument("--repeats", type=positive_int, default=3,
                       help="timed runs of every configuration after one untimed warm-up run; figures are their "
                            "median and range (default 3)")
    bench.add_argument("--interleave", action="store_true",
                       help="time a budget's mira configurations in turns: --repeats rounds over them, each turn a "
                            "fresh model's untimed run and one timed run, so that a host whose speed drifts weighs "
                            "on all alike (a budget's rows are written when its last round ends)")
    bench.add_argument("--beams", default="", metavar="W,W,...",
                       help="also run beam search at these widths with mira+p (e.g. 1,2,4,8), at --beam-budget, "
                            "which must be one of --budgets")
    bench.add_argument("--beam-budget", default="24GiB", help="the budget of the beam-search runs, one of --budgets "
                                                                "(default 24GiB)")
    bench.add_argument("--beam-new-tokens", type=positive_int, default=64,
                       help="new tokens per beam-search run (default 64)")
    bench.add_argument("--offload-prompts", type=positive_int, default=1,
                       help="prompts hf-offload runs (it is slow: every token reads the offloaded weights over PCIe); default 1")
    bench.add_argument("--offload-new-tokens", type=positive_int, default=4,
                       help="new tokens per hf-offload prompt (default 4; at least 3 for a decode figure)")
    bench.add_argument("--offload-budgets", metavar="B,B,...",
                       help="budgets hf-offload runs at (default: every budget of --budgets but 'all')")
    bench.add_argument("--cpu-threads", type=thread_count, metavar="N", dest="cpu_expert_threads",
                       help="compute threads of the CPU that computes missed experts, in the configurations where "
                            "it does (mira where the calibration has it pay, mira-cpu-all, mira-cpu-graph's lanes); "
                            "default: the torch threads less one")
    bench.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    bench.add_argument("--out", metavar="FILE.json", default="mira-bench.json", type=_json_out,
                       help="the JSON result, written after every run (default mira-bench.json); the PNG goes beside it")
    bench.add_argument("--resume", action="store_true",
                       help="continue the run in --out: keep the runs it holds and measure only the missing ones "
                            "(it must be the same model, prompt set, commit and device; for runs longer than one "
                            "sitting)")
    bench.add_argument("--quiet", action="store_true", help="no progress bars")
    bench.set_defaults(run=_bench)


def _bench(args: argparse.Namespace) -> None:
    from mira.bench.prompts import fixed_prompts, read_prompt_file
    from mira.bench.report import format_table, plot
    from mira.bench.run import BenchSetup, run_bench
    from mira.bench.sources import open_source
    from mira.errors import MiraError
    from mira.runtime.engine import parse_device

    for label in [*_names(args.budgets), args.beam_budget, *_names(args.offload_budgets or "")]:
        _check_budget(label)
    configs, budgets = _names(args.configs), _names(args.budgets)
    if not configs or not budgets:
        raise MiraError("--configs and --budgets each need at least one name, e.g. --configs mira,lru "
                        "--budgets 25%,all")
    for flag, names in (("--configs", configs), ("--budgets", budgets)):
        if len(set(names)) < len(names):
            raise MiraError(f"{flag} names {', '.join(sorted({n for n in names if names.count(n) > 1}))} more than "
                            "once; name each once")
    if args.num_prompts is not None and not args.prompts:
        raise MiraError("--num-prompts takes the first prompts of --prompts; pass --prompts FILE, or --fixed-count "
                        "for the fixed setting")
    unknown = [c for c in configs if c not in MIRA_CONFIGS and c not in BASELINES]
    if unknown:
        raise MiraError(f"unknown configuration {', '.join(unknown)}; choose from "
                        f"{', '.join([*MIRA_CONFIGS, *BASELINES])}")
    if args.prompts:
        prompts = read_prompt_file(Path(args.prompts))[: args.num_prompts]
        prompt_set = f"{Path(args.prompts).name} ({len(prompts)} prompts)"
    else:
        try:
            inputs, outputs = (int(n) for n in args.fixed.lower().split("x"))
        except ValueError:
            raise MiraError(f"cannot read --fixed {args.fixed!r}; write INxOUT, e.g. 64x256") from None
        if inputs < 1 or outputs < 2:
            raise MiraError(f"--fixed {args.fixed!r} needs at least one prompt token and two new tokens (decoding "
                            "is timed after the first), e.g. 64x256")
        prompts = fixed_prompts(args.fixed_count, inputs, outputs)
        prompt_set = f"fixed {inputs} in / {outputs} out, random ids ({args.fixed_count} prompts)"
    schemes = _schemes(args.quant)
    beams = _beam_widths(args.beams)
    if beams and args.beam_budget not in budgets:
        raise MiraError(f"--beams runs at --beam-budget {args.beam_budget}, which is not one of --budgets {args.budgets}; "
                        f"add it there or pass another --beam-budget")
    setup = BenchSetup(prompts, prompt_set, budgets, configs, beams=beams, beam_budget=args.beam_budget,
                       beam_new_tokens=args.beam_new_tokens, offload_prompts=args.offload_prompts,
                       offload_new_tokens=args.offload_new_tokens,
                       offload_budgets=_names(args.offload_budgets) if args.offload_budgets else None,
                       profile=args.profile, repeats=args.repeats, interleave=args.interleave, schemes=schemes)
    device = parse_device(args.device)
    if args.cpu_expert_threads is not None and not any(_cpu_share_runs(name, device.type) for name in configs):
        raise MiraError(f"--cpu-threads sets the threads of the CPU that computes missed experts, which none of --configs "
                        f"{args.configs} has on {device.type}; add mira-cpu-all, or leave out --cpu-threads")
    source = open_source(args.model, args.synthetic, device, progress=not args.quiet, routing=args.routing,
                         schemes=tuple(schemes), configs=tuple(configs))
    source.heads = args.heads
    source.cpu_threads = args.cpu_expert_threads
    out = Path(args.out)
    result = run_bench(source, setup, device, out, "mira " + shlex.join(args.argv), resume=args.resume)
    print(format_table(result))
    for run in result["runs"]:  # the table marks a skipped row; its reason is here
        if run.get("skipped"):
            print(f"skipped {run['config']} at {run['budget']}: {run['skipped']}", file=sys.stderr)
    if all(run.get("skipped") for run in result["runs"]):
        print(f"results: {out} (every cell skipped, so no chart)", file=sys.stderr)
        return
    try:
        plot(result, str(out.with_suffix(".png")))
    except ImportError:
        print("mira: matplotlib is not installed; no PNG written (pip install matplotlib)", file=sys.stderr)
    print(f"results: {out} and {out.with_suffix('.png')}", file=sys.stderr)


def _cpu_share_runs(config: str, device_type: str) -> bool:
    """Whether configuration `config` may compute missed experts on the CPU worker: on CUDA unless it
    turns the share off or auto's is off (lagged residency by name); on the CPU only where it asks for
    one (auto stays off there)."""
    settings = MIRA_CONFIGS.get(config)
    if settings is None:
        return False
    mode = settings.get("cpu_experts", "auto")
    if device_type != "cuda":
        return mode in ("all", "graph")
    return mode != "off" and not (mode == "auto" and settings["residency"] == "lagged")


def _check_budget(label: str) -> None:
    """A budget as `--budgets` takes it: 'all', a share of the experts ('25%') or a size ('24GiB').

    Raises:
        MiraError: anything else, before any model is loaded.
    """
    from mira.cache.budget import parse_size
    from mira.errors import MiraError

    if label == "all":
        return
    if label.endswith("%"):
        try:
            share = float(label[:-1])
        except ValueError:
            share = 0
        if not 0 < share <= 100:
            raise MiraError(f"cannot read the budget {label!r}; a share of the experts is in (0%, 100%], like 25%")
        return
    try:
        parse_size(label)
    except MiraError:
        raise MiraError(f"cannot read the budget {label!r}; pass a size like 24GiB, a share of the experts like "
                        "25%, or all") from None


def _json_out(text: str) -> str:
    """--out: a file to write, which the chart, written beside it as NAME.png, does not overwrite."""
    from mira.cli_args import output_file

    if Path(text).suffix.lower() == ".png":
        raise argparse.ArgumentTypeError(f"{text} is the name the chart would take (NAME.png beside NAME.json); pass "
                                         "a .json file")
    return output_file(text)


def _beam_widths(text: str) -> list[int]:
    """--beams as distinct positive widths, in order.

    Raises:
        MiraError: a width that is not a positive whole number, or one named twice.
    """
    from mira.errors import MiraError

    widths = []
    for name in _names(text):
        if not name.isdigit() or int(name) < 1:
            raise MiraError(f"--beams {text}: {name!r} is not a beam width; pass whole numbers of at least 1, e.g. 1,2,4")
        if int(name) in widths:
            raise MiraError(f"--beams {text} names {name} twice; name each width once")
        widths.append(int(name))
    return widths


def _schemes(text: str | None) -> list[str | None]:
    """--quant as a list of distinct schemes; [None] without it (the source's default).

    Raises:
        MiraError: an unknown or repeated scheme.
    """
    from mira.errors import MiraError

    if text is None:
        return [None]
    schemes = _names(text)
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown or not schemes:
        raise MiraError(f"unknown quantization scheme {', '.join(unknown) or repr(text)}; choose from "
                        f"{', '.join(SCHEMES)}, e.g. --quant int8-shared,int4")
    if len(set(schemes)) < len(schemes):
        raise MiraError(f"--quant {text} names a scheme twice; name each once")
    return schemes


def _names(text: str) -> list[str]:
    """'a, b,c' -> ['a', 'b', 'c']."""
    return [name.strip() for name in text.split(",") if name.strip()]
