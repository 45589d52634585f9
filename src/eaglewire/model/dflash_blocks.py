"""DFlash blocks anchored at every position of a text, from one capture (pure): the block draft's
counterpart of the TTT unroll, which the doctor's measured checks and the acceptance traces read.

Shapes: B batch, T tokens, n anchors of a chunk, bs block length, J = bs - 1 drafted positions,
H hidden, k aux boundaries, V target vocabulary, P counted (anchor, position) pairs.

Alignment (as decoding and training, ``model/dflash.py``): the block anchored at a holds x_a and
bs - 1 mask tokens at positions a .. a+bs-1 and sees the fused states of x_0 .. x_{a-1}; drafted
position j = 1 .. J predicts x_{a+j}, judged against the target's signal at a+j-1. Training's pieces
do the work (``block_attention_mask``, ``forward_blocks``), with an anchor at every position and
the anchors taken a chunk at a time, so the block queries held at once stay bounded.

In the TTT unroll's terms (what ``acceptance/`` and ``replay.py`` index by): the block anchored at
a is the round whose last verified position is t = a - 1, and drafted position j is step j - 1.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from eaglewire.model.dflash import DFlashDraft, block_attention_mask
from eaglewire.model.ttt import StepCounts, TargetSignal

CHUNK_QUERIES = 1024  # block queries (anchors x block length) through the draft at once
HEAD_CHUNK = 512  # drafted rows through the target's lm_head at once ([n, V] logits)


def is_block_draft(draft) -> bool:
    """Whether ``draft`` drafts a whole block in one pass (the DFlash family)."""
    return getattr(draft, "family", None) == DFlashDraft.family


def head_rows(target, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [R, H], bias [R] or None) of the target's lm_head, frozen, at ``rows`` (None: all V)."""
    lm_head = target.model.get_output_embeddings()
    # frozen: training computes no gradient for the target's [V, H] weight
    weight, bias = lm_head.weight.detach(), getattr(lm_head, "bias", None)
    bias = None if bias is None else bias.detach()
    if rows is None:
        return weight, bias
    rows = rows.to(weight.device)
    return weight[rows], None if bias is None else bias[rows]


