"""A caller's own stopping criterion, as transformers' loop hands it the ids: it compares them with
a tensor of its own, kept where the model is, so decoding ahead (ids on the host) must leave it to
that loop."""

from __future__ import annotations

import torch
from transformers import StoppingCriteria


class StopOnIds(StoppingCriteria):
    """Stops once the last id is one of `ids`."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, -1:] == self.ids).any(dim=-1)
