"""What the commands (generate, serve, bench, tune, doctor, quickstart) share to run a decoder: the precision
to decode in, a target plus a draft checked against it, loaded into one ``SpecDecoder``."""

from __future__ import annotations

import torch

from eaglewire.core.precision import Precision, log_precision, resolve_precision
from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder
from eaglewire.model.checkpoint import load_draft
from eaglewire.core.device import resolve_device
from eaglewire.model.target import Target, load_target

__all__ = ["decode_precision", "load_decode_target", "load_decoder"]


def decode_precision(requested: str, device: str | torch.device = "auto") -> Precision:
    """``--dtype`` of a decoding command on ``device``, resolved and logged once: bf16 where the machine computes
    it natively (``auto``), else fp32."""
    precision = resolve_precision(requested, resolve_device(device))
    log_precision(precision, "decoding")
    return precision


def load_decode_target(target_spec: str, *, device: str | torch.device = "auto", dtype: str = "auto") -> Target:
    """The target loaded in the precision ``dtype`` resolves to on ``device``."""
    return load_target(target_spec, device=device, dtype=decode_precision(dtype, device).dtype)


def load_decoder(target_spec: str, draft_dir: str | None, spec: SpecConfig | None, *, device: str = "auto",
                 dtype: str = "auto", allow: set[str] | frozenset[str] = frozenset()) -> SpecDecoder:
    """Target (+ draft checked against it, in the target's dtype) -> a SpecDecoder."""
    target = load_decode_target(target_spec, device=device, dtype=dtype)
    if draft_dir is None:
        return SpecDecoder(target)
    draft, contract, _ = load_draft(draft_dir, target=target, allow=allow, device=target.device, dtype=target.dtype)
    return SpecDecoder(target, draft, contract, spec)
