"""Speculative output ends exactly where plain decoding ends: tokens, token count and finish reason,
for every ``max_new_tokens`` from 1 to 40, with stop token ids and with stop strings, also when
an accepted block runs past the point where plain decoding stops.

Two kinds of draft make blocks that cross those points: an oracle (the draft's tree builder
replaced by one that proposes the target's own greedy continuation: chain and tree shapes) and
the real draft on a six-token vocabulary (tree with ``--draft-min-prob``), where a random
draft is right often enough. Every check also counts the runs whose last block was cut, so it
cannot pass without exercising the cut.
"""

from __future__ import annotations

import random

import pytest
import torch

from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder
from eaglewire.decode.text import StopStrings
from eaglewire.decode.tree import Tree
from test_spec_decoder import random_draft
from tiny import tiny_target

LIMITS = range(1, 41)
CHAIN = SpecConfig(num_steps=5, topk=1, num_draft_tokens=6)
TREE = SpecConfig(num_steps=4, topk=2, num_draft_tokens=8)


class PieceTokenizer:
    """Token id i decodes to pieces[i]: short strings, so a stop string can end mid-token."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        rng = random.Random(seed)
        self.pieces = ["".join(rng.choice("ab .") for _ in range(rng.randint(1, 3))) for _ in range(vocab_size)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


def run(decoder: SpecDecoder, prompt: list[int], limit: int, stop_ids: set[int], stops: list[str],
        tokenizer) -> tuple[list[int], int, str, int]:
    """(streamed tokens, stats.new_tokens, finish reason, tokens the last round dropped)."""
    should_stop = StopStrings(tokenizer, stops) if stops else None
    chunks = list(decoder.stream(prompt, max_new_tokens=limit, stop_token_ids=stop_ids, should_stop=should_stop))
    st = decoder.stats
    tokens = [t for c in chunks for t in c]
    dropped = 1 + sum(st.accept_lengths) - st.new_tokens  # the prefill's token + every round's
    return tokens, st.new_tokens, st.finish_reason, dropped


def settings(plain: list[int], tokenizer) -> list[tuple[str, set[int], list[str]]]:
    """No stop; a stop token id whose first use is deep in the output; a stop string ending
    mid-output (and, in the oracle's vocabulary, mid-token)."""
    first = {}
    for i, t in enumerate(plain):
        first.setdefault(t, i)
    stop_id = max(first, key=first.get)  # the latest first use
    text = tokenizer.decode(plain)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    return [("length", set(), []), ("stop id", {stop_id}, []), ("stop string", set(), [stop])]


def oracle(decoder: SpecDecoder, continuation: list[int], prompt_len: int) -> None:
    """Trees that hold the target's greedy continuation on their first branch, plus a wrong
    sibling at every depth where the shape has room (tree only)."""
    V = decoder.target.vocab_size
    spec = decoder.spec

    def build(root, P):
        done = P - prompt_len + 1  # tokens produced so far, the root included
        tokens, parents, depths, parent = [root], [-1], [0], 0
        for depth in range(1, spec.num_steps + 1):
            right = continuation[done + depth - 1]
            tokens.append(right)
            parents.append(parent)
            depths.append(depth)
            parent = len(tokens) - 1
            if spec.topk > 1 and len(tokens) < spec.num_draft_tokens - (spec.num_steps - depth):
                tokens.append((right + 1) % V)  # a sibling the target rejects
                parents.append(parents[parent])
                depths.append(depth)
        return Tree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), depths=torch.tensor(depths),
                    scores=-torch.arange(len(tokens), dtype=torch.float))

    decoder.drafter.propose = build


def plain_at(full: tuple[list[int], int, str, int], limit: int) -> tuple[list[int], int, str]:
    """Plain greedy decoding with ``max_new_tokens=limit``, from its run with the largest limit:
    the same tokens up to the limit (plain decoding makes one token per round)."""
    tokens, _, finish, _ = full
    if len(tokens) <= limit:
        return tokens, len(tokens), finish
    return tokens[:limit], limit, "length"


def check(plain_decoder, spec_decoder, prompt, tokenizer, cut_counts, long_rounds, *, limits=LIMITS):
    full, *_ = run(plain_decoder, prompt, max(limits), set(), [], tokenizer)
    for name, stop_ids, stops in settings(full, tokenizer):
        plain = run(plain_decoder, prompt, max(limits), stop_ids, stops, tokenizer)
        for limit in (1, len(plain[0]), max(limits)):  # plain_at's premise, where it matters most
            assert run(plain_decoder, prompt, limit, stop_ids, stops, tokenizer)[:3] == plain_at(plain, limit)
        for limit in limits:
            got = run(spec_decoder, prompt, limit, stop_ids, stops, tokenizer)
            assert got[:3] == plain_at(plain, limit), f"{name}, max_new_tokens {limit}, prompt {prompt}"
            assert got[1] == len(got[0])
            cut_counts[name] += got[3] > 0
            long_rounds[0] += sum(a > 1 for a in spec_decoder.stats.accept_lengths)


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_oracle_blocks_cut_exactly_where_plain_stops(spec):
    target = tiny_target("llama", initializer_range=0.2, num_layers=2, hidden_size=32)
    tokenizer = PieceTokenizer(target.vocab_size, seed=1)
    draft, contract = random_draft(target, bounds=(0, 1))  # aux below L = 2
    cut_counts, long_rounds = {"length": 0, "stop id": 0, "stop string": 0}, [0]
    for seed in range(2):
        prompt = torch.randint(0, 256, (5 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = SpecDecoder(target)
        continuation, *_ = run(plain, prompt, max(LIMITS) + spec.num_steps + 1, set(), [], tokenizer)
        decoder = SpecDecoder(target, draft, contract, spec)
        oracle(decoder, continuation, len(prompt))
        check(plain, decoder, prompt, tokenizer, cut_counts, long_rounds)
    assert long_rounds[0] > 0 and all(n > 0 for n in cut_counts.values()), (cut_counts, long_rounds)


def test_real_draft_blocks_cut_exactly_where_plain_stops():
    """The real draft's tree with a least path probability (six tokens, so a random draft is
    often right); fewer limits, as the real draft is slower than the oracle."""
    target = tiny_target("llama", initializer_range=0.2, vocab_size=6, num_layers=2, hidden_size=32)
    tokenizer = PieceTokenizer(target.vocab_size, seed=2)
    draft, contract = random_draft(target, bounds=(0, 1))  # aux below L = 2
    spec = SpecConfig(num_steps=4, topk=2, num_draft_tokens=8, min_prob=0.2)
    cut_counts, long_rounds = {"length": 0, "stop id": 0, "stop string": 0}, [0]
    check(SpecDecoder(target), SpecDecoder(target, draft, contract, spec), [1, 4, 2, 0, 5], tokenizer,
          cut_counts, long_rounds, limits=range(1, 21))
    assert long_rounds[0] > 0 and cut_counts["length"] > 0, (cut_counts, long_rounds)
