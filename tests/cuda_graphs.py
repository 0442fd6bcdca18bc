"""A CUDA graph of one call, captured the way the GPU tests need it."""

from __future__ import annotations

from collections.abc import Callable

import torch


def captured(call: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """`call` run once on a side stream (the warm-up capture wants: compilation, workspaces), then
    captured; replay the graph to run it again."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph
