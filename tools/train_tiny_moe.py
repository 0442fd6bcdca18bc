"""Train mira-tiny-moe, a small Mixtral-architecture model, on the tokenized ShareGPT split.

Runs on one GPU (an H200: about 5 minutes for the shipped model) from the token files that
`tools/prepare_data.py` wrote; it needs torch, transformers and numpy, not the raw data.

- Model: `MixtralForCausalLM`, 12 layers, hidden 256, 8 query heads and 2 key/value heads of
  dimension 32, 8 experts of intermediate size 256 per layer, top-2 routing, tied embeddings,
  vocabulary 8192 (about 23.0M parameters, 46 MB in bf16).
- Precision: bf16 weights and activations for the forward and backward pass, with an fp32 master
  copy of every weight that AdamW updates (so the experts run in transformers' bf16 grouped GEMM).
- Loss: next-token cross-entropy over every token, plus a per-layer Switch-Transformer balancing
  loss, E * sum_e f_e * P_e averaged over layers (f_e the share of routed token slots, P_e the
  mean router probability of expert e in that layer) times `--aux-coef`, plus the router z-loss
  (mean squared log-sum-exp of the router logits, averaged over layers) times `--z-coef`.
  transformers' own `load_balancing_loss_func` pools the counts of all layers before it balances
  them, so it cannot see one layer's dead expert; that is why the loss is computed here per layer.
- Data: `--batch-size` windows of `--seq-len` + 1 tokens, each starting at a uniformly random
  offset of the concatenated training stream (conversations packed, each opening with BOS), drawn
  from a seeded generator; AdamW, linear warm-up then cosine decay to `--min-lr-ratio` of the peak.
- Output: the model folder (`save_pretrained`, bf16, shards of at most 15 MB, standard Mixtral
  keys `model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight`...), `generation_config.json`
  (eos = `<|end|>`) and `train_log.json` (arguments, progress, final train and held-out loss).

Usage (the shipped model; see the model card for the exact command):
    python tools/train_tiny_moe.py --data-dir .carry/data --out OUT_DIR --steps N
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
from transformers import GenerationConfig, MixtralConfig, MixtralForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sharegpt_data as sd  # noqa: E402


def model_config(vocab_size: int, aux_coef: float) -> MixtralConfig:
    """The architecture of mira-tiny-moe."""
    return MixtralConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        router_aux_loss_coef=aux_coef,
        output_router_logits=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        sliding_window=None,
    )


def routing_losses(router_logits: tuple[torch.Tensor, ...], top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-layer balancing loss and z-loss, averaged over layers, and the routed shares.

    L layers, N tokens, E experts.

    Returns:
        (balance, z, share): balance and z are scalars; share is (L, E), the share of routed token
        slots per expert in each layer (rows sum to 1).
    """
    logits = torch.stack(router_logits).float()  # (L, N, E)
    num_experts = logits.shape[-1]
    probs = logits.softmax(dim=-1)  # (L, N, E)
    chosen = probs.topk(top_k, dim=-1).indices  # (L, N, K)
    counts = torch.zeros_like(probs[:, 0]).scatter_add_(
        1, chosen.flatten(1), torch.ones_like(chosen.flatten(1), dtype=probs.dtype)
    )  # (L, E)
    share = counts / counts.sum(dim=-1, keepdim=True)  # (L, E)
    mean_prob = probs.mean(dim=1)  # (L, E)
    balance = (num_experts * (share * mean_prob).sum(dim=-1)).mean()
    z = torch.logsumexp(logits, dim=-1).square().mean()
    return balance, z, share


def entropy(share: torch.Tensor) -> torch.Tensor:
    """Natural-log entropy of each row of a (L, E) share matrix."""
    return -(share * share.clamp_min(1e-12).log()).sum(dim=-1)


