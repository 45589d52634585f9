"""DFlash's training objective: parallel blocks at sampled anchors, their loss and counts (pure).

Shapes: B batch, T tokens, N anchors (blocks) per row, bs block size, J = bs - 1 drafted
positions per block, P counted (block, position) pairs, H hidden, V target vocab, K top-K.

Alignment, as in decoding: a block anchored at position a holds token x_a (the target's last
output) and bs - 1 mask tokens at positions a .. a+bs-1; it sees the fused states of x_0 ..
x_{a-1} only. Drafted position j = 1 .. bs-1 predicts x_{a+j} and is judged against the
target's distribution at index a+j-1 (the one that produced x_{a+j} on greedy data). A pair
counts when a+j < T, x_{a+j} is under the loss mask and the block was kept.

Anchors are sampled per row among positions whose own token and next token are both under the
loss mask (as SpecForge does), without replacement. The loss is, like the EAGLE-3 TTT loss,
a weighted sum over drafted positions of the mean soft cross-entropy against the target: position
j weighs ``exp(-(j-1)/gamma)`` (DFlash's decay: early positions decide acceptance).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from eaglewire.model.dflash import DFlashDraft, block_attention_mask
from eaglewire.model.ttt import StepCounts, target_signal, topk_signal

# Block positions scored per chunk of the head and loss: a chunk's [n, V] logits, log-softmax and
# target probabilities are what a DFlash step holds in memory (V is the whole target vocabulary).
HEAD_CHUNK = 512


def position_weights(block_size: int, gamma: float) -> list[float]:
    """Weight of drafted positions 1 .. bs-1: exp(-(j-1)/gamma)."""
    return [math.exp(-j / gamma) for j in range(block_size - 1)]


def sample_anchors(loss_mask: torch.Tensor, n: int, generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """loss_mask [B, T] -> (anchors [B, N], keep [B, N] bool), N = min(n, most candidates in a row).

    Candidates: a < T-1 with loss_mask[a] and loss_mask[a+1]. Each row takes up to ``n`` of its own
    at random, sorted; a row with fewer fills the rest with dropped blocks (anchor 0, keep False).
    """
    B, T = loss_mask.shape
    m = loss_mask.bool()
    valid = torch.zeros(B, T, dtype=torch.bool, device=m.device)
    valid[:, :-1] = m[:, :-1] & m[:, 1:]
    width = min(n, int(valid.sum(1).max())) if T > 1 else 0
    if width == 0:
        return torch.zeros(B, 0, dtype=torch.long, device=m.device), torch.zeros(B, 0, dtype=torch.bool, device=m.device)
    noise = torch.rand(B, T, generator=generator).to(m.device)
    noise = noise.masked_fill(~valid, 2.0)
    picked = noise.argsort(dim=1)[:, :width]  # [B, N]
    keep = torch.gather(valid, 1, picked)
    anchors = torch.where(keep, picked, torch.full_like(picked, T))
    anchors = anchors.sort(dim=1).values
    keep = anchors < T
    return torch.where(keep, anchors, torch.zeros_like(anchors)), keep


def block_tokens(input_ids: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor, block_size: int,
                 mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block token ids [B, N*bs], positions [B, N*bs]): each block is its anchor's token then mask
    tokens, at positions anchor .. anchor + bs - 1."""
    B, N = anchors.shape
    ids = torch.full((B, N, block_size), mask_token_id, dtype=torch.long, device=input_ids.device)
    first = torch.gather(input_ids, 1, anchors)  # [B, N]
    ids[:, :, 0] = torch.where(keep, first, torch.full_like(first, mask_token_id))
    pos = anchors[:, :, None] + torch.arange(block_size, device=anchors.device)  # [B, N, bs]
    return ids.reshape(B, N * block_size), pos.reshape(B, N * block_size)  # [B, N*bs] each


