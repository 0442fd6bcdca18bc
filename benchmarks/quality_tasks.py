"""Multiple-choice accuracy of each expert scheme on the committed BIG-bench tasks, through the lm-eval
backend `mira` (zero-shot, lm-eval's acc and acc_norm): the difference between schemes is the point;
a small model scores near chance.

    python benchmarks/quality_tasks.py                      # the bundled model, every scheme, CPU or GPU
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import mira.eval.lm_eval_backend  # noqa: E402,F401  (registers the model `mira`)
from mira.bench.provenance import result_header  # noqa: E402
from mira.runtime.engine import default_device  # noqa: E402
from mira.store.files import write_json_atomic  # noqa: E402
from mira.store.schemes import SCHEMES  # noqa: E402

TASKS_DIR = ROOT / "tests" / "lm_eval_tasks"
TASKS = ("mira_bigbench_anachronisms", "mira_bigbench_general_knowledge", "mira_bigbench_cause_and_effect_one_sentence")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the bundled model)")
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated schemes (default: all)")
    parser.add_argument("--limit", type=int, help="first N documents of each task (default: all)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "lm-eval-tiny.json")
    args = parser.parse_args()

    device = torch.device(args.device or default_device())
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    accuracy = {}
    for scheme in [s.strip() for s in args.schemes.split(",") if s.strip()]:
        model_args = {"quant": scheme} | ({"pretrained": args.model} if args.model else {})
        run = lm_eval.simple_evaluate(model="mira", model_args=model_args, device=str(device), tasks=list(TASKS),
                                      task_manager=manager, limit=args.limit, log_samples=False)
        accuracy[scheme] = {task: {"acc": run["results"][task]["acc,none"],
                                   "acc_stderr": run["results"][task]["acc_stderr,none"],
                                   "acc_norm": run["results"][task]["acc_norm,none"],
                                   "documents": run["n-samples"][task]["effective"]} for task in TASKS}
        print(scheme, {task: round(figures["acc"], 4) for task, figures in accuracy[scheme].items()}, file=sys.stderr)
    command = "python " + shlex.join(["benchmarks/quality_tasks.py", *sys.argv[1:]])
    result = result_header(command, device) | {
        "model": args.model or "mira-tiny-moe (bundled)", "tasks_dir": str(TASKS_DIR.relative_to(ROOT)),
        "setting": "zero-shot multiple choice, lm-eval acc (sum of log-probabilities) and acc_norm (per byte)",
        "accuracy": accuracy,
    }
    write_json_atomic(args.out, result)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
