"""What the training loop asks of a draft family: build the draft, read the target's signal for a
batch, count what each predicted position divides by, and the loss with its counts.

Both families report per predicted position (EAGLE-3: TTT step j; DFlash: drafted block position
j + 1) the same ``StepCounts`` fields, as a [positions, COUNT_FIELDS] float64 tensor on the batch's device
(read to the host once per log row), so the loop's steps, data parallel sums, logging, evaluation and
resume are one code path.

``dense`` (EAGLE-3's ``--sync-free``): the target's head and the draft's loss at every position, masked,
so that nothing in the step makes a CUDA host wait for the device (``model/ttt.py``'s ``ttt_loss``).
"""

from __future__ import annotations

import math
from typing import Callable, Protocol

import torch

from eaglewire.data.sources import Batch
from eaglewire.model.dflash import DFlashConfig, DFlashDraft, default_mask_token_id
from eaglewire.model.dflash_blocks import draft_head
from eaglewire.model.dflash_objective import BlockSignal, block_loss, block_signal, label_indices, position_weights
from eaglewire.model.draft import DraftConfig, Eagle3Draft
from eaglewire.model.target import Target
from eaglewire.model.target_head import HeadOnlyError, unnorm_weight
from eaglewire.model.ttt import (StepCounts, TargetSignal, counted_per_step, signal_positions, target_signal,
                                 topk_signal, ttt_loss, vocab_coverage)
from eaglewire.model.vocab import build_draft_vocab


class Objective(Protocol):
    positions: int  # predicted positions per row position (TTT steps, or drafted block positions)
    weights: list[float]  # each position's weight in the loss

    def build(self, target: Target, num_aux: int, counts: torch.Tensor) -> torch.nn.Module: ...
    def signal(self, draft, batch: Batch, *, evaluation: bool = False, dense: bool = False): ...
    def counted(self, batch: Batch, signal) -> torch.Tensor: ...  # [positions] float64
    def loss(self, draft, batch: Batch, signal, normalizers: torch.Tensor | None, *,
             dense: bool = False) -> tuple[torch.Tensor, torch.Tensor]: ...  # loss, counts [positions, COUNT_FIELDS]
    def coverage(self, batch: Batch, signal) -> tuple[int, int]: ...


