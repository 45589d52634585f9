"""Peer run: train speculators' (0.9) EAGLE-3 draft on CPU with eaglewire's recipe.

Runs in the speculators environment (see peer_speculators_check.py for its set-up) and
imports only speculators, torch, transformers and safetensors (never eaglewire). The data
directory comes from benchmarks/experiments/peers/shards_to_speculators.py (our shards in speculators'
offline layout, plus a local verifier directory: nothing is downloaded):

    /work/peer-venv/bin/python benchmarks/experiments/peers/peer_speculators_train.py \
        --data /work/runs/peer-data-100k --out /work/runs/peer-draft-100k --threads 2

It drives speculators' own trainer, ``speculators.train.cli.main`` (the ``speculators
train`` command), with these flags for eaglewire's recipe (extra speculators flags may
follow ``--`` and override them):

| eaglewire train            | speculators train                                         |
|----------------------------|-----------------------------------------------------------|
| --ttt-steps 7              | --ttt-steps 7                                             |
| --loss-decay 0.8           | --ttt-step-loss-decay 0.8 (weight decay**j, as ours)      |
| soft CE on the draft vocab | --loss-fn kl_div (same gradient), --loss-implementation eager (fused is Triton) |
| --draft-vocab-size 8192    | --draft-vocab-size 8192 (d2t/t2d from token_freq.pt)      |
| --lr 1e-4, AdamW, wd 0     | --optimizer adamw --lr 1e-4 --weight-decay 0              |
| 20 warmup + cosine to 0    | --scheduler-type cosine --scheduler-warmup-steps, with our min(warmup, total//10+1) |
| --batch-tokens 4096        | --total-seq-len 4096 (sequences packed in one row, no padding) |
| --epochs 1, --max-steps    | --epochs 1, --max-steps                                   |
| boundaries [2, 15, 27]     | --target-layer-ids 2 15 27 (from the conversion)          |
| our draft architecture     | --num-layers 1 --draft-arch llama --no-norm-before-residual --no-norm-before-fc --no-norm-output --full-attention-indices 0 |

Left as speculators has them (its API exposes no knob): gradient clipping at 1.0 (ours
0.5), AdamW betas (0.9, 0.999) (ours (0.9, 0.95)), a frozen lm_head initialised from the
target's (ours is trained), no dropping of positions whose target argmax falls outside
the draft vocabulary, and its loss-mask shift (see shards_to_speculators.py).

CPU adaptations (speculators' trainer assumes an accelerator), all without changing its
arithmetic: batches and the model go to "cpu" instead of local rank 0; its step timer
does not call torch.accelerator.synchronize(); attention is SDPA
(flex attention needs a GPU compile) with its additive mask built in float32 instead of
bf16, because SDPA rejects a bf16 mask for fp32 queries; hidden states are fp32 (CPU
autocast to bf16 is slow without AVX512-BF16); dataloader workers 0.

Throughput: target tokens processed per wall second spent in training epochs (data
loading, forward, backward, optimizer step); setup, validation and checkpoint writing are
excluded. Tokens are counted as eaglewire's trainer counts them (every token of every
sequence in a batch: ``train_tokens``); ``train_positions`` is what the forward sees
(speculators' shift drops one position per sequence). Written to
OUT/peer_metrics.json with the final training and validation metrics. The checkpoint
speculators saves is OUT/<last epoch>/ (config.json + model.safetensors, bf16).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="output of shards_to_speculators.py")
    p.add_argument("--out", type=Path, required=True, help="speculators save path (checkpoints, metrics)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--loss-decay", type=float, default=0.8)
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--batch-tokens", type=int, default=4096, help="speculators --total-seq-len")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attn-impl", default="sdpa", choices=["sdpa", "eager", "simple_flex_attention"])
    p.add_argument("--overwrite", action="store_true", help="replace --out")
    p.add_argument("extra", nargs="*", help="after --: more `speculators train` flags (they win)")
    return p.parse_args(argv)


def speculators_argv(args, meta: dict) -> list[str]:
    argv = [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", meta["verifier_dir"],
        "--data-path", str(args.data), "--hidden-states-backend", "file",
        "--save-path", str(args.out), "--log-dir", str(args.out / "logs"), "--logger", "",
        "--target-layer-ids", *map(str, meta["target_layer_ids"]),
        "--draft-vocab-size", str(args.draft_vocab_size),
        "--num-layers", "1", "--draft-arch", "llama",
        "--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output",
        "--full-attention-indices", "0", "--draft-attn-impl", args.attn_impl,
        "--total-seq-len", str(args.batch_tokens), "--train-data-ratio", str(meta["train_data_ratio"]),
        "--hidden-states-dtype", "float32", "--num-workers", "0", "--on-missing", "raise",
        "--loss-implementation", "eager", "--loss-fn", "kl_div",
        "--ttt-steps", str(args.ttt_steps), "--ttt-step-loss-decay", str(args.loss_decay),
        "--optimizer", "adamw", "--lr", str(args.lr), "--weight-decay", str(args.weight_decay),
        "--scheduler-type", "cosine", "--scheduler-warmup-steps", str(args.warmup_steps),
        "--epochs", str(args.epochs), "--seed", str(args.seed),
        "--no-resume-from-checkpoint", "--checkpoint-freq", "1", "--log-freq", "1",
    ]
    if args.max_steps is not None:
        argv += ["--max-steps", str(args.max_steps)]
    return argv + list(args.extra)


STATS: dict = {"train_seconds": 0.0, "train_tokens": 0, "train_positions": 0, "steps": 0, "epochs": 0,
               "last_train": {}, "val": None}


def _scalar_metrics(metrics: dict) -> dict[str, float]:
    """speculators' {name_sum, name_total} tensors -> {name: sum / total}."""
    out = {}
    for key, value in metrics.items():
        if key.endswith("_sum") and key[:-4] + "_total" in metrics:
            total = float(metrics[key[:-4] + "_total"])
            out[key[:-4]] = float(value) / total if total else None
    return out


