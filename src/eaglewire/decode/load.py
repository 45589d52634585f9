"""What the commands (generate, serve, bench, doctor, quickstart) share to run a decoder: a
target plus a draft checked against it, loaded into one ``SpecDecoder``."""

from __future__ import annotations

from eaglewire.model.checkpoint import load_draft
from eaglewire.decode.engine import SpecConfig, SpecDecoder
from eaglewire.model.target import load_target

__all__ = ["load_decoder"]


def load_decoder(target_spec: str, draft_dir: str | None, spec: SpecConfig | None, *, device: str = "auto",
                 allow: set[str] | frozenset[str] = frozenset()) -> SpecDecoder:
    """Target (+ draft checked against it) -> a SpecDecoder."""
    target = load_target(target_spec, device=device)
    if draft_dir is None:
        return SpecDecoder(target)
    draft, contract, _ = load_draft(draft_dir, target=target, allow=allow, device=target.device)
    return SpecDecoder(target, draft, contract, spec)
