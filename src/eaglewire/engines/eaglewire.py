"""eaglewire's own engine (``eaglewire generate`` / ``serve`` / ``bench``): it reads the contract the
draft records, so its ids are the boundaries themselves, and it runs and is measured here. Its
launch flags are SGLang's names (``--speculative-num-steps`` ...), with an inconsistent chain an
error instead of a silent adjustment.
"""

from __future__ import annotations

from eaglewire.engines.flags import Flags, chain_shape, parse_flags

NAME = "eaglewire"


def to_ids(boundaries: list[int], num_layers: int, arch: str | None) -> list[int]:
    return list(boundaries)


def to_boundaries(ids: list[int], num_layers: int, arch: str | None) -> list[int]:
    return list(ids)


def lint_flags(flags: str, declared: list[int], num_layers: int, arch: str | None) -> Flags:
    """eaglewire's flags that it would refuse."""
    return chain_shape(parse_flags(flags), Flags(), verdict="fail", silently="eaglewire refuses it")
