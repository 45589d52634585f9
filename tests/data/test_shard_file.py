"""shard_file.save_file: safetensors' layout from chunks, and the sha256 it hashes beside the writes."""

import hashlib
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file

from eaglewire.data.shard_file import save_file


def test_chunks_are_written_as_one_tensor_and_the_returned_sha256_is_the_files(tmp_path):
    g = torch.Generator().manual_seed(0)
    aux = [torch.randn(n, 6, generator=g).bfloat16() for n in (5, 1, 9)]
    strided = torch.randn(8, 4, generator=g)[:, ::2]  # not contiguous: written through a copy
    tensors = {"aux_hidden": aux, "input_ids": torch.arange(15, dtype=torch.int32), "strided": strided,
               "empty": [torch.zeros(0, 3), torch.ones(2, 3)]}
    path = tmp_path / "s.safetensors"
    digest = save_file(tensors, path, metadata={"b": "2", "a": "1"})
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    back = load_file(path)
    assert torch.equal(back["aux_hidden"], torch.cat(aux)) and torch.equal(back["strided"], strided)
    assert torch.equal(back["input_ids"], tensors["input_ids"]) and torch.equal(back["empty"], torch.ones(2, 3))
    again = tmp_path / "t.safetensors"
    assert save_file(tensors, again, metadata={"a": "1", "b": "2"}) == digest  # the same bytes, run after run


def test_a_failed_write_leaves_no_hashing_thread_behind(tmp_path):
    before = {t.ident for t in threading.enumerate()}
    bad = torch.empty(4, 2, device="meta")  # its bytes cannot be read: the write fails midway
    with pytest.raises((NotImplementedError, RuntimeError, TypeError)):
        save_file({"good": torch.ones(1024, 16), "z_bad": bad}, tmp_path / "s.safetensors")
    assert not [t for t in threading.enumerate() if t.ident not in before and t.name == "shard-sha256"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_the_disk_is_told_to_start_on_each_chunk_on_linux(tmp_path, monkeypatch):
    """Where libc has sync_file_range, each written chunk starts its writeback (the fsync then waits for the
    rest only: benchmarks/experiments/data/shard_write.py); the bytes are the same either way."""
    import eaglewire.data.shard_file as shard_file

    assert shard_file._START_WRITEBACK is not None
    started = []
    real = shard_file._START_WRITEBACK
    monkeypatch.setattr(shard_file, "_START_WRITEBACK", lambda fd: started.append(real(fd)))
    tensors = {"a": [torch.ones(64, 8), torch.zeros(32, 8)], "b": torch.arange(7)}
    digest = save_file(tensors, tmp_path / "s.safetensors")
    assert started == [0, 0, 0]  # one per chunk, each call accepted
    monkeypatch.setattr(shard_file, "_START_WRITEBACK", None)
    assert save_file(tensors, tmp_path / "t.safetensors") == digest
