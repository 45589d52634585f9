"""Readers for hidden states captured by other tools, one sample (one file) at a time.

Shapes: T tokens of one sample, n states stored per token, k aux states, H hidden size.

| layout      | files                                  | tensors                                           |
|-------------|----------------------------------------|---------------------------------------------------|
| vllm        | ``<req_id>.safetensors`` (+ ``.lock``) in the connector's ``shared_storage_path`` | ``hidden_states`` [T, n, H], ``token_ids`` [T] |
| speculators | ``<preprocessed>/hidden_states/hs_{i}.safetensors`` (vLLM's connector file, moved) beside the ``datasets`` rows in ``<preprocessed>`` | as vllm; row i: ``input_ids``, ``loss_mask`` |
| specforge   | ``rows_<g>-<g+2000>/data_{i}.ckpt`` or ``.ckpt.gz`` (``torch.save`` dicts, gzip) | ``input_ids`` [T], ``loss_mask`` [T], ``hidden_state`` [1, T, H] (post-norm), ``aux_hidden_state`` [1, T, k*H] |

Where each is written, read from the released code (tests/data/test_foreign_writers.py runs
those writers): vLLM 0.33.0 ``ExampleHiddenStatesConnector`` stacks the aux layers' states
(``eagle_aux_hidden_state_layer_ids`` order) on dim 1 and saves ``{"hidden_states", "token_ids"}``
to ``<shared_storage_path>/<req_id>.safetensors``. speculators 0.9.0 ``prepare-data`` saves the
rows (``input_ids``, ``loss_mask``, ``seq_len``) with ``Dataset.save_to_disk(<preprocessed>)``,
and ``generate-offline-data`` moves each request's connector file to
``<preprocessed>/hidden_states/hs_{i}.safetensors`` (``--output DIR``: ``DIR/hs_{i}``), i the
dataset row. SpecForge's ``scripts/prepare_hidden_states.py`` writes one dict per sample,
gzipped with ``--compress``.

vLLM's file (``vllm`` and ``speculators``) is read by the vllm engine's capturer (``read_file``), the one
reader ``prepare --capture vllm`` reads it with too.

None of these files records which layers it holds; the caller supplies the boundaries. A
sample that cannot be read yields a ``Skip`` with the reason, so one bad file among
thousands is counted, not fatal.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError

from eaglewire import engines
from eaglewire.data.label_check import POST_NORM, PRE_NORM
from eaglewire.data.tables import TableError, iter_rows, table_kind
from eaglewire.engines.interface import StatesFile

LAYOUTS = ("vllm", "speculators", "specforge")
# which side of the final norm each layout stores its boundary-L state on (import-data --last-state's default):
# vLLM/speculators capture the last layer's output, SpecForge the target's post-norm hidden_states[-1]
LAYOUT_LAST_STATE = {"vllm": PRE_NORM, "speculators": PRE_NORM, "specforge": POST_NORM}
_HS_RE = re.compile(r"hs_(\d+)\.safetensors")
SPECULATORS_STATES_DIR = "hidden_states"  # speculators' default: <preprocessed>/hidden_states
SPECFORGE_SUFFIXES = (".ckpt", ".ckpt.gz")


class ForeignDataError(ValueError):
    """A source directory that is not in the layout it was said to be in."""


@dataclass
class Sample:
    seq_id: str
    input_ids: torch.Tensor  # [T] integer
    loss_mask: torch.Tensor | None  # [T] 0/1, None when the source records none
    states: torch.Tensor  # [T, n, H] every stored state, in stored order
    # [T, H] a final state stored apart from ``states`` (SpecForge's hidden_state, post-norm as it writes it)
    final_state: torch.Tensor | None = None


@dataclass
class Skip:
    seq_id: str
    reason: str  # short, countable: "unreadable file", "non-finite states", ...
    detail: str


def _connector_file(path: Path, *, token_ids: bool = True) -> StatesFile:
    """A file vLLM's hidden-state connector wrote (speculators' hs_{i} are those files, moved), as vLLM's capturer
    reads its own."""
    return engines.get("vllm", engines.Ability.CAPTURE).capturer.read_file(path, token_ids=token_ids)


def read_vllm(src: Path) -> Iterator[Sample | Skip]:
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ForeignDataError(f"--from vllm: {src} holds no *.safetensors files (vLLM's "
                               "extract_hidden_states connector writes one per request)")
    for path in files:
        try:
            found = _connector_file(path)
        except (SafetensorError, OSError, KeyError, RuntimeError) as e:
            yield Skip(path.stem, "unreadable file", f"{path}: {e}")
            continue
        yield Sample(path.stem, found.token_ids, None, found.states)


def read_rows(tokens: Path) -> Iterator[dict]:
    """Rows of a ``datasets`` directory, a parquet/Arrow file or a jsonl file, streamed."""
    if table_kind(tokens) is not None:
        try:
            yield from iter_rows(tokens, columns=["id", "input_ids", "loss_mask"])
        except TableError as e:
            raise ForeignDataError(f"--tokens {tokens}: {e}") from e
        return
    if tokens.is_dir():
        raise ForeignDataError(f"--tokens {tokens} is a directory but not a datasets directory (no state.json): "
                               "pass the directory Dataset.save_to_disk wrote, or a jsonl/parquet file")
    with open(tokens) as f:
        for line_no, line in enumerate(f):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise ForeignDataError(f"--tokens {tokens} line {line_no + 1} is not JSON ({e})") from e


def _hs_files(folder: Path) -> dict[int, Path]:
    return {int(m.group(1)): p for p in folder.iterdir() if (m := _HS_RE.fullmatch(p.name))} if folder.is_dir() else {}


def speculators_layout(src: Path, tokens: Path | None) -> tuple[dict[int, Path], Path]:
    """(hs_<i> files by row index, the rows) of a speculators capture.

    ``src`` is ``<preprocessed>`` (the datasets directory of ``prepare-data``, with the states in
    its ``hidden_states/``), or the states folder itself (``generate-offline-data --output DIR``)
    with ``--tokens <preprocessed>``; the rows default to the datasets directory the states are in
    or beside.
    """
    states_dir = src
    files = _hs_files(src)
    if not files:
        states_dir = src / SPECULATORS_STATES_DIR
        files = _hs_files(states_dir)
    if not files:
        raise ForeignDataError(
            f"--from speculators: {src} holds no hs_<i>.safetensors files, nor does {src / SPECULATORS_STATES_DIR} "
            "(where generate-offline-data writes them by default); pass the --preprocessed-data directory, or "
            "the --output directory with --tokens <preprocessed-data>")
    if tokens is None:
        for candidate in (states_dir.parent, states_dir):  # <preprocessed>/hidden_states, or beside them
            if table_kind(candidate) == "datasets":
                tokens = candidate
                break
    if tokens is None:
        raise ForeignDataError(
            f"--from speculators: {states_dir} holds hidden states but not their tokens, and no datasets directory "
            "holds it; pass --tokens <preprocessed-data> (the directory prepare-data wrote: row i = hs_i, with "
            "input_ids and loss_mask), or a jsonl of those rows")
    return files, tokens


def read_speculators(src: Path, tokens: Path | None) -> Iterator[Sample | Skip]:
    files, tokens = speculators_layout(src, tokens)
    for i, row in enumerate(read_rows(tokens)):
        path = files.pop(i, None)
        seq_id = str(row.get("id", f"hs_{i}"))
        if path is None:
            yield Skip(seq_id, "no states for this row", f"row {i} of {tokens}: no hs_{i}.safetensors")
            continue
        if row.get("input_ids") is None or row.get("loss_mask") is None:
            raise ForeignDataError(f"--tokens {tokens} row {i} has no input_ids/loss_mask (keys: "
                                   f"{', '.join(row)}); pass the preprocessed dataset the states came from")
        try:
            found = _connector_file(path, token_ids=False)
        except (SafetensorError, OSError, KeyError, RuntimeError) as e:
            yield Skip(seq_id, "unreadable file", f"{path}: {e}")
            continue
        ids = torch.tensor(row["input_ids"]).flatten()
        stored_ids = found.token_ids
        if stored_ids is not None and not torch.equal(stored_ids.long(), ids.long()):
            yield Skip(seq_id, "token ids differ from the rows' input_ids",
                       f"{path} stores other token ids than row {i} of {tokens}")
            continue
        yield Sample(seq_id, ids, torch.tensor(row["loss_mask"]).flatten(), found.states)
    for i, path in sorted(files.items()):
        yield Skip(path.stem, "no row for these states", f"{path}: {tokens} has no row {i}")


def specforge_files(src: Path) -> list[Path]:
    """SpecForge's feature files under ``src``, in its own order (list_local_files: every path sorted)."""
    return sorted(p for p in src.rglob("*") if p.name.endswith(SPECFORGE_SUFFIXES) and p.is_file())


