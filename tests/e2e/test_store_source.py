"""A store is exactly its source: the cache is keyed on the weights' content and the source's place,
and the repair a corruption error names gives back the files of a clean conversion."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch

import mira
from mira.cli import main
from mira.errors import MiraError
from mira.store.cache import cache_dir, cache_store_path
from mira.store.convert import convert
from tiny_models import make_checkpoint

PROMPT = torch.tensor([[5, 17, 42, 9, 77, 3]])


def tree(path: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `path`."""
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def greedy(model_path: Path) -> list[int]:
    model = mira.load(model_path, device="cpu", progress=False)
    return model.generate(PROMPT, max_new_tokens=6, do_sample=False)[0].tolist()


def run_advised(message: str, model_dir: Path | None = None) -> int:
    """Run the `mira ...` command quoted in an error message, as the user would."""
    command = re.search(r"`(mira [^`]*)`", message).group(1)
    if model_dir is not None:
        command = command.replace("MODEL_DIR", shlex.quote(str(model_dir)))
    return main(shlex.split(command)[1:] + ["--quiet"])


def test_a_checkpoint_overwritten_with_new_weights_generates_from_the_new_weights(tmp_path, capfd):
    checkpoint = make_checkpoint("mixtral", tmp_path / "checkpoint-final", seed=0)
    old = greedy(checkpoint)
    shutil.rmtree(checkpoint)
    make_checkpoint("mixtral", checkpoint, seed=1)  # same names, shapes and sizes; other weights
    reference = convert(make_checkpoint("mixtral", tmp_path / "fresh", seed=1), tmp_path / "reference", progress=False)
    capfd.readouterr()
    new = greedy(checkpoint)
    assert "changed since" in capfd.readouterr().err
    assert new == greedy(tmp_path / "reference") and new != old
    assert tree(cache_store_path(checkpoint, "int8-shared"))["experts/layer-000.safetensors"] == \
        reference.files["experts/layer-000.safetensors"]


