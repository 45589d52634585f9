"""EAGLE-3 and DFlash drafts trained from the same shards with the same wall-clock budget, side by side.

    # train both at once, one thread each, for the same minutes (resumable: rerun the same command);
    # --steps FAMILY=N sets each one's schedule (cosine to zero at N) to what its step rate fits in
    # the minutes (a first minute of each run says its tokens/s in metrics.jsonl)
    python benchmarks/experiments/training/families.py train --data runs/data --out runs/families --minutes 42 \
        --steps eagle3=720 --steps dflash=1320
    # both budgets extended alike: each family starts from its draft of a previous run (new schedule)
    python benchmarks/experiments/training/families.py train --data runs/data --out runs/families-2 --init-from runs/families \
        --minutes 80 --steps eagle3=1200 --steps dflash=4800
    # held-out τ in eaglewire's engine (greedy, 256 tokens, MT-bench and HumanEval), outputs vs plain
    python benchmarks/experiments/training/families.py measure --out runs/families --num-prompts 10
    # both in llama-server (draft-eagle3 / draft-dflash) against its plain decoding, per target GGUF
    python benchmarks/experiments/training/families.py llamacpp --out runs/families --gguf q4_0=Q4_0.gguf --gguf f16=F16.gguf

Both trainings run *concurrently*, each with one thread: whatever else the machine runs slows
both alike, so the same wall-clock budget buys each family what its own step costs (a sequential
pair on a shared 2-core machine would hand one of them a quieter half). The recipes are each
family's defaults at the reference's settings (lr 1e-3, 2,048 tokens per batch): EAGLE-3 with 4 TTT
steps and an 8,192-token draft vocabulary, DFlash with blocks of 8, two layers and 32 anchors per
sequence. `measure` runs `eaglewire bench` on each draft with a chain of 7 drafted tokens (the
longest a block of 8 proposes) and plain decoding, and writes `families.json` with τ, tokens/s and
whether every output equals plain decoding's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RECIPES = {
    "eagle3": ["--family", "eagle3", "--ttt-steps", "4", "--draft-vocab-size", "8192"],
    "dflash": ["--family", "dflash", "--block-size", "8", "--draft-layers", "2", "--anchors-per-sequence", "32"],
}
COMMON = ["--lr", "1e-3", "--batch-tokens", "2048", "--epochs", "20", "--eval-interval", "100",
          "--save-interval", "50", "--val-sequences", "32", "--no-progress"]
DATASETS = ("mt-bench", "humaneval")
CHAIN = "1,0,0,0;1,7,1,8"  # plain; a chain of 7 drafted tokens
LLAMACPP_CHAINS = (1, 2, 3, 5, 7)  # drafted tokens per round in llama-server


def eaglewire() -> list[str]:
    return [sys.executable, "-m", "eaglewire.cli"]


def train(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads_each), "MKL_NUM_THREADS": str(args.threads_each)}
    procs = {}
    for family, recipe in RECIPES.items():
        draft = out / family
        resume = ["--resume"] if (draft / "train_state.pt").exists() else []
        steps = dict(kv.split("=") for kv in args.steps).get(family)
        init = ["--init-draft", str(Path(args.init_from) / family)] if args.init_from else []
        cmd = [*eaglewire(), "train", "--target", args.target, "--data", args.data, "--out", str(draft),
               "--minutes", str(args.minutes), *COMMON, *recipe, *resume, *init, *args.extra,
               *(["--max-steps", steps] if steps else [])]
        log = open(out / f"{family}.log", "a")
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        procs[family] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log)
    start = time.time()
    for family, (proc, log) in procs.items():
        rc = proc.wait()
        log.close()
        print(f"{family}: exit {rc} after {time.time() - start:.0f} s (log {out / (family + '.log')})")


def measure(args: argparse.Namespace) -> None:
    out = Path(args.out)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    report = {"machine": subprocess.run([sys.executable, "-m", "eaglewire.core.machine"], capture_output=True,
                                        text=True).stdout.strip(), "drafts": {}}
    for family in RECIPES:
        draft = out / family
        trained = json.loads((draft / "config.json").read_text())["training"]
        row = {"steps": trained["steps"], "train_tokens": trained["train_tokens"], "seconds": trained["seconds"],
               "final_eval": trained["final_eval"], "datasets": {}}
        for dataset in DATASETS:
            bench_out = out / "bench" / family / dataset
            cmd = [*eaglewire(), "bench", "--target", args.target, "--draft", str(draft), "--dataset", dataset,
                   "--configs", CHAIN, "--max-new-tokens", str(args.max_new_tokens),
                   "--num-prompts", str(args.num_prompts), "--out", str(bench_out), "--no-progress"]
            subprocess.run(cmd, env=env, check=True)
            row["datasets"][dataset] = json.loads((bench_out / "bench.json").read_text())
        report["drafts"][family] = row
    (out / "families.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({f: {d: r["datasets"][d]["rows"] for d in DATASETS}
                      for f, r in report["drafts"].items()}, indent=2)[:4000])


def llamacpp(args: argparse.Namespace) -> None:
    """`eaglewire bench --engine llamacpp` for each draft on each target GGUF: plain and chains of
    LLAMACPP_CHAINS drafted tokens (a DFlash draft's as draft-dflash: one block of n + 1)."""
    out = Path(args.out)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    report = {}
    for name, gguf in (kv.split("=", 1) for kv in args.gguf):
        for family in RECIPES:
            bench_out = out / "llamacpp" / name / family
            configs = ";".join(["1,0,0,0"] + [f"1,{n},1,{n + 1}" for n in LLAMACPP_CHAINS])
            cmd = [*eaglewire(), "bench", "--target", args.target, "--draft", str(out / family), "--engine", "llamacpp",
                   "--engine-target", gguf, "--engine-threads", str(args.threads), "--dataset", args.dataset,
                   "--configs", configs, "--max-new-tokens", str(args.max_new_tokens),
                   "--num-prompts", str(args.num_prompts), "--out", str(bench_out), "--no-progress"]
            subprocess.run(cmd, env=env, check=True)
            report[f"{name}/{family}"] = json.loads((bench_out / "bench.json").read_text())["rows"]
    (out / "families-llamacpp.json").write_text(json.dumps(report, indent=2))
    for key, rows in report.items():
        print(key, [(r["name"], r["tokens_per_second"], r["tau_pooled"], r["speedup"]) for r in rows])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="stage", required=True)
    t = sub.add_parser("train")
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--target", default="smollm2-135m")
    t.add_argument("--minutes", type=float, default=60)
    t.add_argument("--threads-each", type=int, default=1)
    t.add_argument("--steps", action="append", default=[], help="FAMILY=N: that family's --max-steps")
    t.add_argument("--init-from", help="a previous --out: each family starts from its draft there (--init-draft: "
                                       "its weights, a new optimizer and schedule), extending both budgets alike")
    t.add_argument("extra", nargs="*", help="more train flags for both, after --")
    m = sub.add_parser("measure")
    m.add_argument("--out", required=True)
    m.add_argument("--target", default="smollm2-135m")
    m.add_argument("--num-prompts", type=int, default=10)
    m.add_argument("--max-new-tokens", type=int, default=256)
    m.add_argument("--threads", type=int, default=2)
    c = sub.add_parser("llamacpp")
    c.add_argument("--out", required=True)
    c.add_argument("--target", default="smollm2-135m")
    c.add_argument("--gguf", action="append", required=True, help="NAME=PATH of a target GGUF (repeatable)")
    c.add_argument("--dataset", default="mt-bench")
    c.add_argument("--num-prompts", type=int, default=4)
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    {"train": train, "measure": measure, "llamacpp": llamacpp}[args.stage](args)


if __name__ == "__main__":
    main()
