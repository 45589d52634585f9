"""Readers for hidden states captured by other tools, one sample (one file) at a time.

Shapes: T tokens of one sample, n states stored per token, k aux states, H hidden size.

| layout      | files                                  | tensors                                           |
|-------------|----------------------------------------|---------------------------------------------------|
| vllm        | ``<request>.safetensors`` (extract_hidden_states' example connector) | ``hidden_states`` [T, n, H], ``token_ids`` [T] |
| speculators | ``hs_{i}.safetensors`` + rows (jsonl)  | ``hidden_states`` [T, n, H]; row i: ``input_ids``, ``loss_mask`` |
| specforge   | ``**/*.ckpt`` (``torch.save`` dicts)   | ``input_ids`` [T], ``loss_mask`` [T], ``hidden_state`` [T, H] (post-norm), ``aux_hidden_state`` [T, k*H] |

None of these files records which layers it holds; the caller supplies the boundaries. A
sample that cannot be read yields a ``Skip`` with the reason, so one bad file among
thousands is counted, not fatal.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

LAYOUTS = ("vllm", "speculators", "specforge")
_HS_RE = re.compile(r"hs_(\d+)\.safetensors")


class ForeignDataError(ValueError):
    """A source directory that is not in the layout it was said to be in."""


@dataclass
class Sample:
    seq_id: str
    input_ids: torch.Tensor  # [T] integer
    loss_mask: torch.Tensor | None  # [T] 0/1, None when the source records none
    states: torch.Tensor  # [T, n, H] every stored state, in stored order
    post_norm_last: torch.Tensor | None = None  # [T, H] specforge's final state, after the final norm


@dataclass
class Skip:
    seq_id: str
    reason: str  # short, countable: "unreadable file", "non-finite states", ...
    detail: str


def _read_safetensors(path: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
        missing = [n for n in names if n not in keys]
        if missing:
            raise KeyError(f"no tensor {', '.join(missing)} (it holds {', '.join(sorted(keys)) or 'none'})")
        return {n: f.get_tensor(n) for n in keys if n in names or n in ("input_ids", "token_ids")}


def _states(x: torch.Tensor) -> torch.Tensor:
    """[T, n, H], accepting a leading batch of one."""
    return x[0] if x.ndim == 4 and x.shape[0] == 1 else x


def read_vllm(src: Path) -> Iterator[Sample | Skip]:
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ForeignDataError(f"--from vllm: {src} holds no *.safetensors files (vLLM's "
                               "extract_hidden_states connector writes one per request)")
    for path in files:
        try:
            t = _read_safetensors(path, ("hidden_states", "token_ids"))
        except (SafetensorError, OSError, KeyError, RuntimeError) as e:
            yield Skip(path.stem, "unreadable file", f"{path}: {e}")
            continue
        yield Sample(path.stem, t["token_ids"].flatten(), None, _states(t["hidden_states"]))


def read_rows(tokens: Path) -> Iterator[dict]:
    """Rows of a jsonl dataset, streamed."""
    if tokens.is_dir():
        raise ForeignDataError(
            f"--tokens {tokens} is a directory (an Arrow dataset?); eaglewire reads the rows as jsonl: "
            "export them with datasets.load_from_disk(DIR).to_json('rows.jsonl')")
    with open(tokens) as f:
        for line_no, line in enumerate(f):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise ForeignDataError(f"--tokens {tokens} line {line_no + 1} is not JSON ({e})") from e


def read_speculators(src: Path, tokens: Path | None) -> Iterator[Sample | Skip]:
    files = {int(m.group(1)): p for p in src.iterdir() if (m := _HS_RE.fullmatch(p.name))}
    if not files:
        raise ForeignDataError(f"--from speculators: {src} holds no hs_<i>.safetensors files")
    if tokens is None:
        raise ForeignDataError(
            f"--from speculators: {src} holds hidden states but not their tokens; pass --tokens ROWS.jsonl "
            "(the dataset the states were captured from, row i = hs_i, with input_ids and loss_mask)")
    for i, row in enumerate(read_rows(tokens)):
        path = files.pop(i, None)
        seq_id = str(row.get("id", f"hs_{i}"))
        if path is None:
            yield Skip(seq_id, "no states for this row", f"row {i} of {tokens}: no {src}/hs_{i}.safetensors")
            continue
        if "input_ids" not in row or "loss_mask" not in row:
            raise ForeignDataError(f"--tokens {tokens} row {i} has no input_ids/loss_mask (keys: "
                                   f"{', '.join(row)}); pass the preprocessed dataset the states came from")
        try:
            t = _read_safetensors(path, ("hidden_states",))
        except (SafetensorError, OSError, KeyError, RuntimeError) as e:
            yield Skip(seq_id, "unreadable file", f"{path}: {e}")
            continue
        ids = torch.tensor(row["input_ids"]).flatten()
        stored_ids = t.get("input_ids", t.get("token_ids"))
        if stored_ids is not None and not torch.equal(stored_ids.flatten().long(), ids.long()):
            yield Skip(seq_id, "token ids differ from the rows' input_ids",
                       f"{path} stores other token ids than row {i} of {tokens}")
            continue
        yield Sample(seq_id, ids, torch.tensor(row["loss_mask"]).flatten(), _states(t["hidden_states"]))
    for i, path in sorted(files.items()):
        yield Skip(path.stem, "no row for these states", f"{path}: {tokens} has no row {i}")


def read_specforge(src: Path, num_aux: int) -> Iterator[Sample | Skip]:
    files = sorted(src.rglob("*.ckpt"))
    if not files:
        raise ForeignDataError(f"--from specforge: {src} holds no *.ckpt files (SpecForge's "
                               "prepare_hidden_states writes one torch.save dict per sample)")
    for path in files:
        seq_id = str(path.relative_to(src).with_suffix(""))
        try:
            d = torch.load(path, map_location="cpu", weights_only=True)
            missing = [k for k in ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state") if k not in d]
            if missing:
                raise KeyError(f"no {', '.join(missing)}")
        except (OSError, RuntimeError, KeyError, EOFError, TypeError, ValueError) as e:
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
        yield Sample(seq_id, d["input_ids"].flatten(), d["loss_mask"].flatten(), states, post_norm_last=last)
