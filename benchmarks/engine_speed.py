"""Engine speed on CPU, side by side in one process (SmolLM2-135M, fp32):

1. verify cost: one target pass over N new tokens after a 300-token prefix, relative to
   N = 1, for our lean runner and the HF runner;
2. plain greedy decoding: our engine vs HF ``generate`` on MT-bench first turns;
3. with ``--draft``: chain and tree speculation, HF prompt-lookup decoding in the same table.

    python benchmarks/engine_speed.py [--threads 2] [--prompts 4] [--max-new-tokens 96] [--draft DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eaglewire.model.checkpoint import load_draft
from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder
from eaglewire.decode.runner import HFRunner, LeanRunner
from eaglewire.decode.text import encode_prompt
from eaglewire.core.presets import DEFAULT_TARGET
from eaglewire.core.prompts import load_prompts
from eaglewire.model.target import load_target


def verify_cost(target, repeats: int) -> None:
    prefix = torch.randint(0, target.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    print("\n| new tokens | lean runner (ms) | vs 1 token | HF runner (ms) | vs 1 token |\n|---|---|---|---|---|")
    base = {}
    for n in (1, 2, 4, 8, 16, 32):
        row = []
        for cls in (LeanRunner, HFRunner):
            runner = cls(target, [2, 15, 27])
            runner.forward(prefix, torch.arange(300), None)
            runner.commit(list(range(300)))
            ids, pos = prefix[:n], torch.arange(300, 300 + n)
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                last, _ = runner.forward(ids, pos, None if n == 1 else torch.ones(n, 300 + n, dtype=torch.bool).tril(300))
                runner.head(last)
                times.append(time.perf_counter() - t)
                if cls is HFRunner:
                    runner.commit([])  # drop the block again
                else:
                    runner.length = 300
            ms = statistics.median(times) * 1000
            base.setdefault(cls, ms)
            row += [f"{ms:.1f}", f"{ms / base[cls]:.2f}x"]
        print(f"| {n} | " + " | ".join(row) + " |")


def hf_generate(target, ids, max_new, **kw):
    out = target.model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                                pad_token_id=target.tokenizer.eos_token_id, eos_token_id=None, **kw)
    return out.shape[1] - len(ids)


def decode_table(target, prompts, max_new, draft_dir) -> None:
    runs = {"HF generate": lambda ids: (hf_generate(target, ids, max_new), None),
            "HF prompt lookup": lambda ids: (hf_generate(target, ids, max_new, prompt_lookup_num_tokens=10), None)}
    plain = SpecDecoder(target)
    runs["eaglewire plain"] = lambda ids: _ours(plain, ids, max_new)
    if draft_dir:
        draft, contract, _ = load_draft(draft_dir, target=target)
        for name, spec in (("eaglewire chain 1,5,1,6", SpecConfig(num_steps=5, topk=1, num_draft_tokens=6)),
                           ("eaglewire tree 1,5,4,8", SpecConfig(num_steps=5, topk=4, num_draft_tokens=8))):
            dec = SpecDecoder(target, draft, contract, spec)
            runs[name] = lambda ids, dec=dec: _ours(dec, ids, max_new)
    totals = {k: [0, 0.0, []] for k in runs}
    for p in prompts:
        ids = encode_prompt(target.tokenizer, p.text, chat=p.chat)
        for name, fn in runs.items():  # side by side, prompt by prompt
            t = time.perf_counter()
            n, tau = fn(ids)
            totals[name][0] += n
            totals[name][1] += time.perf_counter() - t
            if tau is not None:
                totals[name][2].append(tau)
    ref = totals["HF generate"][0] / totals["HF generate"][1]
    print("\n| method | tokens/s | vs HF generate | accept length |\n|---|---|---|---|")
    for name, (n, s, taus) in totals.items():
        tau = f"{statistics.mean(taus):.2f}" if taus else "-"
        print(f"| {name} | {n / s:.1f} | {n / s / ref:.2f}x | {tau} |")


def _ours(decoder, ids, max_new):
    tokens, stats = decoder.generate(ids, max_new_tokens=max_new)
    return len(tokens), stats.accept_length


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--draft", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(DEFAULT_TARGET, device="cpu", dtype="fp32")
    print(f"SmolLM2-135M fp32, {args.threads} threads, torch {torch.__version__}")
    with torch.no_grad():
        verify_cost(target, args.repeats)
        decode_table(target, load_prompts("mt-bench", args.prompts), args.max_new_tokens, args.draft)


if __name__ == "__main__":
    main()
