"""`mira train-predictor`, `mira eval-predictor` and the recording behind `mira trace --features`
(paper IV-E and Fig. 9): arguments in, library calls out.

`add_commands(subparsers)` adds the two subcommands to mira's parser; `record_with_features` is
what `mira trace --features` calls.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mira.errors import MiraError


def record_with_features(model, prompts: list[str], max_new_tokens: int, out: Path, raw: bool = False,
                         progress: bool = True):
    """Greedy-generate from each prompt and write the routing trace `out` and its features beside it.

    Args:
        model: a loaded `MiraModel`.
        prompts: the prompts, one sequence each (batch 1).
        max_new_tokens: tokens generated per prompt.
        out: the trace file `T.npz`; the features go to `T.features.npz`.
        raw: do not apply the tokenizer's chat template.
        progress: show a progress bar.

    Returns:
        (RoutingTrace, FeatureSet) as written.
    """
    from mira.predict.features import features_path
    from mira.runtime.tracing import FeatureRecorder
    from mira.runtime.tracing import record_trace

    with FeatureRecorder(model) as recorder:
        trace = record_trace(model, prompts, max_new_tokens, raw=raw, progress=progress)
    features = recorder.features()
    features.check(trace)
    trace.save(out)
    features.save(features_path(out))
    return trace, features


def _store(model: str | None, quant: str | None) -> Path:
    from mira.runtime.engine import BUNDLED_MODEL, resolve_store

    return resolve_store(Path(model) if model else BUNDLED_MODEL, quant, progress=True)


def _train(args: argparse.Namespace) -> None:
    from mira.predict.config import HeadConfig, TrainConfig
    from mira.predict.heads import HEADS_FILE, predictor_file, save_heads
    from mira.predict.train import load_training_data, train_heads
    from mira.store.manifest import Manifest

    store = _store(args.model, args.quant)
    fingerprint = Manifest.read(store).source_fingerprint
    data = load_training_data(args.traces, fingerprint, args.history_window)
    _, sources, experts = data.targets.shape
    head_config = HeadConfig(num_layers=sources + 2, num_experts=experts, top_k=data.top_k,
                             hidden_size=data.inputs.hidden.shape[-1], width=args.width,
                             history_window=args.history_window)
    heads, figures = train_heads(data, head_config, TrainConfig(epochs=args.epochs, seed=args.seed),
                                 progress=not args.quiet)
    figures["traces"] = [str(path) for path in args.traces]
    path = save_heads(heads, Path(args.out) / HEADS_FILE if args.out else predictor_file(store), fingerprint, figures)
    validation = " ".join("-" if layer["validation_decode_coverage@2"] is None
                          else f"{layer['validation_decode_coverage@2']:.2f}" for layer in figures["layers"])
    print(f"predictor heads {path}: {sources} MixtureHeads, {heads.parameter_count()} parameters, trained on "
          f"{figures['train_steps']} steps of {figures['sequences']} sequences; Coverage@2 on validation decode "
          f"steps per source layer: {validation}")


def _eval(args: argparse.Namespace) -> None:
    import numpy as np

    from mira.predict.coverage import evaluate, format_coverage, plot_coverage
    from mira.predict.features import load_features
    from mira.predict.heads import load_heads, predictor_file
    from mira.store.trace import RoutingTrace
    from mira.store.manifest import Manifest

    store = _store(args.model, args.quant)
    fingerprint = Manifest.read(store).source_fingerprint
    heads_path = Path(args.heads) if args.heads else predictor_file(store)
    if args.heads and not heads_path.is_file():
        raise MiraError(f"no predictor heads at {heads_path}; train them with `mira train-predictor`")
    heads, metadata = load_heads(heads_path, fingerprint) if heads_path.is_file() else (None, {})
    feature_sets = [load_features(path, fingerprint)[1] for path in args.traces]
    layers, experts = feature_sets[0].num_layers, feature_sets[0].num_experts
    if args.profile:
        profile = RoutingTrace.load(args.profile)
        profile.check_profile_of(layers, experts, f"the traces' model ({args.traces[0]})")
        popularity = profile.expert_counts().reshape(layers, experts)
    else:
        popularity = np.asarray(metadata["training"]["popularity"]) if metadata else None
    result = evaluate(feature_sets, heads, popularity)
    result.update(traces=[str(path) for path in args.traces], heads=str(heads_path) if heads else None,
                  popularity_profile=args.profile or ("training traces" if metadata else None))
    if args.json:
        print(json.dumps(result))
    else:
        if heads is None:
            print(f"no trained heads at {heads_path}: training-free predictors only", file=sys.stderr)
        print(format_coverage(result))
    if args.plot:
        plot_coverage(result, args.plot, title=f"{store.name}: {result['decode_steps']} decode steps")
        print(f"wrote {args.plot}", file=sys.stderr)


def add_commands(subparsers) -> None:
    """Add `train-predictor` and `eval-predictor` to mira's subcommands.

    Args:
        subparsers: what `ArgumentParser.add_subparsers` returned; each command sets `run`.
    """
    from mira.cli_args import existing_file, output_dir, output_file, positive_int
    from mira.predict.config import HISTORY_WINDOW, HeadConfig, TrainConfig
    from mira.store.schemes import SCHEMES

    model_help = "the Mira store or Hugging Face directory the traces were recorded on (default: the bundled model)"
    quant_help = ("with a Hugging Face directory: the scheme of its store, whose heads these are, as `mira generate "
                  "--quant` picks it (default int8-shared)")
    train = subparsers.add_parser(
        "train-predictor", help="train the i -> i+2 expert predictor heads from traces",
        description="Train one MixtureHead per MoE layer (but the last two) to predict the routed token mass of "
                    "layer i+2 from features of layer i, on traces recorded with `mira trace --features`; "
                    "whole sequences are held out for validation and each head stops early. The heads are saved "
                    "with their metadata in the store's predictor/ folder, where the runtime finds them.")
    train.add_argument("--model", help=model_help)
    train.add_argument("--quant", choices=SCHEMES, help=quant_help)
    train.add_argument("--traces", nargs="+", required=True, type=existing_file, metavar="T.npz",
                       help="traces recorded with `mira trace --features` (T.features.npz beside each)")
    train.add_argument("--out", metavar="DIR", type=output_dir,
                       help="folder for heads.safetensors (default: <store>/predictor)")
    train.add_argument("--epochs", type=positive_int, default=TrainConfig.epochs,
                       help=f"most epochs per head (default {TrainConfig.epochs})")
    train.add_argument("--width", type=positive_int, default=HeadConfig.width,
                       help=f"hidden units of each branch (default {HeadConfig.width})")
    train.add_argument("--history-window", type=positive_int, default=HISTORY_WINDOW, metavar="W",
                       help=f"steps of layer i+2's routing the history feature averages (default {HISTORY_WINDOW})")
    train.add_argument("--seed", type=int, default=TrainConfig.seed, help="random seed (default 0)")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.set_defaults(run=_train)

    evaluate = subparsers.add_parser(
        "eval-predictor", help="Coverage@1..3 of every expert predictor on held-out traces",
        description="Mass-weighted Coverage@k (paper Fig. 9): for every step and source layer i, the share of "
                    "the routed token mass at layer i+2 that falls on each predictor's top k experts, per layer, "
                    "for the trained MixtureHead, its ActHead and HistHead alone, gate speculation, the previous "
                    "step's routing and popularity; decode steps, prompt steps and all steps apart.")
    evaluate.add_argument("--model", help=model_help)
    evaluate.add_argument("--quant", choices=SCHEMES, help=quant_help)
    evaluate.add_argument("--traces", nargs="+", required=True, type=existing_file, metavar="T.npz",
                          help="held-out traces recorded with `mira trace --features`")
    evaluate.add_argument("--heads", type=existing_file, metavar="FILE",
                          help="heads.safetensors (default: the store's predictor/)")
    evaluate.add_argument("--profile", type=existing_file, metavar="TRACE",
                          help="trace whose routing ranks the popularity baseline (default: the heads' training "
                               "traces)")
    evaluate.add_argument("--json", action="store_true", help="print the results as one JSON object")
    evaluate.add_argument("--plot", metavar="FILE.png", type=output_file, help="write Coverage@k per layer as a PNG")
    evaluate.set_defaults(run=_eval)
