"""Atomic writes (mira.store.files): the file a reader finds has the mode a file made by open() has."""

import io
import json
import os
import stat
import threading

import numpy as np

from mira.store import files


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_an_atomic_write_gets_the_mode_open_gives_a_new_file(tmp_path):
    made_by_open = tmp_path / "plain.txt"
    made_by_open.write_text("x")
    json_path, npz_path = tmp_path / "a.json", tmp_path / "a.npz"
    files.write_json_atomic(json_path, {"a": 1})
    files.write_npz_atomic(npz_path, {"x": np.arange(3)})
    assert _mode(json_path) == _mode(npz_path) == _mode(made_by_open) == files.FILE_MODE
    assert json.loads(json_path.read_text()) == {"a": 1}
    assert np.load(npz_path)["x"].tolist() == [0, 1, 2]


def test_the_mode_is_set_on_the_file_not_left_to_the_temporary_files_default(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "FILE_MODE", 0o640)
    path = tmp_path / "b.json"
    files.write_json_atomic(path, {"b": 2})
    assert _mode(path) == 0o640
    assert not list(tmp_path.glob(".b.json.*"))  # no temporary left behind


def test_a_link_is_written_through_and_a_pipe_in_place(tmp_path):
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("{}")
    link.symlink_to(target.name)
    files.write_json_atomic(link, {"c": 3})
    assert link.is_symlink() and json.loads(target.read_text()) == {"c": 3}
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    read = []
    reader = threading.Thread(target=lambda: read.append(pipe.read_bytes()))
    reader.start()
    files.write_npz_atomic(pipe, {"x": np.arange(4)})
    reader.join(10)
    assert stat.S_ISFIFO(pipe.stat().st_mode) and np.load(io.BytesIO(read[0]))["x"].tolist() == [0, 1, 2, 3]
