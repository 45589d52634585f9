"""The EAGLE-3 TTT unroll without a host synchronisation: ``model/ttt.py``'s ``ttt_unroll`` with its counts
kept on the device and no data-dependent shapes, for a GPU, where every ``int(tensor)`` or boolean-mask
index stalls the host until the device has caught up.

Shapes: B batch, T tokens, H hidden, Vd draft vocab, K = ttt_steps, n = T - 1 - j positions of step j.

Same loss and counts as ``ttt_unroll`` up to float summation order: instead of selecting the counted
positions (a shape the host must read), the draft head and the soft cross-entropy run at every position
of the step and a mask zeroes the rest. The cross-entropy reads the logits in their own dtype (bf16 under
autocast) chunk by chunk and keeps only them and a log-sum-exp per position for the backward: no fp32 copy
of [B, n, Vd] logits nor of their log-softmax is kept.
"""

from __future__ import annotations

import torch

from eaglewire.model.draft import Eagle3Draft
from eaglewire.model.ttt import TargetSignal, counted_positions, ttt_hidden_states

COUNT_FIELDS = 5  # StepCounts' fields in order: loss_sum, valid, correct, cond_valid, cond_correct


class SoftCrossEntropy(torch.autograd.Function):
    """``-(p * log_softmax(logits)).sum(-1)`` in fp32, token chunk by token chunk: logits [N, Vd] (any float
    dtype), p [N, Vd] target probabilities (constant) -> [N]."""

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


def ttt_unroll_on_device(draft: Eagle3Draft, emb: torch.Tensor, aux_hidden: torch.Tensor, loss_mask: torch.Tensor,
                         signal: TargetSignal, *, ttt_steps: int, decay: float,
                         normalizers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ttt_unroll`` with ``normalizers`` [K] a device tensor (each step's count over the whole optimizer step)
    and the counts returned as a [K, 5] float64 device tensor (``StepCounts`` fields per step)."""
    B, T, _ = emb.shape
    draft_to_target = draft.draft_to_target
    all_right_so_far = torch.ones(B, T, dtype=torch.bool, device=emb.device)
    total = emb.new_zeros(())
    counts = []
    for j, hidden in ttt_hidden_states(draft, emb, aux_hidden, ttt_steps):
        n_pos = max(T - 1 - j, 0)
        valid = counted_positions(loss_mask, signal.in_vocab, j)  # [B, n]
        logits = draft.logits(hidden[:, :n_pos])  # [B, n, Vd]
        logits = logits.reshape(B * n_pos, logits.shape[-1])  # [B*n, Vd]
        p = signal.probs[:, 1 + j:].reshape(B * n_pos, logits.shape[-1])  # [B*n, Vd]
        ce = soft_cross_entropy(logits, p).view(B, n_pos)  # [B, n]
        ce_sum = torch.where(valid, ce, torch.zeros_like(ce)).sum()
        total = total + decay ** j * ce_sum / normalizers[j].clamp(min=1).to(ce_sum.dtype)
        with torch.no_grad():
            predicted = draft_to_target[logits.argmax(-1)].view(B, n_pos)  # [B, n] target ids
            right = (predicted == signal.argmax[:, 1 + j:]) & valid  # [B, n]
            cond = all_right_so_far[:, :n_pos] & valid  # [B, n]
            counts.append(torch.stack([ce_sum.detach().double(), valid.sum().double(), right.sum().double(),
                                       cond.sum().double(), (right & cond).sum().double()]))  # [5]
            # A position whose earlier step did not count is not "right so far" (as in ttt_unroll).
            right_full = torch.zeros(B, T, dtype=torch.bool, device=emb.device)
            right_full[:, :n_pos] = right
            all_right_so_far = all_right_so_far & right_full
    return total, torch.stack(counts)  # [K, 5]


def counted_on_device(loss_mask: torch.Tensor, in_vocab: torch.Tensor, ttt_steps: int) -> torch.Tensor:
    """``counted_per_step`` as a [K] float64 device tensor (no read to the host)."""
    return torch.stack([counted_positions(loss_mask, in_vocab, j).sum().double() for j in range(ttt_steps)])
