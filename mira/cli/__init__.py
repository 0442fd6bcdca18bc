"""`mira ...`: parse arguments, build configs, call the library. No logic of its own."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from mira import __version__
from mira.bench.command import add_command as add_bench_command
from mira.bench.simulate import MIXTRAL_EXPERT_BYTES
from mira.bench.simulate import POLICIES as SIMULATED_POLICIES
from mira.bench.simulate import RESIDENCY as SIMULATED_RESIDENCY
from mira.cli_args import (QUANT_HELP, CommandParser, MiraArgumentParser, add_model_options,
                           add_sampling_options, add_threads_option, check_sampling, end_quietly_on_broken_pipe,
                           existing_file, load_model, nonnegative_int, output_dir, output_file, positive_float,
                           positive_int, sampling_config)
from mira.errors import MiraError
from mira.eval.command import add_command as add_eval_command
from mira.cli.predictor import add_commands as add_predictor_commands
from mira.serve.command import add_command as add_serve_command
from mira.store.command import add_command as add_store_command
from mira.cli.models import add_command as add_models_command
from mira.store.schemes import SCHEMES

def _convert(args: argparse.Namespace) -> None:
    from mira.models.hub import locate
    from mira.store.convert import convert

    source = locate(args.model_dir)  # a hub id or cache folder -> its snapshot
    manifest = convert(source.directory, Path(args.out), args.quant, progress=not args.quiet, force=args.force)
    print(f"store {args.out}: {len(manifest.moe_layers)} MoE layers x {manifest.num_experts} experts, "
          f"{manifest.scheme}, {manifest.layout['nbytes'] / 2**20:.2f} MiB per expert")


def _trace(args: argparse.Namespace) -> None:
    from mira.cli.predictor import record_with_features
    from mira.runtime.tracing import read_prompts, record_trace

    prompts = read_prompts(Path(args.prompts))
    if args.features:
        from mira.predict.features import features_path

        beside = features_path(args.out)
        try:  # checked before generating, as --out is
            output_file(str(beside))
        except argparse.ArgumentTypeError as error:
            raise MiraError(f"--features writes {beside} beside the trace, which cannot be ({str(error).split(';')[0]}); "
                            "pass another --out") from None
        trace, _ = record_with_features(load_model(args), prompts, args.max_new_tokens, Path(args.out), raw=args.raw,
                                        progress=not args.quiet)
    else:
        trace = record_trace(load_model(args), prompts, args.max_new_tokens, raw=args.raw, progress=not args.quiet)
        trace.save(args.out)
    print(f"trace {args.out}: {trace.num_tokens} tokens ({int(trace.is_prefill.sum())} of prompts, "
          f"{int((~trace.is_prefill).sum())} of decode steps: a last new token is never routed) from {len(prompts)} "
          f"prompts, {trace.num_layers} MoE layers, top-{trace.top_k} of {trace.num_experts}")


def _simulate(args: argparse.Namespace) -> None:
    import json

    from mira.bench.simulate import format_table, load_predictions, plot_sweep, simulate
    from mira.store.trace import RoutingTrace

    policies = args.policy or SIMULATED_POLICIES
    if args.profile and not {"static", "mira"} & set(policies):
        raise MiraError(f"--profile places static's experts and primes mira's; --policy {', '.join(policies)} read "
                        "none of it: add --policy static or --policy mira, or leave out --profile")
    if args.predictions and "mira" not in policies:
        raise MiraError("--predictions stages through the mira policy's STAGE rows; add --policy mira, or leave out "
                        "--predictions")
    recorded = trace = RoutingTrace.load(args.trace)
    profile = RoutingTrace.load(args.profile) if args.profile else None
    start = args.calibrate or 0
    if args.calibrate:
        if args.profile:
            raise MiraError("--calibrate takes the profile from the trace's first tokens, and --profile gives another; "
                            "pass one of them")
        if not 0 < args.calibrate < trace.num_tokens:
            raise MiraError(f"--calibrate takes a token count between 1 and {trace.num_tokens - 1} (the trace has "
                            f"{trace.num_tokens})")
        profile, trace = trace.tokens(0, start), trace.tokens(start, trace.num_tokens)
    if args.heads and args.predictions != "trained":
        raise MiraError("--heads is read by --predictions trained alone; pass --predictions trained, or leave out "
                        "--heads")
    slot_counts = args.sweep or [args.slots]
    if args.stage_slots is not None and args.stage_slots > min(slot_counts):
        raise MiraError(f"--stage-slots {args.stage_slots} is more than the {min(slot_counts)} slots simulated; "
                        "pass at most that many (STAGE rows are part of the slots)")
    # predictions come from the whole recording (its features, or a file made for it), then lose the profile's part
    predictions = load_predictions(args.predictions, recorded, args.heads, profile)[start:] if args.predictions \
        else None
    options = dict(stage_slots=args.stage_slots, expert_bytes=args.expert_bytes, bandwidth_gbps=args.bandwidth,
                   profile=profile, residency=args.residency)
    try:  # prefetching stages through the mira policy's STAGE rows: the other policies replay without it
        results = [simulate(trace, policy, slots, predictions=predictions if policy == "mira" else None, **options)
                   for slots in slot_counts for policy in policies]
    except ValueError as error:
        raise MiraError(str(error)) from error
    if args.json:
        for result in results:
            print(json.dumps(result))
    else:
        print(format_table(results))
    if args.plot:
        plot_sweep(results, args.plot, title=f"{Path(args.trace).name}: {trace.num_tokens} tokens")
        print(f"wrote {args.plot}", file=sys.stderr)


def _slot_list(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive slot counts like 64,128,256, got {text!r}")
    return counts


def _messages(args: argparse.Namespace) -> str | list[dict]:
    """`mira generate`'s input: --messages FILE.json, or --prompt (`-`: standard input) after --system."""
    import json

    if args.messages:
        if args.system is not None:
            raise MiraError("--system goes with --prompt; put the system message first in the --messages file")
        try:
            messages = json.loads(Path(args.messages).read_text())
        except (OSError, ValueError) as error:
            raise MiraError(f"cannot read the messages file {args.messages}: {error}; give a JSON list of "
                            '{"role": ..., "content": ...} objects') from None
        if not (isinstance(messages, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                   and isinstance(m.get("content"), str) for m in messages)):
            raise MiraError(f"{args.messages} is not a JSON list of {{\"role\": ..., \"content\": ...}} objects with "
                            "text content")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise MiraError("the prompt is empty" + (" (nothing came on standard input)" if args.prompt == "-" else "")
                        + "; give some text with --prompt")
    if args.system is None:
        return prompt
    return [{"role": "system", "content": args.system}, {"role": "user", "content": prompt}]


