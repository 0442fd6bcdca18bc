"""Checks of command-line arguments, made while parsing, before any work: each bad value is refused
with one line, `mira: error: ...`, that names the fix."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from mira.errors import MiraError


class MiraArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (`mira: error: ...; see `mira generate --help``), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"mira: error: {message}; see `{self.prog} --help`\n")


def positive_int(text: str) -> int:
    value = _number(text, int, "a whole number")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not positive; pass 1 or more")
    return value


def nonnegative_int(text: str) -> int:
    value = _number(text, int, "a whole number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative; pass 0 or more")
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
    """A file that can be written: its directory exists and is writable, and it is not a directory."""
    path = Path(text)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; pass a file name")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"the directory {parent} does not exist; create it or pass another path")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text} cannot be written (permission denied); pass another path")
    return text


def output_dir(text: str) -> str:
    """A directory that can be created or written: not a file, under a writable existing directory."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; pass a directory")
    existing = path.parent if str(path.parent) else Path(".")
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write in {existing} (permission denied); pass another path")
    return text


def check_model_options(args: argparse.Namespace) -> None:
    """Refuse options that cannot act in the setting the other options choose.

    Raises:
        MiraError: such an option, and what to pass instead.
    """
    from mira.runtime.engine import parse_device

    device = parse_device(args.device)
    if device.type == "cpu" and args.vram_budget is None:
        for flag, value in (("--policy", args.policy), ("--prefetch", args.prefetch), ("--residency", args.residency)):
            if value is not None:
                raise MiraError(f"{flag} {value} has no effect on the CPU without --vram-budget (every expert is read "
                                f"in place from host memory); pass --vram-budget (e.g. 25%) or leave out {flag}")
    if args.profile is not None and args.policy != "static":
        raise MiraError("--profile places the static policy's experts; pass --policy static with it, or leave it out")
    if args.policy == "static" and args.profile is None:
        raise MiraError("--policy static keeps the experts most routed in a profile resident; pass --profile TRACE "
                        "(a routing trace recorded by `mira trace`)")


def check_sampling(args: argparse.Namespace) -> None:
    """Refuse sampling options that greedy decoding ignores, and a prompt with no text.

    Raises:
        MiraError: such an option or prompt, and the fix.
    """
    if args.temperature == 0 and args.top_p is not None:
        raise MiraError("--top-p has no effect with --temperature 0 (greedy decoding); pass a positive "
                        "--temperature or leave out --top-p")
    if args.raw and not args.prompt and not getattr(args, "messages", None):
        raise MiraError("--prompt is empty and --raw gives the model no other text; pass a prompt")


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
