"""On CUDA, missed experts computed by the CPU worker while the fused kernel computes the rest
(mira.runtime.hybrid): the CPU path's greedy text in float32, layer outputs against the float64
reference in bf16, with every miss on the CPU and with a hand-made split.

Skipped without a GPU; run on the GPU machine with `python -m pytest -m gpu`.
"""

import pytest
import torch
import torch.nn.functional as F

import mira
from mira.cache.costmodel import CpuPace, HybridCosts, LinearCost
from mira.kernels.reference import moe_ffn_reference
from mira.runtime import engine
from mira.runtime.experts import MiraExperts
from mira.runtime.hybrid import HybridExperts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GREEDY = dict(max_new_tokens=32, do_sample=False, pad_token_id=0)
E, K, H = 8, 2, 64


def _prompt():
    return torch.randint(2, 320, (1, 16), generator=torch.Generator().manual_seed(5))


def _budget(store, slots: int, dtype: str) -> int:
    probe = mira.load(store, device="cuda", dtype=dtype, vram_budget=64 << 30, progress=False)
    return probe.plan.reserve_bytes + slots * probe.store.blob_bytes


def test_every_miss_on_the_cpu_generates_the_cpu_paths_float32_text(mixtral_store):
    expected = mira.load(mixtral_store, device="cpu", progress=False).generate(_prompt(), **GREEDY)
    model = mira.load(mixtral_store, device="cuda", dtype="float32", vram_budget=_budget(mixtral_store, 10, "float32"),
                      cpu_experts="all", progress=False)
    assert model.stats()["residency"] == "inline" and model.hybrid.costs is not None  # calibrated for predictions
    got = model.generate(_prompt(), **GREEDY).cpu()
    cpu = model.stats()["cpu_experts"]
    print(f"\n{cpu}")
    assert torch.equal(got, expected) and cpu["tokens"] > 0
    assert all("predicted_ms" in layer for layer in cpu["layers"])
    for layer in cpu["layers"]:  # the device's side timed on the stream; the later side is at least either mean
        assert layer["device_ms"] > 0 and layer["served_ms"] >= max(layer["measured_ms"], layer["device_ms"]) - 1e-3


def test_misses_cut_between_the_cpu_and_the_kernel_generate_the_cpu_paths_float32_text(mixtral_store):
    """Costs under which every one-token layer call cuts a miss (tests/e2e/test_hybrid.py works one
    out), on every layer: the greedy text of the CPU path, in float32."""
    expected = mira.load(mixtral_store, device="cpu", progress=False).generate(_prompt(), **GREEDY)
    model = mira.load(mixtral_store, device="cuda", dtype="float32", vram_budget=_budget(mixtral_store, 10, "float32"),
                      cpu_experts="all", progress=False)
    blob = model.store.blob_bytes
    costs = HybridCosts(blob_bytes=blob, cpu=LinearCost(2e-3, 0.0), cpu_call_s=0.0, pcie_bytes_per_s=blob / 1e-3)
    layers = [m for m in model.hf_model.modules() if isinstance(m, MiraExperts)]
    hybrid = HybridExperts(model.hybrid.worker, model.store, model.cache.tables, costs, True, torch.device("cuda"),
                           cut_granule=layers[0].ffn.cut_granule)
    for layer in layers:
        layer.hybrid = hybrid
    got = model.generate(_prompt(), **GREEDY).cpu()
    summary = hybrid.summary()
    print(f"\n{summary['cuts']} cuts, {summary['experts']} whole experts on the CPU")
    assert torch.equal(got, expected) and summary["cuts"] > 0


