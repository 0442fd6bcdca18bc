"""`mira models`: every MoE family this transformers offers, and whether Mira runs it."""

from __future__ import annotations

import argparse
import json


def add_command(subparsers) -> None:
    models = subparsers.add_parser(
        "models", help="list the MoE families this transformers offers and whether Mira runs them",
        description="Every causal LM family of the installed transformers whose Experts class uses "
                    "transformers' experts interface, whether Mira runs it, and which expert kernels it gets "
                    "(the fused ones on CUDA, or the PyTorch reference for layouts they do not compute).")
    models.add_argument("--json", action="store_true", help="print JSON instead of a table")
    models.set_defaults(run=_models)


def _models(args: argparse.Namespace) -> None:
    import transformers

    from mira.models.families import family_statuses

    rows = [{"model_type": s.family.model_type, "model_class": s.family.model_class,
             "experts_class": ", ".join(s.family.experts_classes), "runs": s.runs,
             "kernels": _kernels(s.spec) if s.runs else None, "problem": s.problem} for s in family_statuses()]
    if args.json:
        print(json.dumps({"transformers": transformers.__version__, "families": rows}, indent=1))
        return
    width = max(len(row["model_type"]) for row in rows)
    print(f"{'model_type':<{width}}  runs  kernels    experts class")
    for row in rows:
        runs = {True: "yes", False: "no", None: "?"}[row["runs"]]
        print(f"{row['model_type']:<{width}}  {runs:<4}  {row['kernels'] or '-':<9}  {row['experts_class']}"
              + (f"  ({row['problem']})" if row["problem"] else ""))
    print(f"{sum(row['runs'] is True for row in rows)} of {len(rows)} MoE families of transformers "
          f"{transformers.__version__} run in Mira")


def _kernels(spec) -> str:
    """"fused" where the Triton kernels compute these experts on CUDA, else "reference"."""
    from mira.kernels import fused_unsupported
    from mira.store.layout import ExpertLayout

    act, gate = spec.ffn_functions()
    layout = ExpertLayout("int8-shared", spec.hidden, spec.intermediate, gated=spec.gated, bias=spec.bias)
    return "fused" if fused_unsupported(layout, act, gate) is None else "reference"
