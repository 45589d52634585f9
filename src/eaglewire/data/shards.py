"""Hidden-state shards: the on-disk store of captured training data.

Shapes: S sequences in a shard, N tokens in a shard (the sum of their lengths), T one
sequence's tokens, H target hidden size, k number of aux boundaries.

A shard is one safetensors file holding S sequences concatenated along tokens, unpadded:

| tensor      | shape    | dtype                                                   |
|-------------|----------|---------------------------------------------------------|
| input_ids   | [N]      | int32                                                   |
| loss_mask   | [N]      | uint8                                                   |
| aux_hidden  | [N, k*H] | bf16 or fp16, boundaries concatenated in contract order |
|             |          | (or fp8 e4m3 with ``--state-dtype fp8``)                |
| aux_scale   | [N, k]   | fp32, only with fp8: token n, boundary i is aux * scale |
| last_hidden | [N, H]   | bf16 or fp16 (``--labels hidden``, the default)         |
| topk_logprobs | [M, K] | fp16 (``--labels topk:K``, instead of last_hidden)      |
| topk_ids    | [M, K]   | uint16 (vocab <= 65536) or int32                        |
| offsets     | [S+1]    | int64; sequence s is tokens offsets[s]:offsets[s+1]     |

M counts the labelled positions: q is labelled when token q+1 of its sequence is under the loss
mask (where training reads the target's distribution), in token order; the reader derives each
sequence's rows from its loss mask (``state_codec.label_positions``). The manifest records
``state_dtype`` and ``labels`` (``hidden`` or ``topk:K``); manifests without them are bf16/fp16
aux states with the last hidden state.

``manifest.json`` (under torchrun one ``manifest.rank{r}-of-{w}.json`` per rank) lists the
finished shards with their sha256, the ``source`` the data came from (the input's identity and
the settings; a resume must match it) and, when written by ``prepare``, a ``status``: whether
the run completed, how many conversations it planned, what it skipped and why. Shard and manifest are each written to a temp file and
moved into place with ``os.replace``, so a crash loses only the sequences still buffered,
and a resume redoes exactly those.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import numpy as np
import torch

from eaglewire.core.contract import ContractError, HiddenStateContract, TargetFingerprint
from eaglewire.core.distributed import check_rank
from eaglewire.core.fileio import atomic_path, atomic_write_json
from eaglewire.data.shard_file import save_file
from eaglewire.data.state_codec import (DTYPES, FP8, Storage, dequantise_fp8, id_dtype, label_positions,
                                        parse_labels, quantise_fp8, topk_labels)

log = logging.getLogger(__name__)

SHARD_FORMAT_VERSION = 1
# safetensors dtype -> numpy dtype of the raw bytes; bf16 is read as int16 and fp8 as uint8, then viewed
_NP_DTYPES = {"I64": np.int64, "I32": np.int32, "U16": np.uint16, "U8": np.uint8, "BF16": np.int16,
              "F16": np.float16, "F32": np.float32, "F8_E4M3": np.uint8}
_MANIFEST_RE = re.compile(r"manifest(\.rank\d+-of-\d+)?\.json")
_MANIFEST_KEYS = ("format_version", "contract", "source", "dtype", "shards")
_MAX_OPEN = 512  # memory-mapped shards a dataset keeps open (each holds a file descriptor)

T_ = TypeVar("T_")


class ShardError(ValueError):
    """Shard data that is corrupted, missing, or not eaglewire's."""


def _redo(path: Path) -> str:
    return (f" Delete {path} and re-run `eaglewire prepare` with the same --out "
            f"({path.parent}); the resume re-creates it.")


# ---------------------------------------------------------------- names, parallel work

def shard_work(items: Sequence[T_], rank: int, world_size: int) -> list[T_]:
    """This rank's share of ``items``: ``items[rank::world_size]`` (disjoint, covering)."""
    check_rank(rank, world_size)
    return list(items[rank::world_size])


# ---------------------------------------------------------------- manifests

