"""The compute precision of training and capture: ``--dtype auto|fp32|bf16``, resolved once per
run into a ``Precision`` that says what it chose and why (a log line, and a record the training
summary and the shard manifest keep).

``auto``: bf16 on CUDA (as before); on a CPU, bf16 where it computes bf16 natively
(``machine.native_bf16``: avx512_bf16 or AMX with oneDNN), fp32 elsewhere, where bf16 is
converted to fp32 in software and is slower than fp32 itself.

Training in bf16 is ``torch.autocast`` around the draft's forward (``Precision.autocast``): the
weights stay fp32 (the optimizer updates fp32 master weights), matmuls run in bf16, and the loss,
the log-softmax / softmax and the target's signal are computed in fp32 by the callers (they cast
with ``.float()``; autocast leaves those ops in fp32). Capture in bf16 loads the target's weights
in bf16 (``Precision.dtype``).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

DTYPE_CHOICES = ("auto", "fp32", "bf16")
# The one help text of the decoding commands' ``--dtype`` (generate, serve, bench, tune).
DECODE_DTYPE_HELP = ("the target's and the draft's precision when decoding: auto (bf16 where the CPU computes bf16 "
                     "natively, i.e. avx512_bf16 or AMX with oneDNN, and on CUDA; fp32 elsewhere), fp32, bf16; sampling "
                     "computes in fp32, and greedy speculative output equals plain decoding in the same dtype")
_NAMES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    name: str  # fp32 | bf16 (| fp16 for a capture that asks for it)
    requested: str  # what the user asked: auto, fp32, bf16
    device_type: str  # cpu | cuda
    reason: str  # why ``name``: one sentence for the log and the record

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.name]

    def autocast(self):
        """The context to run the draft's forward in: autocast to ``dtype`` unless fp32."""
        if self.name == "fp32":
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def record(self) -> dict[str, str]:
        """What a run records (training summary, manifest status)."""
        return {"dtype": self.name, "requested": self.requested, "device": self.device_type, "reason": self.reason}

    def describe(self) -> str:
        return f"{self.name} (--dtype {self.requested}): {self.reason}"


def resolve_precision(requested: str, device: torch.device | str, *, native: bool | None = None) -> Precision:
    """``requested`` (auto, fp32, bf16; fp16 and the long names are accepted as the target loader
    accepts them) on ``device`` -> the precision to compute in, with its reason. ``native`` (tests)
    stands for ``machine.native_bf16()``."""
    device_type = torch.device(device).type
    if requested != "auto" and requested not in _NAMES:
        raise ValueError(f"--dtype {requested!r} is not one of {', '.join(DTYPE_CHOICES)}")
    if device_type == "cuda":
        name = "bf16" if requested == "auto" else _NAMES[requested]
        why = "CUDA computes bf16 natively" if requested == "auto" else "asked for"
        return Precision(name=name, requested=requested, device_type=device_type, reason=why)
    if device_type != "cpu":
        name = "fp32" if requested == "auto" else _NAMES[requested]
        return Precision(name=name, requested=requested, device_type=device_type,
                         reason=f"asked for on {device_type}" if requested != "auto" else f"{device_type}: fp32 by default")
    if native is None:
        from eaglewire.core.machine import native_bf16

        native = native_bf16()
    if requested == "auto":
        if native:
            return Precision(name="bf16", requested=requested, device_type="cpu",
                             reason="this CPU computes bf16 natively (avx512_bf16 or AMX, with oneDNN)")
        return Precision(name="fp32", requested=requested, device_type="cpu",
                         reason="this CPU has no native bf16 (no avx512_bf16 or AMX with oneDNN): bf16 would "
                                "be converted in software, slower than fp32")
    name = _NAMES[requested]
    if name == "bf16" and not native:
        return Precision(name=name, requested=requested, device_type="cpu",
                         reason="asked for, but this CPU has no native bf16 (no avx512_bf16 or AMX with "
                                "oneDNN): expect it slower than fp32")
    return Precision(name=name, requested=requested, device_type="cpu", reason="asked for")


def log_precision(precision: Precision, what: str) -> None:
    """The one log line saying what ``what`` computes in and why (a warning for slow bf16)."""
    level = logging.WARNING if "slower than fp32" in precision.reason and precision.name == "bf16" else logging.INFO
    log.log(level, "%s computes in %s", what, precision.describe())


def dtype_name(dtype: torch.dtype) -> str:
    """fp32 | bf16 | fp16: how eaglewire names ``dtype`` in flags, reports and records."""
    names = {v: k for k, v in _DTYPES.items()}
    if dtype not in names:
        raise ValueError(f"dtype {dtype} is not one of {', '.join(map(str, names))}")
    return names[dtype]


def precision_of(dtype: torch.dtype, device: torch.device | str, *, requested: str, reason: str) -> Precision:
    """The record of a model already loaded in ``dtype`` (e.g. a target handed to ``prepare``)."""
    return Precision(name=dtype_name(dtype), requested=requested, device_type=torch.device(device).type, reason=reason)
