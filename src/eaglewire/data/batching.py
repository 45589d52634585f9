"""Token-budget batching, shared by capture (prepare, doctor) and training."""

from __future__ import annotations

from typing import Sequence, TypeVar

T_ = TypeVar("T_")

__all__ = ["pack_by_tokens"]


def pack_by_tokens(items: Sequence[T_], lengths: Sequence[int], batch_tokens: int) -> list[list[T_]]:
    """Cut ``items`` (in ascending ``lengths``) into consecutive batches with rows x longest row
    <= batch_tokens; an item longer than the budget gets a batch of its own."""
    assert list(lengths) == sorted(lengths), "pack_by_tokens needs items in ascending length"
    batches: list[list[T_]] = []
    batch: list[T_] = []
    for item, n in zip(items, lengths, strict=True):
        if batch and (len(batch) + 1) * n > batch_tokens:
            batches.append(batch)
            batch = []
        batch.append(item)
    if batch:
        batches.append(batch)
    return batches
