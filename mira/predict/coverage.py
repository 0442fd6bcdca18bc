"""Mass-weighted Coverage@k, the predictor metric of the paper's Fig. 9 (section VI-B).

For one forward step and one source layer i, a predictor ranks the experts of layer i+2; its
Coverage@k is the fraction of the routed token mass actually seen at layer i+2 (each token's K
routed slots, one unit of mass each) that falls on the predictor's top k experts. Read k as the
prefetch budget: Coverage@2 is the share of the routing that two prefetched experts would serve.
Steps are averaged weighted by their tokens.

Ties in a predictor's scores go to the lower expert id, so a result never depends on the sort.
"""

from __future__ import annotations

import numpy as np

from mira.charts import save_png


def top_experts(scores: np.ndarray, k: int) -> np.ndarray:
    """The k best-scored experts of each row, ties to the lower id.

    Args:
        scores: float [..., E].
        k: experts kept, 1 <= k <= E.

    Returns:
        int64 [..., k]: expert ids, best first.
    """
    return np.argsort(-scores, axis=-1, kind="stable")[..., :k]


def coverage(scores: np.ndarray, mass: np.ndarray, k: int, weights: np.ndarray | None = None) -> np.ndarray:
    """Mass-weighted Coverage@k per layer.

    S steps, L layers (source layers, or any other grouping), E experts.

    Args:
        scores: float [S, L, E]: the predictor's scores for the target layer of each source layer.
        mass: float [S, L, E]: the routed token mass actually seen at the target layer; rows need not
            be normalized (a row of counts works), rows of zeros count as covered nothing.
        k: the prefetch budget.
        weights: float [S]: the weight of each step (its tokens); default 1 each.

    Returns:
        float64 [L]: the weighted mean over steps of the covered fraction of each row's mass.

    Raises:
        ValueError: shapes that do not match, k outside 1..E, or no weight at all.
    """
    if scores.shape != mass.shape or scores.ndim != 3:
        raise ValueError(f"scores {scores.shape} and mass {mass.shape} must both be [steps, layers, experts]")
    if not 1 <= k <= scores.shape[-1]:
        raise ValueError(f"k must be between 1 and {scores.shape[-1]} experts, got {k}")
    weights = np.ones(scores.shape[0]) if weights is None else np.asarray(weights, dtype=np.float64)
    if weights.shape != scores.shape[:1] or weights.sum() <= 0:
        raise ValueError(f"weights must be [{scores.shape[0]}] with a positive sum, got shape {weights.shape}")
    mass = mass.astype(np.float64)
    total = mass.sum(-1)  # [S, L]
    covered = np.take_along_axis(mass, top_experts(scores, k), axis=-1).sum(-1)  # [S, L]
    fraction = np.divide(covered, total, out=np.zeros_like(covered), where=total > 0)  # [S, L]
    return (weights[:, None] * fraction).sum(0) / weights.sum()  # [L]


PREDICTORS = ("mixture", "act", "hist", "gate", "previous", "popularity", "oracle")
LABELS = {"mixture": "MixtureHead", "act": "ActHead alone", "hist": "HistHead alone", "gate": "gate speculation",
          "previous": "previous step", "popularity": "popularity", "oracle": "oracle (ceiling)"}
SUBSETS = {"decode": "steps of one token (decode)", "prefill": "steps of a prompt (prefill), token-weighted",
           "all": "all steps, token-weighted"}


