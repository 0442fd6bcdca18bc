"""The header every benchmark result records: command, commit, machine, date."""

from __future__ import annotations

import datetime
import subprocess

from mira.bench.provenance import ROOT, result_header


def test_the_header_names_the_command_the_machine_and_a_utc_date(monkeypatch):
    monkeypatch.delenv("MIRA_COMMIT", raising=False)
    monkeypatch.delenv("MIRA_RUN_CONTEXT", raising=False)
    header = result_header("python benchmarks/x.py --flag")
    assert set(header) == {"command", "commit", "machine", "date"}
    assert header["command"] == "python benchmarks/x.py --flag"
    assert "no GPU" in header["machine"] and "torch " in header["machine"]
    assert datetime.datetime.fromisoformat(header["date"]).utcoffset() == datetime.timedelta(0)
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    expected = git.stdout.strip() if git.returncode == 0 else "unknown"
    assert header["commit"].split(" + ")[0] == expected


def test_a_copy_whose_git_metadata_is_stale_is_told_its_commit(monkeypatch):
    monkeypatch.setenv("MIRA_COMMIT", "31a53f5")
    assert result_header("cmd")["commit"] == "31a53f5 (from MIRA_COMMIT)"


def test_what_else_ran_on_the_machine_is_recorded_when_told(monkeypatch):
    monkeypatch.setenv("MIRA_RUN_CONTEXT", "GPU 1 ran kernels.py meanwhile")
    assert result_header("cmd")["context"] == "GPU 1 ran kernels.py meanwhile"
