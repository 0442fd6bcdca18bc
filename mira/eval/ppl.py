"""Perplexity of each expert scheme over a token stream, and its distance from the unquantized experts.

The stream is read in windows of `context` tokens that advance by `stride`; each window scores only
the tokens no earlier window scored, with the rest as context, so every token but the first is
scored once. Per window the reference model (`none`: the checkpoint's own expert weights) runs
once, and every other scheme is compared with that one forward: the KL divergence
KL(reference || scheme) of the next-token distributions, whether their top-1 tokens agree, and
the negative log-likelihood of the actual next token.

T scored tokens, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from mira.errors import MiraError

REFERENCE = "none"


@dataclass(frozen=True)
class Window:
    """The model reads ids[begin:end]; the window scores ids[first_scored:end] (first_scored > begin)."""

    begin: int
    end: int
    first_scored: int


def windows(num_tokens: int, context: int, stride: int) -> list[Window]:
    """Windows of `context` tokens, `stride` apart (the last one ends at the stream's end), that
    together score tokens 1..num_tokens-1 once each.

    Raises:
        MiraError: a context under 2 tokens, a stride outside 1..context-1, or a stream shorter than one window.
    """
    if context < 2:
        raise MiraError(f"--context {context} leaves nothing to predict; pass at least 2")
    if not 1 <= stride < context:  # a window's first token has no context in it, so it must be scored earlier
        raise MiraError(f"--stride {stride} must be at least 1 and less than the context of {context} tokens")
    if num_tokens < context:
        raise MiraError(f"the text has {num_tokens} tokens, fewer than one window of {context}; pass a longer text "
                        f"or a smaller --context")
    out, begin, scored = [], 0, 1
    while True:
        end = begin + context
        out.append(Window(begin, end, scored))
        if end == num_tokens:
            return out
        scored = end
        begin = min(begin + stride, num_tokens - context)


@dataclass
class SchemeTotals:
    """Running sums for one scheme over the scored tokens."""

    tokens: int = 0
    nll: float = 0.0  # sum of -log p(actual next token)
    kl: float = 0.0  # sum of KL(reference || scheme), nats
    max_kl: float = 0.0
    top1_agree: int = 0

    def add(self, log_probs: torch.Tensor, targets: torch.Tensor, reference: torch.Tensor) -> None:
        """Count one window: log-probabilities [T, V] of this scheme and of the reference, targets [T]."""
        self.tokens += targets.numel()
        self.nll -= float(log_probs.gather(1, targets[:, None]).double().sum())
        kl = (reference.exp() * (reference - log_probs)).sum(dim=1)  # [T]
        self.kl += float(kl.double().sum())
        self.max_kl = max(self.max_kl, float(kl.max()))
        self.top1_agree += int((log_probs.argmax(dim=1) == reference.argmax(dim=1)).sum())

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    def summary(self, reference: SchemeTotals | None) -> dict:
        """JSON-ready figures; the distances from the reference only when one is given (not for itself)."""
        figures = {"perplexity": self.perplexity, "nll_per_token": self.nll / self.tokens}
        if reference is not None:
            figures |= {"perplexity_change": self.perplexity / reference.perplexity - 1,
                        "mean_kl": self.kl / self.tokens, "max_kl": self.max_kl,
                        "top1_agreement": self.top1_agree / self.tokens}
        return figures


LogProbs = Callable[[torch.Tensor], torch.Tensor]  # token ids [S] -> next-token log-probabilities [S, V]


def model_log_probs(model) -> LogProbs:
    """The float32 next-token log-probabilities of a causal LM (a MiraModel or a transformers model),
    one sequence, no KV cache kept."""
    device = next(model.hf_model.parameters()).device if hasattr(model, "hf_model") else model.device

    @torch.no_grad()  # not inference_mode: buffers the model allocates on a first call must stay usable by generate
    def forward(ids: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids[None].to(device), use_cache=False).logits[0]  # [S, V]
        return torch.log_softmax(logits.float(), dim=-1)

    return forward


def measure(models: dict[str, LogProbs], ids: torch.Tensor, spans: list[Window], progress: bool = True) -> dict:
    """Score `ids` [N] window by window with every scheme's model (REFERENCE among them).

    Returns:
        {scheme: figures} (SchemeTotals.summary), the reference first.
    """
    if REFERENCE not in models:
        raise ValueError(f"the reference scheme {REFERENCE!r} is missing")
    totals = {scheme: SchemeTotals() for scheme in models}
    bar = tqdm(total=len(spans) * len(models), desc="eval", unit="forward", disable=not progress)
    for window in spans:
        inputs = ids[window.begin:window.end]
        targets = ids[window.first_scored:window.end]
        scored = slice(window.first_scored - window.begin - 1, window.end - window.begin - 1)  # logits predicting them
        reference = models[REFERENCE](inputs)[scored]  # [T, V]
        totals[REFERENCE].add(reference, targets.to(reference.device), reference)
        bar.update()
        for scheme, forward in models.items():
            if scheme != REFERENCE:
                totals[scheme].add(forward(inputs)[scored], targets.to(reference.device), reference)
                bar.update()
    bar.close()
    figures = {REFERENCE: totals[REFERENCE].summary(None)}
    return figures | {scheme: totals[scheme].summary(totals[REFERENCE]) for scheme in models if scheme != REFERENCE}
