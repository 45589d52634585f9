"""Capture throughput vs a plain HF forward with output_hidden_states=True, side by side.

    python benchmarks/capture_throughput.py [--threads 2] [--seq-len 512] [--batch 4] [--repeats 5]

Alternates the two measurements in one process so a busy neighbour hits both alike;
reports tokens/s of each and their ratio (capture / HF).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eaglewire.model.boundary_capture import capture
from eaglewire.core.contract import default_aux_boundaries
from eaglewire.core.presets import DEFAULT_TARGET
from eaglewire.model.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target, device="cpu", dtype="fp32")
    bounds = default_aux_boundaries(target.num_layers)
    ids = torch.randint(0, target.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    tokens = ids.numel()

    def ours():
        capture(target, ids, bounds)

    @torch.inference_mode()
    def hf():
        out = target.model(ids, output_hidden_states=True)
        torch.cat([out.hidden_states[b] for b in bounds], dim=-1)  # what a user stores

    ours(), hf()  # warm up
    times = {"eaglewire capture": [], "HF forward, output_hidden_states": []}
    for _ in range(args.repeats):
        for name, fn in (("eaglewire capture", ours), ("HF forward, output_hidden_states", hf)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"target {args.target}, {args.threads} threads, batch {args.batch} x {args.seq_len} tokens, "
          f"median of {args.repeats}")
    print("| method | tokens/s |\n|---|---|")
    for k, v in med.items():
        print(f"| {k} | {tokens / v:,.0f} |")
    ratio = med["HF forward, output_hidden_states"] / med["eaglewire capture"]
    print(f"\nratio capture / HF = {ratio:.2f}")


if __name__ == "__main__":
    main()
