"""A round's draft cost in eaglewire's engine: a DFlash draft (one block pass per round) against an
EAGLE-3 draft (one pass per drafted token), both random, on the real SmolLM2-135M target, fp32.

Each config decodes the same prompt greedily; random drafts are rarely right, so nearly every
round drafts its full shape and verifies it. Reported per round: draft seconds (drafting plus
feeding the accepted tokens' states to the draft), verify seconds, and tokens per round.

    OMP_NUM_THREADS=2 python benchmarks/experiments/engine/dflash_round.py [--threads 2] [--tokens 48] [--block-size 8]
"""

from __future__ import annotations

import argparse

import torch

from eaglewire.core.contract import HiddenStateContract, default_aux_boundaries
from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder
from eaglewire.decode.text import encode_prompt
from eaglewire.model.dflash import DFlashConfig, DFlashDraft
from eaglewire.model.draft import DraftConfig, Eagle3Draft
from eaglewire.model.target import load_target

PROMPT = "Explain in a few sentences why the sky is blue."


def eagle3(target, bounds):
    V = target.vocab_size
    draft = Eagle3Draft(DraftConfig.from_target(target.text_config, num_aux=len(bounds), draft_vocab_size=V,
                                                vocab_size=V))
    draft.set_vocab(torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    return draft, HiddenStateContract(aux_boundaries=tuple(bounds), target=target.fingerprint)


def dflash(target, bounds, block_size: int, layers: int):
    V = target.vocab_size
    draft = DFlashDraft(DFlashConfig.from_target(target.text_config, num_aux=len(bounds), vocab_size=V,
                                                 num_layers=layers, block_size=block_size, mask_token_id=V - 1))
    return draft, HiddenStateContract(aux_boundaries=tuple(bounds), target=target.fingerprint, family="dflash")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per config")
    ap.add_argument("--block-size", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target = load_target("smollm2-135m", device="cpu", dtype="fp32")
    bounds = default_aux_boundaries(target.num_layers)
    ids = encode_prompt(target.tokenizer, [{"role": "user", "content": PROMPT}], chat=True)
    n = args.block_size - 1
    configs = [("plain", SpecDecoder(target)),
               (f"eagle3 chain {n}", SpecDecoder(target, *eagle3(target, bounds), SpecConfig.chain(n)))]
    for layers in (1, 2):
        configs.append((f"dflash block {args.block_size} ({layers} layer{'s' * (layers > 1)}), chain {n}",
                        SpecDecoder(target, *dflash(target, bounds, args.block_size, layers), SpecConfig.chain(n))))
    for _, decoder in configs:  # warm-up: kernels, packed weights, caches
        decoder.generate(ids, max_new_tokens=4)
    print(f"SmolLM2-135M fp32, {args.threads} threads, prompt {len(ids)} tokens, {args.tokens} new tokens, greedy")
    print(f"{'config':38} {'rounds':>6} {'draft ms/round':>15} {'verify ms/round':>16} {'tok/round':>9} {'tok/s':>7}")
    for name, decoder in configs:
        _, st = decoder.generate(ids, max_new_tokens=args.tokens)
        r = max(st.rounds, 1)
        print(f"{name:38} {st.rounds:6d} {1e3 * st.draft_seconds / r:15.1f} {1e3 * st.verify_seconds / r:16.1f} "
              f"{st.accept_length:9.2f} {st.tokens_per_second:7.1f}")


if __name__ == "__main__":
    main()
