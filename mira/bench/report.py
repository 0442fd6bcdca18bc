"""The table and charts of a `mira bench` result (the JSON that mira.bench.run writes)."""

from __future__ import annotations

from mira.cache.costmodel import HybridCosts
from mira.charts import save_png


def format_table(result: dict) -> str:
    """One line per run: budget, configuration, speed, where tokens were served, PCIe, the bound."""
    header = ["budget", "config", "quant", "beams", "slots", "TTFT s", "decode tok/s (range)", "e2e tok/s", "hot/stage/miss %",
              "PCIe GB", "prefetch P/R", "bound tok/s", "achieved/bound", "CPU tokens", "hybrid bound tok/s"]
    lines = [header]
    for row in result["runs"]:
        if row.get("skipped"):  # its reason follows the table (mira bench prints it whole)
            lines.append([row["budget"], row["config"], row.get("quant", ""), "", "", "", "skipped"] + [""] * 8)
            continue
        served = row.get("tokens_served")
        share = "/".join(f"{100 * served[t] / max(sum(served.values()), 1):.0f}" for t in ("hot", "stage", "miss")) \
            if served else ""
        precision, recall = row.get("prefetch_precision"), row.get("prefetch_recall")
        bound = {} if "figures_of" in row.get("bound", {}) else row.get("bound", {})  # another machine's limit
        lines.append([
            row["budget"], row["config"], row.get("quant", ""), str(row.get("num_beams", 1)), str(row.get("slots", "")),
            _num(row.get("ttft_s")), _median_range(row, "decode_tokens_per_s"), _num(row.get("e2e_tokens_per_s")),
            share,
            _num(row.get("pcie_gb")), f"{precision:.2f}/{recall:.2f}" if precision is not None else "",
            _num(bound.get("bound_tokens_per_s")), _num(row.get("achieved_over_bound")), _num(row.get("cpu_tokens")),
            _num(bound.get("hybrid_bound_tokens_per_s")),
        ])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    title = f"{result['model']}, {result['routing']} routing, prompts: {result['prompt_set']}, {result['machine']}"
    body = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in lines]
    compared = [f"{budget}: mira {c['mira']:.3g} tokens/s, {c['mira_over_best_baseline']:.3f}x the fastest baseline "
                f"({c['best_baseline']}{' on ' + c['best_baseline_ran_on'] if 'best_baseline_ran_on' in c else ''}, "
                f"{c['best_baseline_tokens_per_s']:.3g}); achieved/bound "
                f"{_num(c['mira_achieved_over_bound']) or '-'}" for budget, c in result.get("comparison", {}).items()]
    steady = [row for row in result["runs"] if row.get("decode_route_changes", {}).get("low")]
    if steady:
        changes = steady[0]["decode_route_changes"]
        body.append(f"note: in {len(steady)} run(s) decode routing barely changes from step to step ({changes['value']} "
                    f"of layer-steps change their experts, {changes['uniform']} under uniform routing): their budgets "
                    "hardly matter (mira.bench.variety)")
    lines = [title, *body] + (["", "mira against the fastest baseline:", *compared] if compared else [])
    lines += cpu_share_lines(result) + share_off_lines(result)
    for budget, configs in result.get("quant_comparison", {}).items():
        for config, speeds in configs.items():
            ratios = ", ".join(f"{key.replace('_over_', ' / ')} {value:.3f}x" for key, value in speeds.items()
                               if "_over_" in key)
            lines.append(f"{budget}: {config} decode tokens/s by scheme: " + ", ".join(
                f"{scheme} {value:.3g}" for scheme, value in speeds.items() if "_over_" not in scheme) + f"; {ratios}")
    return "\n".join([*lines, *layer_times(result)])


GPU_ONLY = "mira-gpu"  # mira with --cpu-experts off


