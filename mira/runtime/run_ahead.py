"""Decoding with one step in flight ahead of the host (DESIGN.md 2.8).

transformers' sampling loop reads every new token back (its stop check and streamer) before it
prepares the next step, so between two replayed decode steps the device waits for the host's
Python (`benchmarks/profile_decode.py` shows how long). This loop, which `MiraModel.generate`
hands to transformers' `generate` as its `custom_generate` (the prompt, processors and stopping
criteria prepared by `generate` itself), keeps one step in flight: it launches step k+1 from token
k where the device wrote it, and only then reads token k back (an asynchronous copy, landed by
then), streams it and checks the stop conditions. A stop at token k leaves step k+1 computed and unused: its token is
dropped and its KV entry lies past the returned sequence (the cache is emptied for the next call).

Every step's inputs are made as generate's loop makes them: `prepare_inputs_for_generation` on
the ids so far (on the device: the host need not know the last token) and the generation state,
whose attention mask and positions grow by one after each step (as transformers'
`_update_model_kwargs_for_generation` does for them). Stopping criteria see the ids on the host and
no scores, so a caller's own criteria run ahead only as `HostCriterion`s; end-of-sequence ids are
checked on the token read back. Batch 1 only (`applies`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer
from transformers.generation.stopping_criteria import (
    EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria, StopStringCriteria,
)

from mira.runtime.graphs import CACHE_ARGUMENTS  # generate's keyword for the KV cache, as transformers names it

HANDLED = {  # generate's keywords whose meaning this loop keeps (the rest goes to transformers' own loop)
    "max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_p", "top_k", "repetition_penalty",
    "logits_processor", "stopping_criteria", "streamer", "pad_token_id", "eos_token_id", "attention_mask",
    "disable_compile", "use_cache", "num_beams", *CACHE_ARGUMENTS,
}


class HostCriterion(StoppingCriteria):
    """A stopping criterion that needs neither the ids on their device nor the step's scores, so that
    decoding ahead may check it on the ids read back to the host (its scores argument None)."""


HOST_CRITERIA = (HostCriterion, StopStringCriteria, MaxTimeCriteria, MaxLengthCriteria, EosTokenCriteria)


def applies(hf_model, input_ids: torch.Tensor, kwargs: Mapping) -> bool:
    """Whether this loop decodes this `generate` call as transformers' loop would: one sequence, one
    beam, keywords it handles, stopping criteria it may check on the host (`HOST_CRITERIA`), and a
    model whose generation state grows the generic way (`_grow`)."""
    update = type(hf_model)._update_model_kwargs_for_generation
    return (update.__qualname__.startswith("GenerationMixin.") and input_ids.shape[0] == 1
            and set(kwargs) <= HANDLED and kwargs.get("num_beams", 1) in (1, None)
            and all(isinstance(criterion, HOST_CRITERIA) for criterion in kwargs.get("stopping_criteria") or ()))


class _Landing:
    """Where each chosen token is copied to the host without waiting for it: a pinned slot per new
    token on CUDA, with an event the reader waits on; a plain copy on the CPU."""

    def __init__(self, tokens: int, device: torch.device):
        self._cuda = device.type == "cuda"
        self._slots = torch.empty(max(tokens, 1), dtype=torch.long, pin_memory=self._cuda)
        self._events: deque = deque()
        self._written = 0

    def send(self, token: torch.Tensor) -> None:
        self._slots[self._written : self._written + 1].copy_(token, non_blocking=self._cuda)
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
        self._events.append((self._written, event))
        self._written += 1

    def __len__(self) -> int:
        return len(self._events)

    def take(self) -> int:
        """The oldest token not taken yet, once it has landed."""
        index, event = self._events.popleft()
        if event is not None:
            event.synchronize()
        return int(self._slots[index])

    def settle(self) -> None:
        """Wait for every copy still in flight (their slots are freed with this object)."""
        while self._events:
            self.take()


def decode_ahead(model, input_ids: torch.Tensor, logits_processor: LogitsProcessorList,
                 stopping_criteria: StoppingCriteriaList, generation_config: GenerationConfig,
                 streamer: BaseStreamer | None = None, **model_kwargs) -> torch.Tensor:
    """transformers' greedy and multinomial sampling for one sequence, one step ahead: the prompt's
    ids [1, T] in, [1, T + new] out, the same ids as `generate`'s own loop. `streamer` is bound by
    the caller (`generate` passes its own only to its loops); `generate` has already put the prompt."""
    device = input_ids.device
    prompt = input_ids.shape[1]
    limit = generation_config.max_length  # prompt plus max_new_tokens, as generate prepared it
    eos = set()
    host_criteria = []
    for criterion in stopping_criteria:
        if isinstance(criterion, EosTokenCriteria):
            eos.update(criterion.eos_token_id.reshape(-1).tolist())
        elif not isinstance(criterion, MaxLengthCriteria):  # the length is this loop's own bound
            host_criteria.append(criterion)

    ids = torch.empty((1, limit), dtype=input_ids.dtype, device=device)  # the sequence as the device knows it
    ids[:, :prompt] = input_ids
    landing = _Landing(limit - prompt, device)
    length = prompt

    def choose(logits: torch.Tensor) -> None:
        nonlocal length
        scores = logits_processor(ids[:, :length], logits[:, -1].to(copy=True, dtype=torch.float32))
        if generation_config.do_sample:
            token = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            token = torch.argmax(scores, dim=-1)
        ids[:, length] = token
        landing.send(token)
        length += 1

    outputs = model(**model.prepare_inputs_for_generation(input_ids, is_first_iteration=True, **model_kwargs),
                    return_dict=True)
    choose(outputs.logits)
    del outputs
    taken = prompt  # ids the host has read back, streamed and checked
    host_ids = torch.empty((1, limit), dtype=input_ids.dtype)  # the sequence as the host knows it: [:, :taken]
    host_ids[:, :prompt] = input_ids.cpu()
    while landing:
        if length < limit:  # the next step, from the token the device chose
            _grow(model_kwargs)
            inputs = model.prepare_inputs_for_generation(ids[:, :length], next_sequence_length=1, **model_kwargs)
            outputs = model(**inputs, return_dict=True)
            choose(outputs.logits)
            del inputs, outputs
        token = landing.take()
        host_ids[0, taken] = token
        taken += 1
        # the criteria first, then the streamer: as in generate's loop, a criterion that reads what was
        # streamed (a stop string) stops the step after the token that met it
        halt = token in eos or any(bool(criterion(host_ids[:, :taken], None).any()) for criterion in host_criteria)
        if streamer is not None:
            streamer.put(torch.tensor([token]))
        if halt:
            break
    landing.settle()
    if streamer is not None:
        streamer.end()
    return ids[:, :taken]


def _grow(state: dict) -> None:
    """The generation state one token on: its attention mask and positions, where it has them."""
    if (mask := state.get("attention_mask")) is not None:
        state["attention_mask"] = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
    if (positions := state.get("position_ids")) is not None:
        state["position_ids"] = torch.cat([positions, positions[..., -1:] + 1], dim=-1)
