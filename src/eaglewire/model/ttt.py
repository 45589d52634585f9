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


COUNT_FIELDS = 5  # StepCounts' fields in order: loss_sum, valid, correct, cond_valid, cond_correct


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

    @classmethod
    def rows(cls, counts: torch.Tensor) -> list[StepCounts]:
        """[K, COUNT_FIELDS] counts (``ttt_loss``'s, the training loop's sums) -> one per step (one read)."""
        return [cls.from_floats(row) for row in counts.tolist()]

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


def counted_per_step(loss_mask: torch.Tensor, in_vocab: torch.Tensor, ttt_steps: int) -> torch.Tensor:
    """[K] float64 on the mask's device: how many positions each TTT step counts in a batch (what ``ttt_loss``
    divides by when not given ``normalizers``); no read to the host."""
    return torch.stack([counted_positions(loss_mask, in_vocab, j).sum().double() for j in range(ttt_steps)])


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


class SoftCrossEntropy(torch.autograd.Function):
    """``-(p * log_softmax(logits)).sum(-1)`` in fp32, token chunk by token chunk: logits [N, Vd] (any float
    dtype), p [N, Vd] target probabilities (constant) -> [N]. Keeps only the logits in their own dtype (bf16
    under autocast) and a log-sum-exp per row for the backward: no fp32 copy of the logits nor of their
    log-softmax, which at every position of a step (``dense``) would be the largest tensors of the step."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, p: torch.Tensor, chunk: int) -> torch.Tensor:
        N = logits.shape[0]
        ce = logits.new_empty(N, dtype=torch.float32)  # [N]
        lse = logits.new_empty(N, dtype=torch.float32)  # [N]
        for s in range(0, N, chunk):
            x = logits[s:s + chunk].float()  # [c, Vd]
            lse[s:s + chunk] = torch.logsumexp(x, dim=-1)
            q = p[s:s + chunk]
            # -sum_v q (x - lse) = lse * sum_v q - sum_v q x
            ce[s:s + chunk] = lse[s:s + chunk] * q.sum(-1) - (q * x).sum(-1)
        ctx.save_for_backward(logits, p, lse)
        ctx.chunk = chunk
        return ce

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor):
        logits, p, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)  # [N, Vd]
        for s in range(0, logits.shape[0], ctx.chunk):
            q = p[s:s + ctx.chunk]
            softmax = torch.exp(logits[s:s + ctx.chunk].float() - lse[s:s + ctx.chunk, None])  # [c, Vd]
            g = grad_ce[s:s + ctx.chunk, None]  # [c, 1]
            grad[s:s + ctx.chunk] = (g * (softmax * q.sum(-1, keepdim=True) - q)).to(grad.dtype)
        return grad, None, None


CHUNK_ELEMENTS = 1 << 26  # fp32 temporaries of the cross-entropy: at most 256 MiB per chunk


def soft_cross_entropy(logits: torch.Tensor, p: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """[N, Vd] draft logits, [N, Vd] target probabilities -> [N] cross-entropy (fp32), ``chunk`` rows at a time."""
    return SoftCrossEntropy.apply(logits, p, chunk or max(1, CHUNK_ELEMENTS // max(logits.shape[-1], 1)))


def ttt_loss(draft: Eagle3Draft, emb: torch.Tensor, aux_hidden: torch.Tensor, loss_mask: torch.Tensor,
             signal: TargetSignal, *, ttt_steps: int, decay: float = 0.8, normalizers: torch.Tensor | None = None,
             dense: bool = False,
             observe: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Unroll the draft ``ttt_steps`` times: the weighted loss and the per-step counts, both device tensors.

    emb [B, T, H] target embeddings of input_ids; aux_hidden [B, T, k*Ht]; loss_mask [B, T].
    Loss: sum_j decay**j * (sum over counted positions of -sum_v p_target log q_draft) / N_j, where N_j is
    this batch's count of counted positions, or ``normalizers[j]`` ([K] tensor) when the batch is one part
    of a larger optimizer step (micro-batches, ranks): then the parts' losses add up to the loss of the
    whole step. Counts: [K, COUNT_FIELDS] float64, ``StepCounts``' fields per step (``StepCounts.rows``
    reads them). ``observe(j, logits [N, Vd], right [N], cond [N])``, if given, sees each step's draft
    logits at its counted positions (detached), whether each is right, and whether every earlier step was
    right there.

    Where the draft head and the loss run (same loss and counts either way, up to float summation order):
    - ``dense=False``: only at the counted positions, selected by a boolean mask, so padding and prompt
      tokens cost nothing; their number is a shape the host reads (a CUDA host then waits for the device);
    - ``dense=True``: at every position of the step, a mask zeroing the others, with the chunked
      ``soft_cross_entropy``: no shape depends on values, so nothing makes the host wait (``--sync-free``).
    """
    B, T, _ = emb.shape
    draft_to_target = draft.draft_to_target
    all_right_so_far = torch.ones(B, T, dtype=torch.bool, device=emb.device)
    total = emb.new_zeros(())
    counts = []
    for j, hidden in ttt_hidden_states(draft, emb, aux_hidden, ttt_steps):
        # Step j at t is judged against the target at t+1+j.
        n_pos = max(T - 1 - j, 0)
        valid = counted_positions(loss_mask, signal.in_vocab, j)  # [B, n]
        if dense:
            logits = draft.logits(hidden[:, :n_pos]).flatten(0, 1)  # [B*n, Vd]
            ce = soft_cross_entropy(logits, signal.probs[:, 1 + j:].flatten(0, 1)).view(B, n_pos)  # [B, n]
            ce_sum = torch.where(valid, ce, torch.zeros_like(ce)).sum()
            with torch.no_grad():
                predicted = draft_to_target[logits.argmax(-1)].view(B, n_pos)  # [B, n] target ids
                right = (predicted == signal.argmax[:, 1 + j:]) & valid  # [B, n]
        else:
            logits = draft.logits(hidden[:, :n_pos][valid]).float()  # [N, Vd]
            ce = -(signal.probs[:, 1 + j:][valid] * F.log_softmax(logits, dim=-1)).sum(-1)  # [N]
            ce_sum = ce.sum()
            with torch.no_grad():
                right = torch.zeros_like(valid)  # [B, n]
                right[valid] = draft_to_target[logits.argmax(-1)] == signal.argmax[:, 1 + j:][valid]
        n = valid.sum().double()
        step_norm = n if normalizers is None else normalizers[j]
        norm = step_norm.clamp(min=1).to(ce_sum.dtype)
        # Each mode rounds as it did before the two unrolls were one: runs reproduce their losses bit for bit.
        total = total + (decay ** j * ce_sum / norm if dense else decay ** j * (ce_sum / norm))
        with torch.no_grad():
            cond = all_right_so_far[:, :n_pos] & valid  # [B, n]
            if observe is not None:
                picked = logits.view(B, n_pos, -1)[valid].float() if dense else logits
                observe(j, picked.detach(), right[valid], cond[valid])
            counts.append(torch.stack([ce_sum.detach().double(), n, right.sum().double(), cond.sum().double(),
                                       (right & cond).sum().double()]))  # [COUNT_FIELDS]
            # A position whose earlier step did not count (outside the loss mask, or the
            # target's token outside the draft vocab) is not "right so far".
            right_full = torch.zeros_like(all_right_so_far)  # [B, T]
            right_full[:, :n_pos] = right
            all_right_so_far = all_right_so_far & right_full
    return total, torch.stack(counts)  # [K, COUNT_FIELDS]


def ttt_unroll(draft: Eagle3Draft, emb: torch.Tensor, aux_hidden: torch.Tensor, loss_mask: torch.Tensor,
               signal: TargetSignal, *, ttt_steps: int, decay: float = 0.8,
               normalizers: torch.Tensor | list[int] | None = None,
               observe: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
               ) -> tuple[torch.Tensor, list[StepCounts]]:
    """``ttt_loss`` with its counts read to the host (one read) as a ``StepCounts`` per step: for callers that
    use them at once (the doctor's replay, benchmarks); ``normalizers`` may be a list of counts."""
    if normalizers is not None:
        normalizers = torch.as_tensor(normalizers, dtype=torch.float64, device=emb.device)
    total, counts = ttt_loss(draft, emb, aux_hidden, loss_mask, signal, ttt_steps=ttt_steps, decay=decay,
                             normalizers=normalizers, observe=observe)
    return total, StepCounts.rows(counts)
