"""Continuous batching in process: aggregate tokens/s of B sequences decoded together, plain and speculative, per
batch size (SmolLM2-135M + the shipped reference draft, MT-bench prompts, greedy, every sequence joined at once).

    OMP_NUM_THREADS=2 python benchmarks/experiments/engine/batch_engine_speed.py --batch 1,2,4,8,16 --tokens 64

Prints one row per (shape, batch size): tokens/s over the whole batch, ms a step, and tau; and whether each
sequence's output equals plain decoding's at the same batch size.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def run_batch(engine, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float, int, float]:
    """-> (outputs, seconds, steps, tau)."""
    start = time.perf_counter()
    seqs = [engine.add(p, max_new_tokens=tokens) for p in prompts]
    steps = 0
    while engine.live:
        engine.step()
        steps += 1
    seconds = time.perf_counter() - start
    rounds = sum(s.stats.rounds for s in seqs)
    tau = sum(sum(s.stats.accept_lengths) for s in seqs) / max(rounds, 1)
    return [s.produced for s in seqs], seconds, steps, tau


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,2,4,8,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="plain,chain 1,chain 3")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from eaglewire.core.machine import summary_line
    from eaglewire.core.presets import DEFAULT_TARGET, resolve_draft
    from eaglewire.core.prompts import load_prompts
    from eaglewire.decode.batch_engine import BatchEngine
    from eaglewire.decode.load import load_decoder
    from eaglewire.concurrency.schedule import Schedule
    from eaglewire.decode.spec_config import SpecConfig
    from eaglewire.decode.text import encode_prompt

    decoder = load_decoder(DEFAULT_TARGET, resolve_draft("reference"), SpecConfig.chain(3), dtype=args.dtype)
    tok = decoder.target.tokenizer
    all_prompts = [encode_prompt(tok, p.text, chat=p.chat) for p in load_prompts("mt-bench")]
    batches = [int(b) for b in args.batch.split(",")]
    shapes = {"plain": None, **{s: SpecConfig.chain(int(s.split()[1])) for s in args.shapes.split(",")
                                if s.startswith("chain")}}
    print(summary_line(), decoder.target.dtype, flush=True)
    rows, plain_out = [], {}
    for B in batches:
        prompts = [all_prompts[i % len(all_prompts)] for i in range(B)]
        for name in [s.strip() for s in args.shapes.split(",")]:
            engine = BatchEngine(decoder, Schedule.fixed(shapes[name]))
            run_batch(engine, prompts[:1], 4)  # warm the slot's caches and oneDNN's kernels
            outs, seconds, steps, tau = run_batch(engine, prompts, args.tokens)
            if name == "plain":
                plain_out[B] = outs
            same = sum(o == p for o, p in zip(outs, plain_out.get(B, outs)))
            n = sum(map(len, outs))
            row = dict(shape=name, batch=B, tokens_per_s=round(n / seconds, 1), ms_per_step=round(1e3 * seconds / steps, 1),
                       tau=round(tau, 2), same_as_plain=f"{same}/{B}")
            rows.append(row)
            print(f"B={B:3} {name:8} {row['tokens_per_s']:7.1f} tok/s  {row['ms_per_step']:7.1f} ms/step  "
                  f"tau {row['tau']:.2f}  same as plain {row['same_as_plain']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": summary_line(), "threads": args.threads, "dtype": str(decoder.target.dtype), "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
