"""Model FLOP utilisation (MFU) of draft training: FLOPs per trained token, the device's peak, the ratio.

Counting convention (PaLM's, as nanoGPT and most MFU figures): 2 FLOPs per multiply-add of every matmul
weight a token touches, attention's scores and weighted sum as 4 x T x (heads x head_dim) per token and layer
(T the sequence length, the causal half not subtracted), and a training step as 3 x the forward (the backward
computes gradients of activations and of weights). Norms, RoPE, softmax and the loss are left out; so is the
target's head, which computes the labels (not the draft's work).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Peak dense (no 2:4 sparsity) FLOP/s per GPU, (bf16 tensor cores, fp32 without TF32), from NVIDIA's data
# sheets (H100/H200 "Tensor Core GPU" data sheets, SXM columns; A100 data sheet; L40S and L4 data sheets).
# Matched by substring of torch.cuda.get_device_name(), first match wins: the longer names come first.
PEAK_FLOPS: tuple[tuple[str, float, float | None], ...] = (
    ("H100 PCIe", 756e12, 51e12),
    ("H100 NVL", 835e12, 60e12),
    ("H200", 989e12, 67e12),
    ("GH200", 989e12, 67e12),
    ("H100", 989e12, 67e12),  # SXM
    ("A100", 312e12, 19.5e12),
    ("L40S", 362e12, 91.6e12),
    ("L4", 121e12, 30.3e12),
)


@dataclass(frozen=True, kw_only=True)
class DraftShape:
    """What the FLOP count of one EAGLE-3 draft needs (``DraftConfig``'s fields of those names)."""
    hidden_size: int  # H
    target_hidden_size: int  # Ht
    num_aux: int  # k
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int  # Vd

    @classmethod
    def of(cls, config) -> DraftShape:
        return cls(**{name: int(getattr(config, name)) for name in cls.__dataclass_fields__})


def layer_matmul_params(s: DraftShape) -> int:
    """Weights of the decoder layer's matmuls: q/k/v read the 2H-wide input, o and the MLP the H-wide one."""
    q = 2 * s.hidden_size * s.num_attention_heads * s.head_dim
    kv = 2 * (2 * s.hidden_size * s.num_key_value_heads * s.head_dim)
    o = s.num_attention_heads * s.head_dim * s.hidden_size
    mlp = 3 * s.hidden_size * s.intermediate_size
    return q + kv + o + mlp


def eagle3_forward_flops(s: DraftShape, *, ttt_steps: int, seq_len: float) -> float:
    """Forward FLOPs per token: the fc fusion once, then per TTT step the layer, the draft head and attention."""
    fc = 2 * s.num_aux * s.target_hidden_size * s.hidden_size
    head = 2 * s.hidden_size * s.draft_vocab_size
    attention = 4 * seq_len * s.num_attention_heads * s.head_dim
    return fc + ttt_steps * (2 * layer_matmul_params(s) + head + attention)


def eagle3_train_flops(s: DraftShape, *, ttt_steps: int, seq_len: float) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward)."""
    return 3 * eagle3_forward_flops(s, ttt_steps=ttt_steps, seq_len=seq_len)


def attention_length(lengths: list[int]) -> float:
    """The T of the per-token attention term over sequences of these lengths: a token of a sequence of
    length L attends over L, so the token-weighted mean sum(L^2) / sum(L)."""
    total = sum(lengths)
    return sum(n * n for n in lengths) / total if total else 0.0


def peak_flops(device_name: str | None, dtype: str) -> float | None:
    """Peak dense FLOP/s of the named device in ``dtype`` (bf16 | fp32); None when not in the table
    (a CPU, an unknown GPU): no guess."""
    if not device_name:
        return None
    for key, bf16, fp32 in PEAK_FLOPS:
        if key.lower() in device_name.lower():
            return bf16 if dtype == "bf16" else fp32 if dtype == "fp32" else None
    return None


@dataclass(frozen=True)
class Utilisation:
    tokens_per_s: float
    flops_per_s: float  # achieved (model FLOPs / wall seconds)
    peak: float | None  # the device's peak, None when unknown
    device: str

    @property
    def mfu(self) -> float | None:
        return self.flops_per_s / self.peak if self.peak else None

    def describe(self) -> str:
        """``12,345 tokens/s, 210.3 TFLOP/s = 21.3% MFU of NVIDIA H200 (989 TFLOP/s bf16)`` or ``... (peak of cpu unknown)``."""
        head = f"{self.tokens_per_s:,.0f} tokens/s, {self.flops_per_s / 1e12:.3g} TFLOP/s"
        if self.mfu is None:
            return f"{head} (MFU: peak of {self.device} unknown)"
        return f"{head} = {100 * self.mfu:.1f}% MFU of {self.device} ({self.peak / 1e12:.0f} TFLOP/s peak)"

    def record(self) -> dict[str, float | None]:
        return {"tokens_per_s": round(self.tokens_per_s, 1), "tflops": round(self.flops_per_s / 1e12, 4),
                "mfu": None if self.mfu is None else round(self.mfu, 4)}


def utilisation(tokens: int, seconds: float, flops_per_token: float, *, device_name: str, dtype: str) -> Utilisation:
    seconds = max(seconds, 1e-9)
    return Utilisation(tokens_per_s=tokens / seconds, flops_per_s=tokens * flops_per_token / seconds,
                       peak=peak_flops(device_name, dtype), device=device_name)
