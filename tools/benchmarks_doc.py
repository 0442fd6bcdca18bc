"""Write docs/benchmarks.md, and the headline table in README.md, from benchmarks/results/*.json.

Every figure printed is read from a committed result file, in a section that names the file and the
command, commit, machine and date it records. Each kind of result has a small renderer, chosen by a
field the JSON holds; a file no renderer knows is listed by a generic one, so a new result never
breaks generation. `--check` regenerates in memory and fails if the committed files differ.

    python tools/benchmarks_doc.py           # rewrite docs/benchmarks.md and README's table
    python tools/benchmarks_doc.py --check   # exit 1 if either is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

from mira.bench.report import cpu_share_configs

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
HEADLINE_BEGIN = "<!-- headline figures: written by tools/benchmarks_doc.py -->"
HEADLINE_END = "<!-- end of headline figures -->"
PROVENANCE = ("command", "commit", "machine", "gpu", "device", "date", "context", "commit_note")
MAX_TABLE_COLUMNS = 12
MAX_LIST_ITEMS = 12
RECORD_DEPTH = 3
LABEL_KEYS = ("name", "preset", "config", "setting", "policy", "residency", "prefetch", "budget", "slots",
              "launch", "layer", "pin", "cache", "workers")

Json = dict[str, Any]
Lines = list[str]


# ---- formatting: one rule per type, so regeneration is byte-identical ----

def fmt(value: Any, key: str = "") -> str:
    """One cell: fixed significant digits, thousands separators, seconds shown in ms or us."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if key.endswith("_s") and not key.endswith("per_s") and 0 < abs(value) < 1:
            return f"{num(value * 1e3)} ms" if abs(value) >= 1e-3 else f"{num(value * 1e6)} us"
        return num(value)
    if isinstance(value, dict) and is_stats(value):
        return f"{fmt(value['median'], key)} ({fmt(value['min'], key)} to {fmt(value['max'], key)})"
    if isinstance(value, list):
        if all(not isinstance(v, (dict, list)) for v in value):
            shown = ", ".join(fmt(v, key) for v in value[:MAX_LIST_ITEMS])
            return shown + (f", ... ({len(value)} values)" if len(value) > MAX_LIST_ITEMS else "")
        return f"({len(value)} entries)"
    if isinstance(value, dict):
        return f"({len(value)} fields)"
    return str(value).replace("|", "\\|").replace("\n", " ")


def num(x: float) -> str:
    """Four significant digits below 1,000, whole numbers with separators above."""
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 1e-3:
        return f"{x:.4g}"
    return f"{x:.3e}"


def is_stats(value: Any) -> bool:
    return isinstance(value, dict) and {"median", "min", "max"} <= value.keys()


def with_range(run: Json, key: str) -> str:
    """A median with its range over repeats when the run recorded one."""
    rng = run.get(f"{key}_range")
    text = fmt(run.get(key), key)
    return f"{text} ({fmt(rng[0], key)} to {fmt(rng[1], key)})" if rng else text


def table(header: list[str], rows: list[list[str]]) -> Lines:
    if not rows:
        return []
    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out + [""]


def flatten(value: Any, prefix: str = "", depth: int = 99) -> dict[str, Any]:
    """Nested dicts as dotted keys down to scalars, lists and {median, min, max} figures; keys
    deeper than `depth` (launch configurations, mostly) are left to the JSON."""
    if isinstance(value, dict) and not is_stats(value) and not (prefix and is_records(value)):
        if depth == 0:
            return {}
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k), depth - 1))
        return out
    return {prefix: value}


# ---- the generic renderer: any JSON, as tables of its scalar leaves ----

def is_records(value: Any) -> bool:
    """A list of dicts, or a dict whose values are all dicts (and not {median, min, max})."""
    if isinstance(value, list):
        return bool(value) and all(isinstance(v, dict) for v in value)
    return (isinstance(value, dict) and bool(value) and not is_stats(value)
            and all(isinstance(v, dict) and not is_stats(v) for v in value.values()))


def labelled(value: list | dict) -> list[tuple[str, Json]]:
    """Records with a label each: the dict's key, else the record's own identifying fields."""
    if isinstance(value, dict):
        return [(str(k), v) for k, v in value.items()]
    out = []
    for i, rec in enumerate(value):
        parts = [fmt(rec[k]) for k in LABEL_KEYS if k in rec and not isinstance(rec[k], (dict, list))]
        out.append((", ".join(parts) if parts else str(i), rec))
    return out


