"""Batched plain decoding, the regeneration workload: HF ``generate`` vs our batched lean decoder.

Side by side in one process, alternating (HF first in odd rounds, ours first in even ones), on
the first ``batch`` MT-bench first turns through the chat template, greedy, stopping at EOS /
end of turn like ``eaglewire regenerate``. Both sides run regenerate's own ``_generate`` (HF:
left-padded ``generate``; ours: ``decode.batched.BatchedDecoder``, weights prepared once outside
the timing, as regenerate does once per run), after one short untimed call of each. tokens/s
counts reply tokens, stop token included, over the wall time of the whole call (prefill
included); "same replies" counts rows whose greedy replies agree.

    python benchmarks/experiments/engine/batched_decode.py [--batch 16 64] [--max-new-tokens 64] [--threads 2] [--rounds 1]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch

from eaglewire.data.regenerate import RegenerateConfig, _generate, _generation_config
from eaglewire.decode.batched import BatchedDecoder
from eaglewire.decode.text import encode_prompt
from eaglewire.core.presets import DEFAULT_TARGET
from eaglewire.core.prompts import load_prompts
from eaglewire.model.target import load_target
from eaglewire.core.tokens import stop_token_ids


def timed(fn) -> tuple[list[tuple[list[int], bool]], float, int]:
    """(replies, seconds, reply tokens with their stop tokens)."""
    start = time.perf_counter()
    replies = fn()
    seconds = time.perf_counter() - start
    return replies, seconds, sum(len(tokens) + stopped for tokens, stopped in replies)


def run_batch(target, decoder, prompts: list[list[int]], max_new: int, rounds: int) -> dict:
    stops = stop_token_ids(target.tokenizer, target.model)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else stops[0]
    gen_config = _generation_config(RegenerateConfig(max_new_tokens=max_new), stops, pad)
    sides = {"hf": lambda: _generate(target, prompts, gen_config, stops),
             "ours": lambda: _generate(target, prompts, gen_config, stops, decoder)}
    warm = _generation_config(RegenerateConfig(max_new_tokens=2), stops, pad)
    _generate(target, prompts, warm, stops)  # first-call costs (allocator, kernels) off the clock
    _generate(target, prompts, warm, stops, decoder)
    totals = {name: [0.0, 0] for name in sides}
    replies = {}
    for r in range(rounds):
        for name in (("hf", "ours") if r % 2 == 0 else ("ours", "hf")):
            replies[name], seconds, tokens = timed(sides[name])
            totals[name][0] += seconds
            totals[name][1] += tokens
    same = sum(a == b for a, b in zip(replies["hf"], replies["ours"]))
    return {name: tokens / seconds for name, (seconds, tokens) in totals.items()} | {"same": same}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target, device="cpu", dtype="fp32")
    decoder = BatchedDecoder(target)
    questions = load_prompts("mt-bench")
    if max(args.batch) > len(questions):
        sys.exit(f"--batch {max(args.batch)}: MT-bench has only {len(questions)} first turns")
    ids = [encode_prompt(target.tokenizer, q.text, chat=True) for q in questions]
    print(f"`python {shlex.join(sys.argv)}`\n\n{args.target} fp32, {args.threads} threads, greedy, "
          f"max_new_tokens {args.max_new_tokens}, {args.rounds} round(s), torch {torch.__version__}\n")
    print("| batch | HF generate tok/s | batched lean tok/s | ratio | same replies |\n|---|---|---|---|---|")
    for batch in args.batch:
        r = run_batch(target, decoder, ids[:batch], args.max_new_tokens, args.rounds)
        print(f"| {batch} | {r['hf']:.1f} | {r['ours']:.1f} | {r['ours'] / r['hf']:.2f}x | "
              f"{r['same']}/{batch} |", flush=True)


if __name__ == "__main__":
    main()
