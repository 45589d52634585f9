"""The draft's round on CPU, one revision at a time: draft ms per round, ms per token and the tokens themselves,
so two revisions can be compared for speed and for identical output (SmolLM2-135M + the shipped reference draft,
4 MT-bench prompts x 64 new tokens, greedy; chain 3, tree 5/4/8, tree 5/4/8 with --draft-min-prob 0.05).

    git worktree add /tmp/old OLD_REVISION
    for rep in 1 2 3; do for src in /tmp/old/src src; do
        PYTHONPATH=$src OMP_NUM_THREADS=2 python benchmarks/experiments/engine/draft_round_ab.py --out /tmp/ab-$(basename $(dirname $src))-$rep.json
    done; done
    python benchmarks/experiments/engine/draft_round_ab.py --compare /tmp/ab-old-1.json /tmp/ab-main-1.json   # same tokens?
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def run(out: str, threads: int, prompts: int, tokens: int) -> None:
    from eaglewire.core.presets import DEFAULT_TARGET
    from eaglewire.core.prompts import load_prompts
    from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder
    from eaglewire.decode.text import encode_prompt
    from eaglewire.core.presets import resolve_draft
    from eaglewire.model.checkpoint import load_draft
    from eaglewire.model.target import load_target

    torch.set_num_threads(threads)
    target = load_target(DEFAULT_TARGET)
    draft, contract, _ = load_draft(resolve_draft("reference"), target=target)
    result = {}
    for name, spec in (("chain 3", SpecConfig.chain(3)), ("tree 5/4/8", SpecConfig()),
                       ("tree 5/4/8, min prob 0.05", SpecConfig(min_prob=0.05))):
        decoder = SpecDecoder(target, draft, contract, spec)
        outputs, draft_s, rounds, total_s = [], 0.0, 0, 0.0
        for p in load_prompts("mt-bench")[:prompts]:
            new, stats = decoder.generate(encode_prompt(target.tokenizer, p.text, chat=p.chat), max_new_tokens=tokens)
            outputs.append(new)
            draft_s, rounds, total_s = draft_s + stats.draft_seconds, rounds + stats.rounds, total_s + stats.total_seconds
        result[name] = {"tokens": outputs, "draft_ms_per_round": round(1e3 * draft_s / rounds, 2),
                        "ms_per_token": round(1e3 * total_s / sum(map(len, outputs)), 2)}
        print(f"{name:28} draft {result[name]['draft_ms_per_round']:6.2f} ms/round  "
              f"{result[name]['ms_per_token']:6.2f} ms/token", flush=True)
    with open(out, "w") as f:
        json.dump(result, f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--compare", nargs=2, metavar="JSON")
    args = ap.parse_args()
    if args.compare:
        a, b = (json.load(open(path)) for path in args.compare)
        same = {name: a[name]["tokens"] == b[name]["tokens"] for name in a}
        print(same)
        return 0 if all(same.values()) else 1
    run(args.out, args.threads, args.prompts, args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
