"""Why ``eaglewire serve`` decodes on the thread that loaded the models.

PyTorch's OpenMP runtime (libgomp) keeps a pool of worker threads for each thread that runs
parallel work. Once two threads have pools, libgomp manages more threads than there are cores
and stops spinning between parallel regions, so each small parallel op waits for its workers
to wake. This times the few-row packed GEMMs of a SmolLM2-135M decode step (576 -> 1536) in
one process: on the first thread to run parallel work, then on a second thread.

    OMP_NUM_THREADS=2 python benchmarks/experiments/engine/engine_thread.py [--threads 2] [--repeats 300]
"""

from __future__ import annotations

import argparse
import threading

import torch
from gemm_rows import H, I, timed  # SmolLM2-135M's hidden and intermediate sizes; ms per call

from eaglewire.decode.gemm import PackedLinear


def gemm_times(repeats: int) -> dict[int, float]:
    """Microseconds per call of a packed [rows, H] x [H, I] GEMM, for 1 and 8 rows."""
    linear = PackedLinear(torch.randn(I, H))
    return {rows: 1e3 * timed(lambda x=torch.randn(rows, H): linear(x), repeats) for rows in (1, 8)}


def on_new_thread(fn):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn()))
    thread.start()
    thread.join()
    return result["value"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs = [("first thread", gemm_times(args.repeats)),
            ("second thread", on_new_thread(lambda: gemm_times(args.repeats))),
            ("first thread again", gemm_times(args.repeats))]
    print(f"packed GEMM {H}->{I}, {args.threads} threads, microseconds per call\n")
    print("| thread running it | 1 row | 8 rows |\n|---|---|---|")
    for name, times in runs:
        print(f"| {name} | {times[1]:.0f} | {times[8]:.0f} |")


if __name__ == "__main__":
    main()
