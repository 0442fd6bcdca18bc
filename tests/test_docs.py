"""The documents cannot drift: docs/benchmarks.md and README's headline table match the results, and
README's commands and Python example run against the real CLI parser and API."""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def load_generator(name: str = "benchmarks_doc"):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def readme_commands(program: str) -> list[list[str]]:
    """The argument lists of every `program` command in README's bash blocks (continuation lines
    joined, chains split at `&&`, `;` and `|`, comments dropped)."""
    commands = []
    for block in code_blocks(README.read_text(), "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words: list[str] = []
            for word in shlex.split(line, comments=True) + ["&&"]:
                if word in ("&&", ";", "|"):
                    if words[:1] == [program]:
                        commands.append(words[1:])
                    words = []
                else:
                    words.append(word)
    return commands


def test_benchmarks_doc_is_current():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "benchmarks_doc.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_check_fails_on_a_stale_doc_and_regeneration_fixes_it(tmp_path, monkeypatch, capsys):
    gen = load_generator()
    doc, readme = tmp_path / "benchmarks.md", tmp_path / "README.md"
    shutil.copy(gen.DOC, doc)
    shutil.copy(gen.README, readme)
    monkeypatch.setattr(gen, "DOC", doc)
    monkeypatch.setattr(gen, "README", readme)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    doc.write_text(doc.read_text().replace("| mira (lagged) |", "| mira (lagged) | 1 |", 1))
    assert gen.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "benchmarks.md" in err and "README" not in err
    assert gen.main([]) == 0
    assert gen.main(["--check"]) == 0
    assert doc.read_text() == (ROOT / "docs" / "benchmarks.md").read_text()


def test_every_result_file_has_a_section_with_its_provenance():
    gen = load_generator()
    results = gen.load_results()
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    for stem, data in results.items():
        assert f"\n## {stem}\n" in text
        section = text.split(f"\n## {stem}\n", 1)[1].split("\n## ", 1)[0]
        for key in ("command", "commit", "machine", "date"):
            if isinstance(data.get(key), str):
                assert str(data[key]).replace("|", "\\|") in section, (stem, key)


def test_renderers_are_chosen_by_fields_and_unknown_results_still_render():
    gen = load_generator()
    kind = {name: match for name, match, _, _ in gen.RENDERERS}
    assert kind["mira bench"]({"runs": [], "configs": [], "budgets": []})
    assert not kind["mira bench"]({"runs": []})
    new = {"command": "python benchmarks/new.py", "commit": "abc", "date": "2030-01-01",
           "speed": {"median": 12.3456, "min": 11.0, "max": 13.0, "runs": [11.0, 12.3456, 13.0]},
           "latency_s": 0.00125, "rows": [{"name": "a", "bytes": 1234567}, {"name": "b", "bytes": 3}]}
    text = "\n".join(gen.section("new-result", new))
    assert "- command: `python benchmarks/new.py`" in text
    assert "12.35 (11 to 13)" in text  # four significant digits, median then range
    assert "1.25 ms" in text and "1,234,567" in text
    assert "| a | a | 1,234,567 |" in text  # records labelled by their name field


def test_headline_figures_are_the_json_values():
    gen = load_generator()
    results = gen.load_results()
    rows = {row[0]: row for row in gen.headline_rows(results, "docs/benchmarks.md")}
    kernel = results["kernels-h200"]["shapes"]["mixtral-8x7b"]["mira_one_expert_s"]
    row = rows["one Mixtral-shaped INT8 expert, batch 1"]
    assert row[1] == f"{kernel * 1e6:.4g} us"
    assert "\n".join(gen.headline(results, "docs/benchmarks.md")) in README.read_text()


def test_readme_is_short_and_keeps_the_ci_test_command():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    first_block = code_blocks(text, "bash")[0].splitlines()
    assert first_block[0].startswith("pip install torch==2.13.0 -e . && mira generate")
    install, test = (part.strip() for part in first_block[1].split("&&"))
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in ci  # CI runs exactly the README's test command
    assert any(line.endswith(install.removeprefix("pip install")) for line in ci if "pip install" in line)


def test_readme_has_no_commit_hashes_or_issue_numbers():
    text = README.read_text()
    assert not re.search(r"\b[0-9a-f]{7,40}\b", text)
    assert not re.search(r"(issue|#)\s*#?\d+", text, flags=re.I)


README_MIRA_COMMANDS = readme_commands("mira")


def test_readme_shows_every_subcommand():
    shown = {args[0] for args in README_MIRA_COMMANDS}
    assert shown >= {"generate", "chat", "serve", "convert", "store", "bench", "simulate", "trace",
                     "train-predictor", "eval-predictor", "eval"}


@pytest.mark.parametrize("args", README_MIRA_COMMANDS, ids=" ".join)
def test_readme_commands_parse(args, tmp_path, monkeypatch):
    from mira.cli import build_parser

    monkeypatch.chdir(tmp_path)  # the files the example names exist, as they would for its reader
    for arg in args:
        if re.fullmatch(r"[\w.-]+\.(json|jsonl|npz|txt)", arg):
            (tmp_path / arg).touch()
    try:
        build_parser().parse_args(args)
    except SystemExit as e:
        pytest.fail(f"README's `mira {shlex.join(args)}` does not parse (exit {e.code})")


def test_readme_python_example_runs_on_the_bundled_model():
    import torch

    block = next(b for b in code_blocks(README.read_text(), "python") if "import mira" in b)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)  # noqa: S102 - the README's own example
    ids, out, logits = scope["ids"], scope["out"], scope["logits"]
    assert out.shape[1] == ids.shape[1] + 20
    # greedy generate's first new token is the plain forward's most likely next token
    assert out[0, ids.shape[1]].item() == torch.argmax(logits[0, -1]).item()


def test_the_families_listed_are_those_run_against_transformers_with_every_case_passing():
    families_doc = load_generator("families_doc")
    runs, other = families_doc.RUNS, "test_int8_store_is_exactly_the_dequantized_model"
    results = {"mixtral": {runs: True, other: True}, "olmoe": {runs: True, other: False},
               "ergo": {"test_experts_wrapping_the_interface_in_their_own_forward_are_refused": True},
               "jamba": {runs: False, other: True}}
    assert families_doc.passing(results) == ["mixtral"]