def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _totals(shards: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(s["num_tokens"] for s in shards)
    size = sum(s["bytes"] for s in shards)
    return {"sequences": sum(s["num_sequences"] for s in shards), "tokens": tokens,
            "loss_tokens": sum(s["num_loss_tokens"] for s in shards), "bytes": size,
            "bytes_per_token": size / tokens if tokens else 0.0}


def source_differences(recorded: Any, now: Any) -> str:
    """``key: recorded X, now Y; ...`` for the top-level keys of two source records that differ."""
    if not isinstance(recorded, dict) or not isinstance(now, dict):
        return f"recorded {str(recorded)[:200]}, now {str(now)[:200]}"
    keys = [k for k in {**recorded, **now} if recorded.get(k) != now.get(k)]
    return "; ".join(f"{k}: recorded {json.dumps(recorded.get(k))[:200]}, now {json.dumps(now.get(k))[:200]}"
                     for k in keys)


def read_sources(data_dir: str | Path) -> list[tuple[str, Any]]:
    """(manifest part name, recorded source) of every part in ``data_dir``; [] for none."""
    data_dir = Path(data_dir)
    return [(name, part["source"]) for name, part in _read_parts(data_dir)] if data_dir.is_dir() else []


def incomplete_reason(manifest: dict[str, Any]) -> str | None:
    """Why a merged manifest's data is incomplete (with what it covers), or None.

    Parts without a ``status`` (written by other tools or older versions) count as complete.
    """
    parts, statuses = manifest["parts"], manifest["statuses"]
    world = max((st.get("world_size", 1) for st in statuses if st), default=1)
    stopped = [name for name, st in zip(parts, statuses) if st is not None and not st.get("complete")]
    if not stopped and len(parts) >= world:
        return None
    planned = sum(st.get("conversations", 0) for st in statuses if st)
    stored = manifest["totals"]["sequences"]
    missing = f"; {world - len(parts)} of {world} ranks wrote nothing" if len(parts) < world else ""
    return (f"its `eaglewire prepare` did not finish ({', '.join(stopped) or 'some ranks'} "
            f"incomplete{missing}): it holds {stored:,} sequences from the {planned:,} conversations "
            "planned")


def _read_parts(data_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    """Every manifest part in ``data_dir`` as (file name, manifest): manifest.json first, then by rank."""
    names = [p.name for p in data_dir.glob("manifest*.json") if _MANIFEST_RE.fullmatch(p.name)]
    names.sort(key=lambda n: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", n)])  # rank2 < rank10
    parts = []
    for name in names:
        try:
            part = json.loads((data_dir / name).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ShardError(f"{data_dir / name} is not a readable manifest ({e})."
                             + _redo(data_dir / name)) from e
        missing = [k for k in _MANIFEST_KEYS if not isinstance(part, dict) or k not in part]
        if missing:
            raise ShardError(f"{data_dir / name} is not an eaglewire shard manifest (no "
                             f"{', '.join(missing)})." + _redo(data_dir / name))
        if part["format_version"] != SHARD_FORMAT_VERSION:
            raise ShardError(f"{data_dir / name} has shard format {part['format_version']!r}; this "
                             f"eaglewire reads format {SHARD_FORMAT_VERSION}. Re-capture with "
                             "`eaglewire prepare` into a new --out")
        parts.append((name, part))
    return parts


def _check_contract(expected: HiddenStateContract, stored: HiddenStateContract, what: str, *,
                    allow: set[str] | frozenset[str] = frozenset(), strict: bool = True) -> list[str]:
    """``expected.check_same(stored)``; with ``strict`` the soft fields (the target dtype)
    must match too, since one store holds one capture. Returns the allowed differences.
    """
    warnings = expected.check_same(stored, what=what, allow=allow)
    diffs = stored.target.differences(expected.target)
    if strict and diffs:
        lines = "; ".join(f"{k} recorded {a!r} but {b!r} now" for k, (a, b) in diffs.items())
        raise ContractError(f"{what} were captured differently: {lines}. Capture with matching "
                            "settings or use another directory")
    return warnings


def _entry_problem(data_dir: Path, entry: dict[str, Any]) -> str | None:
    """Why a manifest entry's file is unusable (missing, wrong size), or None; cheap (a stat)."""
    path = data_dir / entry["file"]
    if not path.is_file():
        return "is listed in the manifest but missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"has {size} bytes but the manifest records {entry['bytes']}"
    return None


# ---------------------------------------------------------------- writing

def _ids_error(seq_id: str, dtype: torch.dtype, lo: int, hi: int, vocab: int) -> ValueError:
    return ValueError(f"input_ids of sequence {seq_id!r} ({dtype}, values {lo}..{hi}): token ids must be "
                      f"integers in [0, {vocab})")


def _mask_error(seq_id: str, dtype: torch.dtype) -> ValueError:
    return ValueError(f"loss_mask of sequence {seq_id!r} ({dtype}) must hold only 0/1")


def _nonfinite_error(seq_id: str, name: str, count: int) -> ShardError:
    return ShardError(f"sequence {seq_id!r}: {name} holds {count} NaN/inf values; the target produced non-finite "
                      "states (an fp16 overflow?). Capture in bf16/fp32 or drop this sequence")


def _range_error(seq_id: str, name: str, amax: float, dtype: str) -> ShardError:
    return ShardError(f"sequence {seq_id!r}: {name} reaches |x| = {amax:.4g}, beyond the {dtype} range; store "
                      "shards as bf16 (--dtype bf16)")


@dataclass
class _Piece:
    """Consecutive buffered sequences: their ids, lengths and stored tensors (concatenated along tokens)."""

    ids: list[str]
    lengths: list[int]
    tensors: dict[str, torch.Tensor]


class ShardWriter:
    """Buffer captured sequences and write them as shards plus a manifest, resumably.

    Contract: after every completed shard the directory is a valid store (ShardDataset reads
    it); a sequence id is stored at most once across all manifest parts of the directory;
    finished shards are never rewritten. Constructing a writer on a directory with manifests
    is a resume: their contract and dtype must match, ``done_ids`` holds what they finished,
    and this rank's temp files and unrecorded shards (left by a crash) are removed.
    """

    def __init__(self, out_dir: str | Path, contract: HiddenStateContract, *, source: dict[str, Any],
                 dtype: str = "bf16", shard_tokens: int = 65536, rank: int = 0, world_size: int = 1,
                 state_dtype: str | None = None, labels: str = "hidden",
                 labels_head: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """``labels_head`` maps last states [n, H] to the target's logits [n, V]; ``topk:K`` labels
        need it (the last state is reduced to its top-K at ``add`` and not stored)."""
        self.storage = Storage(dtype=dtype, state_dtype=state_dtype, labels=labels)
        parse_labels(labels, vocab_size=contract.target.vocab_size)
        if self.storage.labels_mode == "topk" and labels_head is None:
            raise ValueError(f"--labels {labels} stores the target's top-K log-probabilities: the writer needs "
                             "the target's head (final norm + lm_head) to compute them")
        self.labels_head = labels_head
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be a positive number of tokens, got {shard_tokens}")
        check_rank(rank, world_size)
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.contract, self.dtype, self.shard_tokens = contract, dtype, shard_tokens
        self.rank, self.world_size = rank, world_size
        self.source = json.loads(json.dumps(source))  # fails now, not after the first shard
        self.status: dict[str, Any] | None = None  # prepare's progress record; see set_status
        name = "manifest.json" if world_size == 1 else f"manifest.rank{rank}-of-{world_size}.json"
        self._manifest_path = self.out_dir / name
        self._prefix = "shard-" if world_size == 1 else f"shard-r{rank}-"
        self._shards: list[dict[str, Any]] = []
        self._buffer: list[_Piece] = []  # sequences stored next, in order
        self._buffer_ids: set[str] = set()
        self._buffer_tokens = 0
        self._closed = False
        self.done_ids: set[str] = set()
        self._resume()

    def _resume(self) -> None:
        """Adopt what earlier runs finished; drop entries whose file is gone; clean up after a crash."""
        keep: set[str] = set()
        dropped = False
        for name, part in _read_parts(self.out_dir):
            what = f"existing shards in {self.out_dir} ({name})"
            _check_contract(self.contract, HiddenStateContract.from_dict(part["contract"]), what)
            if why := Storage.of(part).refusal(self.storage, what):
                raise ShardError(why)
            if part["source"] != self.source:
                raise ShardError(f"{what} were prepared from other input or with other settings "
                                 f"({source_differences(part['source'], self.source)}); adding to them "
                                 "would mix two data sets. Use another --out, or pass --overwrite "
                                 "to delete them and start over")
            shards = [s for s in part["shards"] if _entry_problem(self.out_dir, s) is None]
            if name == self._manifest_path.name:
                for s in part["shards"]:
                    if (problem := _entry_problem(self.out_dir, s)) is not None:
                        log.warning("%s %s; dropping it, its %d sequences will be redone",
                                    self.out_dir / s["file"], problem, s["num_sequences"])
                dropped = len(shards) != len(part["shards"])
                self._shards = shards
                self.status = part.get("status")
                keep.update(s["file"] for s in shards)
            else:
                keep.update(s["file"] for s in part["shards"])  # never touch other parts' files
            self.done_ids.update(i for s in shards for i in s["sequence_ids"])
        self._next_index = self._clean(keep)
        if dropped:
            self._write_manifest()
        if self.done_ids:
            log.info("resuming in %s: %d sequences already on disk", self.out_dir, len(self.done_ids))

    def _clean(self, keep: set[str]) -> int:
        """Remove this rank's temp files and shards no manifest lists; return the next shard index."""
        pattern = re.compile(re.escape(self._prefix) + r"(\d+)\.safetensors")
        top = -1
        for path in sorted(self.out_dir.iterdir()):
            base = path.name.removesuffix(".tmp")
            if path.name.endswith(".tmp") and (base == self._manifest_path.name or pattern.fullmatch(base)):
                log.info("removing %s, left by an interrupted writer", path)
                path.unlink()
            elif (m := pattern.fullmatch(path.name)) and path.name not in keep:
                log.warning("removing %s: no manifest records it (its writer stopped before "
                            "recording it); its sequences will be redone", path)
                path.unlink()
            elif m:
                top = max(top, int(m.group(1)))
        return top + 1

    def add(self, seq_id: str, input_ids: torch.Tensor, loss_mask: torch.Tensor,
            aux_hidden: torch.Tensor, last_hidden: torch.Tensor) -> None:
        """Buffer one sequence; write a shard once ``shard_tokens`` tokens are buffered.

        input_ids [T] and loss_mask [T] integer, aux_hidden [T, k*H] and last_hidden [T, H] float.
        An id already stored or buffered is skipped, so a resume may re-add everything.
        Raises ValueError on a wrong shape or dtype, ShardError on non-finite hidden states.
        """
        if self._closed:
            raise RuntimeError(f"the writer for {self.out_dir} is closed; create a new one to add more")
        seq_id = str(seq_id)
        if seq_id in self.done_ids or seq_id in self._buffer_ids:
            log.debug("sequence %r is already stored; skipping it", seq_id)
            return
        seq_id, stored = self._validate(seq_id, input_ids, loss_mask, aux_hidden, last_hidden)
        label_rows = [stored["topk_ids"].shape[0]] if "topk_ids" in stored else None
        self.add_packed([seq_id], [stored["input_ids"].shape[0]], stored, label_rows)

    def add_packed(self, ids: list[str], lengths: list[int], stored: dict[str, torch.Tensor],
                   label_rows: list[int] | None = None) -> None:
        """Buffer sequences already checked and in their stored dtypes on the CPU, concatenated: ``input_ids``
        and ``loss_mask`` [N], ``aux_hidden`` [N, k*H] ... (``Storage.layout``), N = sum(lengths); top-K label
        tensors have ``label_rows[s]`` rows for sequence s. Shards are cut as ``add`` one at a time would cut them;
        ids already stored or buffered are skipped. The tensors are kept (not copied) until their shard is written.
        """
        assert len(ids) == len(lengths) and (label_rows is None or len(label_rows) == len(ids))
        rows = label_rows or [0] * len(ids)
        starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()  # token offsets [S+1]
        label_starts = np.concatenate([[0], np.cumsum(rows)]).tolist()  # label row offsets [S+1]

        def take(a: int, b: int) -> None:  # sequences a..b-1 into the buffer
            if b > a:
                cut = {name: label_starts if name.startswith("topk_") else starts for name in stored}
                part = {name: x[cut[name][a]:cut[name][b]] for name, x in stored.items()}
                self._buffer.append(_Piece(list(ids[a:b]), list(lengths[a:b]), part))

        first = 0
        for s, seq_id in enumerate(ids):
            if seq_id in self.done_ids or seq_id in self._buffer_ids:
                log.debug("sequence %r is already stored; skipping it", seq_id)
                take(first, s)
                first = s + 1
                continue
            self._buffer_ids.add(seq_id)
            self._buffer_tokens += lengths[s]
            if self._buffer_tokens >= self.shard_tokens:
                take(first, s + 1)
                first = s + 1
                self._flush()
        take(first, len(ids))

    def _validate(self, seq_id: str, input_ids: Any, loss_mask: Any, aux_hidden: Any,
                  last_hidden: Any) -> tuple[str, dict[str, torch.Tensor]]:
        """Check one sequence against the contract; return it as CPU tensors in stored dtypes."""
        t = {name: torch.as_tensor(x).detach() for name, x in (
            ("input_ids", input_ids), ("loss_mask", loss_mask),
            ("aux_hidden", aux_hidden), ("last_hidden", last_hidden))}
        k, h = self.contract.num_aux, self.contract.target.hidden_size
        n = t["input_ids"].shape[0] if t["input_ids"].ndim == 1 and t["input_ids"].shape[0] > 0 else "T"
        for name, want, doc in (("input_ids", [n], "[T]"), ("loss_mask", [n], "[T]"),
                                ("aux_hidden", [n, k * h], f"[T, k*H] with k={k} aux boundaries, H={h}"),
                                ("last_hidden", [n, h], f"[T, H] with H={h}")):
            if list(t[name].shape) != want:
                raise ValueError(f"{name} of sequence {seq_id!r} has shape {list(t[name].shape)}; "
                                 f"expected [{', '.join(map(str, want))}] ({doc}, T >= 1 tokens "
                                 "given by input_ids)")
        ids, mask, vocab = t["input_ids"], t["loss_mask"], self.contract.target.vocab_size
        if ids.is_floating_point() or ids.dtype == torch.bool or ids.min() < 0 or ids.max() >= vocab:
            raise _ids_error(seq_id, ids.dtype, int(ids.min()), int(ids.max()), vocab)
        if mask.is_floating_point() or not ((mask == 0) | (mask == 1)).all():
            raise _mask_error(seq_id, mask.dtype)
        for name in ("aux_hidden", "last_hidden"):
            x = t[name]
            if not x.is_floating_point():
                raise ValueError(f"{name} of sequence {seq_id!r} has dtype {x.dtype}; expected floats")
            if not torch.isfinite(x).all():
                raise _nonfinite_error(seq_id, name, int((~torch.isfinite(x)).sum()))
        stored: dict[str, torch.Tensor] = {}
        if self.storage.state_dtype == "fp8":
            stored["aux_hidden"], stored["aux_scale"] = quantise_fp8(t["aux_hidden"], k)  # [T, k*H], [T, k]
        else:
            stored["aux_hidden"] = self._half(seq_id, "aux_hidden", t["aux_hidden"])
        if self.storage.labels_mode == "hidden":
            stored["last_hidden"] = self._half(seq_id, "last_hidden", t["last_hidden"])
        else:
            last = t["last_hidden"]
            rows = label_positions(mask.to(last.device))  # [T] bool
            logits = self.labels_head(last[rows]) if bool(rows.any()) else last.new_zeros(0, vocab)  # [m, V]
            values, top = topk_labels(logits, self.storage.topk)  # [m, K] each
            stored["topk_logprobs"] = values.half()  # log-probabilities: within fp16's range, 11 bits
            stored["topk_ids"] = top.to("cpu").to(id_dtype(vocab))
        # copy=True: a row of a captured batch must not keep the whole batch alive in the buffer
        stored = {name: x.to("cpu", copy=True).contiguous() for name, x in stored.items()}
        return seq_id, {"input_ids": ids.to("cpu", torch.int32, copy=True),
                        "loss_mask": mask.to("cpu", torch.uint8, copy=True), **stored}

    def _half(self, seq_id: str, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` (finite) in the 16-bit storage dtype, cast on the capture device: half the transfer."""
        stored = x.to(DTYPES[self.dtype])
        if not torch.isfinite(stored).all():
            raise _range_error(seq_id, name, float(x.abs().max()), self.dtype)
        return stored

    def add_encoded(self, ids: list[str], lengths: list[int], input_ids: torch.Tensor, loss_mask: torch.Tensor,
                    stored: dict[str, torch.Tensor], checks: torch.Tensor, label_rows: list[int] | None = None) -> None:
        """``add`` of a batch whose states were encoded where they were computed (``state_codec.encode_states``)
        and copied here: input_ids [N] int32, loss_mask [N] uint8, ``stored`` as ``add_packed`` takes it (top-K ids
        in any integer dtype), ``checks`` [N, 6]. The same checks as ``add`` with the same messages, sequence by
        sequence: the sequences before a refused one are kept, as one ``add`` at a time would keep them."""
        refused = self._first_refusal(ids, lengths, input_ids, loss_mask, checks)
        stored = {"input_ids": input_ids, "loss_mask": loss_mask, **stored}
        if "topk_ids" in stored:
            stored["topk_ids"] = stored["topk_ids"].to(id_dtype(self.contract.target.vocab_size))
        keep = len(ids) if refused is None else refused[0]
        self.add_packed(ids[:keep], lengths[:keep], stored, None if label_rows is None else label_rows[:keep])
        if refused is not None:
            raise refused[1]

    def _first_refusal(self, ids: list[str], lengths: list[int], input_ids: torch.Tensor, loss_mask: torch.Tensor,
                       checks: torch.Tensor) -> tuple[int, Exception] | None:
        """(the first sequence ``_validate`` would refuse, its error), or None; from per-token figures."""
        from eaglewire.data.state_codec import (CHECK_AMAX_AUX, CHECK_AMAX_LAST, CHECK_NONFINITE_AUX,
                                                CHECK_NONFINITE_LAST, CHECK_RANGE_AUX, CHECK_RANGE_LAST)

        assert min(lengths) >= 1 and sum(lengths) == input_ids.shape[0] == loss_mask.shape[0] == checks.shape[0]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])  # [S]
        vocab = self.contract.target.vocab_size
        ids_np, mask_np = input_ids.numpy(), loss_mask.numpy()
        c = checks.numpy().astype(np.float64)  # [N, 6]
        lo, hi = np.minimum.reduceat(ids_np, starts), np.maximum.reduceat(ids_np, starts)  # [S] each
        bad_mask = np.maximum.reduceat(mask_np, starts) > 1  # [S]; uint8 masks: not 0/1 means > 1
        per_seq = np.add.reduceat(c, starts, axis=0)  # [S, 6] sums (counts, overflow flags)
        amax = np.maximum.reduceat(c, starts, axis=0)  # [S, 6]
        bad = (lo < 0) | (hi >= vocab) | bad_mask | (per_seq[:, [CHECK_NONFINITE_AUX, CHECK_NONFINITE_LAST,
                                                                  CHECK_RANGE_AUX, CHECK_RANGE_LAST]] > 0).any(-1)
        if not bad.any():
            return None
        s = int(bad.argmax())
        seq_id = str(ids[s])
        if lo[s] < 0 or hi[s] >= vocab:
            return s, _ids_error(seq_id, input_ids.dtype, int(lo[s]), int(hi[s]), vocab)
        if bad_mask[s]:
            return s, _mask_error(seq_id, loss_mask.dtype)
        for name, col in (("aux_hidden", CHECK_NONFINITE_AUX), ("last_hidden", CHECK_NONFINITE_LAST)):
            if per_seq[s, col]:
                return s, _nonfinite_error(seq_id, name, int(per_seq[s, col]))
        for name, col, top in (("aux_hidden", CHECK_RANGE_AUX, CHECK_AMAX_AUX),
                               ("last_hidden", CHECK_RANGE_LAST, CHECK_AMAX_LAST)):
            if per_seq[s, col]:
                return s, _range_error(seq_id, name, float(amax[s, top]), self.dtype)
        raise AssertionError(f"sequence {seq_id!r} was flagged without a reason")

    def _flush(self) -> None:
        """Write the buffered sequences as the next shard (atomically), then the manifest."""
        if not self._buffer:
            return
        ids = [seq_id for piece in self._buffer for seq_id in piece.ids]
        lengths = [n for piece in self._buffer for n in piece.lengths]
        offsets = torch.zeros(len(ids) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)  # [S+1]
        # name -> the pieces' parts, written one after another (no concatenated copy): input_ids [N] int32,
        # loss_mask [N] uint8, aux_hidden [N, k*H] (+ aux_scale [N, k]), last_hidden [N, H] or topk_* [M, K]
        tensors = {name: [piece.tensors[name] for piece in self._buffer] for name in self._buffer[0].tensors}
        tensors["offsets"] = [offsets]  # [S+1]
        name = f"{self._prefix}{self._next_index:05d}.safetensors"
        path = self.out_dir / name
        with atomic_path(path, fsync=True) as tmp:  # durable before it replaces anything
            digest = save_file(tensors, str(tmp), metadata={"format_version": str(SHARD_FORMAT_VERSION),
                                                            "contract": json.dumps(self.contract.to_dict()),
                                                            **self.storage.record()})
            entry = {"file": name, "sha256": digest, "bytes": tmp.stat().st_size,
                     "num_sequences": len(ids), "num_tokens": int(offsets[-1]),
                     "num_loss_tokens": sum(int(part.sum()) for part in tensors["loss_mask"]), "sequence_ids": ids,
                     "sequence_lengths": lengths}
            if "topk_ids" in tensors:
                entry["num_label_rows"] = sum(int(part.shape[0]) for part in tensors["topk_ids"])
        self._shards.append(entry)
        self._next_index += 1
        self.done_ids.update(ids)
        self._buffer, self._buffer_ids, self._buffer_tokens = [], set(), 0
        self._write_manifest()
        log.info("wrote %s: %d sequences, %d tokens", path, entry["num_sequences"], entry["num_tokens"])

    def set_status(self, **status: Any) -> None:
        """Update the manifest's ``status`` (e.g. complete=False at the start, True at the end) now."""
        self.status = {**(self.status or {}), **json.loads(json.dumps(status))}
        self._write_manifest()

    def _write_manifest(self) -> None:
        manifest = {"format_version": SHARD_FORMAT_VERSION, "contract": self.contract.to_dict(),
                    "source": self.source, **self.storage.record(), "rank": self.rank,
                    "world_size": self.world_size, "shards": self._shards, "totals": _totals(self._shards)}
        if self.status is not None:
            manifest["status"] = self.status
        atomic_write_json(self._manifest_path, manifest, indent=1, fsync=True)

    def close(self) -> dict[str, Any]:
        """Flush the last partial shard, write the manifest, return this writer's totals (idempotent)."""
        if not self._closed:
            self._flush() if self._buffer else self._write_manifest()
            self._closed = True
        return _totals(self._shards)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # Keep what is written; a resume redoes the buffered sequences rather than trusting them.
        # Ctrl-C is the user's own doing: the CLI says the one line that matters (resume).
        (log.debug if exc_type is KeyboardInterrupt else log.warning)("writer for %s stopped by %s; %d buffered sequences were not written, a resume "
                    "redoes them", self.out_dir, exc_type.__name__, len(self._buffer_ids))
        self._closed = True


# ---------------------------------------------------------------- reading

def _merge_parts(data_dir: Path) -> dict[str, Any]:
    """One manifest from every part in ``data_dir``; parts must agree on contract and storage."""
    hint = f"run `eaglewire prepare --out {data_dir}` to capture shards there"
    if not data_dir.is_dir():
        raise ShardError(f"{data_dir} does not exist; {hint}")
    parts = _read_parts(data_dir)
    if not parts:
        raise ShardError(f"{data_dir} holds no manifest.json; {hint}")
    first_name, first = parts[0]
    contract = HiddenStateContract.from_dict(first["contract"])
    shards: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    for name, part in parts:
        _check_contract(contract, HiddenStateContract.from_dict(part["contract"]),
                      f"manifest part {name} in {data_dir}")
        if Storage.of(part) != Storage.of(first):
            raise ShardError(f"manifest part {name} in {data_dir} stores {Storage.of(part).describe()} but "
                             f"{first_name} stores {Storage.of(first).describe()}; capture every rank with one "
                             "--dtype, --state-dtype and --labels")
        for s in part["shards"]:
            if len(s["sequence_ids"]) != s["num_sequences"]:
                raise ShardError(f"{data_dir / name} is inconsistent: {s['file']} lists "
                                 f"{len(s['sequence_ids'])} ids for {s['num_sequences']} sequences")
            for seq_id in s["sequence_ids"]:
                if seq_id in seen:
                    raise ShardError(f"sequence {seq_id!r} is stored twice in {data_dir}: in "
                                     f"{seen[seq_id]} and {s['file']}")
                seen[seq_id] = s["file"]
            shards.append(s)
    if not shards:
        raise ShardError(f"{data_dir} holds no shards yet (its manifest lists none); {hint}")
    statuses = [part.get("status") and {**part["status"], "world_size": part.get("world_size", 1)}
                for _, part in parts]
    return {"format_version": SHARD_FORMAT_VERSION, "contract": first["contract"],
            "source": first["source"], **Storage.of(first).record(), "parts": [n for n, _ in parts],
            "statuses": statuses, "shards": shards, "totals": _totals(shards)}


def _read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(data start, header) of a safetensors file: u64 little-endian length, then JSON."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= size - 8:
            raise ShardError(f"{path} is not a safetensors file (header length {length}, "
                             f"file {size} bytes)." + _redo(path))
        try:
            return 8 + length, json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ShardError(f"{path} has a corrupted header ({e})." + _redo(path)) from e


def _map_shard(path: Path, contract: HiddenStateContract, storage: Storage,
               entry: dict[str, Any]) -> dict[str, np.ndarray]:
    """Memory-map one shard: tensor name -> numpy view of its bytes; nothing is read but the header
    (and, for top-K labels, the loss mask, giving each sequence's label rows as ``label_offsets``)."""
    start, header = _read_header(path)
    meta = header.pop("__metadata__", None) or {}
    if "contract" in meta:
        _check_contract(contract, HiddenStateContract.from_json(meta["contract"]), f"shard {path}")
    layout = storage.layout(contract, entry["num_tokens"], entry["num_sequences"], entry.get("num_label_rows", 0))
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    views = {}
    for name, (st_dtype, shape) in layout.items():
        info = header.get(name, {})
        got = (info.get("dtype"), info.get("shape"))
        begin, end = info.get("data_offsets", (0, -1))
        nbytes = math.prod(shape) * np.dtype(_NP_DTYPES[st_dtype]).itemsize
        if got != (st_dtype, shape) or end - begin != nbytes or start + end > raw.shape[0]:
            raise ShardError(f"{path}: tensor {name} is {got[0]} {got[1]} but the manifest implies "
                             f"{st_dtype} {shape}." + _redo(path))
        views[name] = raw[start + begin:start + end].view(_NP_DTYPES[st_dtype]).reshape(shape)
    offsets, n = views["offsets"], entry["num_tokens"]
    if offsets[0] != 0 or offsets[-1] != n or (np.diff(offsets) < 0).any():
        raise ShardError(f"{path}: offsets do not partition its {n} tokens." + _redo(path))
    if storage.labels_mode == "topk":
        views["label_offsets"] = _label_offsets(views["loss_mask"], offsets)
        if views["label_offsets"][-1] != entry["num_label_rows"]:
            raise ShardError(f"{path}: its loss mask labels {views['label_offsets'][-1]} positions but the "
                             f"manifest records {entry['num_label_rows']} label rows." + _redo(path))
    return views


def _label_offsets(loss_mask: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """[S+1] int64: sequence s's label rows are label_offsets[s]:label_offsets[s+1]. A sequence's
    labelled positions are its tokens but the first under the loss mask, moved one back."""
    csum = np.concatenate([[0], np.cumsum(loss_mask, dtype=np.int64)])  # [N+1]
    counts = csum[offsets[1:]] - csum[offsets[:-1]] - loss_mask[offsets[:-1]].astype(np.int64)  # [S]
    return np.concatenate([[0], np.cumsum(counts)])


class ShardDataset(torch.utils.data.Dataset):
    """Memory-mapped reader over every shard in a directory (all manifest parts merged).

    Construction checks the manifest, the contract (``expect``, ``target``) and each listed
    file's presence and size; with ``verify`` a shard's sha256 is checked the first time it
    is opened. ``__getitem__`` reads only that sequence's bytes.
    """

    def __init__(self, data_dir: str | Path, *, expect: HiddenStateContract | None = None,
                 target: TargetFingerprint | None = None, allow: set[str] | frozenset[str] = frozenset(),
                 verify: bool = True):
        self.data_dir, self.verify = Path(data_dir), verify
        self.manifest = _merge_parts(self.data_dir)
        self.contract = HiddenStateContract.from_dict(self.manifest["contract"])
        self.storage = Storage.of(self.manifest)
        self.dtype: str = self.storage.dtype
        self.state_dtype: str = self.storage.state_dtype
        self.labels_mode: str = self.storage.labels_mode  # "hidden" (last_hidden) or "topk" (topk_*)
        what = f"shards in {self.data_dir}"
        warnings = (_check_contract(expect, self.contract, what, allow=allow, strict=False)
                    if expect is not None else [])
        if target is not None:
            warnings += self.contract.check_target(target, what=what, allow=allow)
        for w in warnings:
            log.warning("%s: %s", what, w)
        shards = self.manifest["shards"]
        for entry in shards:
            if (problem := _entry_problem(self.data_dir, entry)) is not None:
                path = self.data_dir / entry["file"]
                raise ShardError(f"{path} {problem}." + _redo(path))
        counts = [s["num_sequences"] for s in shards]
        self.sequence_ids: list[str] = [i for s in shards for i in s["sequence_ids"]]
        self.lengths: list[int] = [n for s in shards for n in s["sequence_lengths"]]
        self.num_tokens: int = self.manifest["totals"]["tokens"]
        self._shard_of = np.repeat(np.arange(len(shards)), counts)  # [num sequences]
        self._local = np.concatenate([np.arange(c) for c in counts])  # [num sequences]
        self._open: dict[int, dict[str, np.ndarray]] = {}
        self._verified: set[int] = set()

    def __len__(self) -> int:
        return len(self.sequence_ids)

    def _shard(self, j: int) -> dict[str, np.ndarray]:
        """Shard j's memory-mapped views, opened (and verified) once, then cached."""
        views = self._open.get(j)
        if views is not None:
            return views
        entry = self.manifest["shards"][j]
        path = self.data_dir / entry["file"]
        if self.verify and j not in self._verified:
            digest = _sha256(path)
            if digest != entry["sha256"]:
                raise ShardError(f"{path} is corrupted: its sha256 is {digest[:16]}… but the manifest "
                                 f"records {entry['sha256'][:16]}…." + _redo(path))
            self._verified.add(j)
        if len(self._open) >= _MAX_OPEN:
            self._open.pop(next(iter(self._open)))  # the oldest
        views = self._open[j] = _map_shard(path, self.contract, self.storage, entry)
        return views

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        """Sequence i: input_ids [T] long, loss_mask [T] bool, aux_hidden [T, k*H] (fp8 is read back
        as bf16), and last_hidden [T, H] or, with top-K labels, topk_logprobs [T, K] fp32 and
        topk_ids [T, K] long (zero where a position is not labelled)."""
        i = int(i)
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} is out of range for {len(self)} sequences")
        i %= len(self)
        views = self._shard(int(self._shard_of[i]))
        local = int(self._local[i])
        a, b = (int(x) for x in views["offsets"][local:local + 2])
        input_ids, loss_mask = self.tokens(i)
        item = {"input_ids": input_ids, "loss_mask": loss_mask}
        names = (["aux_hidden"] if self.state_dtype != "fp8" else []) + (
            ["last_hidden"] if self.labels_mode == "hidden" else [])
        for name in names:
            item[name] = torch.from_numpy(np.array(views[name][a:b]))  # a copy of only these rows
            if self.dtype == "bf16":
                item[name] = item[name].view(torch.bfloat16)  # int16 bits -> bf16
        if self.state_dtype == "fp8":
            q = torch.from_numpy(np.array(views["aux_hidden"][a:b])).view(FP8)  # [T, k*H]
            item["aux_hidden"] = dequantise_fp8(q, torch.from_numpy(np.array(views["aux_scale"][a:b])))
        if self.labels_mode == "topk":
            la, lb = (int(x) for x in views["label_offsets"][local:local + 2])
            rows = label_positions(loss_mask)  # [T] bool, lb - la of them
            K = views["topk_ids"].shape[1]
            item["topk_logprobs"] = torch.zeros(b - a, K)  # [T, K]
            item["topk_logprobs"][rows] = torch.from_numpy(views["topk_logprobs"][la:lb].astype(np.float32))
            item["topk_ids"] = torch.zeros(b - a, K, dtype=torch.long)  # [T, K]
            item["topk_ids"][rows] = torch.from_numpy(views["topk_ids"][la:lb].astype(np.int64))
        return item

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence i's input_ids [T] long and loss_mask [T] bool, without the hidden states."""
        views = self._shard(int(self._shard_of[i]))
        local = int(self._local[i])
        a, b = (int(x) for x in views["offsets"][local:local + 2])
        return (torch.from_numpy(views["input_ids"][a:b].astype(np.int64)),
                torch.from_numpy(views["loss_mask"][a:b].astype(np.bool_)))

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers reopen shards lazily; pickling a memmap would copy the whole file.
        return {**self.__dict__, "_open": {}}
