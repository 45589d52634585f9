"""One TTT training step (forward + backward) of the SmolLM2-135M-shaped draft on CPU, with the
dense TTT attention and with the flash-kernel one, alternating in one process.

Synthetic batch shaped like the ShareGPT shards: B sequences of T tokens, 73% of positions
under the loss mask (the share in the 1k-conversation shards), draft vocabulary 8,192.

    python benchmarks/train_step.py [--threads 2] [--batch 4] [--tokens 1024] [--ttt-steps 7] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from eaglewire.model import ttt_attention as attention_module
from eaglewire.model.draft import DraftConfig, Eagle3Draft
from eaglewire.model.ttt import TargetSignal, ttt_unroll


def smollm2_draft() -> Eagle3Draft:
    cfg = DraftConfig(hidden_size=576, target_hidden_size=576, num_aux=3, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                      draft_vocab_size=8192, rope_theta=100000.0)
    draft = Eagle3Draft(cfg)
    t2d = torch.zeros(49152, dtype=torch.bool)
    t2d[:8192] = True
    draft.set_vocab(torch.zeros(8192, dtype=torch.long), t2d)
    return draft


def batch(B: int, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(B, T, 576, generator=g)
    aux = torch.randn(B, T, 3 * 576, generator=g)
    loss_mask = torch.rand(B, T, generator=g) < 0.73
    probs = torch.softmax(torch.randn(B, T, 8192, generator=g), -1)
    signal = TargetSignal(probs=probs, argmax=probs.argmax(-1), in_vocab=torch.ones(B, T, dtype=torch.bool))
    return emb, aux, loss_mask, signal


def step_seconds(draft, inputs, ttt_steps: int) -> float:
    emb, aux, loss_mask, signal = inputs
    start = time.perf_counter()
    loss, _ = ttt_unroll(draft, emb, aux, loss_mask, signal, ttt_steps=ttt_steps)
    loss.backward()
    draft.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    draft, inputs = smollm2_draft(), batch(args.batch, args.tokens)
    variants = {"dense": attention_module.ttt_attention_dense, "flash": attention_module.ttt_attention_flash}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.repeats + 1):  # the first round warms up
        for name, fn in variants.items():
            with mock.patch("eaglewire.model.draft.ttt_attention", fn):
                t = step_seconds(draft, inputs, args.ttt_steps)
            if r:
                times[name].append(t)
    tokens = args.batch * args.tokens
    print(f"\n{args.batch} x {args.tokens} tokens, ttt {args.ttt_steps}, {args.threads} threads, "
          f"median of {args.repeats}\n\n| TTT attention | s / step | tokens/s | vs dense |\n|---|---|---|---|")
    base = statistics.median(times["dense"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m:.2f} | {tokens / m:.0f} | {base / m:.2f}x |")


if __name__ == "__main__":
    main()