def label_indices(anchors: torch.Tensor, keep: torch.Tensor, loss_mask: torch.Tensor, block_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(signal index [B, N, J] = a + j - 1 for j = 1..bs-1, counted [B, N, J] bool)."""
    B, T = loss_mask.shape
    j = torch.arange(1, block_size, device=anchors.device)  # [J]
    token = anchors[:, :, None] + j  # [B, N, J] index of the predicted token
    inside = token < T
    safe = token.clamp(max=T - 1)
    supervised = torch.gather(loss_mask.bool()[:, None, :].expand(-1, anchors.shape[1], -1), 2, safe)  # [B, N, J]
    return safe - 1, inside & supervised & keep[:, :, None]


@dataclass
class BlockSignal:
    """Where a batch's blocks stand and what the target says at their counted pairs."""

    anchors: torch.Tensor  # [B, N]
    keep: torch.Tensor  # [B, N] bool
    counted: torch.Tensor  # [B, N, J] bool
    probs: torch.Tensor  # [P, V] the target's distribution at each counted pair (row-major order), or [P, K];
    # a pruned draft vocabulary: [P, Vd] over draft ids, renormalised there (the pairs whose argmax lies outside dropped)
    argmax: torch.Tensor  # [P] its argmax (target ids)
    label_ids: torch.Tensor | None = None  # [P, K] target ids of ``probs``' columns (stored top-K); None: dense

    def cross_entropy(self, start: int, logits: torch.Tensor) -> torch.Tensor:
        """-sum_v p_target log q_draft at pairs start .. start + n of the draft's ``logits`` [n, V] -> [n]."""
        n = logits.shape[0]
        logq = F.log_softmax(logits, dim=-1)  # [n, V]
        p = self.probs[start:start + n]
        if self.label_ids is not None:  # a top-K: K columns instead of V, most of them zero anyway
            logq = logq.gather(1, self.label_ids[start:start + n])  # [n, K]
        return -(p * logq).sum(-1)

    def per_position(self) -> list[int]:
        """Counted pairs per drafted position (what the loss of each position divides by)."""
        return [int(c) for c in self.counted.sum(dim=(0, 1))]


@torch.no_grad()
def block_signal(loss_mask: torch.Tensor, *, anchors_per_row: int, block_size: int,
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 last_hidden: torch.Tensor | None = None, topk: tuple[torch.Tensor, torch.Tensor] | None = None,
                 vocab_size: int, generator: torch.Generator | None = None,
                 vocab: tuple[torch.Tensor, torch.Tensor] | None = None) -> BlockSignal:
    """Sample the anchors and read the target's signal at every counted pair: from ``head`` on the
    stored boundary-L ``last_hidden`` [B, T, H], or from the stored top-K ``topk`` = (logprobs, ids),
    [B, T, K] each. ``vocab`` = (draft ids' target ids [Vd], t2d [V]): a pruned draft vocabulary, whose
    signal is read over draft ids as EAGLE-3's is (a pair whose target argmax lies outside is not counted)."""
    anchors, keep = sample_anchors(loss_mask, anchors_per_row, generator)
    index, counted = label_indices(anchors, keep, loss_mask, block_size)
    rows = torch.arange(loss_mask.shape[0], device=loss_mask.device)[:, None, None].expand_as(index)[counted]  # [P]
    cols = index[counted]  # [P]
    if vocab is not None:
        draft_ids, t2d = vocab
        if topk is not None:
            lp, ids = topk[0][rows, cols][None], topk[1][rows, cols][None]  # [1, P, K]
            sig = topk_signal(lp, ids, draft_ids, t2d, torch.ones(1, len(rows), dtype=torch.bool, device=lp.device))
        else:
            sig = target_signal(head, last_hidden[rows, cols][None], draft_ids, t2d)  # [1, P, Vd]
        inside = sig.in_vocab[0]  # [P]
        was, counted = counted, counted.clone()
        counted[was] = inside  # [B, N, J]
        return BlockSignal(anchors=anchors, keep=keep, counted=counted, probs=sig.probs[0][inside],
                           argmax=sig.argmax[0][inside])
    if topk is not None:  # the renormalised top-K over the whole vocabulary, kept as K columns
        lp, ids = topk[0][rows, cols].float(), topk[1][rows, cols].long()  # [P, K]
        argmax = ids.gather(1, lp.argmax(-1, keepdim=True)).squeeze(1)  # [P]
        return BlockSignal(anchors=anchors, keep=keep, counted=counted, probs=torch.softmax(lp, dim=-1),
                           argmax=argmax, label_ids=ids)
    everything = torch.arange(vocab_size, device=loss_mask.device)
    all_in = torch.ones(vocab_size, dtype=torch.bool, device=loss_mask.device)
    sig = target_signal(head, last_hidden[rows, cols][None], everything, all_in)  # [1, P, V]
    return BlockSignal(anchors=anchors, keep=keep, counted=counted, probs=sig.probs[0], argmax=sig.argmax[0])


def block_loss(draft: DFlashDraft, embed: Callable[[torch.Tensor], torch.Tensor],
               lm_head: Callable[[torch.Tensor], torch.Tensor], input_ids: torch.Tensor, aux_hidden: torch.Tensor,
               signal: BlockSignal, *, gamma: float, normalizers: list[int] | None = None
               ) -> tuple[torch.Tensor, list[StepCounts]]:
    """The blocks through the draft; (weighted loss, counts per drafted position).

    input_ids [B, T]; aux_hidden [B, T, k*Ht]; ``embed`` the target's, ``lm_head`` the draft's rows of the
    target's head (``draft_head``), both frozen.
    Loss: sum_j w_j * (sum over counted pairs at j of -sum_v p_target log q_draft) / N_j, N_j this
    batch's count at j or ``normalizers[j]`` (a part of a larger step, as ``ttt_unroll``).
    Counts: ``correct`` when the draft's argmax is the target's; ``cond_*`` among pairs whose earlier
    positions in the block were all right (what acceptance needs).
    """
    cfg = draft.config
    bs, J = cfg.block_size, cfg.block_size - 1
    B, T = input_ids.shape
    d2t = draft.draft_to_target  # [Vd] target id of each column of ``lm_head``'s logits
    N = signal.anchors.shape[1]
    counts = [StepCounts() for _ in range(J)]
    if N == 0 or not bool(signal.counted.any()):
        return aux_hidden.new_zeros(()) * sum(p.sum() for p in draft.parameters()), counts
    ids, block_pos = block_tokens(input_ids, signal.anchors, signal.keep, bs, cfg.mask_token_id)
    with torch.no_grad():
        block_emb = embed(ids).to(aux_hidden.dtype)  # [B, N*bs, H]
    ctx = draft.fuse(aux_hidden)  # [B, T, H]
    ctx_pos = torch.arange(T, device=ctx.device).expand(B, T)  # [B, T]
    mask = block_attention_mask(signal.anchors, signal.keep, T, bs)  # [B, 1, N*bs, T+N*bs]
    out = draft.forward_blocks(block_emb, block_pos, draft.context_kv(ctx, ctx_pos), mask)  # [B, N*bs, H]
    drafted = out.view(B, N, bs, -1)[:, :, 1:]  # [B, N, J, H]
    hidden = drafted[signal.counted]  # [P, H]
    position = torch.arange(J, device=ctx.device).expand_as(signal.counted)[signal.counted]  # [P]
    weights = torch.tensor(position_weights(bs, gamma), device=ctx.device)  # [J]
    per_pos = signal.per_position() if normalizers is None else normalizers
    scale = weights / torch.tensor(per_pos, device=ctx.device).clamp(min=1)  # [J]
    total = ctx.new_zeros(())
    ce_all, right_all = [], []
    for s in range(0, hidden.shape[0], HEAD_CHUNK):
        logits = lm_head(hidden[s:s + HEAD_CHUNK]).float()  # [n, Vd] (Vd = V unless the vocabulary is pruned)
        ce = signal.cross_entropy(s, logits)  # [n]
        total = total + (ce * scale[position[s:s + HEAD_CHUNK]]).sum()
        ce_all.append(ce.detach())
        right_all.append(d2t[logits.detach().argmax(-1)] == signal.argmax[s:s + HEAD_CHUNK])
    with torch.no_grad():
        ce, right = torch.cat(ce_all), torch.cat(right_all)  # [P]
        grid = torch.zeros_like(signal.counted)  # [B, N, J] right, False where not counted
        grid[signal.counted] = right
        # A pair counts as "all earlier right" when every earlier position of its block was counted
        # and right (an uncounted earlier position breaks the chain, as a rejected token would).
        before = torch.cumprod(torch.cat([torch.ones_like(grid[..., :1]), grid[..., :-1]], dim=-1).long(), dim=-1).bool()
        cond = before[signal.counted]  # [P]
        for j in range(J):
            at = position == j
            counts[j] = StepCounts(loss_sum=float(ce[at].sum()), valid=int(at.sum()), correct=int(right[at].sum()),
                                   cond_valid=int((cond & at).sum()), cond_correct=int((cond & at & right).sum()))
    return total, counts
