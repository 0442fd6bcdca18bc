"""What every benchmark result records about where it came from: the command, the commit of the
code measured, the machine and the date (the header of each JSON under benchmarks/results)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def result_header(command: str, device: torch.device | str | None = None) -> dict:
    """{"command", "commit", "machine", "date"} for a result measured now on `device`, and
    "context" when $MIRA_RUN_CONTEXT says what else the machine was doing (another job on a second
    GPU, say), which the figures cannot show by themselves."""
    header = {"command": command, "commit": commit(), "machine": machine(device), "date": utc_now()}
    return header | context()


def context() -> dict:
    """{"context": $MIRA_RUN_CONTEXT} when that is set, else {}."""
    told = os.environ.get("MIRA_RUN_CONTEXT")
    return {"context": told} if told else {}


def commit() -> str:
    """The commit of the code being measured.

    $MIRA_COMMIT when set: a copy of the tree whose git metadata is stale or missing (the GPU
    machine's copy keeps the metadata of when the session began) must be told. Else `git rev-parse
    HEAD` of this checkout, with " + uncommitted changes" when a tracked file outside
    benchmarks/results differs from it, or "unknown" without git.
    """
    told = os.environ.get("MIRA_COMMIT")
    if told:
        return f"{told} (from MIRA_COMMIT)"
    try:
        head = _git("rev-parse", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
    return head + (" + uncommitted changes" if changed else "")


def machine(device: torch.device | str | None = None) -> str:
    """Host name, processor, CPU count, torch threads, the accelerator (if `device` is CUDA), torch."""
    device = torch.device(device) if device is not None else None
    accelerator = torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else "no GPU"
    return (f"{platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
            f"{accelerator}, torch {torch.__version__}")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
