"""Expert predictors on the bundled model's real routing (issue #6; paper IV-E, Fig. 9).

1. Records traces with predictor features of mira-tiny-moe (greedy, CPU, batch 1): prompts of the
   training split of ShareGPT (the first user message of the first conversations not held out,
   in file order) and of the held-out split (the same, held-out conversations).
2. Trains the MixtureHeads on the training traces (`mira.predict.train`, default settings).
3. Evaluates every predictor on the held-out traces: mass-weighted Coverage@1..3 of layer i+2
   per source layer, on decode steps (one token each), on prompt steps (token-weighted) and on
   all steps (token-weighted); popularity is ranked by the training traces.
4. Measures the heads' parameters and the time they add per generated token on the CPU: decoding
   with the predictor driven by hooks at every MoE layer (observe everywhere, scores at 0..L-3, as
   the runtime calls it) against plain decoding, and the predictor's calls of one decode step alone.

The recorded traces and features go to .carry/predictor/ in files of 1500 prompts (not committed;
reused when present); the results to benchmarks/results/predictor-tiny.json and predictor-tiny.png,
and the trained heads to benchmarks/results/predictor-tiny-heads.safetensors (copy it to
<store>/predictor/heads.safetensors to serve it).

    python benchmarks/predictor.py [--train-prompts 3000 --heldout-prompts 100 --max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import mira
from mira.predict.baselines import GateSpeculation
from mira.runtime.experts import model_routers
from mira.cli.predictor import record_with_features
from mira.predict.coverage import evaluate, format_coverage, plot_coverage
from mira.predict.features import HeadInputs, features_path, load_features
from mira.predict.heads import HeadConfig, TrainedPredictor, load_heads, save_heads
from mira.predict.train import TrainConfig, load_training_data, train_heads
from mira.runtime.experts import MiraExperts
from mira.runtime.generate import encode_prompt
from mira.bench.provenance import result_header

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DATA = ROOT / ".carry" / "predictor"
CHUNK = 1500  # prompts per recorded file (about 600 MB of features)
sys.path.insert(0, str(ROOT / "tools"))
from sharegpt_data import first_user_messages  # noqa: E402  (tools/: the benchmarks' ShareGPT prompts)


def _record(model, held_out: bool, count: int, max_new_tokens: int) -> list[Path]:
    """Traces with features of the first `count` prompts of a split, in files of CHUNK prompts (reused when present)."""
    paths = []
    for start in range(0, count, CHUNK):
        end = min(start + CHUNK, count)
        path = DATA / f"{'heldout' if held_out else 'train'}-{start}-{end}x{max_new_tokens}.npz"
        if not (path.is_file() and features_path(path).is_file()):
            path.parent.mkdir(parents=True, exist_ok=True)
            record_with_features(model, first_user_messages(held_out, end, start), max_new_tokens, path)
        paths.append(path)
    return paths


def _decode_ms_per_token(model, prompts: list[str], max_new_tokens: int, predictor=None) -> float:
    """Median over prompts of (generation time - prompt time) / (new tokens - 1), predictor hooked in or not."""
    handles, logits = [], {}
    if model.decode_graphs is not None:
        model.use_cuda_graphs(False)  # the hooks below run on every step, so every step runs eagerly
    if predictor is not None:
        routers = model_routers(model.hf_model)
        experts = sorted((m for m in model.hf_model.modules() if isinstance(m, MiraExperts)),
                         key=lambda m: m.layer_position)
        last = len(experts) - 2

        def at_layer(module, args):
            position = module.layer_position
            predictor.observe(position, args[1])
            if position < last:
                predictor.scores(position, args[0], logits[position], args[1])

        for position, router in enumerate(routers):
            handles.append(router.register_forward_hook(
                lambda module, args, output, position=position: logits.__setitem__(position, output[0])))
        handles += [module.register_forward_pre_hook(at_layer) for module in experts]
    times = []
    try:
        for prompt in prompts:
            ids = encode_prompt(model, prompt, False)
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=0)
            total = time.perf_counter() - start
            times.append((total - prefill) / (out.shape[1] - ids.shape[1] - 1) * 1e3)
    finally:
        for handle in handles:
            handle.remove()
    return statistics.median(times)


def _step_us(predictor, layers: int, hidden_size: int, experts: int, top_k: int, repeats: int = 300) -> float:
    """Microseconds of one decode step's predictor calls: observe at every layer, scores at 0..L-3 (best of 5)."""
    generator = torch.Generator().manual_seed(0)
    hidden, logits = torch.randn(1, hidden_size, generator=generator), torch.randn(1, experts, generator=generator)
    index = torch.randperm(experts, generator=generator)[:top_k][None]  # [1, K]

    def step() -> None:
        for layer in range(layers):
            predictor.observe(layer, index)
            if layer < layers - 2:
                predictor.scores(layer, hidden, logits, index)

    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        best = min(best, (time.perf_counter() - start) / repeats * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-prompts", type=int, default=3000, help="training-split prompts traced")
    parser.add_argument("--heldout-prompts", type=int, default=100, help="held-out prompts traced")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--timing-prompts", type=int, default=8, help="held-out prompts timed per configuration")
    args = parser.parse_args()
    torch.manual_seed(0)

    model = mira.load(device="cpu", progress=False)
    fingerprint = model.store.manifest.source_fingerprint
    train_paths = _record(model, False, args.train_prompts, args.max_new_tokens)
    heldout_paths = _record(model, True, args.heldout_prompts, args.max_new_tokens)

    config = TrainConfig()
    data = load_training_data(train_paths, fingerprint, HeadConfig.history_window)
    steps, sources, experts = data.targets.shape
    head_config = HeadConfig(num_layers=sources + 2, num_experts=experts, top_k=data.top_k,
                             hidden_size=data.inputs.hidden.shape[-1])
    start = time.perf_counter()
    heads, figures = train_heads(data, head_config, config)
    training_seconds = time.perf_counter() - start
    figures["traces"] = [str(path.relative_to(ROOT)) for path in train_paths]
    heads_path = save_heads(heads, RESULTS / "predictor-tiny-heads.safetensors", fingerprint, figures)
    heads, metadata = load_heads(heads_path, fingerprint)  # what was saved is what is measured

    heldout = [load_features(path, fingerprint)[1] for path in heldout_paths]
    del data  # the training inputs (GBs) are no longer needed
    result = evaluate(heldout, heads, np.asarray(figures["popularity"]))
    print(format_coverage(result))
    plot_coverage(result, str(RESULTS / "predictor-tiny.png"),
                  title=f"mira-tiny-moe, {args.heldout_prompts} held-out ShareGPT prompts: {result['decode_steps']} "
                        "decode steps")

    inputs = heldout[0].inputs(head_config.history_window)
    with torch.no_grad():  # how much the contextual gate trusts ActHead (alpha) over HistHead
        alpha = [round(heads(i, HeadInputs(*(t[:, i] for t in inputs))).alpha.mean().item(), 3) for i in range(sources)]
    print("mean alpha (ActHead's weight) per source layer:", alpha)

    timing_prompts = first_user_messages(True, args.timing_prompts)
    routers = model_routers(model.hf_model)
    timing = {"plain": _decode_ms_per_token(model, timing_prompts, args.max_new_tokens)}
    timing["gate speculation"] = _decode_ms_per_token(model, timing_prompts, args.max_new_tokens,
                                                      GateSpeculation(routers, experts))
    timing["MixtureHead"] = _decode_ms_per_token(model, timing_prompts, args.max_new_tokens,
                                                 TrainedPredictor(heads, GateSpeculation(routers, experts), "cpu"))
    timing = {name: round(value, 3) for name, value in timing.items()}
    print("decode ms/token (CPU, median over prompts):", timing)
    shape = (sources + 2, head_config.hidden_size, experts, head_config.top_k)
    step_us = {"gate speculation": _step_us(GateSpeculation(routers, experts), *shape),
               "MixtureHead": _step_us(TrainedPredictor(heads, GateSpeculation(routers, experts), "cpu"), *shape)}
    step_us = {name: round(value, 1) for name, value in step_us.items()}
    print("predictor calls per decode step, us (CPU, best of 5):", step_us)

    mixture = result["coverage"]["mixture"]["decode"]["@2"]["mean"]
    baselines = {name: result["coverage"][name]["decode"]["@2"]["mean"] for name in ("gate", "previous", "popularity")}
    goal = {"mixture_decode_coverage@2": mixture, "best_training_free": max(baselines.values()),
            "met": mixture >= 0.90 and mixture > max(baselines.values())}
    print("goal (MixtureHead mean Coverage@2 >= 0.90 on decode steps, above every baseline):", goal)
    branch = heads.heads[0]
    result.update({
        **result_header(" ".join(["python", "benchmarks/predictor.py", *sys.argv[1:]])),
        "setup": {"model": "mira-tiny-moe (bundled; real learned routing)", "routing": "real",
                  "train_traces": [str(path.relative_to(ROOT)) for path in train_paths],
                  "heldout_traces": [str(path.relative_to(ROOT)) for path in heldout_paths],
                  "heads": str(heads_path.relative_to(ROOT)), **vars(args)},
        "goal": goal,
        "heads": {"count": len(heads.heads), "parameters": heads.parameter_count(),
                  "parameters_per_head": {"act": sum(p.numel() for p in branch.act.parameters()),
                                          "hist": sum(p.numel() for p in branch.hist.parameters()),
                                          "gate": sum(p.numel() for p in branch.gate.parameters())},
                  "config": metadata["config"], "mean_alpha_per_layer": alpha},
        "training": {key: value for key, value in figures.items() if key != "popularity"} | {
            "seconds": round(training_seconds, 1)},
        "decode_ms_per_token": timing,
        "predictor_us_per_decode_step": step_us,
    })
    out = RESULTS / "predictor-tiny.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
