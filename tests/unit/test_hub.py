"""Models by hub id, hub cache folder or snapshot, found offline in a Hugging Face cache laid out as
huggingface_hub lays it out; stores named after the repo and revision; Mira's cache under XDG."""

import shutil
from pathlib import Path

import pytest
import torch

import mira
from mira.cli import main
from mira.errors import MiraError
from mira.models.hub import hub_cache, locate
from mira.runtime.engine import resolve_store
from mira.store.cache import cache_dir

REVISION = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache_with(root: Path, checkpoint: Path, repo_folder: str = "models--acme--tiny-moe") -> Path:
    repo = root / "hub" / repo_folder
    shutil.copytree(checkpoint, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return repo


def test_a_hub_id_resolves_in_the_cache_that_HF_HOME_names(checkpoints, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    repo = _hub_cache_with(tmp_path, checkpoints["mixtral"])
    snapshot = repo / "snapshots" / REVISION
    for name in ("acme/tiny-moe", repo, snapshot):
        source = locate(name)
        assert source.directory.resolve() == snapshot.resolve()
        assert (source.name, source.repo_id) == (f"acme--tiny-moe-{REVISION[:12]}", "acme/tiny-moe")
    store = resolve_store(Path("acme/tiny-moe"), None, progress=False)
    assert store.parent == cache_dir() and store.name.startswith(f"acme--tiny-moe-{REVISION[:12]}-")
    assert resolve_store(repo, None, progress=False) == store  # the same store, whichever way it was named


def test_mira_load_and_convert_take_a_hub_id_from_the_cache(checkpoints, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    _hub_cache_with(tmp_path, checkpoints["mixtral"])
    model = mira.load("acme/tiny-moe", device="cpu", progress=False)
    assert model.store.path == resolve_store(Path("acme/tiny-moe"), None, progress=False)
    assert model.store.path.name.startswith(f"acme--tiny-moe-{REVISION[:12]}-")
    ids = torch.tensor([[1, 2, 3]])
    assert model(ids).logits.shape[:2] == (1, 3)
    threads = torch.get_num_threads()  # main sets torch's threads for the process; the suite keeps its own
    try:
        assert main(["convert", "acme/tiny-moe", "--out", str(tmp_path / "store"), "--quiet"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert (tmp_path / "store" / "manifest.json").is_file()


def test_a_plain_directory_keeps_its_own_name(checkpoints):
    source = locate(checkpoints["mixtral"])
    assert (source.directory, source.name, source.repo_id) == (checkpoints["mixtral"], "mixtral", None)


def test_a_hub_id_missing_from_the_cache_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_cache() == tmp_path / "elsewhere"
    with pytest.raises(MiraError, match=r"acme/absent is not complete in the Hugging Face cache at .*hf download"):
        locate("acme/absent")


def test_a_repo_folder_without_refs_takes_its_only_snapshot(checkpoints, tmp_path):
    repo = _hub_cache_with(tmp_path, checkpoints["mixtral"])
    (repo / "refs" / "main").unlink()
    assert locate(repo).directory == repo / "snapshots" / REVISION
    shutil.copytree(repo / "snapshots" / REVISION, repo / "snapshots" / ("f" * 40))
    with pytest.raises(MiraError, match="2 snapshots"):
        locate(repo)


def test_mira_cache_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv("MIRA_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "mira" / "stores"
    monkeypatch.setenv("MIRA_CACHE", str(tmp_path / "own"))
    assert cache_dir() == tmp_path / "own" / "stores"
