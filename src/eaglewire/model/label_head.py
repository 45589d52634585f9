"""The target's head as training reads its labels: final norm + lm_head, in the training precision.

Training computes the target's distribution at every reply position from the stored boundary-L state. In
fp32 on a CPU with native bf16 that head (576 -> 49152 for SmolLM2) was a fifth of a bf16 training step; in
bf16 it costs what the draft's own bf16 matmuls cost. The norm runs as the target runs it (HF's RMSNorm
normalises in fp32), the matmul in bf16 with fp32 accumulation, and the caller's softmax in fp32
(``ttt.target_signal`` and ``dflash_objective.block_signal`` cast the logits), so only the logits' rounding
changes: a bf16 ulp of a logit, the precision the target serves in anyway.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from eaglewire.model.target import Target, softcap

__all__ = ["label_head"]


def label_head(target: Target, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """``last_hidden`` [..., H] (pre-norm) -> logits [..., V], the matmul in ``dtype`` (the target's own head where
    that is the target's dtype). The weight is cast once, here, not per call as autocast would."""
    if dtype == target.dtype:
        return target.head
    return _CastHead(target, dtype)


class _CastHead:
    def __init__(self, target: Target, dtype: torch.dtype) -> None:
        lm_head = target.model.get_output_embeddings()
        self.norm = target.decoder.norm
        self.weight = lm_head.weight.detach().to(dtype)  # [V, H]
        self.bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias.detach().to(dtype)  # [V]
        self.cap = target.logit_softcap

    @torch.no_grad()
    def __call__(self, last_hidden: torch.Tensor) -> torch.Tensor:
        normed = self.norm(last_hidden)  # [..., H] in the target's dtype
        logits = F.linear(normed.to(self.weight.dtype), self.weight, self.bias)  # [..., V]
        return softcap(logits.float(), self.cap) if self.cap else logits  # a soft cap in fp32, as the softmax after
