import json

import pytest
import torch
from safetensors.torch import load_file

from eaglewire.fileio import atomic_path, atomic_save_safetensors, atomic_write_json, atomic_write_text


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
