"""Where a continuous-batching step's time goes: per (shape, batch size), ms a step in the target pass
(``BatchEngine._forward``), its head, the drafting (``draft_chains``) and the acceptance (``_settle``), over B
MT-bench prompts x 64 tokens decoded together (SmolLM2-135M + the reference draft, greedy).

    OMP_NUM_THREADS=2 python benchmarks/experiments/engine/batch_step_profile.py --dtype auto --batch 1,8
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--chains", default="0,1,3", help="drafted tokens per round; 0 = plain")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import eaglewire.decode.batch_engine as batch_engine
    from eaglewire.core.machine import summary_line
    from eaglewire.core.presets import DEFAULT_TARGET, resolve_draft
    from eaglewire.core.prompts import load_prompts
    from eaglewire.decode.load import load_decoder
    from eaglewire.concurrency.schedule import Schedule
    from eaglewire.decode.spec_config import SpecConfig
    from eaglewire.decode.text import encode_prompt

    decoder = load_decoder(DEFAULT_TARGET, resolve_draft("reference"), SpecConfig.chain(1), dtype=args.dtype)
    prompts = [encode_prompt(decoder.target.tokenizer, p.text, chat=p.chat) for p in load_prompts("mt-bench")[:16]]
    spent: dict[str, float] = {}

    def timed(name, fn):
        def run(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
            return out
        return run

    batch_engine.draft_chains = timed("draft", batch_engine.draft_chains)
    print(summary_line(), decoder.target.dtype, flush=True)
    for steps in (int(c) for c in args.chains.split(",")):
        for B in (int(b) for b in args.batch.split(",")):
            engine = batch_engine.BatchEngine(decoder, Schedule.fixed(SpecConfig.chain(steps) if steps else None))
            for name in ("_forward", "_head", "_settle", "_extend"):
                setattr(engine, name, timed(name.strip("_"), getattr(engine, name)))
            for b in range(B):
                engine.add(prompts[b % len(prompts)], max_new_tokens=64)
            spent.clear()
            start, n = time.perf_counter(), 0
            while engine.live:
                engine.step()
                n += 1
            total = time.perf_counter() - start
            parts = ", ".join(f"{k} {1e3 * v / n:.1f}" for k, v in spent.items())
            print(f"{'plain' if not steps else f'chain {steps}':8} B={B:3}: {1e3 * total / n:6.1f} ms a step ({parts})",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