def _load_ckpt(path: Path) -> dict:
    if path.name.endswith(".gz"):
        with gzip.open(path, "rb") as f:  # gzip has no random access: read whole, as SpecForge does
            return torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
    return torch.load(path, map_location="cpu", weights_only=True)


def read_specforge(src: Path, num_aux: int) -> Iterator[Sample | Skip]:
    files = specforge_files(src)
    if not files:
        raise ForeignDataError(f"--from specforge: {src} holds no *.ckpt or *.ckpt.gz files (SpecForge's "
                               "prepare_hidden_states writes one torch.save dict per sample, under rows_<i>-<j>/)")
    for path in files:
        rel = path.relative_to(src).as_posix()
        seq_id = rel.removesuffix(".gz").removesuffix(".ckpt")  # rows_0-2000/data_7
        try:
            d = _load_ckpt(path)
            missing = [k for k in ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state") if k not in d]
            if missing:
                raise KeyError(f"no {', '.join(missing)}")
        except (OSError, RuntimeError, KeyError, EOFError, TypeError, ValueError, zlib.error) as e:
            yield Skip(seq_id, "unreadable file", f"{path}: {e}")
            continue
        aux = d["aux_hidden_state"]
        aux = aux[0] if aux.ndim == 3 and aux.shape[0] == 1 else aux  # [T, k*H]
        last = d["hidden_state"]
        last = last[0] if last.ndim == 3 and last.shape[0] == 1 else last  # [T, H]
        if aux.ndim != 2 or aux.shape[-1] % num_aux:
            yield Skip(seq_id, "wrong shape", f"{path}: aux_hidden_state {list(d['aux_hidden_state'].shape)} "
                       f"is not [T, k*H] with k={num_aux}")
            continue
        states = aux.reshape(aux.shape[0], num_aux, -1)  # [T, k, H]
        yield Sample(seq_id, d["input_ids"].flatten(), d["loss_mask"].flatten(), states, final_state=last)
