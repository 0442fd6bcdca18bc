"""The KV cache decode steps replay on (mira.runtime.graphs.static_cache): full-length layers in
place of sliding-window ones, the mask keeping each sliding layer to its window. Checked against
transformers' own decoding of a gpt-oss model whose window is shorter than the text; and which
families take one."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import StaticLayer

from mira.runtime.graphs import DecodeGraphs, replayable_cache, static_cache, takes_static_cache
from tiny_families import CASES, VOCAB, tiny_config


def test_sliding_layers_become_full_length_and_decode_as_transformers_does():
    config = tiny_config("gpt_oss")
    config.sliding_window = 4  # far shorter than prompt and output: the window decides what is seen
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = torch.randint(2, config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    greedy = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True, disable_compile=True)
    own = model.generate(ids, **greedy)  # transformers' default cache, sliding layers of 4 tokens
    cache = static_cache(config, 64)
    assert "sliding_attention" in config.layer_types
    assert all(type(layer) is StaticLayer and layer.max_cache_len == 64 for layer in cache.layers)
    replayed = model.generate(ids, past_key_values=cache, **greedy)
    assert torch.equal(replayed.sequences, own.sequences)
    for ours, theirs in zip(replayed.logits, own.logits):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert replayable_cache(cache)
    unlimited = tiny_config("gpt_oss")
    unlimited.sliding_window = 10_000  # no window: the same text only if the window above mattered
    torch.manual_seed(0)
    wide = AutoModelForCausalLM.from_config(unlimited, dtype=torch.float32).eval()
    assert not torch.equal(wide.generate(ids, **greedy).sequences, own.sequences)


@pytest.mark.parametrize("family", CASES)
def test_a_family_takes_a_static_cache_where_transformers_decodes_with_one(family, monkeypatch):
    # On CUDA, Mira hands generate a static cache (its replayed steps need one) only where the model
    # takes it, through the forward that replays steps (here each step runs eagerly, as on the CPU):
    # there it must decode the tokens of transformers' default cache, elsewhere transformers must
    # refuse one (a model that keeps a cache of its own; a layer kind with no static layer).
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)  # the CPU build has no graph pool
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32).eval()
    ids = torch.randint(2, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    greedy = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, disable_compile=True)
    own = model.generate(ids, **greedy)
    model.forward = DecodeGraphs(model.forward, [])  # generate checks its keywords against this one's
    if not takes_static_cache(model):
        with pytest.raises((KeyError, ValueError)):
            model.generate(ids, past_key_values=static_cache(model.config, 32), **greedy)
        return
    assert torch.equal(model.generate(ids, past_key_values=static_cache(model.config, 32), **greedy), own)
