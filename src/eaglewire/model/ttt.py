"""Training-time test (TTT): the draft unrolled over K steps, its loss and accuracy counts.

Shapes: B batch, T tokens, H hidden, V target vocab, Vd draft vocab, K = ttt_steps.

Alignment (index t of a sequence x_0 .. x_{T-1}):
- step 0 at t reads the fused target state of x_t and the embedding of x_{t+1} and
  predicts the target's distribution at t+1, i.e. over x_{t+2};
- step j at t reads step j-1's pre-norm output at t and the embedding of x_{t+1+j}
  (position t + j, as in decoding) and predicts the target's distribution at t+1+j.
A prediction counts when the predicted token x_{t+2+j} is under the loss mask and the
target's argmax at t+1+j lies in the draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from eaglewire.model.draft import Eagle3Draft


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T, ...] -> [B, T, ...] with ``out[:, t] = x[:, t + n]``, zeros where t + n is out of range
    (n < 0 shifts right: the doctor's alignment probe)."""
    if n == 0:
        return x
    if n < 0:
        pad = torch.zeros_like(x[:, :-n])
        return torch.cat([pad, x[:, :n]], dim=1)  # [B, T, ...]
    pad = torch.zeros_like(x[:, :n])
    return torch.cat([x[:, n:], pad], dim=1)  # [B, T, ...]


@dataclass
class TargetSignal:
    """What the target says at every index, restricted to the draft vocabulary."""

    probs: torch.Tensor  # [B, T, Vd] target distribution over draft ids
    argmax: torch.Tensor  # [B, T] target argmax (target ids)
    in_vocab: torch.Tensor  # [B, T] bool: argmax is in the draft vocabulary


