"""Where a CPU-only run in float32 is pointed to --dtype bfloat16: this CPU's bf16 instructions as
the kernel lists them, and the hint on hand-made cases."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from mira import cli_args
from mira.kernels import cpu_experts

CPUINFO = Path("/proc/cpuinfo")


def test_native_bf16_is_what_the_kernel_lists_for_this_cpu():
    if not CPUINFO.is_file():
        pytest.skip("no /proc/cpuinfo: not Linux")
    flags = {flag for line in CPUINFO.read_text().splitlines() if line.startswith("flags")
             for flag in line.split(":", 1)[1].split()}
    assert cpu_experts.native_bf16() == bool(flags & {"avx512_bf16", "amx_tile"})


def _model(device="cpu", dtype="float32", blob_bytes=cli_args.BF16_HINT_BYTES):
    return SimpleNamespace(config=SimpleNamespace(device=device, dtype=dtype), store=SimpleNamespace(blob_bytes=blob_bytes))


def test_only_a_float32_cpu_run_of_large_experts_on_a_bf16_cpu_is_pointed_to_bf16(monkeypatch):
    monkeypatch.setattr(cpu_experts, "native_bf16", lambda: True)
    assert "--dtype bfloat16" in cli_args.bf16_hint(_model())
    for other in (_model(device="cuda"), _model(dtype="bfloat16"), _model(blob_bytes=cli_args.BF16_HINT_BYTES - 1)):
        assert cli_args.bf16_hint(other) is None
    monkeypatch.setattr(cpu_experts, "native_bf16", lambda: False)
    assert cli_args.bf16_hint(_model()) is None