def records_table(name: str, records: list[tuple[str, Any]]) -> Lines:
    """Records as one table (transposed when wide); lists of records inside them as tables of their own."""
    flat = [(label, flatten(rec, depth=RECORD_DEPTH)) for label, rec in records]
    nested = [(f"{name}[{label}].{k}", v) for label, rec in flat for k, v in rec.items() if is_records(v)]
    flat = [(label, {k: v for k, v in rec.items() if not is_records(v)}) for label, rec in flat]
    columns: list[str] = []
    for _, rec in flat:
        columns += [c for c in rec if c not in columns]
    out = [f"`{name}`:", ""]
    if len(columns) <= MAX_TABLE_COLUMNS or len(columns) <= len(flat):
        rows = [[label] + [fmt(rec.get(c), c) for c in columns] for label, rec in flat]
        out += table([""] + columns, rows)
    else:
        rows = [[c] + [fmt(rec.get(c), c) for _, rec in flat] for c in columns]
        out += table([""] + [label for label, _ in flat], rows)
    for sub_name, sub in nested:
        out += records_table(sub_name, labelled(sub))
    return out


def generic(data: Json) -> Lines:
    """Scalars in one table; each list or dict of records, at any depth, in a table of its own."""
    scalars: list[list[str]] = []
    blocks: Lines = []
    fields = {k: v for k, v in data.items() if not (k in PROVENANCE and isinstance(v, str))}
    for key, value in flatten(fields).items():
        if is_records(value):
            blocks += records_table(key, labelled(value))
        else:
            scalars.append([f"`{key}`", fmt(value, key)])
    return table(["figure", "value"], scalars) + blocks


# ---- renderers for the kinds of results the benchmarks write ----

def bench_title(d: Json) -> str:
    return f"`mira bench`: {d.get('model', '?')}, {d.get('routing', '?')} routing"


def bench(d: Json) -> Lines:
    """`mira bench`: decode tokens/s per configuration and budget, then every run in full."""
    out = [f"{fmt(d.get('prompt_set'))}; {fmt(d.get('decoding', 'greedy'))}.", ""]
    budgets = [str(b) for b in d.get("budgets", [])]
    greedy = [r for r in d["runs"] if not r.get("beam_search")]
    names: list[str] = []
    for r in greedy:
        name = run_name(r)
        if name not in names:
            names.append(name)
    cells = {(run_name(r), r["budget"]): with_range(r, "decode_tokens_per_s") for r in reversed(greedy)}
    budgets += sorted({r["budget"] for r in greedy} - set(budgets))
    rows = [[n] + [cells.get((n, b), "") for b in budgets] for n in names]
    out += ["Decode tokens/s (median and range over repeats where the run repeated):", ""]
    out += table(["configuration (residency)"] + budgets, rows)
    header = ["configuration", "budget", "beams", "slots", "TTFT", "decode tok/s", "end-to-end tok/s",
              "PCIe GB", "bound tok/s", "achieved / bound", "prefetch precision / recall"]
    rows = []
    for r in d["runs"]:
        bound = r.get("bound") or {}
        rows.append([run_name(r), fmt(r["budget"]), fmt(r.get("num_beams", 1)), fmt(r.get("slots")),
                     with_range(r, "ttft_s"), with_range(r, "decode_tokens_per_s"),
                     with_range(r, "e2e_tokens_per_s"), fmt(r.get("pcie_gb")),
                     fmt(bound.get("bound_tokens_per_s")), fmt(r.get("achieved_over_bound")),
                     f"{fmt(r.get('prefetch_precision'))} / {fmt(r.get('prefetch_recall'))}"])
    out += ["Every run (beam-search runs report tokens/s of the whole search as end-to-end):", ""]
    out += table(header, rows)
    ratios = [[fmt(budget), f"`{config}`", "; ".join(f"`{k}` {fmt(v)}" for k, v in speeds.items())]
              for budget, configs in (d.get("quant_comparison") or {}).items() for config, speeds in configs.items()]
    if ratios:
        out += ["Decode tokens/s by expert scheme, and each scheme's over int8-shared's (`quant_comparison`):", ""]
        out += table(["budget", "configuration", "by scheme"], ratios)
    goals = d.get("goals") or {}
    if goals:
        out += ["Goals as the run computed them (`goals`):", ""]
        out += table(["goal", "value", "target", "met"],
                     [[f"`{k}`", fmt(g.get("value")) if isinstance(g, dict) else fmt(g),
                       fmt(g.get("goal")) if isinstance(g, dict) else "", fmt(g.get("met"))
                       if isinstance(g, dict) else ""] for k, g in goals.items()])
    return out