def signal_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] loss mask -> [B, T] bool: the indices whose target signal any TTT step reads
    (the signal at q judges the prediction of x_{q+1}, which must be under the loss mask)."""
    needed = torch.zeros_like(loss_mask, dtype=torch.bool)
    needed[:, :-1] = loss_mask[:, 1:].bool()
    return needed


def vocab_coverage(in_vocab: torch.Tensor, loss_mask: torch.Tensor) -> tuple[int, int]:
    """(target argmaxes inside the draft vocab, all counted) over positions whose next token
    is under the loss mask. in_vocab / loss_mask [B, T]."""
    counted = signal_positions(loss_mask)  # [B, T]
    return int((in_vocab & counted).sum()), int(counted.sum())


@torch.no_grad()
def target_signal(head, last_hidden: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor,
                  needed: torch.Tensor | None = None, chunk_tokens: int = 1024) -> TargetSignal:
    """Apply the target head to boundary L ``last_hidden`` [B, T, H] in token chunks.

    ``head`` maps [N, H] -> [N, V]; ``draft_ids`` [Vd] target id of every draft id. With
    ``needed`` [B, T] bool (``signal_positions``) the head runs only there: elsewhere probs are
    zero and ``in_vocab`` is False (padding and prompt tokens cost nothing).
    """
    B, T, H = last_hidden.shape
    flat = last_hidden.reshape(B * T, H)  # [B*T, H]
    rows = (torch.arange(B * T, device=flat.device) if needed is None
            else needed.reshape(B * T).nonzero().squeeze(1))  # [n] indices into B*T
    probs = torch.zeros(B * T, len(draft_ids), dtype=torch.float32, device=flat.device)  # [B*T, Vd]
    argmax = torch.zeros(B * T, dtype=torch.long, device=flat.device)  # [B*T]
    for start in range(0, len(rows), chunk_tokens):
        sel = rows[start:start + chunk_tokens]
        logits = head(flat[sel]).float()  # [n, V]
        argmax[sel] = logits.argmax(-1)
        probs[sel] = torch.softmax(logits[:, draft_ids], dim=-1)  # [n, Vd]
    in_vocab = t2d[argmax]  # [B*T]
    if needed is not None:
        in_vocab &= needed.reshape(B * T)
    return TargetSignal(probs=probs.view(B, T, -1), argmax=argmax.view(B, T), in_vocab=in_vocab.view(B, T))


@torch.no_grad()
def topk_signal(logprobs: torch.Tensor, ids: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor,
                needed: torch.Tensor) -> TargetSignal:
    """The target's signal from its stored top-K: log-probabilities and target ids, [B, T, K] each.

    As ``target_signal`` does with the full distribution: ``probs`` is the top-K renormalised
    over the ids inside the draft vocabulary (the mass outside it dropped), ``argmax`` is the
    top-1 id and ``in_vocab`` whether it lies in the draft vocabulary, so a position whose top-1 is
    outside is not counted. With K = V this equals ``target_signal`` on the state the top-K came
    from. Only ``needed`` [B, T] positions are read; elsewhere probs are zero and in_vocab False.
    """
    B, T, K = ids.shape
    rows = needed.reshape(B * T).nonzero().squeeze(1)  # [n] indices into B*T
    lp = logprobs.reshape(B * T, K)[rows].float()  # [n, K]
    top = ids.reshape(B * T, K)[rows].long()  # [n, K] target ids
    argmax = torch.zeros(B * T, dtype=torch.long, device=ids.device)  # [B*T]
    argmax[rows] = top.gather(1, lp.argmax(-1, keepdim=True)).squeeze(1)
    inside = t2d[top]  # [n, K]
    p = torch.softmax(lp.masked_fill(~inside, float("-inf")), dim=-1)  # [n, K]
    p = torch.where(inside, p, torch.zeros_like(p))  # a row with no id inside: all zero (and not counted)
    to_draft = (torch.cumsum(t2d.long(), 0) - 1).clamp(min=0)  # [V] draft id of an id inside
    probs = torch.zeros(B * T, len(draft_ids), dtype=torch.float32, device=ids.device)  # [B*T, Vd]
    probs[rows] = probs.new_zeros(len(rows), len(draft_ids)).scatter_add_(1, to_draft[top], p)
    in_vocab = t2d[argmax] & needed.reshape(B * T)  # [B*T]
    return TargetSignal(probs=probs.view(B, T, -1), argmax=argmax.view(B, T), in_vocab=in_vocab.view(B, T))


@dataclass
class StepCounts:
    """Sums over a batch for one TTT step (add them across batches, divide at the end)."""

    loss_sum: float = 0.0
    valid: int = 0
    correct: int = 0
    cond_valid: int = 0  # valid positions where every earlier step was right
    cond_correct: int = 0

    def add(self, other: StepCounts) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_floats(self) -> list[float]:
        return [float(getattr(self, name)) for name in self.__dataclass_fields__]

    @classmethod
    def from_floats(cls, values: list[float]) -> StepCounts:
        """The inverse of ``as_floats`` (counts back to int), e.g. after a sum over ranks."""
        return cls(**{name: v if name == "loss_sum" else int(round(v))
                      for name, v in zip(cls.__dataclass_fields__, values)})

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.valid, 1)

    @property
    def acc(self) -> float:
        return self.correct / max(self.valid, 1)

    @property
    def cond_acc(self) -> float:
        return self.cond_correct / max(self.cond_valid, 1)


def counted_positions(loss_mask: torch.Tensor, in_vocab: torch.Tensor, j: int) -> torch.Tensor:
    """[B, T] mask and in-vocab flags -> [B, max(T-1-j, 0)] bool: step j at t counts when
    x_{t+2+j} is under the loss mask and the target's argmax at t+1+j is in the draft vocab."""
    B, T = loss_mask.shape
    n_pos = max(T - 1 - j, 0)
    valid = torch.zeros(B, n_pos, dtype=torch.bool, device=loss_mask.device)
    if n_pos > 1:
        valid[:, :-1] = loss_mask[:, 2 + j:].bool() & in_vocab[:, 1 + j:T - 1]
    return valid


def counted_per_step(loss_mask: torch.Tensor, in_vocab: torch.Tensor, ttt_steps: int) -> list[int]:
    """How many positions each TTT step counts in a batch (what ``ttt_unroll`` divides by)."""
    return [int(counted_positions(loss_mask, in_vocab, j).sum()) for j in range(ttt_steps)]


