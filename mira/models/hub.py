"""Models named as users name them: a Hugging Face hub id (`org/name`), a repo's folder in the hub
cache, one of its snapshots, or any local directory. Hub ids are resolved in the local cache only
(never downloaded); the store made from a hub model is named after its repo id and revision."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from mira.errors import MiraError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
REPO_FOLDER_PREFIX = "models--"
MODEL_OPTION = "--model (convert's MODEL_DIR, mira.load's path, lm-eval's pretrained=)"  # where each front end takes the model


@dataclass(frozen=True)
class ModelSource:
    directory: Path  # config.json, safetensors and tokenizer files
    name: str  # what the store converted from it is named after
    repo_id: str | None = None  # the hub id, when it came from the hub cache


def hub_cache() -> Path:
    """The hub cache as huggingface_hub finds it, read now: $HF_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def locate(model: str | os.PathLike) -> ModelSource:
    """Where `model` lives on disk and the name of its store.

    Raises:
        MiraError: a hub id that is not in the local cache, or a repo folder without a usable snapshot.
    """
    path = Path(model)
    if path.is_dir():
        if path.name.startswith(REPO_FOLDER_PREFIX) and (path / "snapshots").is_dir():
            return _cached(_repo_id(path.name), _snapshot_of(path))
        if path.parent.name == "snapshots" and path.parent.parent.name.startswith(REPO_FOLDER_PREFIX):
            return _cached(_repo_id(path.parent.parent.name), path)
        return ModelSource(path, path.resolve().name)
    if not path.exists() and REPO_ID.match(str(model)):
        return _cached(str(model), _download_cached(str(model)))
    return ModelSource(path, path.name)  # missing: the caller says so


def _cached(repo_id: str, snapshot: Path) -> ModelSource:
    return ModelSource(snapshot, f"{repo_id.replace('/', '--')}-{snapshot.name[:12]}", repo_id)


def _repo_id(folder_name: str) -> str:
    return folder_name.removeprefix(REPO_FOLDER_PREFIX).replace("--", "/")


def _snapshot_of(repo_folder: Path) -> Path:
    """The snapshot of a repo's cache folder that refs/main names, else its only snapshot."""
    ref = repo_folder / "refs" / "main"
    if ref.is_file():
        snapshot = repo_folder / "snapshots" / ref.read_text().strip()
        if snapshot.is_dir():
            return snapshot
    snapshots = sorted(p for p in (repo_folder / "snapshots").iterdir() if p.is_dir())
    if len(snapshots) != 1:
        listed = ", ".join(p.name for p in snapshots) or "none"
        raise MiraError(f"{repo_folder} has no refs/main and {len(snapshots)} snapshots ({listed}); "
                        f"pass {MODEL_OPTION} with the snapshot folder to use")
    return snapshots[0]


def _download_cached(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache()
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError as error:
        raise MiraError(f"{repo_id} is not complete in the Hugging Face cache at {cache} ({error.__class__.__name__}); "
                        f"download it first (`hf download {repo_id}`), set HF_HOME to the cache that holds it, or "
                        f"pass {MODEL_OPTION} with a local directory") from None
