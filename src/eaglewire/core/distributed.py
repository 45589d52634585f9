"""Rank helpers: which of ``world_size`` processes this one is (torchrun's environment)."""

from __future__ import annotations

import os

__all__ = ["check_rank", "dist_rank_world"]


def check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world_size {world_size}: need 0 <= rank < world_size")


def dist_rank_world() -> tuple[int, int]:
    """(rank, world_size) from torchrun's RANK / WORLD_SIZE variables; (0, 1) when unset."""
    text = {var: os.environ.get(var, default) for var, default in (("RANK", "0"), ("WORLD_SIZE", "1"))}
    if bad := [f"{var}={v!r}" for var, v in text.items() if not v.strip().isdigit()]:
        raise ValueError(f"environment variable {', '.join(bad)} is not a non-negative integer")
    rank, world = int(text["RANK"]), int(text["WORLD_SIZE"])
    check_rank(rank, world)
    return rank, world