def cpu_share_configs(result: dict) -> tuple[str, tuple[str, ...]]:
    """A result's GPU-only mira configuration and those that may give the CPU a share of the
    misses. In results from before `--cpu-experts auto` was generate's default, `mira` had no CPU
    share and `mira-cpu-auto` had the calibrated one; mira-cut-any (cuts beside whole misses too) is
    in older results only."""
    if any(row.get("config") == GPU_ONLY for row in result["runs"]):
        return GPU_ONLY, ("mira", "mira-cpu-split", "mira-cpu-all", "mira-cpu-graph", "mira-cpu-graph-1",
                          "mira-cut-any")
    return "mira", ("mira-cpu-auto", "mira-cpu-all")


def cpu_share_lines(result: dict) -> list[str]:
    """Per budget and scheme where a configuration with a CPU share ran beside GPU-only mira: its
    median decode tokens/s over GPU-only mira's in the same run, and over the caching bound, with
    auto's verdict on its share after the first decode steps; then each repeat's tokens/s and the
    CPU's experts in it (a drift over the repeats shows there)."""
    gpu_name, shared = cpu_share_configs(result)
    lines = []
    for row in result["runs"]:
        if row.get("config") not in shared or "decode_tokens_per_s" not in row:
            continue
        gpu_only = [r for r in result["runs"] if r.get("config") == gpu_name and r["budget"] == row["budget"]
                    and r.get("quant") == row.get("quant") and r.get("num_beams", 1) == row.get("num_beams", 1)
                    and "decode_tokens_per_s" in r]
        if not gpu_only:
            continue
        speed, bound = row["decode_tokens_per_s"], row.get("bound", {}).get("bound_tokens_per_s")
        line = (f"{row['budget']}: {row['config']} {speed:.3g} tokens/s, "
                f"{speed / gpu_only[0]['decode_tokens_per_s']:.3f}x {gpu_name} (GPU only)")
        if bound and "figures_of" not in row["bound"]:
            line += f", {speed / bound:.3f}x the caching bound"
        review = (row.get("cpu_experts") or {}).get("review")
        if review is not None:
            line += (f"; the share {'kept' if review['kept'] else 'dropped'} after {review['after_decode_steps']} "
                     f"decode steps, priced to save {review['paced_saving_ms']:.3g} ms a layer")
        lines.append(line)
        lines += [f"  repeat {number}: {_repeat(r)}" for number, r in enumerate(row.get("repeats", []), 1)
                  if "cpu_experts" in r]
    return ["", "the CPU's share against GPU-only mira in the same run:", *lines] if lines else []


def share_off_lines(result: dict) -> list[str]:
    """Per budget where a calibration left auto's CPU share off at load: the runs it did so in, and
    one CPU expert at one token against its read over PCIe, as calibrated, so that a calibration
    taken in a slow stretch of the host shows beside the figures it shaped
    (mira.runtime.hybrid.machine_costs)."""
    off: dict[tuple[str, str], list[str]] = {}
    for row in result["runs"]:
        share = row.get("cpu_experts") or {}
        if share.get("mode") == "off" and share.get("calibration"):
            costs = HybridCosts.from_json(share["calibration"])
            priced = f"a CPU expert at one token {1e3 * costs.cpu_s(1):.3g} ms against its read over PCIe " \
                     f"{1e3 * costs.pcie_s(1):.3g} ms"
            off.setdefault((row["budget"], priced), []).append(row["config"])
    lines = [f"{budget}: the CPU's share stayed off in {', '.join(configs)}: calibrated, {priced}"
             for (budget, priced), configs in off.items()]
    return ["", *lines] if lines else []


def stolen_note(figures: dict) -> str:
    """", 6.1% of the host's CPU stolen" for a run (or repeat) whose host lost CPU time to its
    hypervisor (mira.runtime.hostcpu); empty where none was lost or none was recorded."""
    share = figures.get("host_cpu_stolen")
    return f", {100 * share:.1f}% of the host's CPU stolen" if share else ""


