"""Is any command slower than it was at another revision? The same CPU commands run from two revisions'
source trees, alternated (old, new, old, new) so that drift of the machine falls on both, each figure the
median of its repeats, in one table of ratios (new / old wall time; > 1: slower).

    python benchmarks/revision_speed.py OLD [NEW] [--repeats 2] [--threads 2] [--out runs/revision_speed]

Each revision runs from a `git worktree` of it under --out, with this venv's packages (PYTHONPATH=its src):
the commands' code differs, the libraries do not. Commands (SmolLM2-135M, the shipped reference draft):

- startup: `eaglewire --help` (import time of the CLI);
- prepare: capture 24 ShareGPT conversations (no regeneration) into shards;
- train: 20 optimizer steps on those shards (each revision on its own shards);
- doctor: the full doctor of the reference draft on 8 held-out conversations;
- bench: plain and chain-3 decoding of 4 MT-bench prompts x 64 tokens (tokens/s from bench.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EAGLEWIRE = str(Path(sys.executable).parent / "eaglewire")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def commands(work: Path) -> dict[str, list[str]]:
    data, draft, bench = work / "data", work / "draft", work / "bench"
    return {
        "startup": ["--help"],
        "prepare": ["prepare", "--target", "smollm2-135m", "--data", "sharegpt", "--num-conversations", "24",
                    "--no-regenerate", "--out", str(data), "--overwrite", "--no-progress"],
        "train": ["train", "--target", "smollm2-135m", "--data", str(data), "--out", str(draft), "--max-steps", "20",
                  "--val-sequences", "2", "--no-progress"],
        "doctor": ["doctor", "--draft", "reference", "--target", "smollm2-135m", "--num-sequences", "8",
                   "--no-cache"],  # a repeat would read the first run's checks back (doctor/cache.py)
        "bench": ["bench", "--draft", "reference", "--dataset", "mt-bench", "--num-prompts", "4",
                  "--max-new-tokens", "64", "--configs", "1,0,0,0;1,3,1,4", "--out", str(bench), "--no-progress"],
    }


def run_one(tree: Path, work: Path, name: str, argv: list[str], threads: int) -> tuple[float, dict]:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads))
    if name == "train":
        shutil.rmtree(work / "draft", ignore_errors=True)
    start = time.perf_counter()
    done = subprocess.run([EAGLEWIRE, *argv], env=env, cwd=work, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1, 3):  # the doctor exits 1/3 on a verdict: still a timed run
        raise SystemExit(f"{name} at {tree.name} exited {done.returncode}:\n{done.stderr[-3000:]}")
    extra = {}
    if name == "bench":
        rows = json.loads((work / "bench" / "bench.json").read_text())["rows"]
        extra = {r["name"]: r["tokens_per_second"] for r in rows}
    return seconds, extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old")
    parser.add_argument("new", nargs="?", default="HEAD")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated commands (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "revision_speed")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    revs = {}
    for label, rev in (("old", args.old), ("new", args.new)):
        sha = subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "--short", rev], text=True).strip()
        tree = args.out / f"tree-{sha}"
        if not tree.exists():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), sha], check=True,
                           capture_output=True)
        work = args.out / f"work-{sha}"
        work.mkdir(exist_ok=True)
        revs[label] = (sha, tree, work)
    names = list(commands(Path("."))) if not args.only else args.only.split(",")
    times: dict[tuple[str, str], list[float]] = {}
    rates: dict[tuple[str, str], dict[str, list[float]]] = {}
    for name in names:
        for _ in range(args.repeats):
            for label in ("old", "new"):
                sha, tree, work = revs[label]
                seconds, extra = run_one(tree, work, name, commands(work)[name], args.threads)
                times.setdefault((name, label), []).append(seconds)
                for k, v in extra.items():
                    rates.setdefault((name, label), {}).setdefault(k, []).append(v)
                print(f"{name} @ {sha}: {seconds:.2f} s {extra or ''}", flush=True)
    lines = [f"revision speed: old {revs['old'][0]}, new {revs['new'][0]}; {cpu_name()}, {os.cpu_count()} cores, "
             f"{args.threads} threads, median of {args.repeats}, alternated", "",
             "| command | old (s) | new (s) | new / old |", "|---|---|---|---|"]
    for name in names:
        old, new = statistics.median(times[(name, "old")]), statistics.median(times[(name, "new")])
        lines.append(f"| {name} | {old:.2f} | {new:.2f} | {new / old:.3f} |")
        for config in rates.get((name, "old"), {}):
            o = statistics.median(rates[(name, "old")][config])
            n = statistics.median(rates[(name, "new")].get(config, [float("nan")]))
            lines.append(f"| {name} {config} (tok/s) | {o:.1f} | {n:.1f} | {o / n:.3f} (old/new tok/s) |")
    table = "\n".join(lines)
    (args.out / "table.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
