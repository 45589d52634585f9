"""EAGLE-3 draft training speed and MFU on one device, the step as it was against the step as it is now.

A random draft for a target of the shape's hidden size (benchmarks/gpu_targets.py SHAPES; draft vocabulary
8,192, TTT 7) trains on random stored states of that shape: no target weights, no shards. The target's
embedding and head are random tensors (the head over a 32,000-token vocabulary), as train's data path needs
them. Each variant times N optimizer steps after warm-up and reports tokens/s, MFU and host milliseconds per
step in data, target head, draft forward, backward and optimizer (on a GPU the parts are launch time: the
device runs behind; the total is synchronised):

- ``old``: reads in the step, the counts read to the host every step (``ttt_unroll``), the unfused AdamW, TTT
  attention through the dense [B, nH, T, T] scores on CUDA;
- ``new``: batches read ahead on a thread (pinned, non_blocking), the sync-free unroll (counts stay on the
  device, chunked soft cross-entropy), fused AdamW on CUDA, TTT attention through CUDA's flash kernel;
- ``new, norms as ops``: ``new`` with the draft's RMSNorm as the seven fp32 ops it was (the fused kernel's share);
- ``new, 2x the tokens a step``: ``new`` over twice the rows a micro-batch (what a larger ``--batch-tokens`` buys);
- ``new+compile``: ``new`` with the layer's norms and MLP compiled (skipped when the time budget is spent).

    python benchmarks/experiments/gpu/gpu_train_probe.py --device cuda --shape llama-3.1-8b     # <= 60 s on an H200
    python benchmarks/experiments/gpu/gpu_train_probe.py --device cpu --shape tiny              # rehearsal, <= 90 s

Prints ONE JSON line, whatever fails (each variant's error is reported in its place).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

SHAPE_RUN = {  # per shape: micro-batch (rows x tokens), steps timed, target vocabulary
    "llama-3.1-8b": dict(rows=4, tokens=1024, steps=8, warmup=2, vocab=32000),
    "tiny": dict(rows=4, tokens=128, steps=8, warmup=2, vocab=2048),
}
DRAFT_VOCAB, TTT_STEPS, NUM_AUX = 8192, 7, 3
VARIANTS = {"old": dict(prefetch=False, sync_free=False, compile_layer=False, dense_attention=True, ops_norm=True),
            "new": dict(prefetch=True, sync_free=True, compile_layer=False),
            "new, norms as ops": dict(prefetch=True, sync_free=True, compile_layer=False, ops_norm=True),
            "new, 2x the tokens a step": dict(prefetch=True, sync_free=True, compile_layer=False, rows_scale=2),
            "new+compile": dict(prefetch=True, sync_free=True, compile_layer=True)}


_SHIPPED: dict = {}  # methods as the project has them, kept while a variant replaces them


def build(shape: str, device, dtype_name: str):
    import torch

    from eaglewire.model.draft import DraftConfig, Eagle3Draft
    from gpu_targets import SHAPES

    s, run = SHAPES[shape], SHAPE_RUN[shape]
    H = s["hidden_size"]
    cfg = DraftConfig(hidden_size=H, target_hidden_size=H, num_aux=NUM_AUX, num_attention_heads=s["num_attention_heads"],
                      num_key_value_heads=s["num_key_value_heads"], head_dim=H // s["num_attention_heads"],
                      intermediate_size=s["intermediate_size"], vocab_size=run["vocab"],
                      draft_vocab_size=min(DRAFT_VOCAB, run["vocab"]), rope_theta=s.get("rope_theta", 10000.0))
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    t2d = torch.zeros(run["vocab"], dtype=torch.bool)
    t2d[:cfg.draft_vocab_size] = True
    draft.set_vocab(torch.zeros(cfg.draft_vocab_size, dtype=torch.long), t2d)
    return draft.to(device), cfg


class RandomTarget:
    """What Eagle3Objective reads of a target: embedding, head, dtype (random, on the device)."""

    def __init__(self, H: int, vocab: int, device, dtype) -> None:
        import torch

        g = torch.Generator().manual_seed(1)
        self.embedding = torch.nn.Embedding(vocab, H).to(device, dtype)
        self.head_weight = (torch.randn(vocab, H, generator=g) / H ** 0.5).to(device, dtype)
        self.dtype = dtype

    def embed_tokens(self, ids):
        return self.embedding(ids)

    def head(self, x):
        return x @ self.head_weight.T  # [N, V]


_BATCHES: dict = {}


def make_batches(n: int, rows: int, tokens: int, H: int, vocab: int):
    """Host batches as a shard reader returns them (bf16 states, 73% of positions under the loss mask);
    made once per process."""
    key = (n, rows, tokens, H, vocab)
    if key not in _BATCHES:
        _BATCHES[key] = _random_batches(*key)
    return _BATCHES[key]


def _random_batches(n: int, rows: int, tokens: int, H: int, vocab: int):
    import torch

    from eaglewire.data.sources import Batch

    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(n):
        out.append(Batch(input_ids=torch.randint(0, vocab, (rows, tokens), generator=g),
                         loss_mask=torch.rand(rows, tokens, generator=g) < 0.73,
                         aux_hidden=torch.randn(rows, tokens, NUM_AUX * H, generator=g).to(torch.bfloat16),
                         last_hidden=torch.randn(rows, tokens, H, generator=g).to(torch.bfloat16)))
    return out


def run_variant(name: str, shape: str, device, *, prefetch: bool, sync_free: bool, compile_layer: bool,
                dense_attention: bool = False, rows_scale: int = 1, ops_norm: bool = False) -> dict:
    """``dense_attention``: TTT attention through the [B, nH, T, T] score matrix, as before the flash paths (on
    CUDA; the CPU's fp32 path was flash already). ``rows_scale``: that many times the shape's rows a micro-batch
    (``train --batch-tokens`` raised alike). ``ops_norm``: the draft's RMSNorm as ops on every device, as before
    its fused kernel on CUDA."""
    import torch

    import eaglewire.model.draft as draft_module
    from eaglewire.model.ttt_attention import ttt_attention, ttt_attention_dense

    draft_module.ttt_attention = ttt_attention_dense if dense_attention and device.type == "cuda" else ttt_attention
    norm = draft_module.RMSNorm
    shipped = _SHIPPED.setdefault("RMSNorm.forward", norm.forward)  # before any variant replaced it
    norm.forward = norm.ops if ops_norm else shipped

    from eaglewire.core.precision import resolve_precision
    from eaglewire.train.flops import DraftShape, eagle3_train_flops, utilisation
    from eaglewire.train.objectives import Eagle3Objective
    from eaglewire.train.prefetch import InStep, Prefetcher

    run = SHAPE_RUN[shape]
    precision = resolve_precision("bf16" if device.type == "cuda" else "fp32", device)
    draft, cfg = build(shape, device, precision.name)
    target = RandomTarget(cfg.hidden_size, run["vocab"], device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    objective = Eagle3Objective(target, ttt_steps=TTT_STEPS, loss_decay=0.8, draft_vocab_size=cfg.draft_vocab_size)
    compiled = None
    if compile_layer:
        from eaglewire.train.compiled import compile_layer as compile_it

        compiled = compile_it(draft, precision)
    fused = True if device.type == "cuda" and sync_free else None
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=fused)
    n = run["warmup"] + run["steps"]
    host = make_batches(n, run["rows"] * rows_scale, run["tokens"], cfg.hidden_size, run["vocab"])
    plan = [[i] for i in range(n)]
    load = (lambda idx: host[idx[0]]) if prefetch else (lambda idx: _moved(host[idx[0]], device))
    batches = Prefetcher(load, plan, device, depth=2) if prefetch else InStep(load, plan, device)
    parts = dict.fromkeys(("data", "target_head", "draft_forward", "backward", "optimizer"), 0.0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tokens = 0
    try:
        for step in range(n):
            if step == run["warmup"]:
                sync()
                parts = dict.fromkeys(parts, 0.0)
                start, tokens = time.perf_counter(), 0
            t = [time.perf_counter()]
            batch = next(batches)
            t.append(time.perf_counter())
            optimizer.zero_grad(set_to_none=True)
            # sync_free: the training loop's dense mode (every position, nothing read by the host); else the
            # selecting mode, with the non-finite check read before the update as the CPU step does
            signal = objective.signal(draft, batch, dense=sync_free)
            t.append(time.perf_counter())
            normalizers = objective.counted(batch, signal)  # [K]
            with precision.autocast():
                loss, counts = objective.loss(draft, batch, signal, normalizers, dense=sync_free)
            if not sync_free and not torch.isfinite(loss):
                raise RuntimeError(f"loss is {loss.item()}")
            t.append(time.perf_counter())
            loss.backward()
            t.append(time.perf_counter())
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 0.5)
            optimizer.step()
            t.append(time.perf_counter())
            for key, a, b in zip(parts, t, t[1:]):
                parts[key] += b - a
            tokens += batch.input_ids.numel()  # padded tokens: the probe's rows are all full length
        sync()
        seconds = time.perf_counter() - start
    finally:
        batches.close()
    if sync_free:
        float(counts.sum())  # the one read (a log row's)
    flops = eagle3_train_flops(DraftShape.of(cfg), ttt_steps=TTT_STEPS, seq_len=run["tokens"])
    name_ = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    use = utilisation(tokens, seconds, flops, device_name=name_, dtype=precision.name)
    out = {**use.record(), "step_ms": round(1000 * seconds / run["steps"], 2),
           "host_ms": {k: round(1000 * v / run["steps"], 2) for k, v in parts.items()},
           "loss": round(float(loss.detach()), 4)}
    if compiled is not None:
        out["compiled"] = compiled
    return out


def _child(name: str, args, timeout: float) -> dict:
    import subprocess

    cmd = [sys.executable, __file__, "--device", args.device, "--shape", args.shape, "--only", name]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"skipped": f"not done within the {timeout:.0f} s left of the budget (compiling)"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"error": f"exit {done.returncode}", "where": done.stderr.strip().splitlines()[-3:]}
    return json.loads(lines[-1])


def _moved(batch, device):
    from eaglewire.train.prefetch import batch_to

    return batch_to(batch, device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", choices=tuple(SHAPE_RUN), default="llama-3.1-8b")
    ap.add_argument("--budget", type=float, default=None, help="seconds after which remaining variants are skipped "
                    "(default 55 on cuda, 75 on cpu)")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled variant")
    ap.add_argument("--only", choices=tuple(VARIANTS), help=argparse.SUPPRESS)  # one variant, its JSON (a child run)
    args = ap.parse_args()
    if args.only:
        import torch

        print(json.dumps(run_variant(args.only, args.shape, torch.device(args.device), **VARIANTS[args.only])))
        return
    began = time.perf_counter()
    budget = args.budget or (55.0 if args.device == "cuda" else 75.0)
    report: dict = {"probe": "gpu_train_probe", "device": args.device, "shape": args.shape, "ttt_steps": TTT_STEPS,
                    "draft_vocab": DRAFT_VOCAB, **SHAPE_RUN.get(args.shape, {}), "variants": {}}
    try:
        import torch

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        device = torch.device(args.device)
        if device.type == "cuda":
            report["gpu"] = torch.cuda.get_device_name(device)
        report["torch"] = torch.__version__
        names = [n for n in VARIANTS if not (args.no_compile and VARIANTS[n]["compile_layer"])]
        for name in names:
            left = budget - (time.perf_counter() - began)
            if left < 5:
                report["variants"][name] = {"skipped": f"time budget of {budget:.0f} s spent"}
                continue
            t0 = time.perf_counter()
            try:
                if VARIANTS[name]["compile_layer"]:  # compiling may take long: a child process, killed at the budget
                    report["variants"][name] = _child(name, args, left)
                else:
                    report["variants"][name] = run_variant(name, args.shape, device, **VARIANTS[name])
            except Exception as e:  # report it in its place; the other variants still run
                report["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:500],
                                            "where": traceback.format_exc().strip().splitlines()[-3:]}
            report["variants"][name]["wall_s"] = round(time.perf_counter() - t0, 1)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        old, new = (report["variants"].get(k, {}).get("tokens_per_s") for k in ("old", "new"))
        if old and new:
            report["speedup_new_vs_old"] = round(new / old, 3)
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"[:500]
    report["wall_s"] = round(time.perf_counter() - began, 1)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
