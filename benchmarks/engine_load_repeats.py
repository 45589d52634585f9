"""`bench --engine E --concurrency` run several times back to back, and where speculation pays read from all of them:
one launch's speed is one sample (a vLLM launch on 2 shared cores keeps a speed of its own, +-35 % from one launch
to the next: BENCHMARKS.md, "Many requests at once"), so a crossover read from one run may be the launch's.

    OMP_NUM_THREADS=2 python benchmarks/engine_load_repeats.py --engine vllm --runs 3 \\
        --configs "1,0,0,0;1,1,1,2;1,3,1,4" --concurrency 1,2,4,8 --out runs/vllm-repeats

Each run launches every config once (bench's order: plain first), so the runs interleave the launches. Per config
and concurrency it prints each run's ratio to that run's plain and their median, and the crossover (the largest
concurrency at which a speculative config beats plain) of each run and of the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def crossover(ratios: dict[tuple[str, int], float], levels: list[int]) -> int | None:
    """The largest concurrency at which some speculative config's ratio to plain is above 1 (None: none)."""
    paying = [c for c in levels if any(r > 1.0 for (name, clients), r in ratios.items()
                                       if clients == c and not name.endswith("1,0,0,0"))]
    return max(paying, default=None)


def ratios_of(report: dict) -> dict[tuple[str, int], float]:
    """bench --concurrency's concurrency.json -> {(config name, clients): tokens/s over plain's at that load}."""
    return {(row["name"], row["clients"]): row["vs_plain"] for row in report["rows"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--draft", default="reference")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--configs", default="1,0,0,0;1,1,1,2;1,3,1,4")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="runs/engine-load-repeats")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    runs: list[dict[tuple[str, int], float]] = []
    for i in range(args.runs):
        out = Path(args.out) / f"run{i + 1}"
        cmd = [sys.executable, "-m", "eaglewire.cli", "--threads", str(args.threads), "bench", "--engine", args.engine,
               "--draft", args.draft, "--dataset", "mt-bench", "--num-prompts", str(args.num_prompts),
               "--max-new-tokens", str(args.max_new_tokens), "--configs", args.configs,
               "--concurrency", args.concurrency, "--out", str(out)]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        runs.append(ratios_of(json.loads((out / "concurrency.json").read_text())))
    keys = sorted(runs[0], key=lambda k: (k[1], k[0]))
    medians = {k: statistics.median(r[k] for r in runs) for k in keys}
    print(f"\n{'config':16} {'clients':>7}  " + " ".join(f"run {i + 1:>2}" for i in range(len(runs))) + "  median")
    for key in keys:
        print(f"{key[0]:16} {key[1]:7}  " + " ".join(f"{r[key]:5.2f}x" for r in runs) + f"  {medians[key]:5.2f}x")
    per_run = [crossover(r, levels) for r in runs]
    print(f"\ncrossover per run: {per_run}; of the medians: {crossover(medians, levels)}")
    summary = {"runs": [{f"{k[0]}@{k[1]}": v for k, v in r.items()} for r in runs],
               "median": {f"{k[0]}@{k[1]}": v for k, v in medians.items()},
               "crossover_per_run": per_run, "crossover_of_medians": crossover(medians, levels)}
    (Path(args.out) / "repeats.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
