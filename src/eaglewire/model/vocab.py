"""The draft vocabulary: the most frequent assistant tokens, and the d2t / t2d maps.

Shapes: V target vocabulary, Vd draft vocabulary.
``d2t[i]`` is the offset from draft id ``i`` to its target id (target = i + d2t[i]);
``t2d[t]`` says whether target id ``t`` is in the draft vocabulary. Draft ids are the
chosen target ids in ascending order, as SGLang and SpecForge expect.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch

log = logging.getLogger(__name__)


def count_tokens(sequences: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """Counts [V] of the tokens under the loss mask, over (input_ids [T], loss_mask [T]) pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in sequences:
        counts += torch.bincount(ids[mask.bool()].long(), minlength=vocab_size)[:vocab_size]
    return counts


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``draft_vocab_size`` tokens by count -> (d2t [Vd] long, t2d [V] bool).

    When the data has fewer distinct tokens, the rest is padded with the lowest unused ids.
    """
    vocab_size = counts.numel()
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in [1, {vocab_size}] "
                         "(the target vocabulary size)")
    seen = int((counts > 0).sum())
    chosen = rank_by_count(counts)[:min(seen, draft_vocab_size)]
    if seen < draft_vocab_size:
        log.warning("the data holds only %d distinct assistant tokens; padding the draft vocabulary "
                    "of %d with unused low ids", seen, draft_vocab_size)
        unused = torch.ones(vocab_size, dtype=torch.bool)
        unused[chosen] = False
        chosen = torch.cat([chosen, unused.nonzero().flatten()[:draft_vocab_size - seen]])
    return vocab_maps(chosen.sort().values, vocab_size)


def rank_by_count(counts: torch.Tensor) -> torch.Tensor:
    """counts [N] -> [N] indices, most counted first; ties (and zero counts) go to the lower index,
    so the ranking is deterministic."""
    n = counts.numel()
    return torch.argsort(counts.long() * n - torch.arange(n), descending=True)


def target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """d2t [Vd] offsets -> [Vd] the target id of each draft id (draft id + d2t)."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def vocab_maps(target_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft vocabulary's target ids [Vd] (ascending) -> (d2t [Vd] long, t2d [V] bool)."""
    d2t = target_ids - torch.arange(target_ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return d2t, t2d


def frequency_coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Share of counted tokens that fall inside the draft vocabulary."""
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else 0.0
