"""The labels' head in the training precision (model/label_head.py)."""

import torch

from eaglewire.model.label_head import label_head
from tiny import tiny_target


def test_a_bf16_label_head_reads_what_the_fp32_head_reads_within_bf16_rounding():
    target = tiny_target("llama", initializer_range=0.2, vocab_size=512)
    last = torch.randn(3, 20, target.hidden_size, generator=torch.Generator().manual_seed(0))  # [B, T, H]
    want = target.head(last)  # [B, T, V] fp32
    head = label_head(target, torch.bfloat16)
    got = head(last)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    # bf16 keeps 8 bits: each product and the rounded logit are 2^-8 relative; the sum over H=64
    # products (fp32 accumulation, any order) stays well inside 3% of the logits' scale.
    scale = want.abs().amax()
    assert (got.float() - want).abs().amax() <= 0.03 * scale
    agree = (got.float().argmax(-1) == want.argmax(-1)).float().mean()
    assert agree >= 0.9  # near ties may flip at bf16's rounding; most labels stay
    assert head.weight.dtype == torch.bfloat16  # cast once, not per call


def test_the_label_head_in_the_targets_own_dtype_is_the_targets_head():
    target = tiny_target("llama")
    assert label_head(target, torch.float32) == target.head


def test_a_soft_capped_head_caps_in_both_precisions():
    """Gemma's final_logit_softcapping: the target's head and the bf16 labels' head both cap (tanh), the latter in
    fp32 as the softmax after it; with the cap small enough to bind, no logit reaches it."""
    target = tiny_target("llama", initializer_range=0.2, vocab_size=512)
    uncapped = target.head(torch.randn(2, 8, target.hidden_size, generator=torch.Generator().manual_seed(1)))
    cap = float(uncapped.abs().amax()) / 4  # binds: the largest logits are 4x it
    target.text_config.final_logit_softcapping = cap
    last = torch.randn(2, 8, target.hidden_size, generator=torch.Generator().manual_seed(1))  # [B, T, H]
    want = target.head(last)
    assert want.abs().amax() < cap and torch.allclose(want, cap * torch.tanh(uncapped / cap))
    got = label_head(target, torch.bfloat16)(last)
    assert got.dtype == torch.float32 and got.abs().amax() < cap
    assert (got - want).abs().amax() <= 0.03 * cap  # bf16's matmul rounding, through tanh (slope <= 1)
