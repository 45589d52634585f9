"""How fast this machine trains a draft for a target, measured in seconds before a run is planned.

The quickstart sizes its data to the machine (``quickstart.plan_data``): a CPU that computes bf16 natively
(AMX: a bf16 matmul ~7x a fp32 one) trains several times faster than one that emulates it, and a fixed
number of conversations would leave that speed unused. The probe runs what a training step runs: the
target's head on the step's tokens (the labels, ``label_head``) and the EAGLE-3 draft's TTT unroll forward
and backward, in the training precision, on a synthetic batch of the target's shapes (random states: the
cost of a step does not depend on their values).
"""

from __future__ import annotations

import time

import torch

from eaglewire.core.precision import Precision
from eaglewire.model.draft import DraftConfig, Eagle3Draft
from eaglewire.model.label_head import label_head
from eaglewire.model.target import Target
from eaglewire.model.ttt import signal_positions, target_signal, ttt_loss

__all__ = ["training_tokens_per_second"]

PROBE_ROWS = 512  # tokens per synthetic sequence


def training_tokens_per_second(target: Target, precision: Precision, *, num_aux: int = 3, ttt_steps: int,
                               draft_vocab_size: int, batch_tokens: int, steps: int = 2,
                               label_fraction: float = 1.0) -> float:
    """Training tokens per second of an EAGLE-3 draft for ``target`` here: one untimed step, then the median of
    ``steps`` timed ones, each the label head plus the unroll's forward and backward over ``batch_tokens``, of which
    ``label_fraction`` carry a label (the data's reply tokens over its tokens). On a CPU a step computes the head and
    the draft at labelled positions only, so its cost follows them: a probe with every position labelled read 415
    tokens/s where the quickstart's data (reply tokens ~40 % of its tokens) trained at 1,061 (issue 74)."""
    if not 0.0 < label_fraction <= 1.0:
        raise ValueError(f"label_fraction must be in (0, 1], got {label_fraction}")
    H = target.hidden_size
    vocab = min(draft_vocab_size, target.vocab_size)
    cfg = DraftConfig.from_target(target.text_config, num_aux=num_aux, draft_vocab_size=vocab,
                                  vocab_size=target.vocab_size)
    draft = Eagle3Draft(cfg).to(target.device)
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[:vocab] = True
    draft.set_vocab(torch.zeros(vocab, dtype=torch.long), t2d)
    head = label_head(target, precision.dtype)
    g = torch.Generator().manual_seed(0)
    B = max(1, batch_tokens // PROBE_ROWS)
    aux = torch.randn(B, PROBE_ROWS, num_aux * H, generator=g).to(target.device)  # [B, T, k*H]
    last = torch.randn(B, PROBE_ROWS, H, generator=g).to(target.device, target.dtype)  # [B, T, H]
    emb = torch.randn(B, PROBE_ROWS, H, generator=g).to(target.device)  # [B, T, H]
    mask = torch.ones(B, PROBE_ROWS, dtype=torch.bool, device=target.device)  # [B, T]
    mask[:, :round((1 - label_fraction) * PROBE_ROWS)] = False  # the prompt's tokens: context, no label
    dense = mask.device.type == "cuda"  # as the loop's --sync-free auto

    def step() -> float:
        start = time.perf_counter()
        needed = None if dense else signal_positions(mask)
        signal = target_signal(head, last, draft.draft_to_target, draft.t2d, needed)
        with precision.autocast():  # as the training loop runs the unroll (train/loop.py)
            loss, _ = ttt_loss(draft, emb, aux, mask, signal, ttt_steps=ttt_steps, dense=dense)
        loss.backward()
        draft.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step()  # warm-up: kernels, allocator
    times = sorted(step() for _ in range(steps))
    return B * PROBE_ROWS / times[len(times) // 2]
