import json

import pytest
import torch
from safetensors.torch import load_file

from eaglewire.core.fileio import atomic_path, atomic_save_safetensors, atomic_write_json, atomic_write_text


def test_writes_replace_the_file_and_leave_no_temporary(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("old")
    atomic_write_json(path, {"x": 1}, fsync=True)
    assert json.loads(path.read_text()) == {"x": 1}
    atomic_save_safetensors({"t": torch.arange(3)}, tmp_path / "m.safetensors", metadata={"format": "pt"})
    assert load_file(tmp_path / "m.safetensors")["t"].tolist() == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "m.safetensors"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "a.txt"
    atomic_write_text(path, "old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash mid-write")
    assert path.read_text() == "old"


def test_a_directory_is_renamed_into_place(tmp_path):
    out = tmp_path / "model"
    with atomic_path(out, suffix=".partial") as tmp:
        tmp.mkdir()
        (tmp / "DONE").write_text("1")
        assert not out.exists()
    assert (out / "DONE").read_text() == "1" and not tmp.exists()


def test_a_failed_write_removes_its_temporary_and_names_the_file(tmp_path, monkeypatch):
    import errno

    import safetensors

    import eaglewire.core.fileio as fileio

    # safetensors reports a full disk as text, not as an OSError
    message = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'

    def full_disk(tensors, filename, metadata=None):
        open(filename, "wb").write(b"half")
        raise safetensors.SafetensorError(message)

    monkeypatch.setattr(fileio, "save_file", full_disk)
    with pytest.raises(OSError) as e:
        atomic_save_safetensors({"t": torch.arange(3)}, tmp_path / "m.safetensors")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "m.safetensors.tmp")
    assert list(tmp_path.iterdir()) == []

    def unnamed(self, text):  # an error raised by write() or close() carries no file name
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(tmp_path), "write_text", unnamed)
    with pytest.raises(OSError) as e:
        atomic_write_text(tmp_path / "a.txt", "x")
    assert e.value.filename == str(tmp_path / "a.txt.tmp")


def test_a_directory_replaces_the_old_one_only_when_complete(tmp_path):
    from eaglewire.core.fileio import atomic_dir, replace_dir

    out = tmp_path / "tree"
    out.mkdir()
    (out / "old").write_text("1")
    with pytest.raises(RuntimeError), atomic_dir(out) as tmp:
        (tmp / "new").write_text("2")
        raise RuntimeError("cut")
    assert [p.name for p in out.iterdir()] == ["old"] and not tmp.exists()
    with atomic_dir(out) as tmp:
        (tmp / "new").write_text("2")
    assert [p.name for p in out.iterdir()] == ["new"] and not tmp.exists()
    other = tmp_path / "other"
    other.mkdir()
    replace_dir(other, out)
    assert list(out.iterdir()) == [] and not other.exists()
