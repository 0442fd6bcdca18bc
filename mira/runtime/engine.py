"""`mira.load`: a model directory or store -> a ready model whose experts come from the store.

This is where the pieces meet: the store (host memory), the budget (how many slots), the policy
and the cache mechanism, the transfer layer, the kernel, and transformers' model with Mira's
experts module bound at every MoE site.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import shlex
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, StaticCache

from mira.cache.budget import SlotPlan
from mira.cache.cache import ExpertCache
from mira.cache.config import CacheConfig
from mira.cache.policy import Popularity, make_policy, policy_class, stage_slots
from mira.cache.slots import SlotPool
from mira.cache.telemetry import Telemetry
from mira.errors import MiraError
from mira.kernels import DECODE_TOKENS, CpuMoEFFN, make_moe_ffn
from mira.models.hub import MODEL_OPTION, ModelSource, locate
from mira.models.loader import MoESite, build_model, looped_layers, read_config, routed_per_token
from mira.models.registry import adapter_for
from mira.predict.baselines import GateSpeculation, Predictor, speculates
from mira.predict.heads import TrainedPredictor, load_heads, load_predictor, predictor_file
from mira.cache.costmodel import CpuPace, HybridCosts, cpu_may_pay, cpu_pays, share_keeps
from mira.runtime.cpu_worker import CpuExpertWorker
from mira.runtime.experts import MiraExperts
from mira.runtime.graph_share import GraphShare, make_graph_share
from mira.runtime.hybrid import CpuExperts, HybridExperts, expert_cuts, machine_costs, worker_threads
from mira.runtime.graphs import CACHE_ARGUMENTS, DecodeGraphs, static_cache, takes_static_cache
from mira.runtime.config import Facts, RuntimeConfig, default_dtype, resolve, resolve_setup
from mira.runtime.plan import share_budget, slot_plan
from mira.runtime.run_ahead import applies, decode_ahead
from mira.runtime.threads import free_idle_team
from mira.cache.transfer import Transfer
from mira.store.cache import cache_store
from mira.store.manifest import Manifest, is_store, looks_like_store, stopped_conversion
from mira.store.store import ExpertStore
from mira.store.verify import corrupt

BUNDLED_MODEL = Path(__file__).resolve().parent.parent / "assets" / "mira-tiny-moe"
REVIEW_STEPS = 16  # decode steps between judgements of auto's CPU share at the paces they measured
REVIEW_CHECKS = 3  # judgements in a row under KEEP_LAYER_S that drop it: a slow start must persist


class MiraModel:
    """A transformers causal LM whose routed experts are served by Mira.

    Attributes:
        hf_model: the transformers model (call it, or use `generate`).
        tokenizer: the model's tokenizer, or None when the directory has none.
        config: the RuntimeConfig it was loaded with.
        store, cache, plan: the expert store, the cache mechanism and the slot plan.
        hybrid: the CPU's share of each layer's misses (mira.runtime.hybrid), or None; kept, for its
            telemetry, after `drop_cpu_share`.
        graph_share: the CPU lanes' share of lagged decode calls' misses (mira.runtime.graph_share), or None.
        share_review: auto's verdict on its CPU share (`review_share` at load), with each judgement's
            saving and paces: kept at the first judgement, every REVIEW_STEPS decode steps, that finds
            it paying, dropped after REVIEW_CHECKS that do not; None before it or without one.
        calibration: this machine's calibrated CPU and PCIe costs for the experts (mira.cache.costmodel),
            whether or not they turned a CPU share on; None where nothing was calibrated.
        decode_graphs: on CUDA, the CUDA-graph replay of decode steps (mira.runtime.graphs), or None
            when switched off (`use_cuda_graphs(False)`) or on the CPU.
        decode_ahead: decode one sequence with one step in flight ahead of the host
            (mira.runtime.run_ahead), on a static KV cache; None (the default): where decode steps
            replay from CUDA graphs, unless `config.graphs.ahead` is off.
    """

    def __init__(self, hf_model, tokenizer, config: RuntimeConfig, store: ExpertStore, cache: ExpertCache,
                 plan: SlotPlan | None, max_context: int, lagged: bool, hybrid: HybridExperts | None = None,
                 calibration: HybridCosts | None = None, review_share: bool = False,
                 graph_share: GraphShare | None = None):
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.config = config
        self.store = store
        self.cache = cache
        self.plan = plan
        self.max_context = max_context
        self.lagged = lagged  # decode layers leave their routing to the settle after each step
        self.hybrid = hybrid  # the CPU's share of the misses (mira.runtime.hybrid), or None
        self.graph_share = graph_share
        self.calibration = calibration
        self.share_review: dict | None = None
        self._judged: list[dict] = []  # the judgements of auto's share so far: saving per layer, paces
        self._review_in = REVIEW_STEPS if review_share and hybrid is not None else None  # decode steps to go
        self._settles = lagged or cache.staging is not None
        self.device = torch.device(config.device)
        self._step_tokens = 0
        self._defer_settle = self.device.type == "cuda" and config.residency.deferred  # see ResidencyConfig
        self._unsettled: int | None = None  # tokens of the step whose settle is deferred
        self._sent: int | None = None  # tokens of the step before it, its counts on their way to the host
        self._two_steps = False  # this generate call settles each step two steps on (`generate`)
        hf_model.register_forward_pre_hook(self._before_step, with_kwargs=True)
        hf_model.register_forward_hook(self._after_step)
        self._eager_forward = hf_model.forward
        self.decode_graphs: DecodeGraphs | None = None
        self._kv_cache: StaticCache | None = None
        self._static_cache_taken = takes_static_cache(hf_model)
        forward = inspect.signature(type(hf_model).forward).parameters
        self._cache_keyword = next((name for name in CACHE_ARGUMENTS if name in forward), "past_key_values")
        self._layers = [m for m in hf_model.modules() if isinstance(m, MiraExperts)]
        self.use_cuda_graphs(self.device.type == "cuda")
        self.decode_ahead: bool | None = None

    def use_cuda_graphs(self, enabled: bool) -> None:
        """Replay decode steps from CUDA graphs (on CUDA only; default on there), or run every step
        eagerly. Graphs apply to batch-1 `generate` calls whose MoE layers never need the host."""
        if enabled and self.device.type != "cuda":
            raise MiraError("CUDA graphs need a CUDA device")
        if enabled and self.decode_graphs is None:
            self.decode_graphs = DecodeGraphs(self._eager_forward, self._layers)
            self.hf_model.forward = self.decode_graphs
        elif not enabled and self.decode_graphs is not None:
            self.decode_graphs.forget()
            self.decode_graphs = None
            self.hf_model.forward = self._eager_forward

    def _before_step(self, module, args, kwargs) -> None:
        if self._two_steps:
            self._settle_sent()  # the step before the last: its counts left for the host a step ago
            if self._unsettled is not None:  # the last step's counts follow once its kernels are done
                self._sent, self._unsettled = self._unsettled, None
                self.cache.tables.send_back()
        else:
            self.finish_step()
        inputs = step_inputs(args, kwargs)
        self._step_tokens = int(inputs.shape[0] * inputs.shape[1])  # batch x new positions (not the logits kept)

    def _after_step(self, module, args, output) -> None:
        if self._defer_settle:
            self._unsettled = self._step_tokens
        else:
            self._settle_step(self._step_tokens)

    def finish_step(self) -> None:
        """Settle the forward steps whose settle is still deferred (on CUDA, until the next step
        starts, or the one after it when decoding runs ahead; `generate` and `stats` call this): their
        routing goes to the policy, in order, as every step's does."""
        self._settle_sent()
        if self._unsettled is not None:
            tokens, self._unsettled = self._unsettled, None
            self._settle_step(tokens)

    def _settle_sent(self) -> None:
        if self._sent is not None:
            tokens, self._sent = self._sent, None
            self._settle_step(tokens, sent=True)

    def _settle_step(self, tokens: int, sent: bool = False) -> None:
        # a decode step's misses price the lanes' quotas again, where there are prices to do it with
        quoting = self.graph_share is not None and self.graph_share.prices is not None and tokens <= DECODE_TOKENS
        before = self.cache.telemetry.layer_misses() if quoting else None
        if self._settles:
            self.cache.settle(sent)  # lagged layers' routing of the step, and staging's, go to the policy
        if self.graph_share is not None:
            self.graph_share.check()  # after the settle's read-back: every lane is through with the step
        if quoting and self.graph_share.decode_settled(self.cache.telemetry.layer_misses() - before) \
                and self.decode_graphs is not None:
            self.decode_graphs.forget()  # captured with the old quotas: captured again
        self.cache.end_step(tokens)
        if self._review_in is not None and tokens <= DECODE_TOKENS:
            self._review_in -= 1
            if not self._review_in:
                self._review_share()

    def _review_share(self) -> None:
        """Auto's CPU share judged at the paces decoding measured (mira.cache.costmodel.share_keeps):
        kept for good once it pays; dropped, decoding going on lagged and GPU only, once REVIEW_CHECKS
        judgements in a row found it not paying (a drop is for good, so its evidence must persist)."""
        saving = self.hybrid.paced_saving()
        if saving is None:  # no decode call yet had a lookup: nothing measured to judge by
            self._review_in = None
            return
        self._judged.append({"paced_saving_ms": round(saving * 1e3, 3), **self.hybrid.paces()})
        kept = share_keeps(saving)
        if not kept and len(self._judged) < REVIEW_CHECKS:
            self._review_in = REVIEW_STEPS
            return
        self._review_in = None
        self.share_review = {"after_decode_steps": REVIEW_STEPS * len(self._judged), **self._judged[-1],
                             "judged": self._judged, "kept": kept}
        if not kept:
            self.drop_cpu_share()

    def drop_cpu_share(self) -> None:
        """Decode without the CPU's share from the next step on: every MoE layer lagged, its misses
        read over PCIe (CUDA graphs replay from the next `generate` call); the worker stops."""
        if self.hybrid is None:
            raise MiraError("this model has no CPU share to drop")
        self.hybrid.collect()  # the last layer's job, recorded
        for layer in self.hf_model.modules():
            if isinstance(layer, MiraExperts):
                layer.hybrid = None
                layer.lagged = True
        self.lagged = self._settles = True
        self._review_in = None
        self.hybrid.worker.close()

    def __call__(self, *args, **kwargs):
        return self.hf_model(*args, **kwargs)

    def generate(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """transformers' `generate`: token ids [B, T] in, token ids [B, T + new] out.

        Raises:
            MiraError: the prompt plus max_new_tokens (or max_length) does not fit in max_context.
        """
        prompt_tokens = input_ids.shape[-1]
        new_tokens = kwargs.get("max_new_tokens")
        if new_tokens is None:  # max_length is a total length, as transformers takes it
            new_tokens = kwargs["max_length"] - prompt_tokens if kwargs.get("max_length") is not None else 0
        self.check_fits(prompt_tokens, new_tokens)
        kwargs.setdefault("disable_compile", True)
        if self.hybrid is not None or self.graph_share is not None:
            free_idle_team()  # this thread's: beside it the CPU share's threads would sleep between operations
        static = self._static_decoding(input_ids, kwargs)
        wanted = self.decode_ahead if self.decode_ahead is not None else (
            self.config.graphs.ahead and self.decode_graphs is not None)
        ahead = static and wanted and applies(self.hf_model, input_ids, kwargs)
        if static and (self.decode_graphs is not None or ahead):
            kwargs[self._cache_keyword] = self._static_kv_cache()
        if ahead:
            kwargs["custom_generate"] = functools.partial(decode_ahead, streamer=kwargs.get("streamer"))
            # a step's settle then waits for the step after next, whose launch need not wait for the
            # step's kernels; not with a CPU share or staging, whose settles rely on the step being done
            self._two_steps = (self._defer_settle and self._settles and self.hybrid is None
                               and self.graph_share is None and all(m.predictor is None for m in self._layers))
        if isinstance(kwargs.get("attention_mask"), torch.Tensor):  # beside the ids, wherever the caller made it
            kwargs["attention_mask"] = kwargs["attention_mask"].to(self.device)
        try:
            return self.hf_model.generate(input_ids.to(self.device), **kwargs)
        finally:
            self._two_steps = False
            self.finish_step()

    def check_fits(self, prompt_tokens: int, new_tokens: int) -> None:
        """Raise MiraError, naming the fix, when the prompt is empty or it and `new_tokens` exceed max_context."""
        if prompt_tokens == 0:
            raise MiraError("the prompt is empty (no tokens); pass a prompt")
        if prompt_tokens + new_tokens > self.max_context:
            positions = getattr(self.hf_model.config, "max_position_embeddings", None)
            if positions is not None and positions <= self.max_context:
                fix = f"shorten the prompt or lower --max-new-tokens (the model holds at most {positions} positions)"
            else:
                fix = ("shorten the prompt, lower --max-new-tokens or pass a larger --max-context"
                       + (f" (up to {positions})" if positions else ""))
            raise MiraError(f"the prompt of {prompt_tokens} tokens plus {new_tokens} new tokens "
                            f"is longer than the context of {self.max_context} tokens; {fix}")

    def _static_decoding(self, input_ids: torch.Tensor, kwargs: dict) -> bool:
        """Whether this generate call can decode on a static KV cache, which CUDA graphs need to replay
        its decode steps: one sequence, a model that takes one, and no MoE layer that needs the host
        after its first call."""
        return (_one_sequence(input_ids, kwargs, self.hf_model.generation_config)
                and self._static_cache_taken and all(layer.host_free for layer in self._layers))

    def _static_kv_cache(self) -> StaticCache:
        """The KV cache CUDA graphs can replay on: fixed buffers of max_context tokens, made once and
        emptied for each generate call (its buffers keep their addresses, so captured steps stay valid)."""
        if self._kv_cache is None:
            self._kv_cache = static_cache(self.hf_model.config, self.max_context)
        else:
            self._kv_cache.reset()
        return self._kv_cache

    @property
    def all_resident(self) -> bool:
        """Every expert has a slot: they were all copied in when loading and the policy has nothing to do."""
        return self.cache.pool.num_slots >= self.store.num_layers * self.store.num_experts

    def stats(self) -> dict:
        """Cache statistics and the setup, as plain JSON-ready values."""
        self.finish_step()
        return {
            "device": self.config.device,
            "dtype": self.config.dtype,
            "quant": self.store.manifest.scheme,
            "policy": ("all-resident" if self.all_resident else "none: experts read in place" if not self.plan
                       else self.config.cache.policy),
            "slots": self.cache.pool.num_slots,
            "total_experts": self.store.num_layers * self.store.num_experts,
            "expert_blob_bytes": self.store.blob_bytes,
            "budget": asdict(self.plan) if self.plan else None,
            "cache": self.cache.telemetry.summary(),
            "prefetch": self.cache.prefetch.as_dict(),
            "residency": "lagged" if self.lagged else "inline",
            "decode_steps_replayed": self.decode_graphs.replays if self.decode_graphs is not None else 0,
            "cpu_experts": {**(self.hybrid.summary() if self.hybrid is not None else
                               self.graph_share.summary() if self.graph_share is not None else {"mode": "off"}),
                            **({"review": self.share_review} if self.share_review is not None else {}),
                            **({"calibration": self.calibration.to_json()} if self.calibration is not None else {})},
        }


def step_inputs(args: tuple, kwargs: dict) -> torch.Tensor:
    """The new positions of a forward step, [B, S] ids or [B, S, H] embeddings, from the model call's
    arguments (as a forward pre-hook with kwargs sees them)."""
    inputs = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    return args[0] if inputs is None and args else inputs


def _one_sequence(input_ids: torch.Tensor, kwargs: dict, defaults) -> bool:
    """A generate call that decodes one sequence in its own KV cache (`defaults`: the model's
    GenerationConfig, for what the call leaves out)."""
    def setting(name: str) -> int:
        value = kwargs.get(name)
        return (value if value is not None else getattr(defaults, name, None)) or 1

    return (input_ids.shape[0] == 1 and all(kwargs.get(name) is None for name in CACHE_ARGUMENTS)
            and setting("num_beams") == 1
            and setting("num_return_sequences") == 1 and kwargs.get("assistant_model") is None)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load(path: str | os.PathLike | None = None, config: RuntimeConfig | None = None, **overrides) -> MiraModel:
    """Load a model for generation with its experts served from a Mira store.

    Args:
        path: a Hugging Face model directory (converted on first use into a store under the cache
            directory, `$MIRA_CACHE` or $XDG_CACHE_HOME/mira, default ~/.cache/mira), a hub id (org/name)
            or repo folder in the local Hugging Face cache, or a store; None for the bundled model.
        config: the settings (mira.runtime.config.RuntimeConfig); default: every one left to Mira.
        overrides: settings by name on top of `config`: device, dtype, vram_budget (bytes, a size such
            as "12GiB", or "25%"), max_context, quant, profile, progress, and policy (mira, lru, lfu, static,
            on-demand), prefetch (auto, trained, gate, off), heads, residency (auto, lagged, inline),
            cuda_graphs, cpu_experts (auto, off, all, split, graph), cpu_threads, cpu_lanes, device_pace,
            deferred_settle and decode_ahead.

    Raises:
        MiraError: with a message naming the fix, for every problem a user can fix.
    """
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise MiraError(f"the model must be a path or a hub id (str or Path), not {type(path).__name__} {path!r}")
    config = (config or RuntimeConfig()).with_overrides(**overrides)
    torch_device = parse_device(config.device)
    if torch_device.type == "cpu" and config.vram_budget is None:
        defaults = RuntimeConfig()
        for name, value, default in (("policy", config.cache.policy, defaults.cache.policy),
                                     ("prefetch", config.prefetch.mode, defaults.prefetch.mode)):
            if value != default:  # no slots to manage or stage into (residency still picks the decode loop)
                raise MiraError(f"{name}={value!r} has no effect on the CPU without vram_budget (every expert is "
                                f"read in place from host memory); pass vram_budget (e.g. '25%') or leave out {name}")
    for flag, file in (("--profile", config.profile), ("--heads", config.prefetch.heads)):
        if file is not None and not Path(file).is_file():
            raise MiraError(f"{flag} {file} is not a file; pass the path of an existing file")
    model_path = Path(path) if path is not None else BUNDLED_MODEL
    directory = _locate(model_path).directory  # a hub id or cache folder -> its snapshot
    _check_model_path(directory)
    positions = getattr(_model_config(directory), "max_position_embeddings", None)
    setup = resolve_setup(dataclasses.replace(config, device=str(torch_device)),
                          cuda_available=torch.cuda.is_available(), model_positions=positions)
    store_path = resolve_store(model_path, config.quant, config.progress)
    store = ExpertStore.open(store_path, pin=torch_device.type == "cuda", progress=config.progress)
    dtype = config.dtype or default_dtype(setup.device, store.layout.weights)
    hf_model, sites = build_model(store_path, getattr(torch, dtype), torch_device)
    popularity = _popularity(config.profile, store) if config.profile is not None else None
    budget = config.vram_budget
    if isinstance(budget, str):
        budget = share_budget(budget, hf_model, store, setup.max_context)
    config = dataclasses.replace(config, device=setup.device, dtype=dtype, vram_budget=budget,
                                 max_context=setup.max_context, quant=store.manifest.scheme)
    return assemble(hf_model, sites, store, store_tokenizer(store_path), config, popularity)


def assemble(hf_model, sites: list[MoESite], store: ExpertStore, tokenizer: PreTrainedTokenizerBase | None,
             config: RuntimeConfig | None = None, profile: Popularity | None = None) -> MiraModel:
    """Bind Mira's experts to a built model: the slot plan, cache, transfer layer, kernel and predictor.

    `load` calls this for a model read from a store; `mira bench` calls it for synthetic models
    whose store lives only in memory. `hf_model` is on its device and in its compute dtype, `sites`
    are its MoE sites (mira.models.loader), `config` the settings (its device and dtype are the
    model's; a share-of-experts budget must already be in bytes), `profile` the routed tokens per
    expert that place the static policy's experts and give the mira policy its prior.
    """
    torch_device = next(hf_model.parameters()).device
    total_experts = store.num_layers * store.num_experts
    if profile is not None and len(profile.counts) != total_experts:
        raise MiraError(f"the profile routes over {len(profile.counts)} experts but this model has {total_experts}; "
                        "record the profile with `mira trace` on the same model")
    setup = resolve_setup(config or RuntimeConfig(), cuda_available=torch_device.type == "cuda",
                          model_positions=getattr(hf_model.config, "max_position_embeddings", None))
    config = dataclasses.replace(config or RuntimeConfig(), device=str(torch_device),
                                 dtype=str(hf_model.dtype).removeprefix("torch."), max_context=setup.max_context,
                                 quant=store.manifest.scheme)
    plan = slot_plan(config, hf_model, store, setup.max_context)
    capacity = plan.slots if plan else 0
    act, gate = adapter_for(hf_model.config).spec.ffn_functions()  # the family's own arithmetic
    ffn = make_moe_ffn(torch_device, store.layout, act, gate=gate, num_experts=store.num_experts, dtype=hf_model.dtype)
    heads = config.prefetch.heads
    top_k = routed_per_token(hf_model.config)
    miss_rate = 1 - min(1.0, capacity / total_experts)

    def share_pays(costs: HybridCosts, worker: CpuExpertWorker) -> bool:
        return cpu_pays(costs, top_k, store.blob_bytes, miss_rate,
                        expert_cuts(store.layout, getattr(ffn, "cut_granule", None), worker.ffn.column_cost))

    worker, costs = _calibrated_worker(config, store, act, gate, torch_device, capacity < total_experts, top_k,
                                       share_pays)
    facts = Facts(device_type=torch_device.type, capacity=capacity, total_experts=total_experts,
                  fused_kernels=hasattr(ffn, "forward_bases"),
                  admits_misses=_policy_class(config.cache.policy).admits_misses,
                  stage_slots=stage_slots(config.cache.policy, capacity, total_experts, config.cache),
                  has_heads=heads is not None or predictor_file(store.path).is_file(),
                  speculates=config.prefetch.mode == "off" or speculates(sites[0].router),  # one Experts class
                  runs_once=looped_layers(hf_model.config) is None,
                  cpu_pays=costs is not None and top_k is not None and share_pays(costs, worker))
    try:
        decided = resolve(config, facts)
    except MiraError:
        if worker is not None:
            worker.close()
        raise
    if decided.cpu_experts in (None, "graph") and worker is not None:
        worker.close()  # unused, or replaced by the lanes (its calibration priced PCIe)
    if decided.cpu_experts is not None:  # the kernel adds zero for the experts the CPU computes
        ffn = make_moe_ffn(torch_device, store.layout, act, gate=gate, num_experts=store.num_experts, absent_zero=True,
                           dtype=hf_model.dtype)
    if isinstance(ffn, CpuMoEFFN):
        ffn.bind(store, config.progress)
    elif store.codes_layout != "tiles":
        raise MiraError(f"the int4 codes of the store {store.path} in this process were laid out for the CPU executor "
                        "(a CPU run in bf16 or fp16); open the store again for a run in float32 or on a GPU")
    if decided.policy != config.cache.policy:  # every expert fits: all resident from the start
        profile = Popularity((1,) * total_experts, 1)
    placement = _policy(decided.policy, decided.policy_slots, total_experts, config.cache, profile)
    transfer = Transfer(torch_device, capacity)
    cache = ExpertCache(store, placement, SlotPool(capacity, store.blob_bytes, torch_device), transfer,
                        Telemetry(store.num_layers, store.num_experts))
    routers = [site.router for site in sites]
    predictor = _predictor(decided.predictor, routers, store, torch_device, heads) if decided.predictor else None
    hybrid = graph_share = None
    if decided.cpu_experts == "graph":
        graph_share = make_graph_share(store, cache.tables, act, gate, costs, top_k,
                                       miss_rate, hf_model.dtype, torch_device,
                                       config.hybrid.threads, config.hybrid.lanes)
    elif decided.cpu_experts is not None:
        worker = worker or CpuExpertWorker(CpuExperts(store.layout, act, gate), worker_threads(config.hybrid.threads))
        hybrid = HybridExperts(worker, store, cache.tables, costs, decided.cpu_experts == "split", torch_device,
                               CpuPace() if costs is not None else None, getattr(ffn, "cut_granule", None),
                               device_pace=config.hybrid.device_pace)
    for position, site in enumerate(sites):
        setattr(site.parent, site.attr, MiraExperts(position, cache, ffn, torch_device, predictor, routers[position],
                                                    lagged=decided.lagged, hybrid=hybrid, graph_share=graph_share,
                                                    route_norm=site.route_norm))
    model = MiraModel(hf_model, tokenizer, config, store, cache, plan, setup.max_context, decided.lagged, hybrid,
                      costs, decided.share_review, graph_share)
    if not config.graphs.enabled and model.decode_graphs is not None:
        model.use_cuda_graphs(False)
    return model


def _calibrated_worker(config: RuntimeConfig, store: ExpertStore, act, gate, device: torch.device, misses: bool,
                       top_k: int | None, share_pays) -> tuple[CpuExpertWorker | None, HybridCosts | None]:
    """On CUDA, where the CPU may take misses, its worker and this machine's calibrated costs
    (mira.runtime.hybrid.machine_costs; for "auto", measured again where a saved calibration says
    that `share_pays(costs, worker)` does not hold); else (None, None): on the CPU, "auto" stays off,
    as it does for experts too small to pay on any machine (`cpu_may_pay`) and where the routed
    experts per token are unknown, and "all" needs no costs."""
    mode = config.hybrid.mode
    if device.type != "cuda" or mode == "off" or not misses or (mode == "auto" and (
            config.residency.mode == "lagged" or top_k is None or not cpu_may_pay(top_k, store.blob_bytes))):
        return None, None
    worker = CpuExpertWorker(CpuExperts(store.layout, act, gate), worker_threads(config.hybrid.threads))
    pays = (lambda costs: share_pays(costs, worker)) if mode == "auto" else None
    return worker, machine_costs(worker, store, device, config.progress, pays)


def _policy(name: str, capacity: int, total_experts: int, config: CacheConfig, profile: Popularity | None):
    try:
        return make_policy(name, capacity, total_experts, config, profile=profile)
    except ValueError as error:
        raise MiraError(f"{error}; pass --profile with a trace recorded by `mira trace`") from error


def _policy_class(name: str):
    try:
        return policy_class(name)
    except ValueError as error:
        raise MiraError(str(error)) from error


def resolve_store(path: Path, quant: str | None, progress: bool) -> Path:
    """The store for `path`: `path` itself if it is a store, else its conversion in the cache directory,
    converted on first use and again whenever the files of `path` changed (mira.store.cache). `path`
    may also be a hub id or a hub cache folder (mira.models.hub)."""
    source = _locate(path)  # a hub id or cache folder -> its snapshot, and a store named after the repo
    path = source.directory
    _check_model_path(path)
    if is_store(path):
        manifest = Manifest.read(path)
        if quant is not None and quant != manifest.scheme:
            raise MiraError(f"store {path} holds {manifest.scheme} experts, not {quant}; pass --quant "
                            f"{manifest.scheme}, or convert the model again with --quant {quant}")
        return path
    return cache_store(path, quant or "int8-shared", progress, name=source.name)


def _locate(path: Path) -> ModelSource:
    """`locate`, but a missing path where a conversion into it stopped (an org/name-like one too) is
    named as such rather than looked up in the Hugging Face cache."""
    if not path.exists() and stopped_conversion(path) is not None:
        _check_model_path(path)
    return locate(path)


def _check_model_path(path: Path) -> None:
    """`path` is a directory that can be a model or a store.

    Raises:
        MiraError: it does not exist, is a file, or is a store without a readable manifest.
    """
    if not path.exists():
        if (partial := stopped_conversion(path)) is not None:
            raise MiraError(f"model path {path} does not exist: a conversion into it stopped before it finished "
                            f"({partial} holds what it wrote); finish it with `mira convert MODEL_DIR --out "
                            f"{shlex.quote(str(path))}`, MODEL_DIR being the model it converts")
        hint = " (the bundled model is missing from this installation)" if path == BUNDLED_MODEL else ""
        raise MiraError(f"model path {path} does not exist{hint}; pass {MODEL_OPTION} with a local Hugging Face "
                        "model directory, a hub id (org/name) in the local Hugging Face cache, or a Mira store")
    if not path.is_dir():
        raise MiraError(f"model path {path} is a file, not a directory; pass {MODEL_OPTION} with a local "
                        "Hugging Face model directory or a Mira store")
    if looks_like_store(path) and not is_store(path):
        raise MiraError(f"{path} is a Mira store whose manifest.json is missing; repair it with `mira convert "
                        f"MODEL_DIR --out {path}`, MODEL_DIR being the model it was converted from")


def _model_config(directory: Path):
    """The transformers config of a model directory or store; a store's unreadable one is corruption,
    named with the command that repairs the store."""
    try:
        return read_config(directory)
    except MiraError as error:
        if not is_store(directory):
            raise
        raise corrupt(directory, Manifest.read(directory), f"config.json cannot be read ({error})") from None


def parse_device(device: str | None) -> torch.device:
    """"cpu", "cuda" or "cuda:N" (default: CUDA when present) as a torch.device that exists here.

    Raises:
        MiraError: an unknown device, or a CUDA device this machine does not have.
    """
    if device is None:
        return torch.device(default_device())
    try:
        torch_device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        torch_device = None
    if torch_device is None or torch_device.type not in ("cpu", "cuda") or (
            torch_device.type == "cpu" and torch_device.index not in (None, 0)):
        raise MiraError(f"unknown device {device!r}; pass --device cpu, cuda or cuda:N")
    if torch_device.type == "cuda":
        if not torch.cuda.is_available():
            raise MiraError(f"--device {device} was asked for but no CUDA device is available; pass --device cpu")
        if torch_device.index is not None and torch_device.index >= torch.cuda.device_count():
            raise MiraError(f"there is no CUDA device {torch_device.index} (this machine has "
                            f"{torch.cuda.device_count()}); pass --device cuda:0 .. "
                            f"cuda:{torch.cuda.device_count() - 1}")
    return torch_device


def _predictor(kind: str, routers: list, store: ExpertStore, device: torch.device,
               heads: str | os.PathLike | None) -> Predictor:
    """The predictor `resolve` chose: "trained" (the given heads, else the store's) or "gate"."""
    gate = GateSpeculation(routers, store.num_experts)
    if kind == "gate":
        return gate
    if heads is not None:
        trained_heads, _ = load_heads(heads, store.manifest.source_fingerprint)
        return TrainedPredictor(trained_heads, gate, device)
    return load_predictor(store.path, routers, device)


def _popularity(path: str | os.PathLike, store: ExpertStore) -> Popularity:
    from mira.store.trace import RoutingTrace

    trace = RoutingTrace.load(path)
    trace.check_profile_of(store.num_layers, store.num_experts, "this model")
    return Popularity.of_trace(trace)


def store_tokenizer(store_path: Path) -> PreTrainedTokenizerBase | None:
    if not any((store_path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(store_path)

