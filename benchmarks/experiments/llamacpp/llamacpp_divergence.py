"""Where llama.cpp's greedy output with the draft parts from its output without, and how close
the target's call was there (eaglewire's fp32 logits): a near-tie that 1-row and 2-row kernels
round differently, or a real fault.

    python benchmarks/experiments/llamacpp/llamacpp_divergence.py --export runs/bench-llamacpp/export-f32 --num-prompts 12
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from eaglewire.decode.text import encode_prompt
from eaglewire.engines.llamacpp import LlamaServer, ServerConfig, complete, require_server
from eaglewire.core.presets import DEFAULT_TARGET
from eaglewire.core.prompts import load_prompts
from eaglewire.model.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", required=True, help="an `export --to llamacpp` folder with target-f32.gguf")
    ap.add_argument("--draft-gguf", default="draft-q8_0.gguf")
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    export = Path(args.export)
    target = load_target(DEFAULT_TARGET, device="cpu", dtype="fp32")
    tok = target.tokenizer
    encoded = [encode_prompt(tok, p.text, chat=p.chat) for p in load_prompts(args.dataset, args.num_prompts)]
    outs = {}
    for name, draft in (("plain", None), ("draft", export / args.draft_gguf)):
        config = ServerConfig(model=export / "target-f32.gguf", draft=draft, n_max=1, threads=args.threads)
        with LlamaServer(require_server(), config) as server:
            outs[name] = [list(complete(server.url, ids, n_predict=args.max_new_tokens).get("tokens") or [])
                          for ids in encoded]
    for i, ids in enumerate(encoded):
        a, b = outs["plain"][i], outs["draft"][i]
        if a == b:
            continue
        k = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
        if k == min(len(a), len(b)):
            print(f"prompt {i}: one output is a prefix of the other ({len(a)} vs {len(b)} tokens)")
            continue
        with torch.no_grad():
            logits = target.model(torch.tensor([ids + a[:k]])).logits[0, -1].float()  # [V]
        top = torch.topk(logits, 3)
        print(f"prompt {i}: parts at new token {k}: plain {a[k]} {tok.decode([a[k]])!r} (logit "
              f"{float(logits[a[k]]):.4f}), drafted {b[k]} {tok.decode([b[k]])!r} ({float(logits[b[k]]):.4f}); "
              f"eaglewire fp32 top-3 {top.indices.tolist()} {[round(v, 4) for v in top.values.tolist()]}")
    same = sum(outs["plain"][i] == outs["draft"][i] for i in range(len(encoded)))
    print(f"identical with and without the draft: {same} of {len(encoded)}")


if __name__ == "__main__":
    main()
