"""A conversion killed (SIGKILL) at any point resumes to the store an uninterrupted conversion
writes, and two conversions into one output end with that one store and nothing else.

The kill points are file-system operations. A child process imports Mira once, then forks one
conversion per kill point (so the imports are paid once); in each, the operations that create,
write, rename or delete files are counted, and the process kills itself with SIGKILL just before
operation k, or, for a file being written, after writing half of it. A first fork, not killed,
counts the operations of a whole conversion."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mira.store.cache import cache_store_path
from mira.store.convert import convert

CHILD = r"""
import json, os, shutil, signal, sys
from pathlib import Path
import mira.store.convert as convert_module
from mira.store.cache import cache_store

target, model_dir, root, mode = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]


def run(out, kill_at, report):
    # One conversion into `out` (or the cache $MIRA_CACHE=out), killed at operation `kill_at` (0: never);
    # the names of its operations are written to the file `report`.
    events = []

    def event(name, torn=None):
        events.append(name)
        if len(events) == kill_at:
            if torn is not None:
                torn()
            os.kill(os.getpid(), signal.SIGKILL)

    def counted(name, function, is_write=lambda *a, **k: True):
        def wrapper(*args, **kwargs):
            if is_write(*args, **kwargs):
                event(name)
            return function(*args, **kwargs)
        return wrapper

    def half(path):
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: len(data) // 2])

    def written(name, function, destination):
        def wrapper(*args, **kwargs):
            event(name)  # before the first byte
            result = function(*args, **kwargs)
            event(name + "-torn", torn=lambda: half(destination(*args)))  # half the file on disk
            return result
        return wrapper

    real_open = os.open
    os.open = counted("create", os.open, lambda path, flags, *a, **k: bool(flags & os.O_CREAT))
    for name in ("mkdir", "replace", "rename", "unlink", "rmdir"):
        setattr(os, name, counted(name, getattr(os, name)))
    shutil.copyfile = written("copy", shutil.copyfile, lambda src, dst, *a: dst)
    convert_module.save_file = written("save", convert_module.save_file, lambda tensors, path, *a: path)
    if target == "cache":
        os.environ["MIRA_CACHE"] = str(out)
        cache_store(model_dir, "int8-shared", progress=False)
    else:
        convert_module.convert(model_dir, out, "int8-shared", progress=False)
    fd = real_open(report, os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, json.dumps(events).encode())
    os.close(fd)


def fork(out, kill_at):
    out.parent.mkdir(parents=True, exist_ok=True)
    report = root / f"events-{kill_at}.json"
    pid = os.fork()
    if pid == 0:
        try:
            run(out, kill_at, report)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


fork(root / "counted" / "store", 0)
events = json.loads((root / "events-0.json").read_text())
if mode == "ten":
    points = sorted({round(1 + i * (len(events) - 1) / 9) for i in range(10)})
else:  # the first layer file half written
    points = [events.index("save-torn") + 1]
killed = {k: fork(root / f"killed-at-{k}" / "store", k) for k in points}
print(json.dumps({"events": events, "killed": killed}))
"""


def _kill_conversions(target: str, model_dir: Path, root: Path, mode: str) -> tuple[list[str], dict[int, bool]]:
    """Run the child: (the operations of a whole conversion, {kill point: whether SIGKILL ended it})."""
    done = subprocess.run([sys.executable, "-c", CHILD, target, str(model_dir), str(root), mode],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    return result["events"], {int(k): v for k, v in result["killed"].items()}


def tree(path: Path) -> dict[str, str]:
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def clean(checkpoints, tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, its store converted without interruption)."""
    out = tmp_path_factory.mktemp("clean") / "store"
    convert(checkpoints["qwen2_moe"], out, "int8-shared", progress=False)
    return checkpoints["qwen2_moe"], out


def test_a_conversion_killed_at_ten_points_from_the_first_byte_to_the_rename_resumes_to_a_clean_store(
        tmp_path, clean):
    checkpoint, reference = clean
    events, killed = _kill_conversions("convert", checkpoint, tmp_path, "ten")
    assert len(events) > 20 and events[-2] == "rename"  # the rename into place, then the lock's unlink
    assert events.count("save-torn") == 4  # three layer files and the non-expert shard
    assert len(killed) == 10 and min(killed) == 1 and max(killed) == len(events) and all(killed.values())
    assert tree(tmp_path / "counted" / "store") == tree(reference)
    for kill_at in killed:
        work = tmp_path / f"killed-at-{kill_at}"
        convert(checkpoint, work / "store", "int8-shared", progress=False)  # resumes, or finds it done
        assert tree(work / "store") == tree(reference), kill_at
        assert os.listdir(work) == ["store"], kill_at  # no .partial, lock or trash left beside it


def test_a_first_use_conversion_killed_in_its_first_layer_resumes(tmp_path, clean, monkeypatch):
    import mira

    checkpoint, reference = clean
    _, killed = _kill_conversions("cache", checkpoint, tmp_path, "first-save")
    [(kill_at, by_sigkill)] = killed.items()
    assert by_sigkill
    monkeypatch.setenv("MIRA_CACHE", str(tmp_path / f"killed-at-{kill_at}" / "store"))
    store = cache_store_path(checkpoint, "int8-shared")
    partial = store.with_name(store.name + ".partial")
    assert partial.is_dir() and not store.exists()
    assert list((partial / "experts").iterdir()) == [partial / "experts" / "layer-000.safetensors.tmp"]
    mira.load(checkpoint, device="cpu", progress=False)
    assert tree(store) == tree(reference)
    assert os.listdir(store.parent) == [store.name]


def test_two_conversions_into_one_output_end_with_one_clean_store_and_no_stray_file(tmp_path, clean):
    checkpoint, reference = clean
    command = [sys.executable, "-m", "mira.cli", "convert", str(checkpoint), "--out", str(tmp_path / "store"),
               "--quiet"]
    both = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in both]
    for code, out, err in results:
        assert code == 0 and "Traceback" not in err and "error" not in err, err
        assert "3 MoE layers x 8 experts" in out
    assert tree(tmp_path / "store") == tree(reference)
    assert os.listdir(tmp_path) == ["store"]