def _generate(args: argparse.Namespace) -> None:
    import json

    from mira.runtime.generate import generate_text
    from mira.store.files import write_json_atomic

    check_sampling(args)
    sampling = sampling_config(args)
    messages = _messages(args)
    model = load_model(args)
    report = generate_text(model, messages, sampling, raw=args.raw)
    stats = model.stats()
    cache = stats["cache"]
    if stats["slots"]:
        experts = (f"{stats['policy']} policy, {stats['slots']}/{stats['total_experts']} expert slots, hit rate "
                   f"{cache['hit_rate']:.2f}, {cache['copies']} copies ({cache['bytes_to_device'] / 2**20:.1f} MiB)")
        if stats["residency"] == "lagged":
            experts += ", lagged residency"
    else:
        experts = "experts read in place from host memory"
    if stats["decode_steps_replayed"]:
        experts += f", {stats['decode_steps_replayed']} decode steps replayed from CUDA graphs"
    if stats["cpu_experts"]["mode"] != "off":
        experts += f", {stats['cpu_experts']['tokens']} tokens of missed experts computed on the CPU"
        review = stats["cpu_experts"].get("review")
        if review is not None and not review["kept"]:
            experts += f" (not after decode step {review['after_decode_steps']}: it did not pay)"
    # a rate needs two new tokens, a TTFT one: with fewer the report holds NaN, which JSON has no word for
    measured = {name: None if math.isnan(value) else value
                for name, value in (("ttft_s", report.ttft_s), ("decode_tokens_per_s", report.decode_tokens_per_s))}
    ttft = "-" if measured["ttft_s"] is None else f"{report.ttft_s:.3f} s"
    decode = "-" if measured["decode_tokens_per_s"] is None else f"{report.decode_tokens_per_s:.1f} tokens/s"
    print(f"\n[mira] TTFT {ttft} | decode {decode} "
          f"({report.new_tokens} new tokens, prompt {report.prompt_tokens}) | {stats['device']} {stats['dtype']}, "
          f"{stats['quant']}, "
          f"{experts}", file=sys.stderr)
    if args.stats_json:
        stats["generation"] = {**{name: getattr(report, name) for name in ("prompt_tokens", "new_tokens",
                                                                           "finish_reason")}, **measured}
        stats["cpu_threads"] = args.cpu_threads
        write_json_atomic(Path(args.stats_json), json.loads(json.dumps(stats, default=str)))