class Eagle3Objective:
    """The TTT unroll over whole sequences (model/ttt.py)."""

    def __init__(self, target: Target, *, ttt_steps: int, loss_decay: float, draft_vocab_size: int,
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.target, self.positions, self.decay, self.vocab = target, ttt_steps, loss_decay, draft_vocab_size
        self.head = head or target.head  # the labels' head (model/label_head.py)
        self.weights = [loss_decay ** j for j in range(ttt_steps)]

    def build(self, target: Target, num_aux: int, counts: torch.Tensor) -> Eagle3Draft:
        cfg = DraftConfig.from_target(target.text_config, num_aux=num_aux, draft_vocab_size=self.vocab,
                                      vocab_size=target.vocab_size)
        draft = Eagle3Draft(cfg)
        draft.set_vocab(*build_draft_vocab(counts, self.vocab))
        return draft

    def signal(self, draft, batch: Batch, *, evaluation: bool = False, dense: bool = False) -> TargetSignal:
        """The target's signal where a step reads it; ``dense``: the head over every position (selecting the
        positions is a shape the host would wait for). The counted positions and their signal are the same
        either way: a step counts only where the loss mask says the signal is read."""
        needed = signal_positions(batch.loss_mask)
        if batch.topk_ids is not None:  # shards with --labels topk:K: the stored top-K is the target's signal
            # (its rows are selected on the host even when dense: one read per batch)
            return topk_signal(batch.topk_logprobs, batch.topk_ids, draft.draft_to_target, draft.t2d, needed)
        return target_signal(self.head, batch.last_hidden.to(self.target.dtype),
                             draft.draft_to_target, draft.t2d, None if dense else needed)

    def counted(self, batch: Batch, signal: TargetSignal) -> torch.Tensor:
        return counted_per_step(batch.loss_mask, signal.in_vocab, self.positions)  # [K]

    def loss(self, draft, batch: Batch, signal: TargetSignal, normalizers: torch.Tensor | None, *,
             dense: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            emb = self.target.embed_tokens(batch.input_ids).float()  # [B, T, H]
        return ttt_loss(draft, emb, batch.aux_hidden.float(), batch.loss_mask, signal, ttt_steps=self.positions,
                        decay=self.decay, normalizers=normalizers, dense=dense)

    def coverage(self, batch: Batch, signal: TargetSignal) -> tuple[int, int]:
        return vocab_coverage(signal.in_vocab, batch.loss_mask)


class DFlashObjective:
    """Parallel blocks at sampled anchors (model/dflash_objective.py), the target's embedding and head."""

    def __init__(self, target: Target, *, block_size: int, layers: int, anchors: int, gamma: float,
                 mask_token_id: int | None, seed: int, draft_vocab_size: int | None = None,
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.target, self.block_size, self.layers, self.anchors, self.gamma = target, block_size, layers, anchors, gamma
        self.head = head or target.head  # the labels' head (model/label_head.py)
        self.mask_token_id, self.seed = mask_token_id, seed
        self.vocab = draft_vocab_size  # None: the target's whole vocabulary
        self.positions = block_size - 1
        self.weights = position_weights(block_size, gamma)
        self._head = None  # (draft, its rows of the target's head): frozen, on the draft's normed output

    def lm_head(self, draft: DFlashDraft):
        if self._head is None or self._head[0] is not draft:
            self._head = (draft, draft_head(self.target, draft))
        return self._head[1]

    def build(self, target: Target, num_aux: int, counts: torch.Tensor) -> DFlashDraft:
        mask = self.mask_token_id
        if mask is None:  # a random test target has no tokenizer: its last id
            mask = (default_mask_token_id(target.tokenizer, target.vocab_size) if target.tokenizer is not None
                    else target.vocab_size - 1)
        if int(counts[mask]) > 0:
            raise ValueError(f"mask token {mask} occurs {int(counts[mask])} times in the training replies; a block "
                             "would not tell a drafted position from that token: pass --mask-token-id with an unused id")
        draft = DFlashDraft(DFlashConfig.from_target(target.text_config, num_aux=num_aux, vocab_size=target.vocab_size,
                                                     num_layers=self.layers, block_size=self.block_size,
                                                     mask_token_id=mask, draft_vocab_size=self.vocab))
        if draft.config.pruned:  # the most frequent reply tokens, as EAGLE-3's (and speculators') draft vocabulary
            draft.set_vocab(*build_draft_vocab(counts, draft.config.draft_vocab_size))
        # The target's head reads states through the target's final norm: starting the draft's own final
        # norm at the same per-channel scale makes its first logits the head's reading of a normed state.
        with torch.no_grad():
            try:
                draft.norm.weight.copy_(unnorm_weight(target).to(draft.norm.weight.dtype))
            except HeadOnlyError:  # a norm with a bias: start from ones
                pass
        return draft

    def signal(self, draft, batch: Batch, *, evaluation: bool = False, dense: bool = False) -> BlockSignal:
        # (``dense`` is EAGLE-3's: a DFlash step reads its sampled blocks' counts on the host.)
        # Evaluation samples the same anchors every time (a fixed generator); training draws from
        # torch's generator, which the checkpoint saves, so a resumed run draws what it would have.
        generator = torch.Generator().manual_seed(self.seed) if evaluation else None
        topk = (batch.topk_logprobs, batch.topk_ids) if batch.topk_ids is not None else None
        last = None if topk is not None else batch.last_hidden.to(self.target.dtype)
        vocab = (draft.draft_to_target, draft.t2d) if draft.config.pruned else None
        return block_signal(batch.loss_mask, anchors_per_row=self.anchors, block_size=self.block_size,
                            head=self.head, last_hidden=last, topk=topk, vocab_size=self.target.vocab_size,
                            generator=generator, vocab=vocab)

    def counted(self, batch: Batch, signal: BlockSignal) -> torch.Tensor:
        return torch.tensor(signal.per_position(), dtype=torch.float64, device=batch.input_ids.device)  # [J]

    def loss(self, draft, batch: Batch, signal: BlockSignal, normalizers: torch.Tensor | None, *,
             dense: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        embed = self.target.embed_tokens
        loss, counts = block_loss(draft, lambda ids: embed(ids).float(), self.lm_head(draft),
                                  batch.input_ids, batch.aux_hidden.float(), signal, gamma=self.gamma,
                                  normalizers=None if normalizers is None else [int(n) for n in normalizers.tolist()])
        return loss, torch.tensor([c.as_floats() for c in counts], dtype=torch.float64,
                                  device=batch.input_ids.device)  # [J, COUNT_FIELDS]

    def coverage(self, batch: Batch, signal: BlockSignal) -> tuple[int, int]:
        """(pairs counted, pairs under the loss mask): a pruned vocabulary drops those whose target argmax is outside."""
        _, supervised = label_indices(signal.anchors, signal.keep, batch.loss_mask, self.block_size)
        return int(signal.counted.sum()), int(supervised.sum())


def summary_loss(counts: list[StepCounts], weights: list[float]) -> float:
    return sum(w * c.loss for w, c in zip(weights, counts))


def default_gamma(block_size: int) -> float:
    """DFlash's decay constant by block size (the paper: 7 for 16, 5 for 10, 4 for 8)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, math.floor(block_size / 2)))
