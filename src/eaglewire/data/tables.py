"""Rows of columnar files, streamed: parquet, Arrow IPC, and ``datasets`` directories (save_to_disk).

A ``datasets`` directory (``Dataset.save_to_disk``) holds ``state.json`` naming its Arrow files
(IPC *stream* format, written in record batches) in row order, beside ``dataset_info.json``;
rows are read with pyarrow alone, batch by batch, so ``datasets`` need not be installed. A
``DatasetDict`` directory (``dataset_dict.json``) holds one such directory per split: the caller
names the split.

A directory of parquet files (a hub data set's ``data/`` with ``train-00000-of-00003.parquet`` ...)
is one table: its files in name order, columns from the first.

Formats are told by their bytes, never by the file name: parquet starts with ``PAR1``, an Arrow
file with ``ARROW1``, an Arrow stream with the continuation marker ``0xFFFFFFFF``.

Recovery: an Arrow stream cut off mid-batch still yields every complete batch before the cut
(``Cut`` says where); a parquet file keeps its index at its end, so a cut-off one cannot be read
at all and raises ``TableError``.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger(__name__)

PARQUET_MAGIC = b"PAR1"
ARROW_FILE_MAGIC = b"ARROW1"
ARROW_STREAM_MAGIC = b"\xff\xff\xff\xff"
_BATCH_ROWS = 1024  # parquet read size


class TableError(ValueError):
    """A columnar input that cannot be read: names the path and what to do."""


@dataclass
class Cut:
    """Where a cut-off Arrow stream stopped being readable."""

    path: Path  # the Arrow file that ends mid-batch
    at_byte: int  # end of its last complete batch
    dropped_bytes: int
    why: str


def table_kind(path: Path) -> str | None:
    """'datasets', 'parquet-dir' (a directory of parquet files, e.g. a hub data set's
    ``data/train-00000-of-00003.parquet`` ...), 'parquet', 'arrow-file', 'arrow-stream', or None when
    ``path`` is none of them."""
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return "datasets"
        return "parquet-dir" if _parquet_children(path) else None
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith(PARQUET_MAGIC):
        return "parquet"
    if head.startswith(ARROW_FILE_MAGIC):
        return "arrow-file"
    if head.startswith(ARROW_STREAM_MAGIC):
        return "arrow-stream"
    return None


def dataset_files(path: Path) -> list[Path]:
    """The Arrow files of a ``datasets`` directory, in row order (``state.json``'s ``_data_files``)."""
    if (path / "dataset_dict.json").is_file() and not (path / "state.json").is_file():
        splits = _read_json(path / "dataset_dict.json").get("splits", [])
        raise TableError(f"{path} is a DatasetDict (splits: {', '.join(map(str, splits)) or 'none'}); "
                         f"pass one split's directory, e.g. {path / (splits[0] if splits else 'train')}")
    state = _read_json(path / "state.json")
    files = [path / entry["filename"] for entry in state.get("_data_files", [])]
    if missing := [f.name for f in files if not f.is_file()]:
        raise TableError(f"{path}/state.json names Arrow files that are not there: {', '.join(missing)}; "
                         "the directory is incomplete: save it again (Dataset.save_to_disk)")
    return files


def _parquet_children(path: Path) -> list[Path]:
    """The parquet files directly in ``path`` (told by their bytes; hidden files left out), in name order."""
    out = []
    for child in sorted(path.iterdir(), key=lambda p: p.name):
        if child.is_file() and not child.name.startswith("."):
            with open(child, "rb") as f:
                if f.read(4) == PARQUET_MAGIC:
                    out.append(child)
    return out


# the hub's {split}-00000-of-00003.parquet (UltraChat's with a hash after it: train_sft-00000-of-00003-a1b2.parquet)
_SPLIT_FILE = re.compile(r"(?P<split>.+?)-\d+-of-\d+(?:-[0-9a-f]+)?(?:\.parquet)?")


def parquet_files(path: Path) -> list[Path]:
    """The parquet files of a directory, in name order: read as one table. A directory holding several
    splits by the hub's naming (``train-*``, ``test-*``) is refused naming them: mixing splits would
    train on the test set."""
    files = _parquet_children(path)
    splits = sorted({m.group("split") for f in files if (m := _SPLIT_FILE.fullmatch(f.name))})
    if len(splits) > 1:
        first = splits[0]
        raise TableError(f"{path} holds the parquet files of several splits ({', '.join(splits)}); pass one split's "
                         f"files as their own directory (e.g. mkdir {path / first} && mv {path}/{first}-*.parquet "
                         f"{path / first}/) or one file")
    return files


def table_columns(path: Path) -> list[str]:
    """The column names of a parquet or Arrow file or a ``datasets`` directory (its first file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind = table_kind(path)
    if kind is None:
        raise TableError(f"{path} is not a parquet file, an Arrow file or a datasets directory")
    files = dataset_files(path) if kind == "datasets" else parquet_files(path) if kind == "parquet-dir" else [path]
    if not files:
        return []
    try:
        if kind in ("parquet", "parquet-dir"):
            return pq.read_schema(files[0]).names
        with pa.memory_map(str(files[0])) as source:
            opened = pa.ipc.open_file(source) if kind == "arrow-file" else pa.ipc.open_stream(source)
            return opened.schema.names
    except (pa.ArrowInvalid, OSError) as e:
        raise TableError(f"{files[0]} cannot be read as {kind} ({e}); a cut-off parquet file is unreadable "
                         "(its index is at the end): fetch it again") from e


def iter_rows(path: Path, *, columns: list[str] | None = None, cuts: list[Cut] | None = None
              ) -> Iterator[dict[str, Any]]:
    """Rows of ``path`` (a parquet or Arrow file, or a ``datasets`` directory) as dicts, in order.

    ``columns`` limits what is read to those present (missing ones are simply absent from the
    rows). A cut-off Arrow stream ends the rows of that file early and appends a ``Cut`` to ``cuts``
    (a warning is logged); without ``cuts`` it raises ``TableError``.
    """
    kind = table_kind(path)
    if kind is None:
        raise TableError(f"{path} is not a parquet file, an Arrow file or a datasets directory "
                         "(Dataset.save_to_disk writes state.json beside its .arrow files)")
    files = dataset_files(path) if kind == "datasets" else parquet_files(path) if kind == "parquet-dir" else [path]
    for file in files:
        file_kind = {"datasets": "arrow-stream", "parquet-dir": "parquet"}.get(kind, kind)
        for batch in _batches(file, file_kind, columns, cuts):
            yield from batch.to_pylist()


def _batches(path: Path, kind: str, columns: list[str] | None, cuts: list[Cut] | None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == "parquet":
        try:
            pf = pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as e:
            raise TableError(f"{path} cannot be read as parquet ({e}); parquet keeps its index at the end of "
                             "the file, so a cut-off download is unreadable: fetch it again") from e
        names = pf.schema_arrow.names
        yield from pf.iter_batches(batch_size=_BATCH_ROWS, columns=_present(columns, names))
        return
    source = pa.memory_map(str(path))
    try:
        if kind == "arrow-file":
            reader = pa.ipc.open_file(source)
            picked = _present(columns, reader.schema.names)
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)
                yield batch.select(picked) if picked is not None else batch
            return
        reader = pa.ipc.open_stream(source)
        picked = _present(columns, reader.schema.names)
        end = source.tell()
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            except (pa.ArrowInvalid, OSError) as e:
                cut = Cut(path, end, path.stat().st_size - end, str(e))
                if cuts is None:
                    raise TableError(f"{path} ends mid-batch after byte {end} ({e})") from e
                log.warning("%s: cannot read past byte %d (%s); dropped the %d byte(s) after the last complete "
                            "batch", path, end, e, cut.dropped_bytes)
                cuts.append(cut)
                return
            end = source.tell()
            yield batch.select(picked) if picked is not None else batch
    except pa.ArrowInvalid as e:  # not even a schema
        raise TableError(f"{path} cannot be read as Arrow ({e})") from e
    finally:
        source.close()


def _present(columns: list[str] | None, names: list[str]) -> list[str] | None:
    return None if columns is None else [c for c in columns if c in names]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise TableError(f"{path} cannot be read ({e}); the datasets directory is damaged: save it again") from e
