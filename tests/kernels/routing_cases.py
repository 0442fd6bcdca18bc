"""Random routing and the error measure the Triton kernel tests share."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def routing(tokens: int, experts: int, top_k: int, seed: int, device: str = DEVICE):
    """Random top-k routing: distinct experts per token, repeated across tokens; softmax weights."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])  # [T, K]
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)  # [T, K]
    return index.to(device), weights.to(device)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()