def run_name(r: Json) -> str:
    """The configuration, its scheme where the row names one, and its residency."""
    name = f"{r['config']}/{r['quant']}" if r.get("quant") else r["config"]
    return f"{name} ({r['residency']})" if r.get("residency") else name


def eval_ppl(d: Json) -> Lines:
    """`mira eval ppl`: each scheme's perplexity and its distance from the unquantized experts."""
    out = [f"{fmt(d.get('scored_tokens'))} tokens of {fmt(d.get('documents'))} documents, windows of "
           f"{fmt(d.get('context'))} tokens advancing {fmt(d.get('stride'))}, {fmt(d.get('dtype'))} on "
           f"{fmt(d.get('device'))}; reference scheme `{d.get('reference')}`. KL is KL(reference || "
           "scheme) of the next-token distributions, per scored token, in nats.", ""]
    rows = [[f"`{name}`", fmt(s.get("perplexity")), pct(s.get("perplexity_change")), fmt(s.get("mean_kl")),
             fmt(s.get("max_kl")), pct(s.get("top1_agreement"), sign=False)]
            for name, s in sorted(d["schemes"].items())]
    return out + table(["scheme", "perplexity", "change", "mean KL", "max KL", "top-1 agreement"], rows)


def pct(x: float | None, sign: bool = True) -> str:
    if x is None:
        return "-"
    return f"{x * 100:+.2f}%" if sign else f"{x * 100:.2f}%"


def lm_eval(d: Json) -> Lines:
    """lm-evaluation-harness accuracy per task and expert scheme."""
    schemes = sorted(d["accuracy"])
    tasks = sorted({t for s in schemes for t in d["accuracy"][s]})
    rows = []
    for task in tasks:
        first = next(d["accuracy"][s][task] for s in schemes if task in d["accuracy"][s])
        rows.append([f"`{task}`", fmt(first.get("documents"))]
                    + [fmt((d["accuracy"][s].get(task) or {}).get("acc")) for s in schemes]
                    + [fmt(first.get("acc_stderr"))])
    out = [f"{fmt(d.get('setting'))}; `acc` per scheme.", ""]
    return out + table(["task", "documents"] + [f"`{s}`" for s in schemes] + ["stderr"], rows)


KERNEL_FIGURES = [
    ("mira_one_expert_s", "Mira, one expert, batch 1"),
    ("mira_one_expert_GBps", "Mira, one expert: blob GB/s"),
    ("read_one_expert_s", "plain read of one expert's bytes"),
    ("torch_bf16_one_expert_s", "torch bf16, one expert"),
    ("torch_dequant_then_matmul_one_expert_s", "torch dequantize then matmul, one expert"),
    ("mira_top2_s", "Mira, top-k decode call"),
    ("torch_bf16_top2_s", "torch bf16, top-k"),
    ("mira_prefill_s", "Mira, prefill (grouped GEMM)"),
    ("torch_bf16_prefill_s", "torch bf16, prefill"),
    ("prefill_mira_over_torch_bf16", "prefill, Mira / torch bf16 time"),
    ("pinned_copy_GBps", "pinned host -> device copy, GB/s"),
    ("zero_copy_GBps", "zero-copy read from pinned memory, GB/s"),
    ("zero_copy_over_copy_bandwidth", "zero-copy / copy bandwidth"),
]


