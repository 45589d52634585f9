"""Compact stored states: fp8 aux states and top-K labels (pure tensor functions), and
``Storage``, what a shard store keeps (its dtypes, labels and tensor layout).

Shapes: T tokens of a sequence, k aux boundaries, H hidden size, V target vocab, K the stored
top-K, n labelled positions (those whose next token is under the loss mask).

fp8: each token's state at each boundary is scaled by its own ``s = amax / 448`` (448 is the
largest finite float8_e4m3fn) and rounded to e4m3. e4m3 keeps 3 mantissa bits, so rounding to
nearest moves a normal value by at most half a unit in the last place, 2^-4 of its size; below
e4m3's smallest normal (2^-6, scaled) the spacing is 2^-9, so those move by at most 2^-10 · s.
Every element therefore comes back within 2^-4 · amax of itself (amax: its token's and
boundary's largest magnitude), and the largest one exactly up to the fp32 scale.

top-K labels: where training reads the target's distribution (the next token is a reply token)
the target's K largest log-probabilities and their ids are stored in place of the last hidden
state. Training renormalises them over the draft vocabulary; with K = V that is exactly the
softmax of the head's logits over the draft vocabulary that the last state would give.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from eaglewire.core.contract import HiddenStateContract
from eaglewire.model.ttt import signal_positions

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}  # 16-bit storage
STATE_DTYPES = (*DTYPES, "fp8")  # the aux states' storage (fp8: e4m3 with a scale per token and boundary)
_ST_HIDDEN = {"bf16": "BF16", "fp16": "F16", "fp8": "F8_E4M3"}  # safetensors' names for the stored dtypes
_BYTES = {"BF16": 2, "F16": 2, "F8_E4M3": 1, "F32": 4, "I32": 4, "U16": 2, "U8": 1, "I64": 8}
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8 = torch.float8_e4m3fn
LABEL_MODES = ("hidden", "topk")
_TOPK = re.compile(r"topk:(\d+)")


def parse_labels(spec: str, *, vocab_size: int | None = None) -> tuple[str, int | None]:
    """``hidden`` -> ("hidden", None); ``topk:K`` -> ("topk", K), 1 <= K (<= vocab_size when given)."""
    if spec == "hidden":
        return "hidden", None
    m = _TOPK.fullmatch(str(spec))
    if m is None or int(m.group(1)) < 1:
        raise ValueError(f"--labels {spec!r} is not a labels mode: pass hidden (store the last hidden state) "
                         "or topk:K with K >= 1 (store the target's K most likely tokens, e.g. topk:32)")
    k = int(m.group(1))
    if vocab_size is not None and k > vocab_size:
        raise ValueError(f"--labels {spec}: K = {k} exceeds the target vocabulary ({vocab_size}); "
                         f"pass at most topk:{vocab_size}")
    return "topk", k


def label_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """loss_mask [T] -> [T] bool: position q is labelled when token q+1 is under the loss mask
    (the target's distribution at q judges the prediction of x_{q+1}; ttt.signal_positions)."""
    return signal_positions(loss_mask[None])[0]  # the one statement of the alignment rule


def quantise_fp8(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """aux states [T, k*H] float -> (q [T, k*H] float8_e4m3fn, scale [T, k] fp32), x ~ q * scale."""
    T = x.shape[0]
    blocks = x.float().reshape(T, k, -1)  # [T, k, H]
    amax = blocks.abs().amax(-1)  # [T, k]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [T, k]; an all-zero state stays 0
    # the clamp keeps amax / scale, which fp32 may round a hair above 448, finite (e4m3fn has no inf)
    q = (blocks / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # [T, k, H]
    return q.reshape(T, -1), scale  # [T, k*H], [T, k]


def dequantise_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(q [T, k*H] float8_e4m3fn, scale [T, k]) -> aux states [T, k*H] in ``dtype``."""
    T, k = scale.shape
    x = q.float().reshape(T, k, -1) * scale.float()[..., None]  # [T, k, H]
    return x.reshape(T, -1).to(dtype)  # [T, k*H]


def topk_labels(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target head's logits [n, V] -> (log-probabilities [n, K] fp32, descending; ids [n, K] long)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    values, ids = logprobs.topk(k, dim=-1)  # [n, K] each, sorted
    return values, ids


def id_dtype(vocab_size: int) -> torch.dtype:
    """Stored top-K ids: uint16 while every id fits (V <= 65536), else int32 (2 bytes a value
    less per label: at H 576 with K = 32 that is 64 of ~1,900 bytes a token)."""
    return torch.uint16 if vocab_size <= 1 << 16 else torch.int32


@dataclass(frozen=True)
class Storage:
    """How a store keeps its states: ``dtype`` (bf16/fp16: the last hidden state, and the aux states
    unless fp8), ``state_dtype`` (the aux states: bf16, fp16 or fp8), ``labels`` (hidden or topk:K)."""

    dtype: str = "bf16"
    state_dtype: str | None = None  # None: as dtype
    labels: str = "hidden"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not a shard dtype; choose one of {', '.join(DTYPES)}")
        state = self.state_dtype or self.dtype
        if state not in (self.dtype, "fp8"):
            raise ValueError(f"state dtype {state!r} with storage dtype {self.dtype!r}: the aux states are "
                             f"stored like the last state ({self.dtype}) or as fp8; pass --state-dtype "
                             f"{self.dtype} or fp8")
        object.__setattr__(self, "state_dtype", state)
        parse_labels(self.labels)

    @classmethod
    def of(cls, manifest: dict[str, Any]) -> Storage:
        """A manifest's (or part's) storage; keys absent in older manifests read as the defaults."""
        return cls(dtype=manifest["dtype"], state_dtype=manifest.get("state_dtype"),
                   labels=manifest.get("labels", "hidden"))

    @property
    def labels_mode(self) -> str:
        """``hidden`` (the last hidden state is stored) or ``topk`` (the target's top-K log-probabilities)."""
        return parse_labels(self.labels)[0]

    @property
    def topk(self) -> int | None:
        """K of ``topk:K`` labels, None for hidden labels."""
        return parse_labels(self.labels)[1]

    def record(self) -> dict[str, str]:
        return {"dtype": self.dtype, "state_dtype": self.state_dtype, "labels": self.labels}

    def describe(self) -> str:
        """``bf16``, or ``bf16, aux fp8, labels topk:32`` when not the defaults."""
        extra = ([f"aux {self.state_dtype}"] if self.state_dtype != self.dtype else []) + (
            [f"labels {self.labels}"] if self.labels != "hidden" else [])
        return ", ".join([self.dtype, *extra])

    def refusal(self, other: Storage, what: str) -> str | None:
        """Why ``other`` cannot add to (or be read as one with) a store kept as ``self``, or None."""
        if self == other:
            return None
        flags = {"dtype": "--dtype", "state_dtype": "--state-dtype", "labels": "--labels"}
        mine = self.record()
        fix = " ".join(f"{flag} {mine[k]}" for k, flag in flags.items() if mine[k] != other.record()[k]
                       and not (k == "state_dtype" and "fp8" not in (self.state_dtype, other.state_dtype)))
        return (f"{what} are stored as {self.describe()} but {other.describe()} is asked; pass {fix} "
                "or use another --out")

    def layout(self, contract: HiddenStateContract, n: int, s: int, m: int) -> dict[str, tuple[str, list[int]]]:
        """Tensor name -> (safetensors dtype, shape) of a shard of n tokens, s sequences and m
        labelled positions."""
        k, h = contract.num_aux, contract.target.hidden_size
        out = {"input_ids": ("I32", [n]), "loss_mask": ("U8", [n]), "offsets": ("I64", [s + 1]),
               "aux_hidden": (_ST_HIDDEN[self.state_dtype], [n, k * h])}
        if self.state_dtype == "fp8":
            out["aux_scale"] = ("F32", [n, k])
        if self.labels_mode == "hidden":
            out["last_hidden"] = (_ST_HIDDEN[self.dtype], [n, h])
        else:
            ids = "U16" if id_dtype(contract.target.vocab_size) == torch.uint16 else "I32"
            out["topk_logprobs"] = ("F16", [m, self.topk])
            out["topk_ids"] = (ids, [m, self.topk])
        return out

    def token_bytes(self, contract: HiddenStateContract) -> int:
        """Bytes a token takes with every position labelled (an upper bound: sizing shards)."""
        return sum(_BYTES[st] * math.prod(shape[1:]) for st, shape in self.layout(contract, 1, 1, 1).values()
                   if shape[0] == 1)


# ---------------------------------------------------------------- a batch's states, encoded where they were computed

# columns of ``encode_states``' checks [N, 6], per token
CHECK_NONFINITE_AUX, CHECK_NONFINITE_LAST, CHECK_AMAX_AUX, CHECK_AMAX_LAST, CHECK_RANGE_AUX, CHECK_RANGE_LAST = range(6)


def state_checks(aux: torch.Tensor, last: torch.Tensor, stored_aux: torch.Tensor | None,
                 stored_last: torch.Tensor | None) -> torch.Tensor:
    """What the writer checks of each token, computed beside the states (no host sync per sequence):
    aux [N, k*H] and last [N, H] as computed, their 16-bit stored forms (None: not stored so) -> [N, 6] fp32:
    NaN/inf counts of aux and last, their largest |x|, and 1 where the stored form overflows (CHECK_*)."""
    def overflows(x: torch.Tensor | None) -> torch.Tensor:
        return (~torch.isfinite(x)).any(-1).float() if x is not None else aux.new_zeros(aux.shape[0], dtype=torch.float)

    return torch.stack([(~torch.isfinite(aux)).sum(-1).float(), (~torch.isfinite(last)).sum(-1).float(),
                        aux.abs().amax(-1).float(), last.abs().amax(-1).float(),
                        overflows(stored_aux), overflows(stored_last)], dim=-1)  # [N, 6]


def encode_states(storage: Storage, aux: torch.Tensor, last: torch.Tensor, k: int, *,
                  label_rows: list[torch.Tensor] | None = None, head=None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One batch's states [N, ...] (sequences concatenated along tokens) in their stored dtypes, on their own
    device: ({name: tensor}, checks [N, 6]; see ``state_checks``). What ``ShardWriter.add`` stores of each
    sequence, element for element; top-K labels need ``head`` and each sequence's labelled rows (indices into N,
    on the states' device), and are computed a sequence at a time (a batch's logits [M, V] could fill the device).
    Top-K ids come back as int32 (the host narrows them to ``id_dtype``)."""
    stored: dict[str, torch.Tensor] = {}
    if storage.state_dtype == "fp8":
        stored["aux_hidden"], stored["aux_scale"] = quantise_fp8(aux, k)  # [N, k*H], [N, k]
    else:
        stored["aux_hidden"] = aux.to(DTYPES[storage.dtype])  # [N, k*H]
    if storage.labels_mode == "hidden":
        stored["last_hidden"] = last.to(DTYPES[storage.dtype])  # [N, H]
    else:
        assert head is not None and label_rows is not None, "top-K labels need the head and the labelled rows"
        values, ids = [], []
        for rows in label_rows:
            v, i = topk_labels(head(last.index_select(0, rows)), storage.topk)  # [m, K] each
            values.append(v.half())
            ids.append(i.int())
        stored["topk_logprobs"] = torch.cat(values)  # [M, K]
        stored["topk_ids"] = torch.cat(ids)  # [M, K]
    checks = state_checks(aux, last, stored["aux_hidden"] if storage.state_dtype != "fp8" else None,
                          stored.get("last_hidden"))
    return stored, checks
