"""`mira eval`: `ppl` (perplexity, KL and top-1 agreement of each expert scheme against the
unquantized experts) and `lm-eval` (lm-evaluation-harness with Mira's backend registered)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from mira.store.schemes import SCHEMES

DEFAULT_CONTEXT = 512  # the bundled model's training context


def add_command(subparsers) -> None:
    from mira.cli_args import output_file, positive_int, size_or_share

    evaluate = subparsers.add_parser(
        "eval", help="what quantized experts cost in quality: perplexity, KL and agreement; lm-eval-harness tasks",
        description="Measure what quantizing the experts costs: `mira eval ppl` scores a text with every scheme "
                    "against the unquantized experts; `mira eval lm-eval` runs lm-evaluation-harness tasks "
                    "through Mira (--model mira).")
    commands = evaluate.add_subparsers(dest="eval_command", required=True, metavar="WHAT")

    ppl = commands.add_parser(
        "ppl", help="perplexity of each expert scheme, and its KL divergence and top-1 agreement with the "
                    "unquantized experts",
        description="Score a text with the same checkpoint's experts stored in each scheme, in windows of --context "
                    "tokens that advance by --stride (each token scored once), and compare every scheme's "
                    "next-token distributions with those of the unquantized experts (`none`, always run) on the "
                    "same windows: perplexity and its change, mean and largest per-token KL(none || scheme), and "
                    "how often the top-1 tokens agree. Every model stays loaded; per window each runs once.")
    ppl.add_argument("--model", help="Hugging Face model directory (converted into a store per scheme on first use); "
                                     "default: the bundled mira-tiny-moe")
    ppl.add_argument("--data", metavar="FILE.txt|FILE.jsonl",
                     help="the text: a .txt file, or JSON lines with a \"text\" field, one document each (documents "
                          "are scored one after another); default: the bundled model's held-out ShareGPT text")
    ppl.add_argument("--quant", metavar="SCHEME,...",
                     help=f"comma-separated expert schemes out of {', '.join(SCHEMES)} (default: every one the "
                          f"model's expert shapes allow); none, the reference, is always run")
    ppl.add_argument("--max-tokens", type=positive_int, metavar="N", help="score only the first N tokens of the text")
    ppl.add_argument("--context", type=positive_int, metavar="N",
                     help=f"tokens per window (default {DEFAULT_CONTEXT}, or the model's positions or the text's tokens "
                          "if fewer)")
    ppl.add_argument("--stride", type=positive_int, metavar="N",
                     help="tokens a window advances (default: half the context)")
    ppl.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when present)")
    ppl.add_argument("--vram-budget", type=size_or_share, metavar="SIZE",
                     help="device memory each scheme's model may use, e.g. 12GiB, or 25%% for slots for a quarter of "
                          "its experts (default on CUDA: the free memory less 1 GiB, shared evenly by the models)")
    ppl.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    ppl.add_argument("--out", metavar="FILE.json", type=output_file,
                     help="also write the JSON result to FILE (with command, commit, machine and date)")
    ppl.add_argument("--quiet", action="store_true", help="no progress bars")
    ppl.set_defaults(run=_ppl)

    harness = commands.add_parser(
        "lm-eval", prefix_chars="+", add_help=False,
        help="run lm-evaluation-harness with Mira's backend: mira eval lm-eval --model mira --model_args "
             "pretrained=PATH,quant=int8-shared --tasks ...",
        description="Everything after `lm-eval` goes to lm-evaluation-harness's own command line (pip install "
                    "'mira[eval]'), with the model `mira` registered.")
    harness.add_argument("harness_args", nargs=argparse.REMAINDER)
    harness.set_defaults(run=_lm_eval)


def storable_schemes(directory: Path) -> list[str]:
    """Every scheme the checkpoint's expert shapes allow (int4 needs whole tiles), `none` first; each
    left out is named on stderr."""
    from mira.eval.ppl import REFERENCE
    from mira.models.loader import read_config
    from mira.models.registry import adapter_for
    from mira.store.layout import ExpertLayout

    spec = adapter_for(read_config(directory), str(directory)).spec
    schemes = [REFERENCE]
    for scheme in SCHEMES:
        if scheme == REFERENCE:
            continue
        try:
            ExpertLayout(scheme, spec.hidden, spec.intermediate, gated=spec.gated, bias=spec.bias)
        except ValueError as error:
            print(f"mira: leaving out {scheme}: {error}", file=sys.stderr)
            continue
        schemes.append(scheme)
    return schemes


def parse_schemes(text: str) -> list[str]:
    """'int8-row, none' -> the schemes asked for, the reference `none` first, each once.

    Raises:
        MiraError: a scheme the store does not know.
    """
    from mira.errors import MiraError
    from mira.eval.ppl import REFERENCE

    asked = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in asked if name not in SCHEMES]
    if unknown:
        raise MiraError(f"unknown quantization scheme {', '.join(unknown)}; choose from {', '.join(SCHEMES)}")
    return list(dict.fromkeys([REFERENCE, *asked]))


def _ppl(args: argparse.Namespace) -> None:
    import torch

    from mira.bench.provenance import result_header
    from mira.errors import MiraError
    from mira.eval.data import HELDOUT_TEXT, read_documents, token_stream
    from mira.eval.ppl import measure, model_log_probs, windows
    from mira.models.hub import locate
    from mira.models.loader import read_config
    from mira.runtime.engine import BUNDLED_MODEL, default_device, load
    from mira.runtime.plan import FREE_MEMORY_MARGIN
    from mira.store.files import write_json_atomic
    from mira.store.manifest import is_store

    model_path = Path(args.model) if args.model else BUNDLED_MODEL
    if is_store(model_path):
        raise MiraError(f"{model_path} is a store of one scheme; mira eval ppl compares schemes of one checkpoint, so "
                        "pass --model with the Hugging Face model directory it was converted from")
    directory = locate(model_path).directory
    schemes = parse_schemes(args.quant) if args.quant else storable_schemes(directory)
    data = Path(args.data) if args.data else HELDOUT_TEXT
    documents = read_documents(data)
    positions = getattr(read_config(directory), "max_position_embeddings", None)
    if positions and args.context and args.context > positions:
        raise MiraError(f"--context {args.context} is beyond the {positions} positions this model was made for; "
                        f"pass --context {positions} or less")
    context = args.context or min(DEFAULT_CONTEXT, positions or DEFAULT_CONTEXT)
    device = torch.device(args.device or default_device())
    budget = args.vram_budget
    if budget is None and device.type == "cuda" and torch.cuda.is_available():
        budget = (torch.cuda.mem_get_info(device)[0] - FREE_MEMORY_MARGIN) // len(schemes)
    models = {scheme: load(model_path, device=str(device), vram_budget=budget, quant=scheme, progress=not args.quiet,
                           max_context=context, cuda_graphs=False)
              for scheme in schemes}
    ids = token_stream(models[schemes[0]].tokenizer, documents, args.max_tokens)
    if len(ids) < 2:
        raise MiraError(f"{data} gives {len(ids)} tokens, and scoring needs at least 2; pass a longer text")
    rows = models[schemes[0]].hf_model.get_input_embeddings().num_embeddings
    if int(ids.max()) >= rows:
        raise MiraError(f"the tokenizer of {model_path} gives token id {int(ids.max())}, beyond the model's {rows} "
                        "embeddings: its tokenizer files are another model's; put the model's own beside its weights")
    if args.context is None:
        context = min(context, len(ids))  # a short text (or --max-tokens) is one window
    stride = args.stride or max(1, context // 2)
    spans = windows(len(ids), context, stride)
    figures = measure({scheme: model_log_probs(model) for scheme, model in models.items()}, ids, spans,
                      progress=not args.quiet)
    result = result_header("mira " + shlex.join(args.argv), device) | {
        "model": str(model_path), "data": str(data), "documents": len(documents), "tokens": len(ids),
        "scored_tokens": len(ids) - 1, "context": context, "stride": stride, "windows": len(spans),
        "device": str(device), "dtype": models[schemes[0]].config.dtype, "reference": schemes[0], "schemes": figures,
    }
    if args.out:
        write_json_atomic(Path(args.out), result)
    print(json.dumps(result, indent=1) if args.json else format_table(result))


def format_table(result: dict) -> str:
    """The result as a Markdown table, with a line saying what was scored."""
    lines = [f"{result['model']}: {result['scored_tokens']} tokens of {Path(result['data']).name} scored in "
             f"{result['windows']} windows of {result['context']} (stride {result['stride']}), {result['device']}, "
             f"{result['dtype']}; KL and agreement against `{result['reference']}`",
             "",
             "| scheme | perplexity | change | mean KL (nats) | max KL | top-1 agreement |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for scheme, figures in result["schemes"].items():
        if "mean_kl" in figures:
            lines.append(f"| {scheme} | {figures['perplexity']:.4f} | {100 * figures['perplexity_change']:+.2f}% | "
                         f"{figures['mean_kl']:.5f} | {figures['max_kl']:.4f} | "
                         f"{100 * figures['top1_agreement']:.2f}% |")
        else:
            lines.append(f"| {scheme} (reference) | {figures['perplexity']:.4f} | | | | |")
    return "\n".join(lines)


def harness_argv(argv: list[str], cuda: bool) -> list[str]:
    """The harness's command line for `argv`: a run that names no device (--device, or device= in
    --model_args) gets the device Mira would pick (the harness's own default is cuda:0, even on a
    machine without one)."""
    model_args = [value for flag, value in zip(argv, argv[1:]) if flag == "--model_args"] + [
        a.split("=", 1)[1] for a in argv if a.startswith("--model_args=")]
    device_arg = any(part.strip().startswith("device=") for value in model_args for part in value.split(","))
    if not argv or argv[:1] in (["ls"], ["validate"]) or any(a == "--device" or a.startswith("--device=") for a in argv) \
            or device_arg or "-h" in argv or "--help" in argv:
        return argv
    return [*argv, "--device", "cuda" if cuda else "cpu"]


def _lm_eval(args: argparse.Namespace) -> None:
    from mira.errors import MiraError

    try:
        from lm_eval._cli import HarnessCLI

        import mira.eval.lm_eval_backend  # noqa: F401  (registers the model `mira`)
    except ImportError as error:
        raise MiraError(f"lm-evaluation-harness is not installed ({error}); pip install 'mira[eval]'") from None
    import torch

    saved = sys.argv
    sys.argv = ["lm-eval", *harness_argv(args.harness_args, torch.cuda.is_available())]  # restored below
    try:
        cli = HarnessCLI()
        cli.execute(cli.parse_args())
    except ValueError as error:
        if not str(error).startswith("Tasks not found"):  # others may come from the run itself: keep them whole
            raise
        raise MiraError(f"lm-evaluation-harness refused the run: {error}; `mira eval lm-eval ls tasks` lists "
                        "the tasks") from None
    except ConnectionError as error:  # a task's dataset, fetched from the Hugging Face Hub on first use
        raise MiraError(f"lm-evaluation-harness could not fetch a task's data ({error}); run it once where the "
                        "Hugging Face Hub can be reached (the datasets library caches it), or give local tasks "
                        "with --include_path") from None
    finally:
        sys.argv = saved
