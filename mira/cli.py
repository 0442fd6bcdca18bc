"""`mira ...`: parse arguments, build configs, call the library. No logic of its own."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mira.bench.command import add_command as add_bench_command
from mira.cache.simulate import BANDWIDTH_GBPS, MIXTRAL_EXPERT_BYTES
from mira.cache.simulate import POLICIES as SIMULATED_POLICIES
from mira.cache.simulate import RESIDENCY as SIMULATED_RESIDENCY
from mira.cli_args import (MiraArgumentParser, check_model_options, check_sampling, end_quietly_on_broken_pipe,
                           existing_file, nonnegative_int, output_dir, output_file, positive_float, positive_int,
                           probability, size_or_share, temperature)
from mira.config import POLICIES, PREFETCH, RESIDENCY
from mira.errors import MiraError
from mira.eval.command import add_command as add_eval_command
from mira.predict.commands import add_commands as add_predictor_commands
from mira.serve.command import add_command as add_serve_command
from mira.store.command import add_command as add_store_command
from mira.store.layout import SCHEMES

QUANT_HELP = ("expert quantization: int8-shared (INT8, one bf16 scale vector per expert shared by its three "
              "matrices; the default), int8-row (INT8, one scale per row), int4 (4-bit, a bf16 scale and offset "
              "per group of 64 weights), none (the checkpoint's dtype)")


def _convert(args: argparse.Namespace) -> None:
    from mira.store.convert import convert

    manifest = convert(Path(args.model_dir), Path(args.out), args.quant, progress=not args.quiet, force=args.force)
    print(f"store {args.out}: {len(manifest.moe_layers)} MoE layers x {manifest.num_experts} experts, "
          f"{manifest.scheme}, {manifest.layout['nbytes'] / 2**20:.2f} MiB per expert")


def _load(args: argparse.Namespace):
    from mira.runtime.engine import load

    check_model_options(args)
    return load(args.model, device=args.device, vram_budget=args.vram_budget, quant=args.quant,
                policy=args.policy or "mira", max_context=args.max_context, profile=args.profile,
                prefetch=args.prefetch or "auto", progress=not args.quiet, cuda_graphs=not args.no_cuda_graphs,
                residency=args.residency or "auto")


def _trace(args: argparse.Namespace) -> None:
    from mira.predict.commands import record_with_features
    from mira.runtime.tracing import read_prompts, record_trace

    prompts = read_prompts(Path(args.prompts))
    if args.features:
        trace, _ = record_with_features(_load(args), prompts, args.max_new_tokens, Path(args.out), raw=args.raw,
                                        progress=not args.quiet)
    else:
        trace = record_trace(_load(args), prompts, args.max_new_tokens, raw=args.raw, progress=not args.quiet)
        trace.save(args.out)
    print(f"trace {args.out}: {trace.num_tokens} tokens ({int(trace.is_prefill.sum())} prompt, "
          f"{int((~trace.is_prefill).sum())} generated) from {len(prompts)} prompts, {trace.num_layers} MoE layers, "
          f"top-{trace.top_k} of {trace.num_experts}")


def _simulate(args: argparse.Namespace) -> None:
    import json

    from mira.cache.simulate import format_table, load_predictions, plot_sweep, simulate
    from mira.predict.trace import RoutingTrace

    trace = RoutingTrace.load(args.trace)
    profile = RoutingTrace.load(args.profile) if args.profile else None
    if args.calibrate:
        if args.profile or not 0 < args.calibrate < trace.num_tokens:
            raise MiraError(f"--calibrate takes a token count between 1 and {trace.num_tokens - 1} (the trace has "
                            f"{trace.num_tokens}), and no --profile")
        profile, trace = trace.tokens(0, args.calibrate), trace.tokens(args.calibrate, trace.num_tokens)
    slot_counts = args.sweep or [args.slots]
    policies = args.policy or SIMULATED_POLICIES
    predictions = load_predictions(args.predictions, trace, args.heads, profile) if args.predictions else None
    options = dict(stage_slots=args.stage_slots, expert_bytes=args.expert_bytes, bandwidth_gbps=args.bandwidth,
                   profile=profile, predictions=predictions, residency=args.residency)
    try:
        results = [simulate(trace, policy, slots, **options) for slots in slot_counts for policy in policies]
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


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="Hugging Face model directory (converted into a store on first use) or a "
                                        "Mira store; default: the bundled mira-tiny-moe")
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when present)")
    parser.add_argument("--vram-budget", type=size_or_share, metavar="SIZE",
                        help="device memory Mira may use, e.g. 12GiB, or 25%% for slots for a quarter of the experts "
                             "beyond the rest of the model (default: free memory less 1 GiB on CUDA; on the CPU, "
                             "experts are read in place unless a budget is given)")
    parser.add_argument("--max-context", type=positive_int,
                        help="tokens of KV cache to reserve, at most the model's positions (default: up to 4096)")
    parser.add_argument("--quant", choices=SCHEMES, help=QUANT_HELP + "; default: the store's own")
    parser.add_argument("--policy", choices=POLICIES,
                        help="expert residency policy under a budget: mira (adaptive HOT+STAGE rebalancer, the "
                             "default), lru, lfu, static (the experts most routed in --profile stay resident), "
                             "on-demand (no caching)")
    parser.add_argument("--profile", metavar="TRACE", type=existing_file,
                        help="routing trace (.npz from `mira trace`) for --policy static")
    parser.add_argument("--prefetch", choices=PREFETCH,
                        help="stage the experts predicted for layer i+2 while layer i runs: trained (heads from "
                             "`mira train-predictor`), gate (layer i+2's router applied to layer i's input), auto "
                             "(the default: trained when the store has heads, else gate) or off. Acts where the "
                             "policy has STAGE slots: inline through them; lagged on the device, one expert per "
                             "layer into three of the budget's slots (auto stages lagged only with --residency "
                             "lagged: small experts lagged by --residency auto decode faster without)")
    parser.add_argument("--residency", choices=RESIDENCY,
                        help="under a budget: lagged (no host sync per MoE layer, so decode steps can be CUDA "
                             "graphs: missed experts are read from pinned host memory inside the kernel and the "
                             "policy acts after each step, so an admitted miss crosses PCIe twice), inline (one "
                             "host sync per MoE layer: each miss is placed before its kernel runs and copied once) "
                             "or auto (the default: lagged on CUDA, and for the policies that never admit a miss, "
                             "static and on-demand; inline otherwise)")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="run every decode step eagerly; by default on CUDA a decode step in which no MoE layer "
                             "needs the host is captured once as a CUDA graph and replayed")
    parser.add_argument("--raw", action="store_true", help="do not apply the tokenizer's chat template")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_threads_option(parser)


def _add_threads_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=positive_int,
                        help="CPU threads to compute with (default: OMP_NUM_THREADS if set, else the physical cores "
                             "less those other processes keep busy)")


def _add_sampling_options(parser: argparse.ArgumentParser, generation: bool = True) -> None:
    """Sampling flags; each left out falls back to the checkpoint's generation_config.json."""
    parser.add_argument("--temperature", type=temperature,
                        help="sampling temperature, 0 for greedy (default: the checkpoint's generation_config.json, "
                             "else greedy)")
    parser.add_argument("--top-p", type=probability,
                        help="nucleus sampling mass in (0, 1] (default: the checkpoint's, else off)")
    parser.add_argument("--top-k", type=positive_int, help="sample from the k likeliest tokens (default: the "
                                                           "checkpoint's, else off)")
    parser.add_argument("--repetition-penalty", type=positive_float,
                        help="divide the logits of tokens already seen, e.g. 1.1 (default: the checkpoint's, else off)")
    if generation:
        parser.add_argument("--max-new-tokens", type=positive_int, default=128,
                            help="tokens to generate (default 128)")
        parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                            help="end the reply before this text (repeatable)")
        parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def _sampling(args: argparse.Namespace):
    from mira.runtime.generate import SamplingConfig

    generation = dict(max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), seed=args.seed) \
        if hasattr(args, "max_new_tokens") else {}
    return SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          repetition_penalty=args.repetition_penalty, **generation)


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
    if args.system is None:
        return prompt
    return [{"role": "system", "content": args.system}, {"role": "user", "content": prompt}]


