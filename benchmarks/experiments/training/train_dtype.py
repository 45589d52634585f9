"""Training in bf16 against fp32 on this CPU, side by side in one process (issue 30's target:
>= 1.8x tokens/s where the CPU computes bf16 natively, held-out acc@0 within noise at equal tokens).

    # a short run (about 4 minutes on 2 cores)
    python benchmarks/experiments/training/train_dtype.py --out /tmp/train-dtype --threads 2 --train-conversations 64 \
        --heldout-conversations 16 --max-length 512 --steps 12 --batch-tokens 2048
    # the full comparison
    nice -n 10 python benchmarks/experiments/training/train_dtype.py --out /tmp/train-dtype --threads 2 \
        --train-conversations 2000 --heldout-conversations 200 --steps 2000

Two measurements:
1. ``step``: one TTT step (forward + backward) of the SmolLM2-shaped draft on
   ``benchmarks/train_step.py``'s synthetic batch (``--micro-batch`` x ``--micro-tokens``), fp32 and
   bf16 (``--dtype bf16``'s autocast), each with the flash and the dense TTT attention, alternating
   in every round so a shared machine's load falls on all variants alike.
2. ``train``: `train` on the same shards (ShareGPT through the SmolLM2 target, captured once in
   fp32; a rerun into the same ``--out`` reuses them, and `prepare` has checked their labels, so
   `train` skips that check) with one recipe and seed, so both runs see the same batches, the same tokens: tokens/s of
   the training steps (the loop's timers: data, target head, draft forward, backward; not the
   evaluation or checkpoints) and held-out acc@0 (the TTT unroll's first step against the target
   head's argmax, fed the stored states of held-out conversations, as `doctor --stored` measures).

Prints the CPU (``eaglewire.core.machine``) and the torch thread count it ran with.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: train_step.py
from train_step import batch, smollm2_draft  # noqa: E402  the same draft and batch

from eaglewire.core import machine  # noqa: E402
from eaglewire.core.precision import resolve_precision  # noqa: E402
from eaglewire.data.prepare import PrepareConfig, prepare  # noqa: E402
from eaglewire.data.shards import ShardDataset  # noqa: E402
from eaglewire.doctor.measure import isolation_accuracy  # noqa: E402
from eaglewire.doctor.stored import stored_batches  # noqa: E402
from eaglewire.model import ttt_attention as attention_module  # noqa: E402
from eaglewire.model.checkpoint import load_draft  # noqa: E402
from eaglewire.model.target import load_target  # noqa: E402
from eaglewire.model.ttt import ttt_unroll  # noqa: E402
from eaglewire.train.loop import train  # noqa: E402
from eaglewire.train.train_config import TrainConfig  # noqa: E402

DTYPES = ("fp32", "bf16")


def args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--data", default="sharegpt")
    p.add_argument("--train-conversations", type=int, default=2000)
    p.add_argument("--heldout-conversations", type=int, default=200)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--micro-tokens", type=int, default=512)
    p.add_argument("--micro-repeats", type=int, default=2, help="0: skip the one-step measurement")
    return p.parse_args()


def step_times(a) -> dict[str, float]:
    """Median seconds of one TTT step per (dtype, attention), alternating each round."""
    draft, inputs = smollm2_draft(), batch(a.micro_batch, a.micro_tokens)
    emb, aux, loss_mask, signal = inputs
    variants = {f"{d} {name}": (d, fn) for d in DTYPES for name, fn in
                (("flash", attention_module.ttt_attention_flash), ("dense", attention_module.ttt_attention_dense))}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(a.micro_repeats + 1):  # the first round warms up
        for name, (dtype, fn) in variants.items():
            with mock.patch("eaglewire.model.draft.ttt_attention", fn):
                start = time.perf_counter()
                with resolve_precision(dtype, "cpu").autocast():
                    loss, _ = ttt_unroll(draft, emb, aux, loss_mask, signal, ttt_steps=a.ttt_steps)
                loss.backward()
                draft.zero_grad(set_to_none=True)
                if r:
                    times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def print_steps(a, steps: dict[str, float]) -> None:
    if not steps:
        return
    tokens, base = a.micro_batch * a.micro_tokens, steps["fp32 flash"]
    print(f"\none TTT-{a.ttt_steps} step, {a.micro_batch} x {a.micro_tokens} tokens, {a.threads} threads, "
          f"median of {a.micro_repeats}\n\n| dtype, TTT attention | s / step | tokens/s | vs fp32 flash |\n|---|---|---|---|")
    for name, s in steps.items():
        print(f"| {name} | {s:.2f} | {tokens / s:.0f} | {base / s:.2f}x |", flush=True)


def heldout_acc0(draft_dir: Path, heldout: ShardDataset, target, max_length: int) -> float:
    draft, contract, _ = load_draft(draft_dir, target=target)
    batches = stored_batches(heldout, list(range(len(heldout))), target, draft, labels="head", max_length=max_length)
    return isolation_accuracy(draft, batches, list(contract.aux_boundaries), steps=1)[0].acc


def main() -> int:
    a = args()
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    start = time.perf_counter()
    info = machine.describe()
    print(machine.summary_line(info), flush=True)
    steps = step_times(a) if a.micro_repeats else {}
    print_steps(a, steps)
    target = load_target(a.target, device="cpu", dtype="fp32")  # one capture feeds both runs
    common = dict(target=a.target, data=a.data, max_length=a.max_length, batch_tokens=max(4096, a.max_length),
                  device="cpu", dtype="fp32")
    shards, heldout_dir = out / "shards", out / "heldout"
    prepare(PrepareConfig(out=str(shards), num_conversations=a.train_conversations, **common), target=target,
            progress=False)
    prepare(PrepareConfig(out=str(heldout_dir), offset=a.train_conversations,
                          num_conversations=a.heldout_conversations, **common), target=target, progress=False)
    heldout = ShardDataset(heldout_dir)
    runs = {}
    for dtype in DTYPES:
        draft_dir = out / f"draft-{dtype}"
        result = train(TrainConfig(out=str(draft_dir), target=a.target, data=str(shards), max_steps=a.steps,
                                   ttt_steps=a.ttt_steps, batch_tokens=a.batch_tokens, lr=a.lr,
                                   warmup_steps=min(20, max(1, a.steps // 10)),
                                   val_sequences=min(32, max(1, a.train_conversations // 8)),
                                   eval_interval=max(a.steps, 1), save_interval=max(a.steps, 1), device="cpu",
                                   dtype=dtype, skip_label_check=True), target=target, progress=False)
        step_seconds = sum(result.timers.values())
        runs[dtype] = {"steps": result.steps, "train_tokens": result.train_tokens, "step_seconds": step_seconds,
                       "tokens_per_s": result.train_tokens / step_seconds, "timers": result.timers,
                       "heldout_acc0": heldout_acc0(draft_dir, heldout, target, a.max_length),
                       "final_val_loss": result.final_eval.get("val_loss")}
    report = {"machine": info, "threads": a.threads, "step_seconds": steps,
              "micro_batch": [a.micro_batch, a.micro_tokens], "train": runs,
              "train_speedup": runs["bf16"]["tokens_per_s"] / runs["fp32"]["tokens_per_s"],
              "acc0_difference": runs["bf16"]["heldout_acc0"] - runs["fp32"]["heldout_acc0"],
              "heldout_tokens": heldout.num_tokens, "seconds": time.perf_counter() - start}
    (out / "train_dtype.json").write_text(json.dumps(report, indent=1))
    print(f"\ntrain: {a.steps} steps of {a.batch_tokens} padded tokens, ttt {a.ttt_steps}, same shards and seed\n\n"
          "| --dtype | train tokens | tokens/s (steps) | held-out acc@0 | final val loss |\n|---|---|---|---|---|")
    for dtype, r in runs.items():
        print(f"| {dtype} | {r['train_tokens']:,} | {r['tokens_per_s']:.0f} | {r['heldout_acc0']:.3f} | "
              f"{r['final_val_loss']:.3f} |")
    print(f"\nbf16 / fp32 tokens/s: {report['train_speedup']:.2f}x; acc@0 difference {report['acc0_difference']:+.3f} "
          f"on {heldout.num_tokens:,} held-out tokens; {report['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