def _repeat(figures: dict) -> str:
    """One repeat's decode tokens/s and the CPU's experts in it (whole, and cut with the device),
    with their mean compute time, each side's pace at the repeat's end, and the host's CPU time
    stolen in it."""
    speed = figures.get("decode_tokens_per_s")
    text = f"{speed:.3g} tokens/s" if speed is not None else "no decode timing"
    text += f", {figures['cpu_experts']:,} experts on the CPU"
    if figures.get("cpu_cuts"):
        text += f" and {figures['cpu_cuts']:,} in part"
    if figures.get("cpu_compute_ms_per_expert") is not None:
        text += f" at {figures['cpu_compute_ms_per_expert']:.3g} ms each"
    if figures.get("cpu_pace") is not None:
        text += f", the CPU's side priced at {figures['cpu_pace']:.3g}x its calibration"
        if figures.get("cpu_cut_pace") is not None:
            text += f" ({figures['cpu_cut_pace']:.3g}x with a cut)"
    if figures.get("device_pace") is not None:
        text += f", the device's side at {figures['device_pace']:.3g}x"
    return text + stolen_note(figures)


COVERS = {"timed runs": "the timed runs", "last turn": "the last turn's timed run"}  # runs a CPU table covers


def layer_times(result: dict) -> list[str]:
    """Per run whose CPU computed missed experts: each MoE layer's cost-model prediction per call
    (the later side, and the CPU's side) against the measured time (hand-off to the worker's partial
    sum written) and the worker's compute time within it, and where the device's side was timed, it
    and the later side against the prediction; then the paced decode jobs' CPU side by kind
    (mira.cache.telemetry.HybridTelemetry); in milliseconds."""
    lines = []
    for row in result["runs"]:
        layers = [layer for layer in (row.get("cpu_experts") or {}).get("layers", []) if "predicted_ms" in layer]
        if not layers:
            continue
        # results written before the per-layer times covered the timed runs alone cover every run
        covers = COVERS.get(row["cpu_experts"].get("covers"), "every run")
        lines += ["", f"{row['config']} at {row['budget']}: predicted and measured ms per MoE layer call with a CPU "
                      f"share (over {covers} of the configuration)",
                  "  layer  calls  CPU experts  predicted ms  predicted CPU ms  measured ms  CPU compute ms  "
                  "predicted/measured  device ms  predicted/served"]
        lines += [f"  {layer['layer']:>5}  {layer['calls']:>5}  {layer['experts']:>11}  {layer['predicted_ms']:>12.3f}  "
                  f"{layer['predicted_cpu_ms']:>16.3f}  {layer['measured_ms']:>11.3f}  "
                  f"{_num(layer.get('cpu_compute_ms')):>14}  "
                  f"{_num(layer.get('predicted_over_measured')):>18}  {_num(layer.get('device_ms')):>9}  "
                  f"{_num(layer.get('predicted_over_served')):>16}" for layer in layers]
        jobs = row["cpu_experts"].get("jobs", [])
        if jobs:
            lines += ["", f"{row['config']} at {row['budget']}: the CPU's side of the decode jobs a pace learnt from, "
                          "calibrated against measured, by kind",
                      "  whole experts  cut share  jobs  calibrated ms  measured ms  measured/calibrated  compute ms"]
            lines += [f"  {job['whole_experts']:>13}  {job['cut_share'] or '-':>9}  {job['jobs']:>4}  "
                      f"{job['calibrated_ms']:>13.3f}  {job['measured_ms']:>11.3f}  "
                      f"{job['measured_over_calibrated']:>19.3f}  {_num(job.get('compute_ms')):>10}" for job in jobs]
    return lines


# one colour each, the same in every chart (mira-cpu-auto, mira-cut-any: older results)
CONFIG_ORDER = ("mira", "mira-cpu-auto", "mira-cpu-all", "mira+p", "mira+p-lagged", "mira+gate", "mira-inline",
                "mira-lagged", "mira-eager", "lru", "lru-lagged", "lfu", "static", "hf-gpu", "hf-offload",
                "mira-gpu", "mira-device-calibrated", "mira-cpu-split", "mira-settle-now", "static-settle-now",
                "mira-cut-any", "mira-cpu-graph", "mira-cpu-graph-1", "mira-token-first", "static-token-first")


