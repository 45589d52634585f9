"""Compact stored states: fp8 aux states and top-K labels (pure tensor functions).

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

import re

import torch

from eaglewire.model.ttt import signal_positions

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
