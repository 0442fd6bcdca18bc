"""A CPU-only run in bfloat16 (`--dtype bfloat16`, and the default for large experts), whose experts go
through the CPU executor, against transformers' own forward of the same quantized model (its
dequantized experts put back):

- its logits lie as close to the exact float32 ones as transformers' own bfloat16 forward does
  (within 2x of that model's error, relative, L2), for every family and quantized scheme, and for
  long prompts, whose INT8 experts take dense products;
- its experts modules really take the executor's products (a float32 run takes none), and a run
  that names no dtype takes them exactly where its experts reach the size for bf16;
- under a budget whose slots are rewritten with other experts, it generates what it generates with
  every expert read in place, and the executor keeps one set of views per address read.
"""

import copy

import pytest
import torch

import mira
from mira.kernels import cpu_int4
from mira.runtime import config
from tiny_models import FAMILIES, dequantized_model

SCHEMES = ["int8-shared", "int8-row", "int4"]
ERROR_OVER_TRANSFORMERS = 2.0  # Mira's bf16 error over transformers' own bf16 error, at most
PROMPTS = 6  # a rounding that flips one token's routing moves its logits far: the errors are summed over prompts
LONG, LONG_PROMPTS = 192, 2  # tokens of a long prompt (DENSE_TOKENS and more for most experts), and how many


def _prompt(seed=0, length=16):
    return torch.randint(2, 320, (1, length), generator=torch.Generator().manual_seed(seed))


def _relative(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got.double() - exact.double()).norm() / exact.double().norm()).item()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_bf16_cpu_run_is_as_close_to_the_exact_model_as_transformers_bf16(family, scheme, checkpoints, stores,
                                                                          int4_checkpoints, int4_stores):
    checkpoint, store = (int4_checkpoints[family], int4_stores[family]) if scheme == "int4" else \
        (checkpoints[family], stores[family, scheme])
    _assert_as_close_as_transformers_bf16(checkpoint, store, [_prompt(seed) for seed in range(PROMPTS)])


@pytest.mark.parametrize("scheme", ["int8-shared", "int8-row"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_long_prompts_dense_products_are_as_close_as_transformers_bf16(family, scheme, checkpoints, stores):
    """A prompt of LONG tokens gives most experts DENSE_TOKENS or more (8 experts, 2 a token)."""
    prompts = [_prompt(seed, LONG) for seed in range(LONG_PROMPTS)]
    _assert_as_close_as_transformers_bf16(checkpoints[family], stores[family, scheme], prompts)


def _assert_as_close_as_transformers_bf16(checkpoint, store, prompts):
    reference = dequantized_model(checkpoint, store)
    in_bf16 = copy.deepcopy(reference).to(torch.bfloat16)
    model = mira.load(store, device="cpu", dtype="bfloat16", progress=False)
    assert model.stats()["dtype"] == "bfloat16"
    if model.store.layout.scheme == "int4":  # laid out for this CPU's torch where it does not read the tiles
        assert model.store.codes_layout == ("torch" if cpu_int4.adapts_codes() else "tiles")
    with torch.no_grad():
        runs = [(reference(ids).logits, in_bf16(ids).logits, model(ids).logits) for ids in prompts]
    exact, theirs, ours = (torch.cat(logits, dim=1) for logits in zip(*runs))
    assert ours.dtype == torch.bfloat16
    assert 0 < _relative(ours, exact) <= ERROR_OVER_TRANSFORMERS * _relative(theirs, exact)


class _Counted(torch.overrides.TorchFunctionMode):
    """Counts the INT8 weight-only products called inside it."""

    def __init__(self):
        super().__init__()
        self.products = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.products += func is torch._weight_int8pack_mm
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype,takes_products", [("bfloat16", True), ("float32", False)])
def test_only_a_bf16_cpu_run_computes_its_experts_with_weight_only_products(dtype, takes_products, stores):
    model = mira.load(stores["mixtral", "int8-shared"], device="cpu", dtype=dtype, progress=False)
    with torch.no_grad(), _Counted() as counted:
        model(_prompt(length=4))
    assert (counted.products > 0) == takes_products


@pytest.mark.parametrize("above", [True, False])
def test_a_cpu_run_of_no_dtype_takes_bf16_and_the_executor_for_large_experts(above, stores, monkeypatch):
    store = stores["mixtral", "int8-shared"]
    weights = mira.load(store, device="cpu", progress=False).store.layout.weights
    monkeypatch.setattr(config, "CPU_BF16_EXPERT_WEIGHTS", weights if above else weights + 1)
    model = mira.load(store, device="cpu", progress=False)
    assert model.stats()["dtype"] == ("bfloat16" if above else "float32")
    with torch.no_grad(), _Counted() as counted:
        logits = model(_prompt(length=4)).logits
    assert logits.dtype == (torch.bfloat16 if above else torch.float32)
    assert (counted.products > 0) == above


def test_a_bf16_cpu_run_under_an_evicting_budget_generates_its_in_place_text(mixtral_store):
    greedy = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    ids = _prompt(seed=5)
    expected = mira.load(mixtral_store, device="cpu", dtype="bfloat16", progress=False).generate(ids, **greedy)
    probe = mira.load(mixtral_store, device="cpu", dtype="bfloat16", vram_budget=1 << 30, progress=False)
    budget = probe.plan.reserve_bytes + 10 * probe.store.blob_bytes  # 10 slots for 24 experts
    model = mira.load(mixtral_store, device="cpu", dtype="bfloat16", vram_budget=budget, policy="lru", progress=False)
    assert torch.equal(model.generate(ids, **greedy), expected)
    assert model.stats()["cache"]["copies"] > 24  # slots rewritten with other experts
    executor = next(m.ffn.executor for m in model.hf_model.modules() if hasattr(m, "ffn"))
    assert len(executor._views) == 10  # one per slot row: every expert is read from a slot