def ttt_hidden_states(draft: Eagle3Draft, emb: torch.Tensor, aux_hidden: torch.Tensor,
                      ttt_steps: int) -> Iterator[tuple[int, torch.Tensor]]:
    """The unroll's draft side: (j, step j's pre-norm output [B, T, H]) for j < ``ttt_steps``, each step fed the
    previous one's output and the embeddings shifted by 1 + j (emb [B, T, H]; aux_hidden [B, T, k*Ht])."""
    B, T, _ = emb.shape
    position_ids = torch.arange(T, device=emb.device).expand(B, T)  # [B, T]
    hidden = draft.fuse(aux_hidden.to(emb.dtype))  # [B, T, H]
    cache: list = []
    for j in range(ttt_steps):
        hidden = draft.forward_ttt(shift_left(emb, 1 + j), hidden, position_ids + j, cache)
        yield j, hidden


def ttt_unroll(draft: Eagle3Draft, emb: torch.Tensor, aux_hidden: torch.Tensor, loss_mask: torch.Tensor,
               signal: TargetSignal, *, ttt_steps: int, decay: float = 0.8,
               normalizers: list[int] | None = None,
               observe: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
               ) -> tuple[torch.Tensor, list[StepCounts]]:
    """Unroll the draft ``ttt_steps`` times; return the weighted loss and per-step counts.

    emb [B, T, H] target embeddings of input_ids; aux_hidden [B, T, k*Ht]; loss_mask [B, T].
    Loss: sum_j decay**j * (sum over valid positions of -sum_v p_target log q_draft) / N_j, where
    N_j is this batch's count of valid positions, or ``normalizers[j]`` when the batch is one part
    of a larger optimizer step (micro-batches, ranks): then the parts' losses add up to the loss
    of the whole step. ``observe(j, logits [N, Vd], right [N], cond [N])``, if given, sees each
    step's draft logits at its counted positions (detached), whether each is right, and whether
    every earlier step was right there.
    """
    B, T, _ = emb.shape
    draft_to_target = draft.draft_to_target
    all_right_so_far = torch.ones(B, T, dtype=torch.bool, device=emb.device)
    total = emb.new_zeros(())
    counts = []
    for j, hidden in ttt_hidden_states(draft, emb, aux_hidden, ttt_steps):
        # Only positions that count reach the head and the loss: the draft vocabulary head
        # and the soft cross-entropy are most of a step's cost, padding and prompt tokens
        # would be thrown away. Step j at t is judged against the target at t+1+j.
        n_pos = max(T - 1 - j, 0)
        valid = counted_positions(loss_mask, signal.in_vocab, j)  # [B, n_pos]
        logits = draft.logits(hidden[:, :n_pos][valid]).float()  # [N, Vd]
        p = signal.probs[:, 1 + j:][valid]  # [N, Vd]
        ce = -(p * F.log_softmax(logits, dim=-1)).sum(-1)  # [N]
        n = int(valid.sum())
        step_loss = ce.sum() / max(n if normalizers is None else normalizers[j], 1)
        total = total + decay ** j * step_loss
        with torch.no_grad():
            right_sel = draft_to_target[logits.argmax(-1)] == signal.argmax[:, 1 + j:][valid]  # [N]
            right = torch.zeros(B, T, dtype=torch.bool, device=emb.device)
            right[:, :n_pos][valid] = right_sel
            cond = all_right_so_far[:, :n_pos][valid]  # [N]
            if observe is not None:
                observe(j, logits.detach(), right_sel, cond)
            counts.append(StepCounts(loss_sum=float(ce.sum()), valid=n, correct=int(right_sel.sum()),
                                     cond_valid=int(cond.sum()), cond_correct=int((right_sel & cond).sum())))
            # A position whose earlier step did not count (outside the loss mask, or the
            # target's token outside the draft vocab) is not "right so far".
            all_right_so_far = all_right_so_far & right
    return total, counts