def predictor_scores(features, heads=None, popularity: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Every predictor's scores for layer i+2 at every step and source layer i of one trace.

    S steps, L MoE layers, E experts.

    Args:
        features: a `FeatureSet` (its routing gives the targets and the baselines' inputs).
        heads: trained `PredictorHeads`, or None to leave out mixture, act and hist.
        popularity: int [L, E] routed slots per expert in a profile, or None to leave it out.

    Returns:
        name -> float [S, L-2, E]; "oracle" is the target itself (the best any predictor can do).
    """
    import torch

    from mira.predict.features import HeadInputs, history

    sources = features.num_layers - 2
    scores = {"gate": features.speculation, "previous": history(features.mass, 1)[:, 2:],
              "oracle": features.targets()}
    if popularity is not None:
        scores["popularity"] = np.broadcast_to(np.asarray(popularity, np.float64)[None, 2:], scores["gate"].shape)
    if heads is not None:
        inputs = features.inputs(heads.config.history_window)
        with torch.no_grad():
            outputs = [heads(layer, HeadInputs(*(t[:, layer] for t in inputs))) for layer in range(sources)]
        for name in ("logits", "act", "hist"):
            stacked = torch.stack([getattr(out, name) for out in outputs], 1).numpy()  # [S, L-2, E]
            scores["mixture" if name == "logits" else name] = stacked
    return scores


def evaluate(feature_sets, heads=None, popularity: np.ndarray | None = None, ks=(1, 2, 3)) -> dict:
    """Coverage@k per source layer of every predictor over some traces (paper Fig. 9).

    Args:
        feature_sets: `FeatureSet`s of held-out traces (each checked against its trace by the caller).
        heads: trained `PredictorHeads`, or None.
        popularity: int [L, E] profile for the popularity baseline, or None.
        ks: the prefetch budgets.

    Returns:
        JSON-ready: steps and tokens counted, and coverage[predictor][subset]["@k"] = {"layers": [L-2
        floats], "mean": float} for the subsets of SUBSETS (decode: one-token steps; prefill:
        prompt steps, token-weighted; all: every step, token-weighted).
    """
    per_set = [predictor_scores(features, heads, popularity) for features in feature_sets]
    targets = np.concatenate([features.targets() for features in feature_sets])  # [S, L-2, E]
    tokens = np.concatenate([features.tokens for features in feature_sets])  # [S]
    masks = {"decode": tokens == 1, "prefill": tokens > 1, "all": np.ones(len(tokens), bool)}
    result = {"steps": len(tokens), "decode_steps": int(masks["decode"].sum()), "tokens": int(tokens.sum()),
              "prefill_tokens": int(tokens[masks["prefill"]].sum()), "coverage": {}}
    for name in (name for name in PREDICTORS if name in per_set[0]):
        scores = np.concatenate([scored[name] for scored in per_set])
        result["coverage"][name] = {
            subset: {f"@{k}": _summary(coverage(scores[mask], targets[mask], k, tokens[mask])) for k in ks}
            for subset, mask in masks.items() if mask.any()}
    return result


def _summary(per_layer: np.ndarray) -> dict:
    return {"layers": [round(float(value), 4) for value in per_layer], "mean": round(float(per_layer.mean()), 4)}


def format_coverage(result: dict) -> str:
    """A text table of `evaluate`'s result: means of every subset, and per layer Coverage@2 on decode steps."""
    coverage_of = result["coverage"]
    ks = list(next(iter(coverage_of.values()))["all"])
    subsets = [s for s in SUBSETS if s in next(iter(coverage_of.values()))]
    sources = len(next(iter(coverage_of.values()))["all"][ks[0]]["layers"])
    lines = [f"mass-weighted Coverage@k of layer i+2 over {result['steps']} steps ({result['decode_steps']} decode, "
             f"{result['tokens']} tokens); mean over source layers 0..{sources - 1}"]
    header = ["predictor"] + [f"{s} {k}" for s in subsets for k in ks] + [f"L{i} @2" for i in range(sources)]
    rows = [header]
    for name, per_subset in coverage_of.items():
        decode = per_subset.get("decode", per_subset["all"])
        row = [LABELS[name]] + [f"{per_subset[s][k]['mean']:.3f}" for s in subsets for k in ks]
        rows.append(row + [f"{value:.2f}" for value in decode[ks[min(1, len(ks) - 1)]]["layers"]])
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines += ["  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]) for row in rows]
    steps = "decode steps" if "decode" in subsets else "all steps (the traces have no decode step)"
    lines.append(f"per-layer columns: Coverage@2 on {steps}; " + "; ".join(f"{s}: {SUBSETS[s]}" for s in subsets))
    return "\n".join(lines)


def plot_coverage(result: dict, path: str, title: str = "") -> None:
    """Write a PNG like the paper's Fig. 9: Coverage@k against source layer, one panel per k, decode steps.

    Args:
        result: `evaluate`'s result.
        path: the PNG file.
        title: the figure's title (the model and the traces).
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    coverage_of = result["coverage"]
    subset = "decode" if "decode" in next(iter(coverage_of.values())) else "all"
    ks = list(next(iter(coverage_of.values()))[subset])
    figure, axes = pyplot.subplots(1, len(ks), figsize=(4.2 * len(ks), 3.8), sharey=True, squeeze=False)
    for axis, k in zip(axes[0], ks):
        for name, per_subset in coverage_of.items():
            layers = per_subset[subset][k]["layers"]
            axis.plot(range(len(layers)), layers, marker="o", markersize=3, label=LABELS[name],
                      linestyle=":" if name == "oracle" else "-", linewidth=2.2 if name == "mixture" else 1.2,
                      zorder=3 if name == "mixture" else 2)
        axis.set_title(f"Coverage{k}")
        axis.set_xlabel("source layer i (target i+2)")
        axis.set_ylim(0, 1.02)
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"routed mass covered ({subset} steps)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    figure.suptitle(title)
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    save_png(figure, path, dpi=120)
    pyplot.close(figure)
