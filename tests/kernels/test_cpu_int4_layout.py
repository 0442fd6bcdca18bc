"""An int4 store's codes rewritten for a CPU whose torch INT4 matmul takes another layout than the
stored tiles (mira.kernels.cpu_int4.adapt_codes), as x86 CPUs without AVX-512 do. This machine is
made one by holding torch to AVX2 (ATEN_CPU_CAPABILITY) in a subprocess that runs this module and
the bf16 CPU runs of int4 stores; in this process the same tests check that a CPU whose torch reads
the tiles keeps them."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import MixtralConfig

from mira.bench.synthetic import synthetic_skeleton, synthetic_store
from mira.errors import MiraError
from mira.kernels import CpuMoEFFN, cpu_int4
from mira.kernels.cpu_experts import CpuExpertFFN
from mira.kernels.reference import expert_ffn
from mira.runtime.engine import assemble
from mira.store import int4

ROOT = Path(__file__).resolve().parents[2]
HELD_TO_AVX2 = os.environ.get("ATEN_CPU_CAPABILITY") == "avx2"
EXPERTS = 4


def _config():
    return MixtralConfig(vocab_size=128, hidden_size=128, intermediate_size=192, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                         num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)


def _relative(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got.double() - exact).norm() / exact.norm()).item()


def test_whole_tiles_of_rows_are_laid_out_as_the_matrix_is():
    packed, _ = int4.quantize_matrix(torch.randn(4 * int4.TILE, 256, generator=torch.Generator().manual_seed(1)))
    whole = cpu_int4.torch_layout(packed)
    parts = [cpu_int4.torch_layout(packed[start:start + int4.TILE]) for start in range(0, len(packed), int4.TILE)]
    assert torch.equal(torch.cat(parts), whole)
    assert torch.equal(whole, packed) == cpu_int4.torch_reads_blobs() != cpu_int4.adapts_codes()


def _tiled(codes: torch.Tensor, tile: int) -> torch.Tensor:
    """Codes [R, C] packed in tiles of `tile` rows: byte (c, j) holds rows j and j + tile / 2."""
    R, C = codes.shape
    halves = codes.view(R // tile, 2, tile // 2, C)
    return (halves[:, 0] | (halves[:, 1] << 4)).transpose(1, 2).reshape(R, C // 2)


def test_halved_tiles_are_tiles_of_half_the_rows():
    codes = torch.randint(0, 16, (3 * int4.TILE, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    halved = cpu_int4.halved_tiles(int4.pack_tiles(codes))
    assert torch.equal(halved, _tiled(codes, int4.TILE // 2))
    if HELD_TO_AVX2:  # torch's own packing here: the shuffle replaces it
        assert cpu_int4._halves_tiles()
        assert torch.equal(halved, torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2))


def test_codes_laid_out_for_this_cpu_give_the_products_of_the_tiles(monkeypatch):
    if HELD_TO_AVX2:
        assert cpu_int4.adapts_codes()  # the case this module is about
    monkeypatch.setattr(cpu_int4, "ADAPT_ELEMENTS", int4.TILE * 192)  # w13 [384, 128]: rewritten in 6 parts
    store = synthetic_store(_config(), 1, "int4", pin=False, progress=False)
    layout = store.layout
    x = torch.randn(3, layout.hidden, generator=torch.Generator().manual_seed(0)).bfloat16()
    exact = [expert_ffn(x.double(), layout.views(store.blob(0, e)), layout, F.silu) for e in range(EXPERTS)]
    in_bf16 = [expert_ffn(x, layout.views(store.blob(0, e)), layout, F.silu) for e in range(EXPERTS)]
    tiles = store.data.clone()
    ffn = CpuMoEFFN(layout, F.silu)
    ffn.bind(store)
    assert store.codes_layout == ("torch" if cpu_int4.adapts_codes() else "tiles")
    assert torch.equal(store.data, tiles) != cpu_int4.adapts_codes()
    adapted = store.data.clone()
    ffn.bind(store)  # once only
    assert torch.equal(store.data, adapted)
    for expert in range(EXPERTS):
        got = ffn.executor.expert(x, layout.views(store.blob(0, expert)))
        assert 0 < _relative(got, exact[expert]) <= 3 * _relative(in_bf16[expert], exact[expert])
    if cpu_int4.adapts_codes():  # the rewritten codes read as tiles would be far off
        wrong = CpuExpertFFN(layout, F.silu).expert(x, layout.views(store.blob(0, 0)))
        assert _relative(wrong, exact[0]) > 0.5


def test_a_store_laid_out_for_the_cpu_executor_is_refused_to_the_reference():
    config = _config()
    store = synthetic_store(config, 1, "int4", pin=False, progress=False)
    skeleton, sites, _ = synthetic_skeleton(config, torch.device("cpu"))
    assemble(skeleton.bfloat16(), sites, store, None)
    if not cpu_int4.adapts_codes():
        assert store.codes_layout == "tiles"
        assemble(skeleton.float(), sites, store, None)  # the tiles serve the reference as well
        return
    assert store.codes_layout == "torch"
    with pytest.raises(MiraError, match="open the store again"):
        assemble(skeleton.float(), sites, store, None)


@pytest.mark.skipif(HELD_TO_AVX2, reason="this is the subprocess the test below starts")
def test_on_a_cpu_held_to_avx2_int4_runs_adapt_their_codes_and_match_transformers():
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("ATEN_CPU_CAPABILITY=avx2 holds x86 CPUs only")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/kernels/test_cpu_int4_layout.py", "tests/e2e/test_cpu_bf16.py", "-k",
                          "not avx2 and (int4 or laid_out)"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout
