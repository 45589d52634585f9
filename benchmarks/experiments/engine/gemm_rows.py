"""Few-row GEMM cost on CPU: every weight matrix of SmolLM2-135M (30 layers + lm_head, fp32,
out of cache) applied to N rows, by MKL (``x @ Wᵀ`` pre-transposed, and ``F.linear``) and by
oneDNN with the weight packed once (``decode.gemm.PackedLinear``). A decode step is N = 1, a
verify pass N = 2-32, a batched step N = batch.

    python benchmarks/experiments/engine/gemm_rows.py [--threads 2] [--rows 1 4 8 16 32 64]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from eaglewire.decode.gemm import PackedLinear

H, I, V, LAYERS = 576, 1536, 49152, 30
SHAPES = [(960, H), (H, H), (2 * I, H), (H, I)]  # [out, in]: qkv, o, gate_up, down


def timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=g) * 0.02 for _ in range(LAYERS) for o, i in SHAPES]
    weights.append(torch.randn(V, H, generator=g) * 0.02)  # lm_head
    transposed = [w.t().contiguous() for w in weights]
    packed = [PackedLinear(w) for w in weights]
    print(f"threads {args.threads}, oneDNN {packed[0].onednn}; ms for all {len(weights)} matrices\n")
    print("| rows | MKL x @ Wt | F.linear | oneDNN packed | oneDNN vs MKL | oneDNN vs its 1 row |")
    print("|---|---|---|---|---|---|")
    one = None
    for n in args.rows:
        xs = [torch.randn(n, w.shape[1], generator=g) for w in weights]
        mkl = timed(lambda: [x @ w for x, w in zip(xs, transposed)], args.repeats)
        lin = timed(lambda: [F.linear(x, w) for x, w in zip(xs, weights)], args.repeats)
        dnn = timed(lambda: [p(x) for x, p in zip(xs, packed)], args.repeats)
        one = one or dnn
        print(f"| {n} | {mkl:.1f} | {lin:.1f} | {dnn:.1f} | {mkl / dnn:.2f}x | {dnn / one:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
