"""Capture through vLLM against eaglewire's in-process capture: the same conversations, one run, tokens/s.

    OMP_NUM_THREADS=2 python benchmarks/vllm_capture.py --conversations 48 --threads 2 --dtype fp32 \
        --out benchmarks/vllm_capture.json

Runs `prepare` twice on the same slice (in process, then `--capture vllm`, which launches vLLM here and
cross-checks its first 4 sequences per boundary) and compares the shards' states per sequence. The vLLM figure
is given with and without its server start (seconds_to_ready, from the launch record). Nothing else should run
beside it: the vLLM server and this process share the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from eaglewire.core.machine import summary_line
from eaglewire.data.prepare import PrepareConfig, prepare
from eaglewire.data.shards import ShardDataset
from eaglewire.model.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("smollm2-135m", device="cpu", dtype=args.dtype)
    work = Path(tempfile.mkdtemp(prefix="vllm-capture-"))
    runs = {}
    for name, extra in (("here", {}), ("vllm", {"capture": "vllm", "capture_threads": args.threads})):
        config = PrepareConfig(out=str(work / name), num_conversations=args.conversations, offset=1000,
                               max_length=args.max_length, dtype=args.dtype, **extra)
        start = time.perf_counter()
        summary = prepare(config, target=target, progress=False)
        wall = time.perf_counter() - start
        record = work / name / "vllm-capture.log.json"
        ready = json.loads(record.read_text())["seconds_to_ready"] if record.exists() else 0.0
        runs[name] = {"tokens": summary.tokens, "sequences": summary.sequences, "wall_s": round(wall, 1),
                      "server_start_s": round(ready, 1), "tokens_per_s": round(summary.tokens / wall, 1),
                      "tokens_per_s_after_start": round(summary.tokens / (wall - ready), 1)}
        print(name, runs[name], flush=True)
    a, b = ShardDataset(work / "here"), ShardDataset(work / "vllm")
    gaps = {"aux_hidden": [], "last_hidden": []}
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"])
        for name in gaps:
            gaps[name].append(float((x[name].float() - y[name].float()).norm() / x[name].float().norm()))
    result = {"machine": summary_line(), "threads": args.threads,
              "dtype": args.dtype, "conversations": args.conversations, "runs": runs,
              "vllm_vs_here": round(runs["vllm"]["tokens_per_s_after_start"] / runs["here"]["tokens_per_s"], 2),
              "stored_state_gap_max": {k: max(v) for k, v in gaps.items()},
              "capture_check": json.loads((work / "vllm" / "manifest.json").read_text())["status"]["capture_check"]}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
