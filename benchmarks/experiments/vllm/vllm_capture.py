"""Capture through vLLM against eaglewire's in-process capture: the same conversations, one run, tokens/s.

    OMP_NUM_THREADS=2 python benchmarks/experiments/vllm/vllm_capture.py --conversations 48 --threads 2 --dtype fp32 \
        --out benchmarks/experiments/vllm/vllm_capture.json
    # bf16, and a draft trained on each capture (same seed and batches, 6 epochs: ~10 minutes each on 2 cores),
    # held-out acc@0 on one in-process capture
    OMP_NUM_THREADS=2 python benchmarks/experiments/vllm/vllm_capture.py --conversations 48 --threads 2 --dtype bf16 \
        --train-epochs 6 --heldout-conversations 16 --out benchmarks/experiments/vllm/vllm_capture_bf16.json

Runs `prepare` twice on the same slice (in process, then `--capture vllm`, which launches vLLM here and
cross-checks its first 4 sequences per boundary) and compares the shards' states per sequence. The vLLM figure
is given with and without its server start (seconds_to_ready, from the launch record). Nothing else should run
beside it: the vLLM server and this process share the machine's cores.

``--train-epochs N`` then trains a draft on each capture with one recipe and seed (the quickstart's) (the same batches: the shards hold
the same sequences in the same order) and measures held-out acc@0 of both on one in-process capture of
``--heldout-conversations`` others, with its binomial standard error: the two captures are the same training data
when the difference is within it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from eaglewire.core.machine import summary_line
from eaglewire.data.engine_capture import relative_error
from eaglewire.data.prepare import PrepareConfig, prepare
from eaglewire.data.shards import ShardDataset
from eaglewire.model.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--aux-boundaries", type=lambda text: [int(b) for b in text.split(",")], default=None,
                    help="e.g. 0,2,15,27 (default: the contract's [2, L/2, L-3])")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--train-epochs", type=int, default=0, help="0: no training comparison")
    ap.add_argument("--heldout-conversations", type=int, default=16)
    ap.add_argument("--batch-tokens", type=int, default=2048, help="the quickstart's recipe: 2048, lr 1e-3")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--work", type=Path, default=None,
                    help="keep the shards and drafts here; a rerun resumes the captures (their tokens/s are then "
                         "not a measurement) and trains again")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("smollm2-135m", device="cpu", dtype=args.dtype)
    work = args.work or Path(tempfile.mkdtemp(prefix="vllm-capture-"))
    runs = {}
    for name, extra in (("here", {}), ("vllm", {"capture": "vllm", "capture_threads": args.threads})):
        config = PrepareConfig(out=str(work / name), num_conversations=args.conversations, offset=1000,
                               max_length=args.max_length, dtype=args.dtype, aux_boundaries=args.aux_boundaries,
                               **extra)
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
    stored = [*a.contract.aux_boundaries, "L"]  # the aux states in the contract's order, then boundary L
    gaps = {str(k): 0.0 for k in stored}
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"])
        H = x["last_hidden"].shape[-1]
        pairs = [(x["aux_hidden"][:, j * H:(j + 1) * H], y["aux_hidden"][:, j * H:(j + 1) * H])  # [T, H] each
                 for j in range(len(stored) - 1)] + [(x["last_hidden"], y["last_hidden"])]
        for k, (here, there) in zip(stored, pairs):
            gaps[str(k)] = max(gaps[str(k)], relative_error(there, here))  # per token, as the run's own check
    result = {"machine": summary_line(), "threads": args.threads,
              "dtype": args.dtype, "aux_boundaries": args.aux_boundaries, "conversations": args.conversations, "runs": runs,
              "vllm_vs_here": round(runs["vllm"]["tokens_per_s_after_start"] / runs["here"]["tokens_per_s"], 2),
              "stored_state_gap_max": {k: round(v, 6) for k, v in gaps.items()},
              "capture_check": json.loads((work / "vllm" / "manifest.json").read_text())["status"]["capture_check"]}
    if args.train_epochs:
        result["train"] = train_on_each(args, target, work)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def train_on_each(args, target, work: Path) -> dict:
    """A draft trained on each capture (same recipe, seed and steps); held-out acc@0 on one in-process capture."""
    from eaglewire.doctor.measure import isolation_accuracy
    from eaglewire.doctor.stored import stored_batches
    from eaglewire.model.checkpoint import load_draft
    from eaglewire.train.loop import train
    from eaglewire.train.train_config import TrainConfig

    heldout_dir = work / "heldout"
    prepare(PrepareConfig(out=str(heldout_dir), num_conversations=args.heldout_conversations,
                          offset=1000 + args.conversations, max_length=args.max_length, dtype=args.dtype,
                          aux_boundaries=args.aux_boundaries),
            target=target, progress=False)
    heldout = ShardDataset(heldout_dir)
    out = {"epochs": args.train_epochs, "batch_tokens": args.batch_tokens, "lr": args.lr,
           "heldout_tokens": heldout.num_tokens}
    for name in ("here", "vllm"):
        draft_dir = work / f"draft-{name}-{args.train_epochs}ep"
        start = time.perf_counter()
        result = train(TrainConfig(out=str(draft_dir), target="smollm2-135m", data=str(work / name),
                                   epochs=args.train_epochs, batch_tokens=args.batch_tokens, lr=args.lr,
                                   warmup_steps=10, val_sequences=4, eval_interval=10_000, save_interval=10_000,
                                   device="cpu",
                                   dtype=args.dtype, skip_label_check=True), target=target, progress=False)
        wall = time.perf_counter() - start
        draft, contract, _ = load_draft(draft_dir, target=target)
        batches = stored_batches(heldout, list(range(len(heldout))), target, draft, labels="head",
                                 max_length=args.max_length)
        counts = isolation_accuracy(draft, batches, list(contract.aux_boundaries), steps=1)[0]
        acc = counts.acc
        out[name] = {"train_s": round(wall, 1), "steps": result.steps, "train_tokens": result.train_tokens,
                     "heldout_acc0": round(acc, 4), "heldout_positions": counts.valid,
                     "stderr": round((acc * (1 - acc) / max(counts.valid, 1)) ** 0.5, 4)}
        print(name, out[name], flush=True)
    out["acc0_difference"] = round(out["vllm"]["heldout_acc0"] - out["here"]["heldout_acc0"], 4)
    return out


if __name__ == "__main__":
    main()
