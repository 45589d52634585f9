"""Atomic file writes: every write goes to a temporary sibling first and is renamed into place
with ``os.replace``, so a crash never leaves a half-written file (or directory) behind."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import save_file

__all__ = ["atomic_path", "atomic_write_bytes", "atomic_write_text", "atomic_write_json",
           "atomic_torch_save", "atomic_save_safetensors"]


def _fsync(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


@contextmanager
def atomic_path(path: str | Path, *, suffix: str = ".tmp", fsync: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` (same directory, so the rename is atomic) to write;
    on a clean exit it replaces ``path``. ``fsync`` makes a file durable before it replaces anything."""
    path = Path(path)
    tmp = path.with_name(path.name + suffix)
    yield tmp
    if fsync:
        _fsync(tmp)
    os.replace(tmp, path)


def atomic_write_bytes(path: str | Path, data: bytes, *, fsync: bool = False) -> None:
    with atomic_path(path, fsync=fsync) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | Path, text: str, *, fsync: bool = False) -> None:
    with atomic_path(path, fsync=fsync) as tmp:
        tmp.write_text(text)


def atomic_write_json(path: str | Path, obj: Any, *, indent: int | None = 2, fsync: bool = False) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent), fsync=fsync)


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def atomic_save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, *,
                            metadata: dict[str, str] | None = None, fsync: bool = False) -> None:
    with atomic_path(path, fsync=fsync) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
