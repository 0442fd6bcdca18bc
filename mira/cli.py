"""`mira ...`: parse arguments, build configs, call the library. No logic of its own."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mira.cache.budget import parse_size
from mira.config import POLICIES
from mira.errors import MiraError
from mira.store.layout import SCHEMES

QUANT_HELP = ("expert quantization: int8-shared (INT8, one bf16 scale vector per expert shared by its three "
              "matrices; the default), int8-row (INT8, one scale per row), none (the checkpoint's dtype)")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except MiraError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _convert(args: argparse.Namespace) -> None:
    from mira.store.convert import convert

    manifest = convert(Path(args.model_dir), Path(args.out), args.quant, progress=not args.quiet)
    print(f"store {args.out}: {len(manifest.moe_layers)} MoE layers x {manifest.num_experts} experts, "
          f"{manifest.scheme}, {manifest.layout['nbytes'] / 2**20:.2f} MiB per expert")


def _generate(args: argparse.Namespace) -> None:
    import json

    from mira.runtime.engine import load
    from mira.runtime.generate import SamplingConfig, generate_text
    from mira.store.files import write_json_atomic

    model = load(args.model, device=args.device, vram_budget=args.vram_budget, quant=args.quant,
                 policy=args.policy, max_context=args.max_context, progress=not args.quiet)
    sampling = SamplingConfig(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    report = generate_text(model, args.prompt, sampling, raw=args.raw)
    stats = model.stats()
    cache = stats["cache"]
    print(f"\n[mira] TTFT {report.ttft_s:.3f} s | decode {report.decode_tokens_per_s:.1f} tokens/s "
          f"({report.new_tokens} new tokens, prompt {report.prompt_tokens}) | {stats['device']} {stats['quant']} "
          f"{stats['policy']} {stats['slots']}/{stats['total_experts']} expert slots | expert hit rate "
          f"{cache['hit_rate']:.2f}, {cache['copies']} copies, {cache['bytes_to_device'] / 2**20:.1f} MiB moved",
          file=sys.stderr)
    if args.stats_json:
        stats["generation"] = {k: v for k, v in report.__dict__.items() if k != "text"}
        write_json_atomic(Path(args.stats_json), json.loads(json.dumps(stats, default=str)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mira",
        description="Run Mixture-of-Experts language models on a GPU too small to hold them: experts are "
                    "quantized into a host-memory store and cached in GPU memory under a byte budget.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    convert = commands.add_parser("convert", help="convert a Hugging Face MoE checkpoint into an expert store",
                                  description="Stream the experts of a local Hugging Face MoE checkpoint into a "
                                              "Mira store, one expert at a time. An interrupted conversion "
                                              "resumes where it stopped.")
    convert.add_argument("model_dir", help="local Hugging Face model directory (config.json, *.safetensors)")
    convert.add_argument("--out", required=True, help="store directory to create")
    convert.add_argument("--quant", choices=SCHEMES, default="int8-shared", help=QUANT_HELP)
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.set_defaults(run=_convert)

    gen = commands.add_parser("generate", help="generate text, streamed as it comes",
                              description="Generate text from a prompt, streaming it to stdout; timings and "
                                          "cache statistics go to stderr at the end.")
    gen.add_argument("--model", help="Hugging Face model directory (converted into a store on first use) or a "
                                     "Mira store; default: the bundled mira-tiny-moe")
    gen.add_argument("--prompt", required=True, help="the user's message")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate (default 128)")
    gen.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when present)")
    gen.add_argument("--vram-budget", type=_size, metavar="SIZE",
                     help="device memory Mira may use, e.g. 12GiB (default: free memory less 1 GiB on CUDA; "
                          "on the CPU, experts are read in place unless a budget is given)")
    gen.add_argument("--max-context", type=int, help="tokens of KV cache to reserve (default: up to 4096)")
    gen.add_argument("--quant", choices=SCHEMES, help=QUANT_HELP + "; default: the store's own")
    gen.add_argument("--policy", choices=POLICIES, default="lru", help="expert residency policy (default lru)")
    gen.add_argument("--temperature", type=float, default=0.7, help="sampling temperature; 0 for greedy (default 0.7)")
    gen.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (default 0.9)")
    gen.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    gen.add_argument("--raw", action="store_true", help="do not apply the tokenizer's chat template")
    gen.add_argument("--stats-json", metavar="FILE", help="write timings and cache statistics to FILE")
    gen.add_argument("--quiet", action="store_true", help="no progress bars")
    gen.set_defaults(run=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except MiraError as error:
        print(f"mira: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