def _generate(args: argparse.Namespace) -> None:
    import json

    from mira.runtime.generate import generate_text
    from mira.store.files import write_json_atomic

    check_sampling(args)
    sampling = _sampling(args)
    messages = _messages(args)
    model = _load(args)
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
    print(f"\n[mira] TTFT {report.ttft_s:.3f} s | decode {report.decode_tokens_per_s:.1f} tokens/s "
          f"({report.new_tokens} new tokens, prompt {report.prompt_tokens}) | {stats['device']}, {stats['quant']}, "
          f"{experts}", file=sys.stderr)
    if args.stats_json:
        stats["generation"] = {k: v for k, v in report.__dict__.items() if k != "text"}
        stats["cpu_threads"] = args.cpu_threads
        write_json_atomic(Path(args.stats_json), json.loads(json.dumps(stats, default=str)))


def _chat(args: argparse.Namespace) -> None:
    from mira.runtime.chat import COMMANDS, chat

    if args.raw:
        raise MiraError("mira chat sends the conversation through the chat template; drop --raw")
    sampling = _sampling(args)
    model = _load(args)
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
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    convert = commands.add_parser("convert", help="convert a Hugging Face MoE checkpoint into an expert store",
                                  description="Stream the experts of a local Hugging Face MoE checkpoint into a "
                                              "Mira store, one expert at a time. An interrupted conversion "
                                              "resumes where it stopped. Over an existing store of the model it "
                                              "checks every file and rewrites those missing or corrupt; if the "
                                              "model's files changed since, it converts again.")
    convert.add_argument("model_dir", help="local Hugging Face model directory (config.json, *.safetensors)")
    convert.add_argument("--out", required=True, type=output_dir, help="store directory to create, check or repair")
    convert.add_argument("--quant", choices=SCHEMES, default="int8-shared", help=QUANT_HELP)
    convert.add_argument("--force", action="store_true",
                         help="replace the Mira store in --out even if it holds another model or scheme")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_threads_option(convert)
    convert.set_defaults(run=_convert)

    gen = commands.add_parser("generate", help="generate text, streamed as it comes",
                              description="Generate text from a prompt, streaming it to stdout; timings and "
                                          "cache statistics go to stderr at the end.")
    _add_model_options(gen)
    given = gen.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="the user's message; - reads it from standard input")
    given.add_argument("--messages", metavar="FILE.json", type=existing_file,
                       help='the conversation so far: a JSON list of {"role": ..., "content": ...} objects')
    gen.add_argument("--system", help="a system message before the prompt")
    _add_sampling_options(gen)
    gen.add_argument("--stats-json", metavar="FILE", type=output_file,
                     help="write timings and cache statistics to FILE")
    gen.set_defaults(run=_generate)

    chat = commands.add_parser("chat", help="talk with the model, turn by turn",
                               description="A conversation at the terminal: each reply streams as it comes and "
                                           "every turn is sent with the whole conversation before it. /reset starts "
                                           "over, /exit or end of input leaves.")
    _add_model_options(chat)
    chat.add_argument("--system", help="the system message that opens the conversation")
    _add_sampling_options(chat)
    chat.set_defaults(run=_chat)

    trace = commands.add_parser("trace", help="record the routing of every token while generating",
                                description="Greedy-generate from every prompt of a file and record, for every "
                                            "token and MoE layer, the experts the router chose (an .npz in the "
                                            "trace format that `mira simulate` replays).")
    _add_model_options(trace)
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
    sim.add_argument("--slots", type=positive_int, default=64, help="expert slots shared by all layers (default 64)")
    sim.add_argument("--sweep", type=_slot_list, metavar="N,N,...", help="replay at each of these slot counts")
    sim.add_argument("--stage-slots", type=nonnegative_int,
                     help="STAGE slots of the mira policy (default: from the cache config)")
    sim.add_argument("--expert-bytes", type=positive_int, default=MIXTRAL_EXPERT_BYTES,
                     help="bytes of one expert, the PCIe cost of a miss (default: a Mixtral-8x7B int8-shared expert)")
    sim.add_argument("--bandwidth", type=positive_float, default=BANDWIDTH_GBPS, metavar="GBPS",
                     help="host-to-device bandwidth in GB/s (default 55, PCIe 5 x16 as measured)")
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
                          "--profile) or oracle (layer i+2's actual routing: the ceiling), computed per step from "
                          "the features beside the trace (`mira trace --features`); or an .npz with 'predictions', "
                          "int [tokens, layers, P], experts best first, -1 for none. PCIe bytes then count the "
                          "prefetch copies too")
    sim.add_argument("--heads", metavar="FILE", type=existing_file, help="predictor heads for --predictions trained "
                                                     "(<store>/predictor/heads.safetensors)")
    sim.add_argument("--json", action="store_true", help="one JSON object per policy and slot count")
    sim.add_argument("--plot", metavar="FILE.png", type=output_file,
                     help="with --sweep: write miss rate against slots as a PNG")
    sim.set_defaults(run=_simulate)

    add_predictor_commands(commands)
    add_bench_command(commands)
    add_store_command(commands)
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
        what = " ".join(str(error).split())
        print(f"mira: error: internal error ({type(error).__name__}: {what}); run again with `mira --debug "
              f"{args.command} ...` for the traceback, and report it", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
