"""Shrinking a trained draft's vocabulary to a subset of its draft ids.

A smaller draft head (fewer ``lm_head`` rows) makes a draft step cheaper where the head
dominates it (llama.cpp on CPU); the price is the target tokens the draft can no longer
propose. The kept draft ids stay in ascending target-id order, so the shrunk draft keeps
the d2t / t2d layout SGLang and SpecForge expect (see ``vocab.py``).

Shapes: V target vocabulary, Vd current draft vocabulary, Vk kept draft vocabulary.
"""

from __future__ import annotations

import dataclasses

import torch

from eaglewire.model.draft import Eagle3Draft
from eaglewire.model.vocab import rank_by_count, vocab_maps


def frequent_draft_ids(draft_to_target: torch.Tensor, counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` draft ids whose target tokens are counted most often -> [Vk] ascending.

    draft_to_target [Vd] target id of each draft id; counts [V] per target id. Ties (and
    tokens never counted) go to the lower draft id, so the choice is deterministic.
    """
    current = draft_to_target.numel()
    if not 1 <= size <= current:
        raise ValueError(f"size {size} must be in [1, {current}] (the draft's current vocabulary size); "
                         "a draft vocabulary can only shrink")
    if counts.dim() != 1 or int(draft_to_target.max()) >= counts.numel():
        raise ValueError(f"counts of shape {tuple(counts.shape)} must be [V], one count per target id "
                         f"(the draft's target ids reach {int(draft_to_target.max())})")
    return rank_by_count(counts[draft_to_target])[:size].sort().values  # [Vk]


def shrink_draft_vocab(draft: Eagle3Draft, keep: torch.Tensor) -> Eagle3Draft:
    """A new draft that proposes only the draft ids ``keep`` [Vk] (ascending, unique).

    Its ``lm_head`` holds those rows, its d2t / t2d map them to the same target ids as
    before; every other tensor is copied. The original draft is left untouched.
    """
    current = draft.config.draft_vocab_size
    keep = torch.as_tensor(keep, dtype=torch.long).flatten().cpu()
    if keep.numel() == 0:
        raise ValueError("keep is empty: a draft needs at least one draft id to propose")
    if int(keep.min()) < 0 or int(keep.max()) >= current:
        raise ValueError(f"keep holds draft ids {int(keep.min())}..{int(keep.max())}; they must be in "
                         f"[0, {current - 1}] (the draft's current vocabulary)")
    if keep.numel() > 1 and not bool((keep[1:] > keep[:-1]).all()):
        raise ValueError("keep must be strictly ascending draft ids (no repeats), so that the kept "
                         "target ids stay in ascending order")
    target_ids = draft.draft_to_target.cpu()[keep]  # [Vk]
    size = keep.numel()
    config = dataclasses.replace(draft.config, draft_vocab_size=size)
    state = {k: v.detach().cpu() for k, v in draft.state_dict().items()}
    state["lm_head.weight"] = state["lm_head.weight"][keep]  # [Vk, H]
    state["d2t"], state["t2d"] = vocab_maps(target_ids, config.vocab_size)  # [Vk], [V]
    param = next(draft.parameters())
    small = Eagle3Draft(config)
    small.load_state_dict(state, strict=True)
    return small.to(device=param.device, dtype=param.dtype).train(draft.training)


def shrink_to_frequent(draft: Eagle3Draft, counts: torch.Tensor, size: int) -> Eagle3Draft:
    """Keeps the ``size`` most frequent tokens (by ``counts`` [V]) of the draft's vocabulary."""
    return shrink_draft_vocab(draft, frequent_draft_ids(draft.draft_to_target.cpu(), counts.cpu(), size))
