"""Evaluate mira-tiny-moe on the held-out ShareGPT split: perplexity, a unigram baseline, routing.

Runs on the CPU in float32 (the whole held-out split, about 0.74M tokens, took 7 minutes on
2 cores). What it measures, all on the same held-out tokens:

- held-out perplexity of the model. Each held-out conversation (BOS + role format, as written by
  `tools/prepare_data.py`) is scored on its own, cut into chunks of 513 tokens that overlap by one
  token, so every token but the conversation's opening BOS is predicted exactly once, with the
  context restarting every 512 tokens;
- the perplexity of a unigram model fitted on the training token stream with add-one smoothing,
  p(t) = (count(t) + 1) / (N + V), on exactly the same predicted tokens;
- routing: for every layer, the top-2 experts of the router logits of every input token (the
  positions that the model reads, padding excluded); per layer, the share of routed token slots that
  each expert receives and the natural-log entropy of that distribution (uniform: log 8 = 2.079),
  over all held-out conversations and separately for 'code' conversations (a message holds a
  ``` fence) and 'prose' conversations (none does);
- heatmaps in the style of the paper's Fig. 2 (layers on x, experts on y, colour = share of routed
  tokens): `heatmap_code.png`, `heatmap_prose.png`, and their difference `heatmap_code_minus_prose.png`.

Writes `eval.json` and the PNGs into the model folder.

Usage:
    python tools/eval_tiny_moe.py [--model-dir mira/assets/mira-tiny-moe] [--data-dir .carry/data]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sharegpt_data as sd  # noqa: E402

TOPICS = ("code", "prose")


def chunks(tokens: np.ndarray, chunk: int) -> list[np.ndarray]:
    """Cut one conversation into pieces of at most chunk + 1 tokens that overlap by one token."""
    return [tokens[i : i + chunk + 1] for i in range(0, max(1, len(tokens) - 1), chunk)]


def unigram_log_probs(train_tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """log p(t) of the add-one-smoothed unigram model of the training stream, shape (V,)."""
    counts = np.bincount(train_tokens, minlength=vocab_size).astype(np.float64)
    return np.log((counts + 1.0) / (counts.sum() + vocab_size))


def entropy(share: np.ndarray) -> np.ndarray:
    """Natural-log entropy of each row of a (L, E) share matrix."""
    return -(share * np.log(np.clip(share, 1e-12, None))).sum(axis=-1)


def routing_table(counts: np.ndarray) -> dict:
    """Per-layer shares, entropy, minimum and maximum share from (L, E) routed-slot counts."""
    share = counts / counts.sum(axis=-1, keepdims=True)
    return {
        "routed_token_slots": int(counts.sum()),
        "share": share.round(5).tolist(),
        "entropy": entropy(share).round(4).tolist(),
        "min_share": share.min(axis=-1).round(4).tolist(),
        "max_share": share.max(axis=-1).round(4).tolist(),
    }


def heatmap(share: np.ndarray, title: str, path: Path, limits: tuple[float, float] | None = None,
            diverging: bool = False) -> None:
    """Experts (y) by layers (x), colour = share of routed token slots (or a difference of shares).

    `limits` fixes the colour scale, so that the heatmaps of two topics can be compared.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers, experts = share.shape
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    if diverging:
        lim = float(np.abs(share).max())
        im = ax.imshow(share.T, origin="lower", aspect="auto", cmap="RdBu_r", vmin=-lim, vmax=lim)
    else:
        vmin, vmax = limits if limits is not None else (float(share.min()), float(share.max()))
        im = ax.imshow(share.T, origin="lower", aspect="auto", cmap="viridis", vmin=vmin, vmax=vmax)
    ax.set_xticks(range(layers))
    ax.set_yticks(range(experts))
    ax.set_xlabel("layer")
    ax.set_ylabel("expert")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="difference of shares" if diverging else "share of routed tokens")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("mira/assets/mira-tiny-moe"))
    parser.add_argument("--data-dir", type=Path, default=Path(".carry/data"))
    parser.add_argument("--chunk", type=int, default=512, help="tokens of context per chunk")
    parser.add_argument("--batch-size", type=int, default=16, help="chunks per forward pass")
    parser.add_argument("--max-conversations", type=int, default=None, help="score only the first N (quick checks)")
    parser.add_argument("--out", type=Path, default=None, help="where eval.json and the PNGs go (default: model dir)")
    args = parser.parse_args()
    out_dir = args.out or args.model_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    meta = json.loads((args.data_dir / "meta.json").read_text())
    index = json.loads((args.data_dir / "heldout_index.json").read_text())[: args.max_conversations]
    held = sd.read_tokens(args.data_dir / "heldout.u16.xz").astype(np.int64)
    train = sd.read_tokens(args.data_dir / "train.u16.xz").astype(np.int64)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    cfg = model.config
    num_layers, num_experts, top_k = cfg.num_hidden_layers, cfg.num_local_experts, cfg.num_experts_per_tok
    unigram = unigram_log_probs(train, cfg.vocab_size)

    pieces = []  # (topic, tokens)
    for entry in index:
        conv = held[entry["offset"] : entry["offset"] + entry["length"]]
        pieces += [(entry["topic"], c) for c in chunks(conv, args.chunk) if len(c) > 1]
    pieces.sort(key=lambda p: -len(p[1]))  # similar lengths together: less padding
    print(f"{len(index)} conversations, {len(pieces)} chunks, "
          f"{sum(len(c) - 1 for _, c in pieces)} predicted tokens", flush=True)

    nll = {t: 0.0 for t in TOPICS}
    uni_nll = {t: 0.0 for t in TOPICS}
    predicted = {t: 0 for t in TOPICS}
    counts = {t: np.zeros((num_layers, num_experts)) for t in TOPICS}
    for i in range(0, len(pieces), args.batch_size):
        batch = pieces[i : i + args.batch_size]
        width = max(len(c) for _, c in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)  # (B, W), right-padded with 0
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (_, c) in enumerate(batch):
            ids[row, : len(c)] = torch.from_numpy(c)
            mask[row, : len(c)] = 1
        inputs, in_mask = ids[:, :-1], mask[:, :-1]  # (B, W - 1)
        out = model(input_ids=inputs, attention_mask=in_mask, output_router_logits=True, use_cache=False)
        token_nll = F.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        token_nll = token_nll.view(len(batch), -1) * mask[:, 1:]  # (B, W - 1)
        router = torch.stack(out.router_logits).view(num_layers, len(batch), -1, num_experts)  # (L, B, W - 1, E)
        chosen = router.topk(top_k, dim=-1).indices  # (L, B, W - 1, K)
        for row, (topic, c) in enumerate(batch):
            n = len(c) - 1  # inputs read and tokens predicted in this chunk
            nll[topic] += token_nll[row].sum().item()
            uni_nll[topic] += -unigram[c[1:]].sum()
            predicted[topic] += n
            for layer in range(num_layers):
                counts[topic][layer] += np.bincount(chosen[layer, row, :n].flatten().numpy(), minlength=num_experts)
        done = min(i + args.batch_size, len(pieces))
        if (i // args.batch_size) % 20 == 0 or done == len(pieces):
            print(f"  {done}/{len(pieces)} chunks ({time.time() - t0:.0f} s)", flush=True)

    total = sum(predicted.values())
    loss = sum(nll.values()) / total
    uni_loss = sum(uni_nll.values()) / total
    all_counts = counts["code"] + counts["prose"]
    result = {
        "command": "python " + " ".join(sys.argv),
        "model_dir": str(args.model_dir),
        "data_meta_sha256": meta["sha256"],
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "held_out_conversations": len(index),
        "held_out_conversations_by_topic": {t: sum(1 for e in index if e["topic"] == t) for t in TOPICS},
        "chunk_tokens": args.chunk,
        "predicted_tokens": total,
        "predicted_tokens_by_topic": predicted,
        "held_out_loss": loss,
        "held_out_perplexity": math.exp(loss),
        "held_out_perplexity_by_topic": {t: math.exp(nll[t] / predicted[t]) for t in TOPICS},
        "unigram_train_tokens": int(len(train)),
        "unigram_loss": uni_loss,
        "unigram_perplexity": math.exp(uni_loss),
        "log_num_experts": math.log(num_experts),
        "routing": {"all": routing_table(all_counts), **{t: routing_table(counts[t]) for t in TOPICS}},
        "seconds": None,
    }
    shares = {t: counts[t] / counts[t].sum(axis=-1, keepdims=True) for t in TOPICS}
    result["routing"]["code_minus_prose_max_abs"] = float(np.abs(shares["code"] - shares["prose"]).max())
    limits = (min(float(s.min()) for s in shares.values()), max(float(s.max()) for s in shares.values()))
    for t in TOPICS:
        heatmap(shares[t], f"mira-tiny-moe, held-out '{t}' conversations ({predicted[t]} tokens)",
                out_dir / f"heatmap_{t}.png", limits=limits)
    heatmap(shares["code"] - shares["prose"], "share of routed tokens, code minus prose",
            out_dir / "heatmap_code_minus_prose.png", diverging=True)
    result["seconds"] = round(time.time() - t0, 1)
    (out_dir / "eval.json").write_text(json.dumps(result, indent=1))

    print(f"held-out: {total} tokens, loss {loss:.4f}, perplexity {math.exp(loss):.2f}; "
          f"unigram perplexity {math.exp(uni_loss):.1f}")
    table = result["routing"]["all"]
    for layer in range(num_layers):
        print(f"  layer {layer:2d}: entropy {table['entropy'][layer]:.4f} (log 8 = {math.log(num_experts):.4f}), "
              f"min share {table['min_share'][layer]:.4f}, max share {table['max_share'][layer]:.4f}")
    print(f"wrote {out_dir / 'eval.json'} and heatmaps ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