def target_lm_head(target, rows: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The target's lm_head alone, as a DFlash draft reads its normed output: [N, H] -> [N, V] fp32
    (not ``Target.head``, which would apply the target's final norm again); ``rows``: only those [R]."""
    weight, bias = head_rows(target, rows)
    return lambda h: F.linear(h.to(weight.dtype), weight, bias).float()


def draft_head(target, draft: DFlashDraft) -> Callable[[torch.Tensor], torch.Tensor]:
    """The rows of the target's lm_head the draft predicts over: [N, H] -> [N, Vd] fp32 (draft ids; the whole
    head, target ids, for a whole-vocabulary draft). The loss and the doctor's judgements read these logits."""
    return target_lm_head(target, draft.draft_to_target if draft.config.pruned else None)


def to_target_vocab(logits: torch.Tensor, draft: DFlashDraft) -> torch.Tensor:
    """[N, Vd] over draft ids -> [N, V] over target ids, -inf outside a pruned draft vocabulary (unchanged for a
    whole-vocabulary draft), as vLLM's qwen3_dflash.py compute_logits scatters them."""
    if not draft.config.pruned:
        return logits
    out = logits.new_full((logits.shape[0], draft.config.vocab_size), float("-inf"))  # [N, V]
    out[:, draft.draft_to_target.to(logits.device)] = logits
    return out


def draft_lm_head(target, draft: DFlashDraft) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the draft predicts, over the target's vocabulary: [N, H] -> [N, V] fp32 logits, -inf outside the
    draft vocabulary (only its Vd rows of the head are computed). Decoding's tracing and timing read these."""
    head = draft_head(target, draft)
    return lambda h: to_target_vocab(head(h), draft)


def mask_embedding(draft: DFlashDraft, embed: Callable[[torch.Tensor], torch.Tensor], device) -> torch.Tensor:
    """[H] the target's embedding of the draft's mask token."""
    ids = torch.tensor([draft.config.mask_token_id], device=device)
    with torch.no_grad():
        return embed(ids)[0].float()


@torch.no_grad()
def anchored_blocks(draft: DFlashDraft, emb: torch.Tensor, mask_emb: torch.Tensor, aux_hidden: torch.Tensor, *,
                    block_len: int | None = None, chunk_queries: int = CHUNK_QUERIES
                    ) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (first anchor, drafted hidden [B, n, J, H]) for blocks anchored at every position 0 .. T-1,
    n anchors at a time.

    emb [B, T, H] target embeddings of the text; mask_emb [H]; aux_hidden [B, T, k*H] the states
    of the text, captured once. ``block_len`` (default the trained block size): the tokens of a
    block, anchor included (llama.cpp runs n_max + 1).
    """
    B, T, H = emb.shape
    bs = block_len or draft.config.block_size
    if bs < 2:
        raise ValueError(f"block_len must be >= 2 (the anchor and one drafted position), got {bs}")
    dtype = next(draft.parameters()).dtype
    emb, mask_emb = emb.to(dtype), mask_emb.to(dtype)
    ctx = draft.fuse(aux_hidden.to(dtype))  # [B, T, H]
    ctx_kv = draft.context_kv(ctx, torch.arange(T, device=ctx.device).expand(B, T))
    per = max(chunk_queries // bs, 1)
    for start in range(0, T, per):
        n = min(per, T - start)
        anchors = torch.arange(start, start + n, device=ctx.device).expand(B, n)  # [B, n]
        keep = torch.ones(B, n, dtype=torch.bool, device=ctx.device)
        block = torch.cat([emb[:, start:start + n, None], mask_emb.expand(B, n, bs - 1, H)], dim=2)  # [B, n, bs, H]
        pos = (anchors[:, :, None] + torch.arange(bs, device=ctx.device)).reshape(B, n * bs)  # [B, n*bs]
        mask = block_attention_mask(anchors, keep, T, bs)  # [B, 1, n*bs, T + n*bs]
        out = draft.forward_blocks(block.reshape(B, n * bs, H), pos, ctx_kv, mask)  # [B, n*bs, H]
        yield start, out.view(B, n, bs, H)[:, :, 1:]  # [B, n, J, H]


def drafted_index(start: int, n: int, J: int, T: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of the predicted token [n, J] clamped into the text, inside the text [n, J] bool) for the
    anchors start .. start+n-1 and drafted positions 1 .. J."""
    token = torch.arange(start, start + n, device=device)[:, None] + torch.arange(1, J + 1, device=device)  # [n, J]
    return token.clamp(max=T - 1), token < T


@torch.no_grad()
def block_judgements(draft: DFlashDraft, lm_head: Callable[[torch.Tensor], torch.Tensor], emb: torch.Tensor,
                     mask_emb: torch.Tensor, aux_hidden: torch.Tensor, loss_mask: torch.Tensor, signal: TargetSignal,
                     *, positions: int | None = None) -> tuple[list[StepCounts], torch.Tensor]:
    """The draft judged at every anchor against the target: (counts per drafted position, as
    ``ttt_unroll``'s per step, right [B, T, J] by anchor).

    Drafted position j of the block anchored at a counts when x_{a+j} is in the text and under the
    loss mask and the target's argmax at a+j-1 lies in the draft vocabulary (``signal.in_vocab``);
    ``cond_*`` among those whose earlier positions in the block were all counted and right (an
    uncounted one breaks the chain, as in training's counts). ``positions``: judge only the first
    ones (the block is computed whole all the same). ``lm_head``: the draft's rows of the target's head
    (``draft_head``: [m, H] -> [m, Vd] fp32 logits over draft ids).
    """
    B, T, _ = emb.shape
    J = min(positions or draft.config.block_size - 1, draft.config.block_size - 1)
    counts = [StepCounts() for _ in range(J)]
    right_all = torch.zeros(B, T, J, dtype=torch.bool)
    d2t = draft.draft_to_target
    rows = torch.arange(B, device=emb.device)[:, None, None]  # [B, 1, 1]
    for start, hidden in anchored_blocks(draft, emb, mask_emb, aux_hidden):
        hidden = hidden[:, :, :J]  # [B, n, J, H]
        n = hidden.shape[1]
        token, inside = drafted_index(start, n, J, T, emb.device)  # [n, J]
        at = token - 1  # [n, J] index of the judging signal
        counted = inside & loss_mask.bool()[:, token] & signal.in_vocab[:, at]  # [B, n, J]
        sel = hidden[counted]  # [P, H]
        r, a = rows.expand_as(counted)[counted], at.expand_as(counted)[counted]  # [P] each
        right, ce = torch.zeros(len(sel), dtype=torch.bool, device=emb.device), torch.zeros(len(sel), device=emb.device)
        for s in range(0, len(sel), HEAD_CHUNK):
            logits = lm_head(sel[s:s + HEAD_CHUNK])  # [m, Vd] fp32
            right[s:s + HEAD_CHUNK] = d2t[logits.argmax(-1)] == signal.argmax[r[s:s + HEAD_CHUNK], a[s:s + HEAD_CHUNK]]
            p = signal.probs[r[s:s + HEAD_CHUNK], a[s:s + HEAD_CHUNK]]  # [m, Vd]
            ce[s:s + HEAD_CHUNK] = -(p * F.log_softmax(logits, dim=-1)).sum(-1)
        grid = torch.zeros_like(counted)  # [B, n, J]
        grid[counted] = right
        before = torch.cumprod(torch.cat([torch.ones_like(grid[..., :1]), grid[..., :-1]], dim=-1).long(),
                               dim=-1).bool()  # [B, n, J] every earlier position counted and right
        position = torch.arange(J, device=emb.device).expand_as(counted)[counted]  # [P]
        cond = before[counted]  # [P]
        for j in range(J):
            here = position == j
            counts[j].add(StepCounts(loss_sum=float(ce[here].sum()), valid=int(here.sum()),
                                     correct=int(right[here].sum()), cond_valid=int((cond & here).sum()),
                                     cond_correct=int((cond & here & right).sum())))
        right_all[:, start:start + n] = grid.cpu()
    return counts, right_all
