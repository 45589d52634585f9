"""What the doctor measures: held-out sequences captured at every candidate boundary, and
the draft's accuracy in isolation for any layout fed exactly as in training.

Both families through one route (``_judged``): an EAGLE-3 draft's TTT unroll, a DFlash draft's
block anchored at every position (``model/dflash_blocks.py``), whose drafted position j + 1 is
"step j" here (acc@0 = the block's first drafted token).

Shapes: B batch, T tokens, H target hidden size, k aux boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from eaglewire.model.boundary_capture import capture
from eaglewire.data.prepare import batches_by_tokens
from eaglewire.data.sources import pad_right
from eaglewire.acceptance.replay import RoundAgreement, compare_rounds
from eaglewire.model.dflash_blocks import block_judgements, draft_head, is_block_draft, mask_embedding
from eaglewire.model.draft import Eagle3Draft
from eaglewire.model.target import Target
from eaglewire.model.ttt import (StepCounts, TargetSignal, counted_positions, shift_left, target_signal, ttt_unroll,
                           vocab_coverage)


@dataclass
class Sequence:
    id: str
    input_ids: torch.Tensor  # [T] long
    loss_mask: torch.Tensor  # [T] bool
    stored_aux: torch.Tensor | None = None  # [T, k*H] captured at training time (shards only)
    stored_last: torch.Tensor | None = None  # [T, H]

    @property
    def prompt_ids(self) -> list[int]:
        """The tokens before the first reply token: the prompt that produced the reply."""
        first = int(self.loss_mask.int().argmax()) if bool(self.loss_mask.any()) else len(self.input_ids)
        return self.input_ids[:first].tolist()


@dataclass
class EvalBatch:
    """One batch, captured once at every boundary any check needs."""

    input_ids: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] bool
    states: dict[int, torch.Tensor]  # boundary -> [B, T, H]
    emb: torch.Tensor  # [B, T, H] target embeddings of input_ids
    signal: TargetSignal  # the target's next-token distribution (draft vocab)
    stored_aux: torch.Tensor | None = None  # [B, T, k*H]
    stored_last: torch.Tensor | None = None  # [B, T, H]
    lengths: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # each row's Sequence.id (rows are sorted by length)
    mask_emb: torch.Tensor | None = None  # [H] a DFlash draft's mask token, the target's embedding of it
    lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None  # a DFlash draft's head: the target's lm_head


def block_parts(target: Target, draft) -> dict:
    """What a DFlash draft drafts with besides the states (the target's mask embedding and lm_head), as
    EvalBatch fields; nothing for an EAGLE-3 draft."""
    if not is_block_draft(draft):
        return {}
    return {"mask_emb": mask_embedding(draft, target.embed_tokens, target.device), "lm_head": draft_head(target, draft)}


def capture_batches(target: Target, draft: Eagle3Draft, sequences: list[Sequence], boundaries: list[int],
                    batch_tokens: int = 2048) -> list[EvalBatch]:
    """Run the target once per batch, keeping every boundary in ``boundaries``."""
    boundaries = sorted(set(boundaries) - {target.num_layers})  # boundary L comes with every capture
    H = target.hidden_size
    out = []
    for batch in batches_by_tokens(sequences, batch_tokens):
        T = max(len(s.input_ids) for s in batch)
        dev = target.device  # a batch lives where the target computes: every check reads it there

        def padded(rows: list[torch.Tensor]) -> torch.Tensor:
            return pad_right(rows, T).to(dev)  # [B, T, ...]

        ids = padded([s.input_ids for s in batch])  # [B, T]
        got = capture(target, ids, boundaries)  # right padding: causal attention needs no mask
        chunks = got.aux_hidden.float().split(H, dim=-1)  # k x [B, T, H]
        with torch.no_grad():
            emb = target.embed_tokens(ids).float()
        signal = target_signal(target.head, got.last_hidden, draft.draft_to_target, draft.t2d)
        stored = [s.stored_aux for s in batch]
        states = {b: c for b, c in zip(boundaries, chunks)}
        states[target.num_layers] = got.last_hidden.float()
        out.append(EvalBatch(
            input_ids=ids, loss_mask=padded([s.loss_mask for s in batch]), states=states, emb=emb, signal=signal,
            stored_aux=padded([x.float() for x in stored]) if stored[0] is not None else None,
            stored_last=(padded([s.stored_last.float() for s in batch])
                         if stored[0] is not None and batch[0].stored_last is not None else None),  # top-K shards: none
            lengths=[len(s.input_ids) for s in batch], names=[s.id for s in batch], **block_parts(target, draft)))
    return out


@torch.no_grad()
def isolation_accuracy(draft: Eagle3Draft, batches: list[EvalBatch], layout: list[int], *, steps: int,
                       shift: int = 0) -> list[StepCounts]:
    """Per-step counts of the draft fed ``layout``'s states exactly as in training (TTT unroll).

    ``shift`` feeds the states of position t + shift at t (an alignment probe).
    """
    return _unrolled_counts(draft, batches, steps, lambda b: shift_left(
        torch.cat([b.states[x] for x in layout], dim=-1), shift))  # [B, T, k*H]


@torch.no_grad()
def stored_accuracy(draft: Eagle3Draft, batches: list[EvalBatch], *, steps: int) -> list[StepCounts]:
    """The same measurement on the states stored at training time (shards)."""
    return _unrolled_counts(draft, batches, steps, lambda b: b.stored_aux)


def _unrolled_counts(draft: Eagle3Draft, batches: list[EvalBatch], steps: int, aux_of) -> list[StepCounts]:
    total = None
    for b in batches:
        counts = _judged(draft, b, aux_of(b), steps)[0]
        total = total or [StepCounts() for _ in counts]
        for t, c in zip(total, counts):
            t.add(c)
    return total or [StepCounts() for _ in range(steps)]


def _judged(draft, batch: EvalBatch, aux: torch.Tensor, steps: int,
            right: torch.Tensor | None = None) -> tuple[list[StepCounts], torch.Tensor | None]:
    """The draft fed ``aux`` [B, T, k*H] at ``batch``'s tokens, judged against its target signal, by
    family: (counts per step, for a DFlash draft per drafted position up to block_size - 1; right
    [B, S, T] as ``step_rightness`` gives it, where ``right`` is asked for)."""
    if is_block_draft(draft):
        if batch.mask_emb is None or batch.lm_head is None:
            raise ValueError("a DFlash draft is measured on batches built for it: pass the draft to "
                             "capture_batches / stored_batches")
        counts, by_anchor = block_judgements(draft, batch.lm_head, batch.emb, batch.mask_emb, aux, batch.loss_mask,
                                             batch.signal, positions=steps)  # by_anchor [B, T, S]
        if right is not None:  # the block anchored at t + 1 is step s's column t
            right[:, :len(counts), :-1] = by_anchor[:, 1:].transpose(1, 2)
        return counts, right

    def observe(j, logits, right_sel, cond):
        valid = counted_positions(batch.loss_mask, batch.signal.in_vocab, j)  # [B, n_pos]
        right[:, j, :valid.shape[1]][valid.cpu()] = right_sel.cpu()

    _, counts = ttt_unroll(draft, batch.emb, aux, batch.loss_mask, batch.signal, ttt_steps=steps,
                           observe=None if right is None else observe)
    return counts, right


@torch.no_grad()
def step_rightness(draft: Eagle3Draft, batch: EvalBatch, layout: list[int], *, steps: int) -> torch.Tensor:
    """[B, S, T] bool: step j at position t predicts the target's argmax, fed ``layout``'s states
    exactly as in training (False where the step does not count: prompt, padding, a token
    outside the draft vocabulary). A DFlash draft: the block anchored at t + 1, its drafted
    position j + 1 (S at most block_size - 1)."""
    aux = torch.cat([batch.states[x] for x in layout], dim=-1)  # [B, T, k*H]
    B, T = batch.loss_mask.shape
    if is_block_draft(draft):
        steps = min(steps, draft.config.block_size - 1)
    return _judged(draft, batch, aux, steps, right=torch.zeros(B, steps, T, dtype=torch.bool))[1]


def engine_agreement(decoder, draft: Eagle3Draft, layout: list[int], prompt: list[int], *, max_new_tokens: int,
                     stop_token_ids: set[int] | None = None) -> RoundAgreement:
    """Run ``decoder``'s greedy chain on ``prompt`` and replay its rounds on the training-time
    unroll of the text it produced, fed the declared ``layout`` (not the decoder's own reading
    of it, which a miswiring would share)."""
    if decoder.spec.topk != 1:
        raise ValueError("the replay follows a chain: build the decoder with topk 1")
    out, stats = decoder.generate(prompt, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
    text = torch.tensor(prompt + out)  # [T]
    own = Sequence("engine output", text, torch.arange(len(text)) >= len(prompt))
    batch = capture_batches(decoder.target, draft, [own], layout)[0]
    right = step_rightness(draft, batch, layout, steps=decoder.spec.num_steps)[0]  # [S, T]
    return compare_rounds(right, len(prompt), stats.accept_lengths)


@dataclass
class Drift:
    boundary: int
    cosine: float  # mean over real tokens of cos(stored, now)
    relative_error: float  # ||stored - now|| / ||now|| over real tokens


@torch.no_grad()
def capture_drift(batches: list[EvalBatch], layout: list[int], last_boundary: int) -> list[Drift]:
    """Stored (training-time) states against states captured now, per boundary."""
    out = []
    with_last = all(b.stored_last is not None for b in batches)  # shards with top-K labels keep no last state
    for i, boundary in enumerate(layout + ([last_boundary] if with_last else [])):
        cos_sum, n, diff2, ref2 = 0.0, 0, 0.0, 0.0
        for b in batches:
            if b.stored_aux is None:
                return []
            H = b.states[boundary].shape[-1]
            stored = b.stored_last if i == len(layout) else b.stored_aux[..., i * H:(i + 1) * H]  # [B, T, H]
            real = pad_right([torch.ones(n_, dtype=torch.bool) for n_ in b.lengths], stored.shape[1])  # [B, T]
            now, then = b.states[boundary][real], stored[real]  # [N, H]
            cos_sum += float(torch.nn.functional.cosine_similarity(now, then, dim=-1).sum())
            n += now.shape[0]
            diff2 += float((then - now).pow(2).sum())
            ref2 += float(now.pow(2).sum())
        out.append(Drift(boundary, cos_sum / max(n, 1), (diff2 / max(ref2, 1e-30)) ** 0.5))
    return out


def coverage(batches: list[EvalBatch]) -> tuple[int, int]:
    """(target next tokens inside the draft vocab, all counted) over reply positions."""
    pairs = [vocab_coverage(b.signal.in_vocab, b.loss_mask) for b in batches]
    return sum(i for i, _ in pairs), sum(n for _, n in pairs)