@pytest.mark.parametrize("split", ["all", "split", "cut"])
def test_bf16_layers_add_the_cpus_share_to_the_kernels(mixtral_store, split):
    model = mira.load(mixtral_store, device="cuda", dtype="bfloat16", vram_budget=_budget(mixtral_store, 8, "bfloat16"),
                      policy="on-demand", prefetch="off", cpu_experts="all", progress=False)
    layer = min((m for m in model.hf_model.modules() if isinstance(m, MiraExperts)), key=lambda m: m.layer_position)
    if split != "all":  # one miss costs 1 ms on either side: the CPU takes floor(n / 2) of n misses; or a
        # CPU at 2 ms per miss, which takes none whole but part of one in a one-token call (tests/e2e/test_hybrid.py)
        blob = model.store.blob_bytes
        cpu_s, granule = (1e-3, None) if split == "split" else (2e-3, layer.ffn.cut_granule)
        costs = HybridCosts(blob_bytes=blob, cpu=LinearCost(cpu_s, 0.0), cpu_call_s=0.0, pcie_bytes_per_s=blob / 1e-3)
        layer.hybrid = HybridExperts(model.hybrid.worker, model.store, model.cache.tables, costs, True,
                                     torch.device("cuda"), cut_granule=granule)
    generator = torch.Generator().manual_seed(7)
    hybrid = layer.hybrid
    host_addresses = model.cache.tables.blob_addresses[:E].cuda()  # every expert read from its host blob
    for tokens in (1, 4, 40):
        hidden = torch.randn(tokens, H, generator=generator)
        index = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(tokens)])
        weights = torch.rand(tokens, K, generator=generator)
        args = (hidden.cuda().bfloat16(), index.cuda(), weights.cuda().bfloat16())
        got = layer(*args).float().cpu()
        kernel_only = layer.ffn.forward_bases(*args, host_addresses).float().cpu()  # the kernel alone
        blobs = [model.store.blob(0, e) for e in range(E)]
        expected = moe_ffn_reference(hidden.double(), index, weights.bfloat16().double(), blobs, model.store.layout,
                                     F.silu)
        error, kernel_error = ((y.double() - expected).abs().max().item() for y in (got, kernel_only))
        print(f"\n{tokens} tokens: max error {error:.4f} with the CPU's share, {kernel_error:.4f} without")
        # the CPU rounds x * s and the gate/up outputs to bf16, which the kernel keeps in fp32
        # (tests/kernels/test_cpu_experts.py derives its bound from those roundings): about twice the error
        assert error <= 3 * kernel_error + 1e-3
    hybrid.collect()
    assert hybrid.telemetry.calls[0] == 3
    assert sum(hybrid.telemetry.cuts) == (split == "cut")  # the one-token call's
    assert torch.equal(model.cache.tables.tables[0].cpu(), model.cache.tables.blob_addresses[:E].cpu())  # restored
    assert model.cache.tables.limits.eq(model.store.layout.intermediate).all().item()


def test_a_dropped_share_decodes_lagged_from_cuda_graphs_with_the_cpu_paths_float32_text(mixtral_store):
    """A share priced at 1 s an expert on the CPU saves nothing: after REVIEW_CHECKS judgements, every
    REVIEW_STEPS decode steps, it is dropped, the rest of the call decodes lagged, and the next call
    replays its decode steps from CUDA graphs; the greedy text of both calls is the CPU path's."""
    greedy = {**GREEDY, "max_new_tokens": engine.REVIEW_STEPS * engine.REVIEW_CHECKS + 8}
    expected = mira.load(mixtral_store, device="cpu", progress=False).generate(_prompt(), **greedy)
    model = mira.load(mixtral_store, device="cuda", dtype="float32", vram_budget=_budget(mixtral_store, 10, "float32"),
                      cpu_experts="all", progress=False)
    blob = model.store.blob_bytes
    costs = HybridCosts(blob_bytes=blob, cpu=LinearCost(1.0, 0.0), cpu_call_s=0.0, pcie_bytes_per_s=blob / 1e-3)
    loaded = model.hybrid  # kept: collected, it would close the worker the two share
    hybrid = HybridExperts(loaded.worker, model.store, model.cache.tables, costs, False, torch.device("cuda"),
                           CpuPace(learn=0.0, forget=0.0), device_pace=False)
    model.hybrid = hybrid
    for layer in (m for m in model.hf_model.modules() if isinstance(m, MiraExperts)):
        layer.hybrid = hybrid
    model._review_in = engine.REVIEW_STEPS  # as `mira.load` sets it for auto's share
    first = model.generate(_prompt(), **greedy).cpu()
    assert model.stats()["cpu_experts"]["review"]["kept"] is False and model.stats()["residency"] == "lagged"
    assert model.decode_graphs.replays == 0
    second = model.generate(_prompt(), **greedy).cpu()
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert model.decode_graphs.replays > 0
