"""Checks of command-line arguments, made while parsing, before any work: each bad value is refused
with one line, `mira: error: ...`, that names the fix."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

from mira.cache.config import POLICIES
from mira.errors import MiraError
from mira.runtime.config import CPU_EXPERTS, DTYPES, PREFETCH, RESIDENCY, RuntimeConfig, refuse_split_off_cuda
from mira.store.schemes import SCHEMES

QUANT_HELP = ("expert quantization: int8-shared (INT8, one bf16 scale vector per expert shared by its three "
              "matrices; the default), int8-row (INT8, one scale per row), int4 (4-bit, a bf16 scale and offset "
              "per group of 64 weights), none (the checkpoint's dtype)")


class MiraArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (`mira: error: ...; see `mira generate --help``), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"mira: error: {message}; see `{self.prog} --help`\n")


class CommandParser(MiraArgumentParser):
    """A command's parser: it refuses what it does not know itself, so that the error names its --help."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return namespace, extra


def positive_int(text: str) -> int:
    value = _number(text, int, "a whole number")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not positive; pass 1 or more")
    return value


def thread_count(text: str) -> int:
    """A positive number of threads, at most the CPUs this process may run on: more would only
    wait for each other's time slices."""
    from mira.runtime.threads import usable_cpus

    value, cpus = positive_int(text), len(usable_cpus())
    if value > cpus:
        raise argparse.ArgumentTypeError(f"{value} threads would share {cpus} CPUs and wait on each other; pass at "
                                         f"most {cpus}")
    return value


def nonnegative_int(text: str) -> int:
    value = _number(text, int, "a whole number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative; pass 0 or more")
    return value


def port(text: str) -> int:
    value = _number(text, int, "a whole number")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port; pass 1 to 65535, or 0 for any free port")
    return value


def seed(text: str) -> int:
    from mira.runtime.generate import SEEDS

    value = _number(text, int, "a whole number")
    if not SEEDS[0] <= value <= SEEDS[1]:
        raise argparse.ArgumentTypeError(f"{text} is out of range; pass a seed from {SEEDS[0]} to {SEEDS[1]}")
    return value


def temperature(text: str) -> float:
    value = _number(text, float, "a number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative; pass 0 for greedy decoding or a positive temperature")
    return value


def probability(text: str) -> float:
    value = _number(text, float, "a number")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]; pass a share of the probability mass such "
                                         "as 0.9 (1 keeps every token)")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float, "a number")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not positive")
    return value


def size_or_share(text: str) -> int | str:
    """A byte size ("12GiB") or a share of the experts beyond the reserve ("25%", as `mira bench` takes)."""
    from mira.cache.budget import parse_size

    if text.strip().endswith("%"):
        share = _number(text.strip()[:-1], float, "a percentage")
        if not 0 < share <= 100:
            raise argparse.ArgumentTypeError(f"{text} is not a share in (0%, 100%]")
        return text.strip()
    try:
        return parse_size(text)
    except MiraError as error:
        raise argparse.ArgumentTypeError(f"{error}, or a share of the experts like 25%") from None


def existing_file(text: str) -> str:
    path = Path(text)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise argparse.ArgumentTypeError(f"{text} {what}; pass the path of an existing file")
    return text


def output_file(text: str) -> str:
    """A file that can be written: its directory exists and takes new files, and it is not a directory."""
    path = Path(text)
    parent = path.parent if str(path.parent) else Path(".")
    if not text:
        raise argparse.ArgumentTypeError("the path is empty; pass a file name")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; pass a file name")
    if parent.exists() and not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{parent} is a file, not a directory; pass another path")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"the directory {parent} does not exist; create it or pass another path")
    if not _takes_files(parent) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text} cannot be written (permission denied); pass another path")
    return text


def _takes_files(directory: Path) -> bool:
    """Whether a file can be created in `directory`: tried, since permissions do not say (root on a
    read-only file system)."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def output_dir(text: str) -> str:
    """A directory that can be created or written: not a file, under a writable existing directory."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; pass a directory")
    existing = path.parent if str(path.parent) else Path(".")
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{existing} is a file, not a directory; pass another path")
    if not _takes_files(existing):
        raise argparse.ArgumentTypeError(f"cannot write in {existing} (permission denied or a read-only file "
                                         "system); pass another path")
    return text


def check_model_options(args: argparse.Namespace) -> None:
    """Refuse options that cannot act in the setting the other options choose.

    Raises:
        MiraError: such an option, and what to pass instead.
    """
    from mira.runtime.engine import parse_device

    device = parse_device(args.device)
    if device.type == "cpu" and args.vram_budget is None:
        defaults = RuntimeConfig()
        for flag, value, default in (("--policy", args.policy, defaults.cache.policy),
                                     ("--prefetch", args.prefetch, defaults.prefetch.mode),
                                     ("--residency", args.residency, defaults.residency.mode)):
            if value not in (None, default):  # the default, named, changes nothing
                raise MiraError(f"{flag} {value} has no effect on the CPU without --vram-budget (every expert is read "
                                f"in place from host memory); pass --vram-budget (e.g. 25%) or leave out {flag}")
    if args.cpu_expert_threads is not None and args.cpu_experts == "off":
        raise MiraError("--cpu-threads sets the threads of the CPU that computes missed experts, which --cpu-experts "
                        "off leaves unused; pass --cpu-experts auto, split or all, or leave out --cpu-threads")
    refuse_split_off_cuda(args.cpu_experts, device.type)
    if args.cpu_expert_threads is not None and device.type == "cpu" and args.cpu_experts in (None, "auto"):
        raise MiraError("--cpu-threads has no effect on the CPU, where --cpu-experts auto (the default) stays off "
                        "(both sides would be the same cores); pass --cpu-experts all, or leave out --cpu-threads")
    if args.cpu_lanes is not None and args.cpu_experts != "graph":
        raise MiraError("--cpu-lanes deals the CPU's share to lanes under --cpu-experts graph only; pass --cpu-experts "
                        "graph, or leave out --cpu-lanes")
    if args.profile is not None and args.policy != "static":
        raise MiraError("--profile places the static policy's experts; pass --policy static with it, or leave it out")
    if args.policy == "static" and args.profile is None:
        raise MiraError("--policy static keeps the experts most routed in a profile resident; pass --profile TRACE "
                        "(a routing trace recorded by `mira trace`)")


