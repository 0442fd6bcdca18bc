"""lm-evaluation-harness backend `mira`: loglikelihood, rolling loglikelihood and generation tasks
run through Mira's runtime (experts served from the store under a VRAM budget).

Registered with the harness's `register_model` when this module is imported (`mira eval lm-eval`
imports it), and declared in the `lm_eval.models` entry-point group for harness versions that
discover plugins by themselves:

    mira eval lm-eval --model mira --model_args pretrained=PATH,vram_budget=12GiB,quant=int8-shared --tasks ...
"""

from __future__ import annotations

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import simple_parse_args_string
from tqdm import tqdm

from mira.errors import MiraError
from mira.eval.ppl import model_log_probs, windows
from mira.runtime.engine import load

DEFAULT_MAX_GEN_TOKS = 256
SAMPLING = ("do_sample", "temperature", "top_p", "top_k")  # the generation settings a task may give; a
# temperature of 0 decodes greedily, as does do_sample false


@register_model("mira")
class MiraLM(TemplateLM):
    """A Mira model as an lm-eval LM; one sequence per forward.

    Args (`--model_args`):
        pretrained: model directory or store (default: the bundled model).
        vram_budget: device memory for Mira, e.g. 12GiB, bytes, or a share of the experts such as 25%.
        quant: expert scheme (int8-shared, int8-row, int4, none).
        device, policy, max_context: as for `mira.load`.
        batch_size, max_batch_size: accepted from the harness's command line; requests run one at a time.

    Raises:
        MiraError: a --model_args key it does not take, or a setting `mira.load` refuses.
    """

    def __init__(self, pretrained: str | None = None, vram_budget: str | int | None = None, quant: str | None = None,
                 device: str | None = None, policy: str = "mira", max_context: int | None = None,
                 batch_size: int | str | None = None, max_batch_size: int | None = None, **unknown) -> None:
        super().__init__()
        if unknown:
            raise MiraError(f"the mira model takes no --model_args {', '.join(sorted(unknown))}; give pretrained, "
                            "vram_budget, quant, device, policy or max_context")
        self.model = load(pretrained, device=device, vram_budget=vram_budget, quant=quant, policy=policy,
                          max_context=max_context, progress=False)
        if self.model.tokenizer is None:
            raise MiraError(f"{pretrained} has no tokenizer files; lm-eval tasks need them")
        self.tokenizer = self.model.tokenizer
        self.max_length = self.model.max_context
        self._log_probs = model_log_probs(self.model)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> MiraLM:
        """The harness's constructor from --model_args, where a setting given there and on the harness's
        own command line (--device, --batch_size) is taken once, and refused if the two differ."""
        args = simple_parse_args_string(arg_string)
        for name, value in (additional_config or {}).items():
            if value is None:
                continue
            if name in args and str(args[name]) != str(value):
                raise MiraError(f"{name} is given twice, {args[name]} in --model_args and {value} on the command "
                                f"line; give it once")
            args.setdefault(name, value)
        return cls(**args)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is replaced by: the BOS token where the tokenizer has one."""
        return self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer(string, add_special_tokens=bool(add_special_tokens), verbose=False).input_ids

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether each continuation token is the argmax) per request;
        the context is cut from the left to fit max_context."""
        results = []
        for _, context, continuation in tqdm(requests, desc="loglikelihood", disable=disable_tqdm):
            whole = torch.tensor((context + continuation)[-(self.max_length + 1):])
            log_probs = self._log_probs(whole[:-1])[-len(continuation):]  # [C, V]
            targets = whole[-len(continuation):].to(log_probs.device)
            total = float(log_probs.gather(1, targets[:, None]).double().sum())
            results.append((total, bool((log_probs.argmax(dim=1) == targets).all())))
            self.cache_hook.add_partial("loglikelihood", (context, continuation), results[-1])
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole string, its first token conditioned on the prefix token, in
        windows of max_context that advance by half of it (mira.eval.ppl.windows)."""
        results = []
        for (string,) in tqdm([request.args for request in requests], desc="loglikelihood_rolling",
                              disable=disable_tqdm):
            ids = torch.tensor([self.prefix_token_id, *self.tok_encode(string)])
            context = min(self.max_length, len(ids))
            total = 0.0
            for window in windows(len(ids), context, max(1, context // 2)):
                log_probs = self._log_probs(ids[window.begin:window.end])
                scored = slice(window.first_scored - window.begin - 1, window.end - window.begin - 1)
                targets = ids[window.first_scored:window.end].to(log_probs.device)
                total += float(log_probs[scored].gather(1, targets[:, None]).double().sum())
            results.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, when the task asks) continuation of each context, cut at its first stop string."""
        results = []
        for context, gen_kwargs in tqdm([request.args for request in requests], desc="generate_until",
                                        disable=disable_tqdm):
            options = dict(gen_kwargs)
            until = options.pop("until", None) or [self.tokenizer.decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(options.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            if max_new >= self.max_length:
                raise MiraError(f"the task asks for {max_new} new tokens and the context holds {self.max_length}; "
                                "give a larger max_context in --model_args or a smaller max_gen_toks")
            sampling = {name: options.pop(name) for name in SAMPLING if name in options}
            if options:
                raise MiraError(f"the mira model does not take the generation setting {', '.join(sorted(options))}; "
                                f"it takes until, max_gen_toks and {', '.join(SAMPLING)}")
            do_sample = bool(sampling.pop("do_sample", False)) and float(sampling.get("temperature", 1.0)) > 0
            ids = self.tok_encode(context)[-(self.max_length - max_new):]
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=max_new, pad_token_id=self.eot_token_id,
                                      do_sample=do_sample, **(sampling if do_sample else {}))
            text = self.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
            for stop in until:
                text = text.split(stop)[0] if stop else text
            results.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return results
