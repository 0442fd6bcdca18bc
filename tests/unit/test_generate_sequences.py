"""Which generate calls decode one sequence in their own KV cache, and so may get the static KV
cache that CUDA graphs replay on (mira.runtime.engine; the graphs themselves are tested on the GPU
in tests/e2e/test_gpu_graphs.py)."""

from types import SimpleNamespace

import torch

from mira.runtime.engine import _one_sequence

PLAIN = SimpleNamespace(num_beams=1, num_return_sequences=1)


def test_one_sequence_is_batch_one_without_beams_extra_sequences_or_a_cache_of_the_callers():
    one = torch.zeros(1, 4, dtype=torch.long)
    assert _one_sequence(one, {}, PLAIN)
    assert _one_sequence(one, {"num_beams": None, "max_new_tokens": 8}, PLAIN)
    assert not _one_sequence(torch.zeros(2, 4, dtype=torch.long), {}, PLAIN)
    assert not _one_sequence(one, {"num_beams": 4}, PLAIN)
    assert not _one_sequence(one, {"num_return_sequences": 2}, PLAIN)
    assert not _one_sequence(one, {"past_key_values": object()}, PLAIN)
    assert not _one_sequence(one, {"assistant_model": object()}, PLAIN)


def test_what_the_call_leaves_out_comes_from_the_models_generation_config():
    one = torch.zeros(1, 4, dtype=torch.long)
    beams = SimpleNamespace(num_beams=4, num_return_sequences=1)
    assert not _one_sequence(one, {}, beams)
    assert _one_sequence(one, {"num_beams": 1}, beams)