def check_sampling(args: argparse.Namespace) -> None:
    """Refuse sampling options that greedy decoding ignores.

    Raises:
        MiraError: such an option, and the fix.
    """
    if args.temperature == 0 and args.top_p is not None:
        raise MiraError("--top-p has no effect with --temperature 0 (greedy decoding); pass a positive "
                        "--temperature or leave out --top-p")


def end_quietly_on_broken_pipe() -> int:
    """The reader of stdout has gone (`mira generate | head`): stop writing to it, say nothing, and exit
    with the status of a process ended by SIGPIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush at exit must not fail again
    return 128 + 13


def _number(text: str, kind: type, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def add_model_options(parser: argparse.ArgumentParser, raw: bool = True) -> None:
    """The options that load a model; `raw` (--raw) where a command can skip the chat template."""
    parser.add_argument("--model", help="Hugging Face model directory (converted into a store on first use), a hub "
                                        "id (org/name) in the local Hugging Face cache, or a Mira store; default: "
                                        "the bundled mira-tiny-moe")
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when present)")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="compute dtype of the activations and the weights outside the experts (default: "
                             "bfloat16 on CUDA; on the CPU, bfloat16 for experts of a million weights or more, whose "
                             "products then read each expert's quantized bytes once, and float32 for smaller ones, "
                             "which computes exactly what the store holds)")
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
    parser.add_argument("--cpu-experts", choices=CPU_EXPERTS,
                        help="compute missed experts on the CPU from host memory while the others cross PCIe: auto "
                             "(the default: on CUDA under a budget, a cost model calibrated per machine, again at the next "
                             "loads where it left the CPU no share, splits "
                             "each layer's misses, and stays off where that would save a decode layer less than "
                             "running layers inline costs, or is dropped once the first decode steps measure it "
                             "not paying; off on the CPU), split (that split wherever there are "
                             "misses, CUDA only), all (every miss the policy leaves in host memory), graph (an "
                             "experiment: decode steps stay lagged and replay from CUDA graphs, the device chooses "
                             "each layer's share for CPU lanes, --cpu-lanes) or off. On, but for graph, MoE layers "
                             "run inline (--residency)")
    parser.add_argument("--cpu-threads", type=thread_count, dest="cpu_expert_threads", metavar="N",
                        help="compute threads of the CPU that computes missed experts (default: --threads less one); "
                             "each job waits for its slowest thread, so use fewer where other work shares the cores")
    parser.add_argument("--cpu-lanes", type=positive_int, metavar="N",
                        help="with --cpu-experts graph: experts the CPU computes at once, each on --cpu-threads / N "
                             "threads (default: on CUDA 1 or 2, whichever the lanes timed at load price the faster; "
                             "else 2, or 1 with one thread): lanes suit experts too small to keep every thread busy")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="run every decode step eagerly; by default on CUDA a decode step in which no MoE layer "
                             "needs the host is captured once as a CUDA graph and replayed")
    if raw:
        parser.add_argument("--raw", action="store_true", help="do not apply the tokenizer's chat template")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    add_threads_option(parser)


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=thread_count,
                        help="CPU threads to compute with (default: OMP_NUM_THREADS if set, else the physical cores "
                             "less those other processes keep busy)")


def add_sampling_options(parser: argparse.ArgumentParser, generation: bool = True) -> None:
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
        parser.add_argument("--seed", type=seed, default=0, help="random seed (default 0)")


def sampling_config(args: argparse.Namespace):
    from mira.runtime.generate import SamplingConfig

    generation = dict(max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), seed=args.seed) \
        if hasattr(args, "max_new_tokens") else {}
    return SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          repetition_penalty=args.repetition_penalty, **generation)


def load_model(args: argparse.Namespace):
    """The model the model options ask for, through `mira.load` with a RuntimeConfig built from them."""
    from mira.runtime.engine import load

    check_model_options(args)
    config = RuntimeConfig(device=args.device, dtype=args.dtype, vram_budget=args.vram_budget,
                           max_context=args.max_context,
                           quant=args.quant, profile=args.profile, progress=not args.quiet)
    settings = {"policy": args.policy, "prefetch": args.prefetch, "residency": args.residency,
                "cpu_experts": args.cpu_experts, "cpu_threads": args.cpu_expert_threads, "cpu_lanes": args.cpu_lanes}
    return load(args.model, config.with_overrides(cuda_graphs=not args.no_cuda_graphs,
                                                  **{k: v for k, v in settings.items() if v is not None}))