def _chat(args: argparse.Namespace) -> None:
    from mira.runtime.chat import COMMANDS, chat

    sampling = sampling_config(args)
    model = load_model(args)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"[mira] {COMMANDS}", file=sys.stderr)
    chat(model, sampling, args.system, read=(lambda: input("> ")) if interactive else input)


def build_parser() -> argparse.ArgumentParser:
    parser = MiraArgumentParser(
        prog="mira",
        description="Run Mixture-of-Experts language models on a GPU too small to hold them: experts are "
                    "quantized into a host-memory store and cached in GPU memory under a byte budget.",
    )
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=CommandParser)

    convert = commands.add_parser("convert", help="convert a Hugging Face MoE checkpoint into an expert store",
                                  description="Stream the experts of a Hugging Face MoE checkpoint on this "
                                              "machine into a Mira store, one expert at a time. An interrupted "
                                              "conversion resumes where it stopped. Over an existing store of the "
                                              "model it checks every file and rewrites those missing or corrupt; "
                                              "if the model's files changed since, it converts again.")
    convert.add_argument("model_dir", help="local Hugging Face model directory (config.json, *.safetensors), or a hub "
                                           "id (org/name) in the local Hugging Face cache")
    convert.add_argument("--out", required=True, type=output_dir, help="store directory to create, check or repair")
    convert.add_argument("--quant", choices=SCHEMES, default="int8-shared", help=QUANT_HELP)
    convert.add_argument("--force", action="store_true",
                         help="replace the Mira store in --out even if it holds another model or scheme")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    add_threads_option(convert)
    convert.set_defaults(run=_convert)

    gen = commands.add_parser("generate", help="generate text, streamed as it comes",
                              description="Generate text from a prompt, streaming it to stdout; timings and "
                                          "cache statistics go to stderr at the end.")
    add_model_options(gen)
    given = gen.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="the user's message; - reads it from standard input")
    given.add_argument("--messages", metavar="FILE.json", type=existing_file,
                       help='the conversation so far: a JSON list of {"role": ..., "content": ...} objects')
    gen.add_argument("--system", help="a system message before the prompt")
    add_sampling_options(gen)
    gen.add_argument("--stats-json", metavar="FILE", type=output_file,
                     help="write timings and cache statistics to FILE")
    gen.set_defaults(run=_generate)

    chat = commands.add_parser("chat", help="talk with the model, turn by turn",
                               description="A conversation at the terminal: each reply streams as it comes and "
                                           "every turn is sent with the whole conversation before it. /reset starts "
                                           "over, /exit or end of input leaves.")
    add_model_options(chat, raw=False)
    chat.add_argument("--system", help="the system message that opens the conversation")
    add_sampling_options(chat)
    chat.set_defaults(run=_chat)

    trace = commands.add_parser("trace", help="record the routing of every token while generating",
                                description="Greedy-generate from every prompt of a file and record, for every "
                                            "token and MoE layer, the experts the router chose (an .npz in the "
                                            "trace format that `mira simulate` replays).")
    add_model_options(trace)
    trace.add_argument("--prompts", required=True, metavar="FILE", type=existing_file,
                       help="one prompt per line, or JSON lines with a \"prompt\" field")
    trace.add_argument("--out", required=True, metavar="T.npz", type=output_file, help="the trace to write")
    trace.add_argument("--max-new-tokens", type=positive_int, default=128,
                       help="tokens to generate per prompt (default 128)")
    trace.add_argument("--features", action="store_true",
                       help="also record the predictor features of every step beside the trace (T.features.npz), "
                            "for `mira train-predictor` and `mira eval-predictor`")
    trace.set_defaults(run=_trace)

    sim = commands.add_parser("simulate", help="replay a routing trace through cache policies and Belady's bound",
                              description="Replay a routing trace (token by token, layer by layer, experts in "
                                          "ascending id) through expert-cache policies sharing N slots over all "
                                          "layers, and through Belady's optimum (the bound). Prints hits and "
                                          "misses by tier, PCIe bytes and the implied PCIe time per token.")
    sim.add_argument("--trace", required=True, metavar="T.npz", type=existing_file, help="the routing trace to replay")
    sim.add_argument("--policy", action="append", choices=SIMULATED_POLICIES,
                     help="a policy to replay (repeatable; default: all of them and belady)")
    slots = sim.add_mutually_exclusive_group()
    slots.add_argument("--slots", type=positive_int, default=64, help="expert slots shared by all layers (default 64)")
    slots.add_argument("--sweep", type=_slot_list, metavar="N,N,...", help="replay at each of these slot counts")
    sim.add_argument("--stage-slots", type=nonnegative_int,
                     help="STAGE slots of the mira policy (default: from the cache config)")
    sim.add_argument("--expert-bytes", type=positive_int, default=MIXTRAL_EXPERT_BYTES,
                     help="bytes of one expert, the PCIe cost of a miss (default: a Mixtral-8x7B int8-shared expert)")
    sim.add_argument("--bandwidth", type=positive_float, metavar="GBPS",
                     help="host-to-device bandwidth in GB/s (default: the pinned copy rate measured on the reference GPU)")
    sim.add_argument("--profile", metavar="TRACE", type=existing_file,
                     help="trace placing the static policy's experts and giving the mira policy its prior "
                          "(default: the replayed trace itself, an oracle profile) and ranking --predictions "
                          "popularity")
    sim.add_argument("--calibrate", type=positive_int, metavar="N",
                     help="use the trace's first N tokens as the profile (as calibration prompts would be) and "
                          "replay the tokens after them")
    sim.add_argument("--residency", choices=SIMULATED_RESIDENCY, default="inline",
                     help="when the policies act: inline (before each layer: an admitted miss crosses PCIe once, "
                          "the default) or lagged (after each step, as in graph-replayed decoding: an admitted miss "
                          "crosses twice)")
    sim.add_argument("--predictions", metavar="PREDICTOR|FILE.npz",
                     help="replay prefetching into STAGE (mira policy; the best prediction per target layer is "
                          "staged, as at run time): gate, trained (needs --heads), previous, popularity (needs "
                          "--profile) or oracle (layer i+2's routed experts, by routed tokens, ties to the lower id: "
                          "a perfect predictor of the routed set, not the best staging, since its first expert may "
                          "be resident already), computed per step from "
                          "the features beside the trace (`mira trace --features`); or an .npz with 'predictions', "
                          "int [tokens, layers, P], experts best first, -1 for none. PCIe bytes then count the "
                          "prefetch copies too")
    sim.add_argument("--heads", metavar="FILE", type=existing_file, help="predictor heads for --predictions trained "
                                                     "(<store>/predictor/heads.safetensors)")
    sim.add_argument("--json", action="store_true", help="one JSON object per policy and slot count")
    sim.add_argument("--plot", metavar="FILE.png", type=output_file,
                     help="write miss rate against slots as a PNG (a line per policy over the --sweep counts)")
    sim.set_defaults(run=_simulate)

    add_predictor_commands(commands)
    add_bench_command(commands)
    add_store_command(commands)
    add_models_command(commands)
    add_serve_command(commands)
    add_eval_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv  # what the results of a run record as its command
    try:
        from mira.runtime.threads import set_threads

        args.cpu_threads = set_threads(getattr(args, "threads", None))
        if getattr(args, "quiet", False):
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()  # this process only: the CLI was asked to be quiet
        args.run(args)
    except MiraError as error:
        if args.debug:
            raise
        print(f"mira: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return end_quietly_on_broken_pipe()
    except Exception as error:  # a fault of Mira's, not of the input: one line, the traceback under --debug
        if args.debug:
            raise
        if isinstance(error, OSError) and error.filename is not None:  # the file system refused a path
            path = error.filename2 or error.filename  # a rename's target, not the hidden file written first
            print(f"mira: error: {error.strerror or error}: {path}; check the path and its permissions",
                  file=sys.stderr)
            return 1
        what = " ".join(str(error).split())
        print(f"mira: error: internal error ({type(error).__name__}: {what}); run again with `mira --debug "
              f"{args.command} ...` for the traceback, and report it", file=sys.stderr)
        return 1
    return 0