def test_an_edited_config_converts_the_cached_store_again_and_generates_from_it(tmp_path, capfd):
    """The cache's store of a directory whose config.json was edited (its fingerprint changed) is the
    cache's own: it is converted again, not refused as another model's."""
    checkpoint = make_checkpoint("mixtral", tmp_path / "ckpt")
    old = greedy(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["num_experts_per_tok"] = 1
    (checkpoint / "config.json").write_text(json.dumps(config))
    shutil.copytree(checkpoint, tmp_path / "fresh")
    capfd.readouterr()
    new = greedy(checkpoint)
    assert "the config or shards of" in capfd.readouterr().err
    assert new == greedy(tmp_path / "fresh") and new != old


def test_a_touched_checkpoint_is_hashed_once_and_not_converted_again(tmp_path, capfd):
    checkpoint = make_checkpoint("olmoe", tmp_path / "ckpt")
    greedy(checkpoint)
    store = cache_store_path(checkpoint, "int8-shared")
    layer = store / "experts" / "layer-000.safetensors"
    written = layer.stat().st_mtime_ns
    shard = checkpoint / "model.safetensors"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    capfd.readouterr()
    greedy(checkpoint)
    assert "convert" not in capfd.readouterr().err and layer.stat().st_mtime_ns == written
    assert mira.store.manifest.Manifest.read(store).sources["model.safetensors"]["mtime_ns"] == shard.stat().st_mtime_ns


def test_a_file_loading_never_reads_added_beside_the_weights_keeps_the_store(tmp_path, capfd):
    checkpoint = make_checkpoint("olmoe", tmp_path / "ckpt")
    greedy(checkpoint)
    layer = cache_store_path(checkpoint, "int8-shared") / "experts" / "layer-000.safetensors"
    written = layer.stat().st_mtime_ns
    (checkpoint / "stats.json").write_text("{}")  # e.g. `mira generate --stats-json` into the model's folder
    (checkpoint / "notes.txt").write_text("tried at 12GiB")
    capfd.readouterr()
    greedy(checkpoint)
    assert "convert" not in capfd.readouterr().err and layer.stat().st_mtime_ns == written
    (checkpoint / "chat_template.jinja").write_text("{{ messages[0].content }}")  # read whenever it is there
    greedy(checkpoint)
    assert "changed since" in capfd.readouterr().err
    assert (cache_store_path(checkpoint, "int8-shared") / "chat_template.jinja").is_file()


def test_two_checkpoints_of_one_name_get_two_stores_named_for_where_they_came_from(tmp_path):
    first = make_checkpoint("qwen3_moe", tmp_path / "run-a" / "checkpoint-final", seed=0)
    second = make_checkpoint("qwen3_moe", tmp_path / "run-b" / "checkpoint-final", seed=1)
    a, b = greedy(first), greedy(second)
    stores = {cache_store_path(first, "int8-shared"), cache_store_path(second, "int8-shared")}
    assert len(stores) == 2 and all(store.parent == cache_dir() and store.is_dir() for store in stores)
    assert all(re.fullmatch(r"checkpoint-final-[0-9a-f]{12}-int8-shared", store.name) for store in stores)
    for checkpoint, tokens, seed in ((first, a, 0), (second, b, 1)):
        reference = convert(checkpoint, tmp_path / f"reference-{seed}", progress=False)
        assert mira.store.manifest.Manifest.read(cache_store_path(checkpoint, "int8-shared")).files == reference.files
        assert tokens == greedy(tmp_path / f"reference-{seed}")


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped expert byte": lambda s: _flip(s / "experts" / "layer-001.safetensors"),
    "truncated layer file": lambda s: (s / "experts" / "layer-002.safetensors").write_bytes(
        (s / "experts" / "layer-002.safetensors").read_bytes()[:-100]),
    "deleted layer file": lambda s: (s / "experts" / "layer-000.safetensors").unlink(),
    "flipped non-expert byte": lambda s: _flip(s / "model-00001.safetensors"),
    "deleted tokenizer": lambda s: (s / "tokenizer.json").unlink(),
    "deleted manifest": lambda s: (s / "manifest.json").unlink(),
    "unreadable config": lambda s: (s / "config.json").write_text("garbage"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_the_advised_command_repairs_a_corrupt_store_to_a_clean_conversion(tmp_path, checkpoints, stores, damage,
                                                                          capfd):
    clean = stores["mixtral", "int8-shared"]
    store = tmp_path / "store"
    shutil.copytree(clean, store)
    DAMAGE[damage](store)
    with pytest.raises(MiraError, match="repair it with `mira convert") as refused:
        mira.load(store, device="cpu", progress=False)
    assert run_advised(str(refused.value), checkpoints["mixtral"]) == 0
    assert tree(store) == tree(clean)  # every file, byte for byte, and nothing else
    assert sorted(os.listdir(tmp_path)) == ["store"]  # no .partial, no lock, no trash beside it
    assert "error" not in capfd.readouterr().err
    mira.load(store, device="cpu", progress=False)


def test_the_advised_command_repairs_a_cache_store_too(tmp_path, stores):
    checkpoint = make_checkpoint("deepseek_v2", tmp_path / "ckpt")
    greedy(checkpoint)
    cached = cache_store_path(checkpoint, "int8-shared")
    _flip(cached / "experts" / "layer-002.safetensors")
    with pytest.raises(MiraError, match=f"repair it with `mira convert {checkpoint} --out {cached}") as refused:
        mira.load(checkpoint, device="cpu", progress=False)
    assert run_advised(str(refused.value)) == 0
    convert(checkpoint, tmp_path / "clean", progress=False)
    assert tree(cached) == tree(tmp_path / "clean")


def test_convert_over_a_store_of_another_model_needs_force(tmp_path, checkpoints, stores, capsys):
    store = tmp_path / "store"
    shutil.copytree(stores["olmoe", "int8-shared"], store)
    argv = ["convert", str(checkpoints["mixtral"]), "--out", str(store), "--quiet"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("mira: error: store") and "--force" in err and err.count("\n") == 1
    assert tree(store) == tree(stores["olmoe", "int8-shared"])  # untouched
    assert main(argv + ["--force"]) == 0
    assert tree(store) == tree(stores["mixtral", "int8-shared"])
    assert sorted(os.listdir(tmp_path)) == ["store"]


def test_mira_store_lists_verifies_and_removes_the_cached_stores(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MIRA_CACHE", str(tmp_path / "cache"))
    checkpoint = make_checkpoint("olmoe", tmp_path / "ckpt")
    greedy(checkpoint)
    cached = cache_store_path(checkpoint, "int8-shared")
    capsys.readouterr()
    assert main(["store", "ls"]) == 0
    listing = capsys.readouterr().out
    assert listing.startswith(f"{cache_dir()}: 1 store\n")
    assert f"{cached.name}\t" in listing and "int8-shared\tcurrent\t" + str(checkpoint) in listing
    assert main(["store", "list"]) == 0 and capsys.readouterr().out == listing  # the word the help uses
    assert main(["store", "verify"]) == 0 and f"{cached}: ok" in capsys.readouterr().out
    _flip(cached / "experts" / "layer-001.safetensors")
    assert main(["store", "verify", cached.name]) == 1
    out, err = capsys.readouterr()
    assert "experts/layer-001.safetensors does not match its checksum" in out and f"--out {cached}" in out
    assert err.startswith("mira: error: 1 of 1 stores failed verification") and err.count("\n") == 1
    assert main(["store", "rm", "nonesuch"]) == 1 and "see `mira store ls`" in capsys.readouterr().err
    assert main(["store", "rm", "--all", cached.name]) == 1 and "--all removes every cached store and takes no " \
        "names" in capsys.readouterr().err and cached.exists()
    assert main(["store", "remove", cached.name]) == 0
    assert not cached.exists() and os.listdir(cache_dir()) == []


def test_mira_store_shows_and_removes_what_unfinished_conversions_left(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MIRA_CACHE", str(tmp_path / "cache"))
    checkpoint = make_checkpoint("olmoe", tmp_path / "ckpt")
    greedy(checkpoint)
    cached = cache_store_path(checkpoint, "int8-shared")
    stopped = cache_dir() / "other-0123456789ab-int8-shared.partial"  # a first use killed mid-conversion
    (stopped / "experts").mkdir(parents=True)
    (stopped / "experts" / "layer-000.safetensors").write_bytes(bytes(3 << 20))
    headless = cache_dir() / "third-0123456789ab-int4"  # a store whose manifest is gone
    shutil.copytree(cached / "experts", headless / "experts")
    trash = cache_dir() / f".{cached.name}.trash-99"  # a replacement killed before its deletion
    trash.mkdir()
    capsys.readouterr()
    assert main(["store", "ls"]) == 0
    listing = capsys.readouterr().out
    assert listing.startswith(f"{cache_dir()}: 3 stores\n") and ".trash" not in listing
    assert f"{stopped.name}\t3.0 MiB\tan unfinished conversion" in listing
    assert f"{headless.name}\t" in listing and "unreadable manifest (the model's next use converts it again)" in listing
    assert main(["store", "verify", stopped.name]) == 0
    assert "an unfinished conversion, not a store" in capsys.readouterr().out
    assert main(["store", "rm", "--all"]) == 0
    assert os.listdir(cache_dir()) == []


def test_a_cache_that_cannot_be_written_names_mira_cache_before_converting(tmp_path, monkeypatch, capfd):
    checkpoint = make_checkpoint("olmoe", tmp_path / "ckpt")
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("MIRA_CACHE", str(tmp_path / "afile"))
    with pytest.raises(MiraError, match=r"cannot write the store cache \S*afile/stores \(Not a directory\); set "
                                        r"MIRA_CACHE to a writable directory"):
        mira.load(checkpoint, device="cpu", progress=False)
    assert "converting" not in capfd.readouterr().err
