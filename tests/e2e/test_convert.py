"""`mira convert`: resumable, atomic, and the store reads back what was written."""

import json
import os
from pathlib import Path

import pytest
import torch

import mira.store.convert as convert_module
from mira.store.convert import convert
from mira.store.store import ExpertStore


@pytest.mark.parametrize("scheme", ["int8-shared", "int4"])
def test_interrupted_conversion_resumes_and_gives_the_same_store(tmp_path, checkpoints, int4_checkpoints,
                                                                 monkeypatch, scheme):
    checkpoint = (int4_checkpoints if scheme == "int4" else checkpoints)["qwen2_moe"]
    reference = convert(checkpoint, tmp_path / "reference", scheme, progress=False)

    real_pack, packed = convert_module.ExpertLayout.pack, []

    def failing_pack(self, tensors, out):
        if len(packed) == 10:  # 8 experts per layer: dies in the second layer
            raise KeyboardInterrupt
        packed.append(1)
        real_pack(self, tensors, out)

    monkeypatch.setattr(convert_module.ExpertLayout, "pack", failing_pack)
    with pytest.raises(KeyboardInterrupt):
        convert(checkpoint, tmp_path / "store", scheme, progress=False)
    partial = tmp_path / "store.partial"
    assert not (tmp_path / "store").exists() and partial.is_dir()
    assert list(json.loads((partial / "progress.json").read_text())["files"]) == ["experts/layer-000.safetensors"]

    monkeypatch.setattr(convert_module.ExpertLayout, "pack", real_pack)
    resumed_layers = []
    monkeypatch.setattr(convert_module.ExpertReader, "read",
                        lambda self, layer, expert, real=convert_module.ExpertReader.read:
                        resumed_layers.append(layer) or real(self, layer, expert))
    manifest = convert(checkpoint, tmp_path / "store", scheme, progress=False)
    assert 0 not in resumed_layers  # the finished layer was not converted again
    assert not partial.exists()
    assert manifest.files == reference.files  # byte-identical to an uninterrupted conversion


def test_every_file_is_on_disk_before_the_store_is_named(tmp_path, checkpoints, monkeypatch):
    """Each file of a converted store, its manifest and its directories are flushed (fsync) before
    `<out>.partial` is renamed to `<out>`, and `<out>`'s parent after: a power loss cannot leave a
    store named whose data was in memory only. Files are followed by inode, which renames keep."""
    events = []
    real_fsync, real_rename = os.fsync, Path.rename

    def fsync(fd):
        events.append(("fsync", os.fstat(fd).st_ino))
        return real_fsync(fd)

    def rename(self, target):
        events.append(("rename", Path(self), Path(target)))
        return real_rename(self, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "rename", rename)
    out = tmp_path / "store"
    manifest = convert(checkpoints["qwen2_moe"], out, "int8-shared", progress=False)
    named = events.index(("rename", tmp_path / "store.partial", out))
    flushed = {inode for kind, inode, *_ in events[:named] if kind == "fsync"}
    for rel in [*manifest.files, "manifest.json", "experts", "."]:
        assert (out / rel).stat().st_ino in flushed, rel
    assert ("fsync", tmp_path.stat().st_ino) in events[named + 1:]


def test_store_blobs_read_back_and_non_expert_weights_are_kept(checkpoints, stores):
    store = ExpertStore.open(stores["deepseek_v3", "none"], progress=False)
    assert store.manifest.moe_layers == [1, 2]  # first_k_dense_replace=1: layer 0 is dense
    from safetensors import safe_open

    with safe_open(str(checkpoints["deepseek_v3"] / "model.safetensors"), "pt") as f:
        gate = f.get_tensor("model.layers.2.mlp.experts.5.gate_proj.weight")
        down = f.get_tensor("model.layers.2.mlp.experts.5.down_proj.weight")
    views = store.layout.views(store.blob(1, 5))
    assert torch.equal(views["w13"][: gate.shape[0]], gate) and torch.equal(views["w2"], down)
    with safe_open(str(stores["deepseek_v3", "none"] / "model-00001.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.gate_proj.weight" in names  # the dense layer's MLP stays in the model
    assert not any(".mlp.experts." in n for n in names)


def test_an_output_named_from_inside_or_through_a_link_is_written_where_it_leads(tmp_path, checkpoints,
                                                                                   monkeypatch):
    from mira.errors import MiraError
    from mira.store.files import FILE_MODE
    from mira.store.manifest import Manifest

    checkpoint = checkpoints["mixtral"]
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    with pytest.raises(MiraError, match=r"--out names the working directory .*; pass --out \.\./empty from there"):
        convert(checkpoint, Path("."), progress=False)
    monkeypatch.chdir(tmp_path)
    manifest = convert(checkpoint, Path("empty"), progress=False)  # an empty folder takes the store
    assert Manifest.read(empty) == manifest
    modes = {rel: (empty / rel).stat().st_mode & 0o777 for rel in manifest.files}
    assert set(modes.values()) == {FILE_MODE}, modes  # the weights as readable as the copied files

    (tmp_path / "link").symlink_to(empty)
    replaced = convert(checkpoint, tmp_path / "link", "int8-row", progress=False, force=True)
    assert (tmp_path / "link").is_symlink() and Manifest.read(empty) == replaced and replaced.scheme == "int8-row"
    assert not list(tmp_path.glob(".*trash*"))


def test_a_moved_source_is_recorded_and_a_full_disk_is_named_with_its_fix(tmp_path, checkpoints, monkeypatch):
    import shutil

    from safetensors import SafetensorError

    from mira.errors import MiraError
    from mira.store.manifest import Manifest

    source = tmp_path / "model"
    shutil.copytree(checkpoints["olmoe"], source)
    convert(source, tmp_path / "store", progress=False)
    source.rename(tmp_path / "moved")
    manifest = convert(tmp_path / "moved", tmp_path / "store", progress=False)  # the same files: nothing rewritten
    assert manifest.source == str((tmp_path / "moved").resolve()) == Manifest.read(tmp_path / "store").source
    assert f"mira convert {tmp_path / 'moved'} --out" in manifest.repair_command(tmp_path / "store")

    def full(tensors, path, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(convert_module, "save_file", full)
    with pytest.raises(MiraError, match=r"cannot write the store .*other.* \(Error while serializing: .*No space left"
                                        r".*\); free space there, or pass another --out"):
        convert(tmp_path / "moved", tmp_path / "other", progress=False)


def test_what_a_stopped_conversion_left_points_to_the_store_it_was_writing(tmp_path, stores, monkeypatch):
    import mira
    from mira.errors import MiraError
    from mira.store.manifest import Manifest

    (tmp_path / "runs" / "s.partial").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for named in (tmp_path / "runs" / "s", "runs/s"):  # runs/s reads as a hub id (org/name) too
        with pytest.raises(MiraError, match=r"model path \S*runs/s does not exist: a conversion into it stopped before "
                                            r"it finished \(\S*runs/s.partial holds what it wrote\); finish it with "
                                            r"`mira convert MODEL_DIR --out \S*runs/s`"):
            mira.load(named, device="cpu", progress=False)
    manifest = Manifest.read(stores["mixtral", "int8-shared"])
    assert manifest.repair_command(tmp_path / "store.partial").endswith(f"--out {tmp_path / 'store'} --quant int8-shared")
