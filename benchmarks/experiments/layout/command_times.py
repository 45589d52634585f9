"""Every command's wall time at two revisions, alternating: did a change of layout make anything slower?

Each revision is checked out once into a git worktree (``/tmp/eaglewire-rev-<sha>``) and run with this checkout's
``.venv`` and ``PYTHONPATH=<worktree>/src``, so the two differ in eaglewire's source alone. Commands run in order
(``prepare`` before the ``train`` and ``doctor`` that read its shards), first once untimed (fetches, file caches),
then each at both revisions back to back, the order of the pair swapped every repeat; a repeat writes into fresh directories, so nothing resumes.

    python benchmarks/experiments/layout/command_times.py --old 020f7ce --new HEAD --repeats 2 --threads 2

Prints a table (median seconds per revision and their ratio) and writes ``--out`` (JSON, every run). Run it alone:
two multi-threaded jobs at once collapse each other's timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# name -> eaglewire arguments; {out} is a directory of this revision and repeat.
COMMANDS: list[tuple[str, list[str]]] = [
    ("help", ["--help"]),
    ("contract", ["contract", "--num-layers", "30", "--aux-boundaries", "3,16,28", "--target-arch", "llama"]),
    ("export", ["export", "--draft", "reference", "--to", "vllm", "--out", "{out}/vllm"]),
    ("generate", ["generate", "--target", "smollm2-135m", "--draft", "reference", "--chat", "--prompt",
                  "Why is the sky blue?", "--max-new-tokens", "48"]),
    ("prepare", ["prepare", "--target", "smollm2-135m", "--data", "sharegpt", "--num-conversations", "16",
                 "--max-length", "512", "--out", "{out}/data"]),
    ("train", ["train", "--target", "smollm2-135m", "--data", "{out}/data", "--out", "{out}/draft", "--max-steps", "12",
               "--val-sequences", "2"]),
    ("doctor", ["doctor", "--draft", "reference", "--target", "smollm2-135m", "--data", "{out}/data",
                "--num-sequences", "4", "--no-tune"]),
    ("tune", ["tune", "--draft", "reference", "--num-prompts", "2", "--max-new-tokens", "32", "--out", "{out}/tune"]),
    ("bench", ["bench", "--draft", "reference", "--dataset", "mt-bench", "--num-prompts", "2", "--max-new-tokens", "32",
               "--configs", "1,0,0,0;1,3,1,4", "--out", "{out}/bench"]),
]


def worktree(rev: str) -> tuple[str, Path]:
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    path = Path(f"/tmp/eaglewire-rev-{sha}")
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, check=True,
                       capture_output=True)
    return sha, path


def run_once(tree: Path, args: list[str], out: Path, threads: int) -> tuple[float, int, str]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": str(threads)}
    argv = [sys.executable, "-m", "eaglewire.cli", "--threads", str(threads), *[a.replace("{out}", str(out)) for a in args]]
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=out, env=env, capture_output=True, text=True)
    return time.perf_counter() - start, done.returncode, (done.stderr or done.stdout)[-400:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", default="HEAD")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated command names (default: all)")
    ap.add_argument("--work", default="runs/command_times")
    ap.add_argument("--out", default="runs/command_times.json")
    a = ap.parse_args()
    revs = [worktree(a.old), worktree(a.new)]
    only = set(filter(None, a.only.split(",")))
    rows: list[dict] = []
    for name, args in COMMANDS:  # once, untimed: models and data sets fetched into the cache, files read once
        if not only or name in only:
            seconds, rc, tail = run_once(revs[1][1], args, (ROOT / a.work / "warm").resolve(), a.threads)
            print(f"{name:9s} warm-up: {seconds:7.1f} s rc {rc}" + (f"\n{tail}" if rc else ""), file=sys.stderr, flush=True)
    for r in range(a.repeats):
        for name, args in COMMANDS:
            if only and name not in only:
                continue
            for sha, tree in (revs if r % 2 == 0 else revs[::-1]):
                out = (ROOT / a.work / f"{sha}-{r}").resolve()
                seconds, rc, tail = run_once(tree, args, out, a.threads)
                rows.append({"command": name, "rev": sha, "repeat": r, "seconds": round(seconds, 2), "rc": rc})
                print(f"{name:9s} {sha} repeat {r}: {seconds:7.1f} s rc {rc}" + (f"\n{tail}" if rc else ""),
                      file=sys.stderr, flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"old": revs[0][0], "new": revs[1][0], "threads": a.threads, "runs": rows},
                                      indent=1))
    print(f"| command | {revs[0][0]} s (median) | {revs[1][0]} s (median) | new / old |\n|---|---|---|---|")
    for name, _ in COMMANDS:
        med = [statistics.median([x["seconds"] for x in rows if x["command"] == name and x["rev"] == sha] or [0])
               for sha, _ in revs]
        if med[0]:
            print(f"| {name} | {med[0]:.1f} | {med[1]:.1f} | {med[1] / med[0]:.2f} |")


if __name__ == "__main__":
    main()
