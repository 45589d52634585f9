"""A shard file written from buffers: safetensors' format, streamed and hashed as it is written.

``safetensors.torch.save_file`` needs each tensor whole (a shard's states concatenated first: one
more copy of ~2 GB per shard on an 8B target) and its metadata comes out in a random order (a Rust
HashMap), so two runs never write the same bytes; the manifest's sha256 then needs the file read
back. ``save_file`` here takes each tensor as chunks along dim 0, writes them in place, hashes the
bytes as they go out, and sorts the metadata: the same tensors give the same file, byte for byte.

The layout is safetensors': u64 little-endian header length, the JSON header (``__metadata__``
first, then each tensor's dtype, shape and data offsets) padded with spaces to 8 bytes, then the
tensors' bytes, ordered by dtype (safetensors' order: wider first) and then by name.

A shard of an 8B target is ~2 GB, and on a GPU the forward computes states faster than one thread
hashes, writes and fsyncs them one after another. So the sha256 runs on a thread of its own beside the
writes (both release the GIL on large buffers), and after each chunk the kernel is told to start writing
the file back to the disk (Linux's ``sync_file_range``, where there is one), so the caller's fsync finds
little left to wait for instead of the whole file: 385 -> 644 MB/s on a 2-core VM's disk
(benchmarks/experiments/data/shard_write.py, BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import queue
import threading
from pathlib import Path
from typing import Sequence

import torch

# safetensors' dtype names, in the order it lays tensors out (its Dtype enum, descending)
_ST_DTYPES: dict[torch.dtype, str] = {
    torch.int64: "I64", torch.float32: "F32", torch.int32: "I32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.uint16: "U16", torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8"}
_RANK = {name: i for i, name in enumerate(_ST_DTYPES.values())}


def _as_chunks(x: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [x] if isinstance(x, torch.Tensor) else list(x)


def header(tensors: dict[str, list[torch.Tensor]], metadata: dict[str, str] | None) -> tuple[bytes, list[str]]:
    """(the header's bytes with its length prefix, tensor names in file order) for ``tensors``
    (name -> chunks concatenated along dim 0)."""
    entries: dict[str, tuple[str, list[int]]] = {}
    for name, chunks in tensors.items():
        first = chunks[0]
        if first.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name}: dtype {first.dtype} is not one a shard stores "
                             f"({', '.join(map(str, _ST_DTYPES))})")
        rest = list(first.shape[1:])
        assert all(c.dtype == first.dtype and list(c.shape[1:]) == rest for c in chunks), name
        entries[name] = (_ST_DTYPES[first.dtype], [sum(c.shape[0] for c in chunks), *rest])
    order = sorted(entries, key=lambda n: (_RANK[entries[n][0]], n))
    head: dict[str, object] = {}
    if metadata:
        head["__metadata__"] = dict(sorted(metadata.items()))
    offset = 0
    for name in order:
        dtype, shape = entries[name]
        nbytes = sum(c.numel() * c.element_size() for c in tensors[name])
        head[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return len(text).to_bytes(8, "little") + text, order


def _raw(chunk: torch.Tensor):
    """A host chunk's bytes, without a copy where it is contiguous."""
    return chunk.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _writeback_starter():
    """Linux's ``sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)``: start writing a file's dirty pages back
    without waiting for them; None where libc has no such call (it is advice: the fsync still decides)."""
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return lambda fd: call(fd, 0, 0, 2)  # offset 0, length 0: to the end of the file; 2 = SYNC_FILE_RANGE_WRITE


_START_WRITEBACK = _writeback_starter()


class _Hasher:
    """sha256 on a thread of its own, fed in order: ``update`` queues a buffer (kept alive until hashed),
    ``hexdigest`` waits for the queued ones. At most ``depth`` buffers wait, bounding the copies held."""

    def __init__(self, first: bytes, depth: int = 8) -> None:
        self._digest = hashlib.sha256(first)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, name="shard-sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (buf := self._queue.get()) is not None:
            self._digest.update(buf)

    def update(self, buf) -> None:
        self._queue.put(buf)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def hexdigest(self) -> str:
        self.close()
        return self._digest.hexdigest()


def save_file(tensors: dict[str, torch.Tensor | Sequence[torch.Tensor]], filename: str | Path,
              metadata: dict[str, str] | None = None) -> str:
    """Write ``tensors`` (name -> a CPU tensor, or CPU chunks concatenated along dim 0) as a safetensors
    file; return its sha256 (hex), computed on the bytes as they are written."""
    chunks = {name: _as_chunks(x) for name, x in tensors.items()}
    head, order = header(chunks, metadata)
    digest = _Hasher(head)
    try:
        with open(filename, "wb") as f:
            f.write(head)
            for name in order:
                for chunk in chunks[name]:
                    if chunk.numel():
                        raw = _raw(chunk)
                        digest.update(raw)  # hashed on its thread while this one writes it
                        f.write(raw)
                        if _START_WRITEBACK is not None:
                            f.flush()
                            _START_WRITEBACK(f.fileno())  # the disk starts on it while the next chunk goes out
    finally:
        digest.close()  # also when a write fails (a full disk): no thread left behind
    return digest.hexdigest()