def _finite(obj):
    """JSON-safe: NaN/inf (speculators' 0/0 metrics) -> None."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def install_cpu_patches(torch, args) -> None:
    """Make speculators' GPU-bound trainer run on CPU; see the module docstring."""
    import speculators.models.eagle3.core as eagle3_core
    import speculators.train.cli as train_cli
    import speculators.train.trainer as trainer_mod

    trainer_mod.get_local_rank = lambda: "cpu"  # Trainer moves the model and batches to local_rank
    eagle3_core.create_float_mask = functools.partial(eagle3_core.create_float_mask, dtype=torch.float32)

    original_steps = trainer_mod._resolve_scheduler_steps

    def resolve_scheduler_steps(config, train_loader_len):  # eaglewire's schedule: train.lr_lambda
        _, total = original_steps(config, train_loader_len)
        total = min(total, config.num_epochs * train_loader_len)
        warmup = min(args.warmup_steps, total // 10 + 1)
        STATS.update(scheduler_total_steps=total, scheduler_warmup_steps=warmup,
                     batches_per_epoch=train_loader_len)
        return warmup, total

    trainer_mod._resolve_scheduler_steps = resolve_scheduler_steps

    class CpuStepTimer(trainer_mod._StepTimer):  # its marks call torch.accelerator.synchronize()
        def mark(self, name):
            if self.enabled:
                self._marks[name] = time.perf_counter()

        def now(self):
            return time.perf_counter() if self.enabled else None

    trainer_mod._StepTimer = CpuStepTimer

    class TimedTrainer(trainer_mod.Trainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.device_type = "cpu"  # autocast device (speculators falls back to "cuda")
            self.model.register_forward_hook(self._count, with_kwargs=True)

        @staticmethod
        def _count(module, _args, kwargs, output):
            if module.training:
                docs = kwargs["document_ids"]  # [1, total_seq_len]: 0..n-1 per packed sequence, -1 padding
                positions = int((docs != -1).sum())
                STATS["train_positions"] += positions
                STATS["train_tokens"] += positions + int(docs.max()) + 1  # shift_batch drops 1 per sequence
                STATS["steps"] += 1
                STATS["last_train"] = _scalar_metrics(output[2])

        def train_epoch(self, epoch, **kw):
            start = time.perf_counter()
            try:
                return super().train_epoch(epoch, **kw)
            finally:
                STATS["train_seconds"] += time.perf_counter() - start
                STATS["epochs"] += 1
                print(f"[peer] epoch {epoch}: {STATS['steps']} steps, {STATS['train_tokens']} tokens, "
                      f"{STATS['train_seconds']:.1f}s in training", flush=True)

        def val_epoch(self, epoch):
            metrics = super().val_epoch(epoch)
            STATS["val"] = metrics
            return metrics

    train_cli.Trainer = TimedTrainer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    from speculators.train.cli import main as speculators_train
    from speculators.train.config import TrainConfig

    meta = json.loads((args.data / "eaglewire_conversion.json").read_text())
    if args.out.exists():
        if not args.overwrite:
            sys.exit(f"{args.out} exists; pass --overwrite or another --out")
        shutil.rmtree(args.out)
    spec_argv = speculators_argv(args, meta)
    cfg = TrainConfig.resolve(spec_argv)
    install_cpu_patches(torch, args)

    wall = time.perf_counter()
    speculators_train(cfg)
    wall = time.perf_counter() - wall

    epochs = [int(d.name) for d in args.out.iterdir() if d.is_dir() and not d.is_symlink() and d.name.isdigit()]
    checkpoint = args.out / str(max(epochs)) if epochs else None
    tps = STATS["train_tokens"] / STATS["train_seconds"] if STATS["train_seconds"] else 0.0
    report = {
        "tool": "speculators", "threads": args.threads, "tokens_per_s": round(tps, 2),
        **STATS, "wall_seconds_total": round(wall, 2),
        "checkpoint": str(checkpoint) if checkpoint else None,
        "data": str(args.data), "data_train_tokens": meta["train_tokens"],
        "speculators_argv": spec_argv,
    }
    (args.out / "peer_metrics.json").write_text(json.dumps(_finite(report), indent=1, default=float))
    acc = {k: round(v, 4) for k, v in STATS["last_train"].items() if k.startswith("full_acc") and v is not None}
    val = {k: round(v, 4) for k, v in _finite(STATS["val"] or {}).items() if k.startswith("full_acc") and v is not None}
    print(f"[peer] speculators EAGLE-3: {STATS['train_tokens']} tokens in {STATS['train_seconds']:.1f}s "
          f"of training = {tps:.1f} tokens/s at {args.threads} thread(s), {STATS['steps']} steps; "
          f"last step {acc}; validation {val}; checkpoint {checkpoint}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