def kernels(d: Json) -> Lines:
    """The fused INT8 kernels against torch and the memory ceilings, per model shape."""
    shapes = d["shapes"]
    out = [f"Setup: {fmt(d.get('setup'))}." if not isinstance(d.get("setup"), dict) else
           "Setup: " + "; ".join(f"{k} {fmt(v)}" for k, v in d["setup"].items()) + ".", ""]
    out += ["Ceilings measured on the machine: "
            + "; ".join(f"`{k}` {fmt(v)}" for k, v in (d.get("ceilings") or {}).items()) + ".", ""]
    rows = [[label] + [fmt(s.get(key), key) for s in shapes.values()]
            for key, label in KERNEL_FIGURES if any(key in s for s in shapes.values())]
    out += table(["figure"] + list(shapes), rows)
    rest = {k: v for k, v in d.items() if k not in ("shapes", "setup", "ceilings")}
    return out + ["All figures of the file:", ""] + generic(rest) + records_table("shapes", list(shapes.items()))


def policies(d: Json) -> Lines:
    """PCIe GB moved replaying real routing traces through every policy and Belady's bound."""
    out: Lines = []
    for case in d["cases"]:
        rows_in = case["rows"]
        names = list(rows_in[0]["pcie_gb"])
        ratios = [k for k in rows_in[0] if k.startswith("mira_")]
        rows = [[fmt(r["slots"])] + [fmt(r["pcie_gb"].get(n)) for n in names] + [fmt(r[k]) for k in ratios]
                for r in rows_in]
        out += [f"{case['name']}: {fmt(case.get('tokens'))} tokens, {fmt(case.get('experts'))} experts of "
                f"{fmt(case.get('expert_bytes'))} bytes. PCIe GB:", ""]
        out += table(["slots"] + names + [f"`{k}`" for k in ratios], rows)
    rest = {k: v for k, v in d.items() if k != "cases"}
    return out + generic(rest)


def online_optimum(d: Json) -> Lines:
    """Blobs moved over Belady's by the optimal policy of a fitted Markov chain, mira and the baselines."""
    out: Lines = []
    for case in d["cases"]:
        names = list(case["rows"][0]["over_belady"])
        rows = [[fmt(r["slots"])] + [fmt(r["over_belady"][n]) for n in names] for r in case["rows"]]
        out += [f"{case['name']}: {fmt(case.get('tokens'))} tokens replayed, {fmt(case.get('calibration_tokens'))} "
                "tokens of calibration. Blobs moved over Belady's:", ""]
        out += table(["slots"] + names, rows)
    rest = {k: v for k, v in d.items() if k != "cases"}
    return out + generic(rest)


def predictor(d: Json) -> Lines:
    """Coverage@k of each expert predictor, mean over layers, decode and prefill steps."""
    rows = []
    for name, phases in sorted(d["coverage"].items()):
        for phase, at_k in sorted(phases.items()):
            rows.append([f"`{name}`", phase] + [fmt((at_k.get(k) or {}).get("mean")) for k in ("@1", "@2", "@3")])
    out = table(["predictor", "steps", "Coverage@1", "Coverage@2", "Coverage@3"], rows)
    rest = {k: v for k, v in d.items() if k not in ("coverage", "training")}
    return out + generic(rest)


Renderer = tuple[str, Callable[[Json], bool], Callable[[Json], str], Callable[[Json], Lines]]

# First match wins; each is keyed on fields its kind of result holds.
RENDERERS: list[Renderer] = [
    ("mira bench", lambda d: {"runs", "configs", "budgets"} <= d.keys(), bench_title, bench),
    ("mira eval ppl", lambda d: {"schemes", "reference"} <= d.keys(),
     lambda d: "`mira eval ppl`: what each expert scheme costs in quality", eval_ppl),
    ("lm-eval", lambda d: "accuracy" in d, lambda d: "lm-evaluation-harness tasks per expert scheme", lm_eval),
    ("kernels", lambda d: {"shapes", "ceilings"} <= d.keys(),
     lambda d: "fused INT8 expert kernels against torch and the ceilings", kernels),
    ("online optimum", lambda d: isinstance(d.get("cases"), list)
     and all("over_belady" in r for c in d["cases"] for r in c.get("rows", [{}])),
     lambda d: "the best online policy of a first-order Markov chain against Belady, mira and the baselines",
     online_optimum),
    ("policies", lambda d: isinstance(d.get("cases"), list) and all("rows" in c for c in d["cases"]),
     lambda d: "replaying real routing through the residency policies", policies),
    ("predictor", lambda d: "coverage" in d, lambda d: "expert prediction i -> i+2, Coverage@k", predictor),
    ("generic", lambda d: True, lambda d: "", generic),
]


# ---- the document ----