class Batches:
    """Random (seq_len + 1)-token windows of a token stream held on the device, from a seeded generator."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, device: torch.device):
        self.tokens = torch.from_numpy(tokens.astype(np.int64)).to(device)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(seq_len + 1, device=device)

    def next(self) -> torch.Tensor:
        """(B, T + 1) token ids."""
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.batch_size,), generator=self.generator)
        return self.tokens[starts.to(self.tokens.device)[:, None] + self.offsets]


@torch.no_grad()
def evaluate(model: MixtralForCausalLM, windows: torch.Tensor, batch_size: int) -> tuple[float, torch.Tensor]:
    """Mean next-token loss over (W, T + 1) windows, and the routed shares (L, E) over them."""
    model.eval()
    total, count, counts = 0.0, 0, None
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size]
        out = model(input_ids=batch[:, :-1], output_router_logits=True, use_cache=False)
        loss = F.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += batch[:, 1:].numel()
        _, _, share = routing_losses(out.router_logits, model.config.num_experts_per_tok)
        c = share * batch[:, :-1].numel()
        counts = c if counts is None else counts + c
    model.train()
    return total / count, counts / counts.sum(dim=-1, keepdim=True)


def held_out_windows(tokens: np.ndarray, seq_len: int, device: torch.device) -> torch.Tensor:
    """Consecutive non-overlapping windows of (seq_len + 1) tokens that tile the stream (tail dropped)."""
    n = (len(tokens) - 1) // seq_len
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)
    return torch.from_numpy(tokens[idx].astype(np.int64)).to(device)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay from `lr` to `lr * min_lr_ratio` at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def sample(model: MixtralForCausalLM, tokenizer_path: Path, prompt: str, max_new_tokens: int) -> str:
    """Greedy answer to one user message, in the role format (a smoke check of the trained model)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    text = sd.format_conversation(sd.Conversation("sample", (("user", prompt),))) + sd.ROLE_TOKENS["assistant"] + "\n"
    ids = torch.tensor([tok.encode(text, add_special_tokens=False).ids], device=model.device)
    model.eval()
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=1, pad_token_id=0)
    model.train()
    return tok.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=Path(".carry/data"))
    parser.add_argument("--out", type=Path, required=True, help="model folder to write")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=256, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--aux-coef", type=float, default=0.02, help="per-layer balancing loss weight")
    parser.add_argument("--z-coef", type=float, default=1e-3, help="router z-loss weight")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--train-eval-windows", type=int, default=1024, help="training windows for the final train loss")
    parser.add_argument("--held-out-windows", type=int, default=None, help="score only this many held-out windows (tests)")
    parser.add_argument("--max-train-seconds", type=float, default=500.0, help="stop early (and say so) past this")
    parser.add_argument(
        "--tokenizer", type=Path, default=Path(__file__).resolve().parents[1] / "mira/assets/mira-tiny-moe/tokenizer.json"
    )
    args = parser.parse_args()

    t_start = time.time()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = json.loads((args.data_dir / "meta.json").read_text())
    train_tokens = sd.read_tokens(args.data_dir / "train.u16.xz")
    held_tokens = sd.read_tokens(args.data_dir / "heldout.u16.xz")
    assert len(train_tokens) == meta["tokens"]["train"] and len(held_tokens) == meta["tokens"]["held_out"]
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else platform.processor()}), "
          f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    print(f"data: {len(train_tokens)} train tokens, {len(held_tokens)} held-out tokens", flush=True)

    config = model_config(meta["vocab_size"], args.aux_coef)
    model = MixtralForCausalLM(config).to(device)  # fp32 initialisation, then bf16 working copy
    params = [p for p in model.parameters()]
    n_params = sum(p.numel() for p in params)
    masters = [p.detach().clone().float() for p in params]
    model.to(torch.bfloat16)
    decay = [m for m, p in zip(masters, params) if p.dim() >= 2]
    no_decay = [m for m, p in zip(masters, params) if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda",
    )
    print(f"model: {n_params} parameters, experts implementation "
          f"{getattr(model.config, '_experts_implementation', 'default')}", flush=True)

    batches = Batches(train_tokens, args.seq_len, args.batch_size, args.seed, device)
    held_windows = held_out_windows(held_tokens, args.seq_len, device)[: args.held_out_windows]
    eval_batch = 64
    log, top_k = [], config.num_experts_per_tok
    tokens_per_step = args.batch_size * args.seq_len
    t_train, steps_done, stopped_early = time.time(), 0, False
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        batch = batches.next()  # (B, T + 1)
        out = model(input_ids=batch[:, :-1], output_router_logits=True, use_cache=False)
        ce = F.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten())
        balance, z, share = routing_losses(out.router_logits, top_k)
        loss = ce + args.aux_coef * balance + args.z_coef * z
        loss.backward()
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(masters, args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(params, masters)
        for p in params:
            p.grad = None
        steps_done = step + 1

        if step % args.log_every == 0 or step == args.steps - 1:
            h = entropy(share)
            elapsed = time.time() - t_train
            row = {
                "step": step, "lr": lr_at(step, args), "ce": ce.item(), "balance": balance.item(), "z": z.item(),
                "grad_norm": norm.item(), "entropy_min": h.min().item(), "entropy_max": h.max().item(),
                "min_share": share.min().item(), "elapsed_s": elapsed,
                "tokens_per_s": tokens_per_step * (step + 1) / elapsed,
            }
            if step % args.eval_every == 0 and step > 0:
                row["held_out_loss_subset"], _ = evaluate(model, held_windows[:256], eval_batch)
            log.append(row)
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        if time.time() - t_train > args.max_train_seconds and step < args.steps - 1:
            stopped_early = True
            print(f"stopping early after {steps_done} steps: past --max-train-seconds", flush=True)
            break
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_seconds = time.time() - t_train

    held_loss, held_share = evaluate(model, held_windows, eval_batch)
    rng = np.random.default_rng(args.seed + 1)
    starts = rng.integers(0, len(train_tokens) - args.seq_len - 1, args.train_eval_windows)
    train_windows = torch.from_numpy(
        train_tokens[starts[:, None] + np.arange(args.seq_len + 1)].astype(np.int64)
    ).to(device)
    train_loss, _ = evaluate(model, train_windows, eval_batch)
    h = entropy(held_share)
    print(f"final: steps {steps_done}, train tokens {steps_done * tokens_per_step}, {train_seconds:.0f} s training, "
          f"train loss {train_loss:.4f} (ppl {math.exp(train_loss):.2f}), "
          f"held-out loss {held_loss:.4f} (ppl {math.exp(held_loss):.2f})", flush=True)
    print("held-out routing entropy per layer: " + " ".join(f"{x:.3f}" for x in h.tolist()), flush=True)
    print("held-out min expert share per layer: " + " ".join(f"{x:.3f}" for x in held_share.min(dim=-1).values.tolist()),
          flush=True)

    generated = None
    if args.tokenizer.exists():
        generated = sample(model, args.tokenizer, "How do I sort a list in Python?", 40)
        print(f"sample: {generated!r}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    model.config.dtype = "bfloat16"
    model.save_pretrained(args.out, max_shard_size="15MB")
    GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=0).save_pretrained(args.out)
    result = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "command": " ".join(sys.argv),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()},
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "parameters": n_params,
        "steps": steps_done,
        "stopped_early": stopped_early,
        "tokens_per_step": tokens_per_step,
        "train_tokens_seen": steps_done * tokens_per_step,
        "train_stream_tokens": int(len(train_tokens)),
        "train_seconds": train_seconds,
        "final_train_loss": train_loss,
        "final_train_loss_windows": args.train_eval_windows,
        "final_held_out_loss": held_loss,
        "held_out_tokens_scored": int(held_windows[:, 1:].numel()),
        "held_out_entropy_per_layer": h.tolist(),
        "held_out_share": held_share.tolist(),
        "sample": generated,
        "log": log,
        "total_seconds": time.time() - t_start,
    }
    (args.out / "train_log.json").write_text(json.dumps(result, indent=1))
    files = sorted(p.name for p in args.out.iterdir())
    print(f"wrote {args.out}: {files} ({time.time() - t_start:.0f} s in all)", flush=True)


if __name__ == "__main__":
    main()
