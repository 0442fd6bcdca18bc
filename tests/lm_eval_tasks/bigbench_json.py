"""BIG-bench JSON tasks (the files under bigbench/, as the `bigbench` sdist ships them) as lm-eval
documents: the prompt BIG-bench would show zero-shot, the choices, and the index of the best one."""

from __future__ import annotations

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def load(task_file: str, **_) -> dict[str, datasets.Dataset]:
    """{"test": documents} of bigbench/`task_file`; the other keyword arguments are lm-eval's metadata."""
    task = json.loads((HERE / "bigbench" / task_file).read_text(encoding="utf-8"))
    input_prefix = task.get("example_input_prefix", "\nQ: ")
    output_prefix = task.get("example_output_prefix", "\nA: ")
    documents = []
    for example in task["examples"]:
        choices = list(example["target_scores"])
        scores = list(example["target_scores"].values())
        question = example["input"]
        if task.get("append_choices_to_input"):
            question += "".join(f"\n  choice: {choice}" for choice in choices)
        query = (task.get("task_prefix", "") + input_prefix + question + output_prefix).lstrip()
        documents.append({"query": query, "choices": choices, "gold": scores.index(max(scores))})
    return {"test": datasets.Dataset.from_list(documents)}
