"""`mira trace`: record the router's choices while a model generates (DESIGN.md 5).

A forward pre-hook on every Mira experts module sees (hidden, top_k_index, top_k_weights) of that
layer; a forward hook on the whole model closes the step. Hooks observe; they change nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from mira.errors import MiraError
from mira.models.loader import looped_layers
from mira.store.trace import RoutingTrace
from mira.store.files import read_text
from mira.runtime.engine import MiraModel
from mira.predict.baselines import GateSpeculation, speculates
from mira.predict.features import FeatureSet
from mira.runtime.experts import MiraExperts, model_routers
from mira.runtime.generate import encode_prompt


class RoutingRecorder:
    """Collects top-k ids and weights of every token at every MoE layer while active.

    Use as a context manager around forward passes or `generate`; `trace()` returns what was seen.

    Raises:
        MiraError: a looped model, which routes each token more than once at some layers.
    """

    def __init__(self, model: MiraModel):
        if (looped := looped_layers(model.hf_model.config)) is not None:
            layers, passes = looped
            raise MiraError(f"this model runs decoder layers {layers.start} to {layers.stop - 1} {passes} times a "
                            "token, and a trace holds one routing per MoE layer and token; Mira cannot record it")
        self.model = model
        self._layers = [m for m in model.hf_model.modules() if isinstance(m, MiraExperts)]
        self._step: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._ids: list[np.ndarray] = []  # [T_step, L, K] per step
        self._weights: list[np.ndarray] = []
        self._seq: list[np.ndarray] = []
        self._prefill: list[np.ndarray] = []
        self.sequence = -1  # next_sequence() opens sequence 0
        self._first_step = False  # the next step is a sequence's prompt
        self._handles: list = []

    def __enter__(self) -> RoutingRecorder:
        for position, layer in enumerate(self._layers):
            self._handles.append(layer.register_forward_pre_hook(
                lambda module, args, position=position: self._step.__setitem__(position, (args[1], args[2]))))
        self._handles.append(self.model.hf_model.register_forward_hook(self._close_step))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _close_step(self, module, args, output) -> None:
        ids = torch.stack([self._step[p][0] for p in range(len(self._layers))], dim=1)  # [T, L, K]
        weights = torch.stack([self._step[p][1].float() for p in range(len(self._layers))], dim=1)
        self._step.clear()
        tokens = ids.shape[0]
        self._ids.append(ids.to("cpu", torch.int16).numpy())
        self._weights.append(weights.to("cpu", torch.float16).numpy())
        self._seq.append(np.full(tokens, max(self.sequence, 0), dtype=np.int32))
        self._prefill.append(np.full(tokens, self._first_step, dtype=bool))
        self._first_step = False

    def reset(self) -> None:
        """Forget what was recorded so far (the next `trace()` holds only what follows)."""
        self._step.clear()
        for recorded in (self._ids, self._weights, self._seq, self._prefill):
            recorded.clear()
        self.sequence = -1
        self._first_step = False

    def next_sequence(self) -> None:
        """The following steps belong to a new sequence; its first step is its prompt (prefill)."""
        self.sequence += 1
        self._first_step = True

    def trace(self) -> RoutingTrace:
        if not self._ids:
            raise MiraError("no tokens were recorded")
        return RoutingTrace(np.concatenate(self._ids), self.model.store.num_experts,
                            topk_weights=np.concatenate(self._weights), seq_id=np.concatenate(self._seq),
                            is_prefill=np.concatenate(self._prefill))


def read_prompts(path: Path) -> list[str]:
    """Prompts from a file: one per line, or JSON lines with a "prompt" field.

    Raises:
        MiraError: missing file, a JSON line without "prompt", or no prompts at all.
    """
    if not path.is_file():
        raise MiraError(f"prompt file {path} does not exist")
    prompts = []
    for number, line in enumerate(read_text(path, "prompt file").splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                prompt = json.loads(line)["prompt"]
            except json.JSONDecodeError as error:
                raise MiraError(f"{path}:{number}: the line is not valid JSON ({error})") from None
            except (KeyError, TypeError):
                raise MiraError(f"{path}:{number}: a JSON line needs a \"prompt\" field") from None
            if not isinstance(prompt, str):
                raise MiraError(f"{path}:{number}: the \"prompt\" field is {json.dumps(prompt)}; give the prompt's "
                                "text as a JSON string")
            prompts.append(prompt)
        else:
            prompts.append(line)
    if not prompts:
        raise MiraError(f"{path} holds no prompts; write one per line or JSON lines with a \"prompt\" field")
    return prompts


def record_trace(model: MiraModel, prompts: list[str], max_new_tokens: int, raw: bool = False,
                 progress: bool = True) -> RoutingTrace:
    """Greedy-generate from each prompt (batch 1) and return the routing of every token."""
    with RoutingRecorder(model) as recorder:
        for prompt in tqdm(prompts, desc="tracing", unit="prompt", disable=not progress):
            recorder.next_sequence()
            ids = encode_prompt(model, prompt, raw)
            model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                           pad_token_id=model.tokenizer.pad_token_id or model.tokenizer.eos_token_id)
    return recorder.trace()


class FeatureRecorder:
    """Records the features of every step while a Mira model runs (the `mira trace --features` side).

    Hooks observe and change nothing: a forward hook on each MoE layer's router keeps its logits, a
    forward pre-hook on each Mira experts module sees (hidden, top_k_index, top_k_weights) of that
    layer, and a forward hook on the whole model closes the step. While it records, decode steps
    run eagerly (no CUDA graphs, whose replays would skip the routers' hooks). Use it as a context manager next
    to `RoutingRecorder` (the trace), around the same forward passes; `features()` returns what was seen.

    Args:
        model: a loaded `MiraModel`.
    """

    def __init__(self, model):
        self.model = model
        self._experts = sorted((m for m in model.hf_model.modules() if isinstance(m, MiraExperts)),
                               key=lambda m: m.layer_position)
        self._routers = model_routers(model.hf_model)
        unknown = sorted({type(r).__name__ for r in self._routers if not speculates(r)})
        if unknown:  # the features' gate speculation needs each router's rule (mira.predict.baselines)
            raise MiraError(f"--features records gate speculation, which Mira cannot compute for this model's "
                            f"routers ({', '.join(unknown)}); record the trace without --features (predictor heads "
                            "cannot be trained for this family)")
        self._speculation = GateSpeculation(self._routers, model.store.num_experts)
        self._logits: dict[int, torch.Tensor] = {}
        self._layer: dict[int, tuple[torch.Tensor, ...]] = {}
        self._steps: list[tuple[np.ndarray, ...]] = []
        self._tokens: list[int] = []
        self._top_k = 0
        self._handles: list = []
        self._graphs = False  # whether the model replayed decode steps from CUDA graphs before recording

    def __enter__(self) -> FeatureRecorder:
        # a decode step replayed from a CUDA graph would not run the routers' hooks
        self._graphs = self.model.decode_graphs is not None
        if self._graphs:
            self.model.use_cuda_graphs(False)
        for position, (experts, router) in enumerate(zip(self._experts, self._routers)):
            self._handles.append(router.register_forward_hook(
                lambda module, args, output, position=position: self._logits.__setitem__(position, output[0])))
            self._handles.append(experts.register_forward_pre_hook(
                lambda module, args, position=position: self._see_layer(position, args[0], args[1])))
        self._handles.append(self.model.hf_model.register_forward_hook(self._close_step))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._graphs:
            self.model.use_cuda_graphs(True)

    def _see_layer(self, position: int, hidden: torch.Tensor, top_k_index: torch.Tensor) -> None:
        # T tokens, H hidden, E experts, K routed per token
        experts = self.model.store.num_experts
        routed = torch.zeros(experts, dtype=torch.int32, device=hidden.device)
        routed.scatter_add_(0, top_k_index.reshape(-1), torch.ones_like(top_k_index.reshape(-1), dtype=torch.int32))
        speculation = (self._speculation.scores(position, hidden) if position < len(self._experts) - 2
                       else torch.zeros(experts, device=hidden.device))
        self._layer[position] = (hidden.float().mean(0), self._logits.pop(position).float().mean(0), routed,
                                 speculation)  # [H], [E], [E], [E]
        self._top_k = top_k_index.shape[1]

    def _close_step(self, module, args, output) -> None:
        layers = [self._layer[p] for p in range(len(self._experts))]
        self._layer.clear()
        hidden, logits, routed, speculation = (torch.stack(parts).cpu() for parts in zip(*layers))  # [L, *]
        self._steps.append((hidden.to(torch.float16).numpy(), logits.numpy(), routed.numpy(),
                            speculation[:-2].numpy()))
        self._tokens.append(int(routed[0].sum()) // self._top_k)

    def features(self) -> FeatureSet:
        """The features of every step recorded so far.

        Raises:
            MiraError: no step was recorded.
        """
        if not self._steps:
            raise MiraError("no steps were recorded")
        hidden, logits, routed, speculation = (np.stack(parts) for parts in zip(*self._steps))
        return FeatureSet(np.concatenate([[0], np.cumsum(self._tokens)]).astype(np.int64), hidden, logits, routed,
                          speculation, self._top_k, self.model.store.manifest.source_fingerprint)