def load_results() -> dict[str, Json]:
    results = {}
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        results[path.stem] = data if isinstance(data, dict) else {"entries": data}
    return results


def section(stem: str, data: Json) -> Lines:
    kind, _, title, render = next(r for r in RENDERERS if r[1](data))
    name = f"{stem}.json"
    out = [f"## {stem}", ""]
    if title(data):
        out += [f"{title(data)}.", ""]
    out += [f"Source: [`benchmarks/results/{name}`](../benchmarks/results/{name}).", ""]
    for key in PROVENANCE:
        if isinstance(data.get(key), str):
            value = data[key]
            out.append(f"- {key}: `{value}`" if key == "command" else f"- {key}: {fmt(value)}")
    if "command" not in data:
        out.append("- command: not recorded at the top level (see the tables)")
    out.append("")
    chart = RESULTS / f"{stem}.png"
    if chart.exists():
        out += [f"![{stem}](../benchmarks/results/{stem}.png)", ""]
    return out + render(data)


def headline_rows(results: dict[str, Json], doc: str) -> list[list[str]]:
    """The few figures README shows, each linked to its section of `doc` (the path to benchmarks.md)."""
    def run(stem: str, config: str, budget: str, quant: str | None = None) -> Json:
        return next(r for r in results[stem]["runs"] if r["config"] == config and r["budget"] == budget
                    and quant in (None, r.get("quant")) and not r.get("beam_search"))

    def tps(stem: str, config: str, budget: str) -> str:
        return with_range(run(stem, config, budget), "decode_tokens_per_s")

    def medians(cells: list[tuple[str, str]], configs: dict[str, str]) -> str:
        """Medians of (stem, budget) cells, each of its stem's configuration in `configs`."""
        return " / ".join(fmt(run(stem, configs[stem], b)["decode_tokens_per_s"]) for stem, b in cells)

    def link(stem: str) -> str:
        return f"[{stem}]({doc}#{stem})"

    def by_quant(stem: str, quant: str, budgets: list[str]) -> str:
        """mira's medians in `stem` with experts in `quant`, one per budget."""
        return " / ".join(fmt(run(stem, "mira", b, quant)["decode_tokens_per_s"]) for b in budgets)

    mixtral, dsv2, dsv2_budget = "bench-mixtral-8x7b", "bench-deepseek-v2-lite", "bench-deepseek-v2-lite-policies"
    int4, int4_budgets = "bench-mixtral-8x7b-int4", ["12GiB", "24GiB"]
    hybrid, hybrid_24 = "bench-mixtral-8x7b-hybrid-budgets", "bench-mixtral-8x7b-hybrid-24gib"  # 24 GiB: its own run
    hybrid_cells = [(hybrid, "8GiB"), (hybrid, "12GiB"), (hybrid_24, "24GiB")]
    names = {stem: cpu_share_configs(results[stem]) for stem in (hybrid, hybrid_24)}
    gpu_only = {stem: gpu for stem, (gpu, _) in names.items()}
    shared = {stem: configs[0] for stem, (_, configs) in names.items()}
    kernel = results["kernels-h200"]["shapes"]["mixtral-8x7b"]
    quality = results["eval-tiny"]["schemes"]["int8-shared"]
    quality4 = results["eval-tiny-int4"]["schemes"]["int4"]
    coverage = results["predictor-tiny"]["coverage"]
    return [
        ["Mixtral-8x7B shape, every expert on the GPU: decode tokens/s",
         tps(mixtral, "mira", "all"), f"transformers bf16 {tps(mixtral, 'hf-gpu', 'all')}", link(mixtral)],
        ["DeepSeek-V2-Lite shape, every expert on the GPU: decode tokens/s",
         tps(dsv2, "mira", "all"), f"transformers bf16 {tps(dsv2, 'hf-gpu', 'all')}", link(dsv2)],
        ["DeepSeek-V2-Lite shape, slots for a quarter of the experts: decode tokens/s",
         tps(dsv2_budget, "mira", "25%"),
         f"static {tps(dsv2_budget, 'static', '25%')}, LRU {tps(dsv2_budget, 'lru', '25%')}, "
         f"LFU {tps(dsv2_budget, 'lfu', '25%')}", link(dsv2_budget)],
        ["DeepSeek-V2-Lite shape, 8 GiB budget: decode tokens/s", tps(dsv2, "mira", "8GiB"),
         f"accelerate offload {tps(dsv2, 'hf-offload', '8GiB')}", link(dsv2)],
        ["Mixtral-8x7B shape replaying real routing, misses shared with the CPU (`--cpu-experts auto`): "
         "median decode tokens/s at 8 / 12 / 24 GiB", medians(hybrid_cells, shared),
         f"GPU only {medians(hybrid_cells, gpu_only)}", f"{link(hybrid)}, {link(hybrid_24)}"],
        ["Mixtral-8x7B shape replaying real routing, `--quant int4`: median decode tokens/s at 12 / 24 GiB",
         by_quant(int4, "int4", int4_budgets), f"int8-shared {by_quant(int4, 'int8-shared', int4_budgets)}",
         link(int4)],
        ["one Mixtral-shaped INT8 expert, batch 1",
         fmt(kernel["mira_one_expert_s"], "_s"), f"torch bf16 {fmt(kernel['torch_bf16_one_expert_s'], '_s')}",
         link("kernels-h200")],
        ["bundled model, quantized experts: perplexity change, top-1 agreement (CPU)",
         f"int8-shared {pct(quality['perplexity_change'])}, {pct(quality['top1_agreement'], sign=False)}; "
         f"int4 {pct(quality4['perplexity_change'])}, {pct(quality4['top1_agreement'], sign=False)}",
         "unquantized experts", f"{link('eval-tiny')}, {link('eval-tiny-int4')}"],
        ["bundled model, experts of layer i+2 predicted at layer i: decode Coverage@2",
         fmt(coverage["mixture"]["decode"]["@2"]["mean"]),
         f"gate speculation {fmt(coverage['gate']['decode']['@2']['mean'])}", link("predictor-tiny")],
    ]


def headline(results: dict[str, Json], doc: str) -> Lines:
    try:
        rows = headline_rows(results, doc)
    except (KeyError, StopIteration) as e:
        raise SystemExit(f"benchmarks_doc: error: a headline figure's result is gone ({type(e).__name__} {e}); "
                         "point headline_rows in tools/benchmarks_doc.py at the file that replaced it") from None
    return table(["measurement (H200 unless noted; synthetic shapes have random weights and routing)",
                  "Mira", "against", "source"], rows)


def document(results: dict[str, Json]) -> str:
    out = ["# Benchmarks", "",
           "Written by `python tools/benchmarks_doc.py` from `benchmarks/results/*.json`; do not edit by hand.",
           "Each section is one result file: the command that wrote it, the commit and machine it ran on,",
           "and its figures as the file holds them (medians with their range where the run repeated).",
           "Analyses that interpret these figures: [quality of the expert schemes](../benchmarks/quality.md).",
           "", "## Headline figures", ""]
    out += headline(results, "")
    out += ["## Result files", ""]
    out += [f"- [{stem}](#{stem})" for stem in results] + [""]
    for stem, data in results.items():
        out += section(stem, data)
    return "\n".join(out).rstrip("\n") + "\n"


def readme_with_headline(readme: str, results: dict[str, Json]) -> str:
    """README with the lines between the headline markers replaced by the current table."""
    if HEADLINE_BEGIN not in readme or HEADLINE_END not in readme:
        raise SystemExit(f"benchmarks_doc: error: README.md lacks the markers {HEADLINE_BEGIN!r} ... "
                         f"{HEADLINE_END!r}; put them where the headline table goes")
    head, rest = readme.split(HEADLINE_BEGIN, 1)
    _, tail = rest.split(HEADLINE_END, 1)
    return head + HEADLINE_BEGIN + "\n" + "\n".join(headline(results, "docs/benchmarks.md")) + HEADLINE_END + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if docs/benchmarks.md or README's table is stale")
    args = parser.parse_args(argv)
    results = load_results()
    wanted = {DOC: document(results), README: readme_with_headline(README.read_text(), results)}
    stale = [p for p, text in wanted.items() if not p.exists() or p.read_text() != text]
    if args.check:
        if stale:
            names = " and ".join(str(p.relative_to(ROOT)) for p in stale)
            verb = "is" if len(stale) == 1 else "are"
            print(f"benchmarks_doc: {names} {verb} stale; run python tools/benchmarks_doc.py", file=sys.stderr)
            return 1
        return 0
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(wanted[path])
        tmp.replace(path)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
