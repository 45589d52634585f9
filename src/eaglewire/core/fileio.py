"""Atomic file writes: every write goes to a temporary sibling first and is renamed into place
with ``os.replace``, so a crash never leaves a half-written file (or directory) behind. A write
that fails removes its temporary, and an I/O failure leaves as an OSError naming the file (even
when a library such as safetensors reported it as text)."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import save_file

from eaglewire.core.errors import as_os_error

__all__ = ["atomic_path", "atomic_dir", "replace_dir", "atomic_write_bytes", "atomic_write_text",
           "atomic_write_json", "atomic_torch_save", "atomic_save_safetensors"]


def _fsync(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def atomic_path(path: str | Path, *, suffix: str = ".tmp", fsync: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` (same directory, so the rename is atomic) to write;
    on a clean exit it replaces ``path``, on an error it is removed. ``fsync`` makes a file
    durable before it replaces anything."""
    path = Path(path)
    tmp = path.with_name(path.name + suffix)
    try:
        yield tmp
        if fsync:
            _fsync(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        _remove(tmp)
        if isinstance(e, Exception) and (os_error := as_os_error(e, tmp)) is not None and os_error is not e:
            raise os_error from e
        raise


def replace_dir(src: str | Path, dest: str | Path) -> None:
    """Move the finished directory ``src`` to ``dest`` (a sibling), replacing what is there: a
    directory cannot be renamed over a non-empty one, so an old ``dest`` is removed first."""
    dest = Path(dest)
    if dest.exists():
        _remove(dest)
    os.replace(src, dest)


@contextmanager
def atomic_dir(path: str | Path, *, suffix: str = ".partial") -> Iterator[Path]:
    """Yield an empty temporary sibling directory of ``path`` to fill; on a clean exit it
    replaces ``path`` (``replace_dir``), on an error it is removed."""
    path = Path(path)
    tmp = path.with_name(path.name + suffix)
    _remove(tmp)  # left by a crash
    tmp.mkdir(parents=True)
    try:
        yield tmp
        replace_dir(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


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