def plot(result: dict, path: str) -> None:
    """Decode tokens/s and TTFT per budget (ascending), one colour per configuration in every chart,
    the repeats' range as error bars, the decode bound drawn, bf16 all-on-GPU as a level."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    runs = [r for r in result["runs"] if not r.get("skipped") and not r.get("beam_search")]
    schemes = list(dict.fromkeys(r["quant"] for r in runs if r.get("quant"))) or [None]
    lines = ("-", "--", "-.", (0, (1, 1)))  # one per scheme, in the order they ran
    style = {scheme: lines[i % len(lines)] for i, scheme in enumerate(schemes)}
    size = {r["budget"]: r.get("budget_bytes", 0) for r in runs if r["config"] != "hf-gpu"}
    budgets = sorted((b for b in result["budgets"] if b in size), key=size.get)
    colours = pyplot.get_cmap("tab20").colors + pyplot.get_cmap("tab20b").colors
    colour = {name: colours[i % len(colours)] for i, name in enumerate(CONFIG_ORDER)}
    figure, axes = pyplot.subplots(1, 2, figsize=(12, 4.5))
    for axis, key, label in ((axes[0], "decode_tokens_per_s", "decode tokens/s"), (axes[1], "ttft_s", "TTFT (s)")):
        series = dict.fromkeys((r["config"], r.get("quant")) for r in runs)
        for config, scheme in sorted(series, key=lambda s: (_config_rank(s[0]), schemes.index(s[1]) if s[1] else 0)):
            chosen = [r for r in runs if r["config"] == config and r.get("quant") == scheme and r.get(key)]
            if config == "hf-gpu" and chosen:
                where = "GPU" if chosen[0].get("device", "cuda") == "cuda" else chosen[0]["device"].upper()
                axis.axhline(chosen[0][key], linestyle="--", color=colour["hf-gpu"],
                             label=f"hf-gpu ({chosen[0].get('dtype', 'bfloat16')}, all on {where})")
                continue
            chosen = sorted((r for r in chosen if r["budget"] in budgets), key=lambda r: budgets.index(r["budget"]))
            if not chosen:
                continue
            x = [budgets.index(r["budget"]) for r in chosen]
            y = [r[key] for r in chosen]
            spread = [[v - r.get(f"{key}_range", [v, v])[0] for v, r in zip(y, chosen)],
                      [r.get(f"{key}_range", [v, v])[1] - v for v, r in zip(y, chosen)]]
            name = f"{config}/{scheme}" if scheme and len(schemes) > 1 else config
            axis.errorbar(x, y, yerr=spread, marker="o", capsize=3, label=name, color=colour.get(config),
                          linestyle=style.get(scheme, "-"))
        if key == "decode_tokens_per_s":
            for scheme in schemes:
                bound = {r["budget"]: r["bound"]["bound_tokens_per_s"] for r in runs
                         if r.get("bound") and "figures_of" not in r["bound"] and r.get("quant") == scheme}
                points = [(budgets.index(b), bound[b]) for b in budgets if b in bound]
                if points:
                    axis.plot(*zip(*points), linestyle=":" if len(schemes) == 1 else style[scheme], color="black",
                              marker="_", label=f"bound, {scheme}" if len(schemes) > 1 else "bound")
        axis.set_xticks(range(len(budgets)), budgets)
        axis.set_xlabel("VRAM budget")
        axis.set_ylabel(label)
        axis.set_yscale("log")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle(f"{result['model']} ({result['routing']} routing), {result['prompt_set']}; {result['machine']}",
                    fontsize=9)
    figure.tight_layout()
    save_png(figure, path, dpi=110)
    pyplot.close(figure)


def _config_rank(name: str) -> int:
    return CONFIG_ORDER.index(name) if name in CONFIG_ORDER else len(CONFIG_ORDER)


def _median_range(row: dict, key: str) -> str:
    """A median with the range of its repeats, when it has one."""
    low_high = row.get(f"{key}_range")
    median = _num(row.get(key))
    return f"{median} ({_num(low_high[0])}-{_num(low_high[1])})" if low_high and median else median


def _num(value) -> str:
    if value is None:
        return ""
    return f"{value:.3g}" if isinstance(value, float) else str(value)
