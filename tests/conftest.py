"""Shared fixtures: tiny checkpoints of every family and their stores, built once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is first imported: without a GPU its kernels run in the
# interpreter on CPU tensors (tests/kernels).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import FAMILIES, INT4_SIZES, make_checkpoint  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Conversions made on first use land in a per-session folder, never in the user's ~/.cache:
    set for the whole session, before any module or session fixture converts a checkpoint."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MIRA_CACHE", str(tmp_path_factory.getbasetemp() / "mira-cache"))
        yield


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: make_checkpoint(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="session")
def int4_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """The same families with experts of whole int4 tiles and groups."""
    root = tmp_path_factory.mktemp("int4-checkpoints")
    return {family: make_checkpoint(family, root / family, **INT4_SIZES) for family in FAMILIES}


@pytest.fixture(scope="session")
def int4_stores(tmp_path_factory, int4_checkpoints) -> dict[str, Path]:
    """family -> int4 store directory of its int4 checkpoint."""
    from mira.store.convert import convert

    root = tmp_path_factory.mktemp("int4-stores")
    for family, checkpoint in int4_checkpoints.items():
        convert(checkpoint, root / family, "int4", progress=False)
    return {family: root / family for family in int4_checkpoints}


@pytest.fixture(scope="session")
def stores(tmp_path_factory, checkpoints) -> dict[tuple[str, str], Path]:
    """(family, scheme) -> store directory."""
    from mira.store.convert import convert

    root = tmp_path_factory.mktemp("stores")
    out = {}
    for family, ckpt in checkpoints.items():
        for scheme in ("none", "int8-shared", "int8-row"):
            out[family, scheme] = root / f"{family}-{scheme}"
            convert(ckpt, out[family, scheme], scheme, progress=False)
    return out


@pytest.fixture(scope="session")
def mixtral_store(tmp_path_factory) -> Path:
    """The tiny Mixtral checkpoint as an int8-shared store: the model of the GPU tests."""
    from mira.store.convert import convert

    root = tmp_path_factory.mktemp("mixtral-store")
    convert(make_checkpoint("mixtral", root / "ckpt"), root / "store", "int8-shared", progress=False)
    return root / "store"
