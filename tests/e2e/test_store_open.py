"""Opening a store with several reader threads reads what one reader reads, and refuses the same
corrupt stores (tests/e2e/test_errors.py covers the messages with the default thread count)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from mira.errors import MiraError
from mira.store.manifest import Manifest
from mira.store.store import ExpertStore


def test_every_blob_is_read_as_its_layer_file_holds_it_whatever_the_number_of_readers(stores):
    path = stores["qwen3_moe", "int8-row"]
    manifest = Manifest.read(path)
    on_disk = torch.stack([load_file(str(path / manifest.expert_file(layer)))["experts"]
                           for layer in manifest.moe_layers])  # [L, E, B]
    for workers in (1, 2, 5):
        store = ExpertStore.open(path, progress=False, workers=workers)
        assert store.data.shape == on_disk.shape and torch.equal(store.data, on_disk)


@pytest.mark.parametrize("workers", [1, 3])
def test_a_corrupt_layer_or_other_file_is_refused_whatever_the_number_of_readers(tmp_path, stores, workers):
    path = tmp_path / "store"
    shutil.copytree(stores["mixtral", "int8-row"], path)
    last = sorted((path / "experts").iterdir())[-1]
    data = bytearray(last.read_bytes())
    data[-7] ^= 0x01
    last.write_bytes(bytes(data))
    with pytest.raises(MiraError, match=f"corrupt: experts/{last.name} does not match its checksum"):
        ExpertStore.open(path, progress=False, workers=workers)
    shutil.copyfile(stores["mixtral", "int8-row"] / "experts" / last.name, last)
    ExpertStore.open(path, progress=False, workers=workers)  # repaired: accepted
    (path / "config.json").write_text((path / "config.json").read_text() + " ")
    with pytest.raises(MiraError, match="corrupt: config.json does not match its checksum"):
        ExpertStore.open(path, progress=False, workers=workers)
