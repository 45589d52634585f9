"""KV caches: keep the accepted path, drop rejected branches.

Shapes: B = 1 sequence, nKV key/value heads, S cached tokens, hd head dim,
N tokens of one verify/draft block.
"""

from __future__ import annotations

import torch


def keep_rows(x: torch.Tensor, prefix: int, keep: torch.Tensor) -> torch.Tensor:
    """[B, n, S, hd] -> [B, n, prefix + len(keep), hd]: rows < prefix plus rows prefix + keep."""
    return torch.cat([x[:, :, :prefix], x[:, :, prefix + keep]], dim=2)


def compact_target_cache(cache, prefix: int, keep: list[int]) -> None:
    """Keep the first ``prefix`` entries and, of the block after them, the ``keep`` rows
    (the accepted path), in every layer of a transformers cache."""
    idx = torch.tensor(keep, dtype=torch.long)
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        idx_dev = idx.to(layer.keys.device)
        layer.keys = keep_rows(layer.keys, prefix, idx_dev)
        layer.values = keep_rows(layer.values, prefix, idx_dev)


class DraftCache:
    """The draft's own KV cache: committed context plus a scratch tree while drafting."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # [1, nKV, S, hd]
        self.v: torch.Tensor | None = None
        self.committed = 0  # entries that came from target states (the context)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)

    def commit(self) -> None:
        self.committed = 0 if self.k is None else self.k.shape[2]

    def rollback(self) -> None:
        """Drop the scratch entries of the last drafting round."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, :self.committed], self.v[:, :, :self.committed]

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]
