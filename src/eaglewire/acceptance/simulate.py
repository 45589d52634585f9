"""Chain shapes walked over draft traces: how many tokens a round drafts, computes and keeps.

Engines stop a chain differently, and that sets both what a round costs and what it gains:

- llama.cpp (``--spec-draft-n-max N --spec-draft-n-min M --spec-draft-p-min P``) drafts while
  the draft's top token, renormalised over its top 10, has probability >= P, at most N tokens;
  the step that falls below P was computed all the same; a draft shorter than M is dropped.
- eaglewire (``--speculative-num-steps N --draft-min-prob P``, topk 1) drafts while the product
  of the draft's probabilities from the root is >= P; its first token comes with the previous
  round's context update, so a round of d drafted tokens runs min(d, N - 1) more draft steps.

A DFlash draft (a block trace, ``trace.block``) drafts every token of a round in ONE pass, so a
round runs one draft step whatever it proposes:

- llama.cpp (``--spec-type draft-dflash``, ``common_speculative_impl_draft_dflash`` in b11434's
  common/speculative.cpp): n_max is clamped to block_size - 1 and the block run is
  [last token, mask x n_max] (n_max + 1 tokens, not the trained block: its trace is that block
  length's); it keeps the block's tokens while their top-10 probability is >= P, the first one
  below stops it, and a draft shorter than n_min is dropped; the pass was run all the same.
- eaglewire: a chain of n drafted tokens, the first n of the trained block (the path-probability
  stop as for EAGLE-3 where asked).

Greedy rounds are walked exactly: each starts right after the last one's bonus token. Sampled
rounds use expectations at every position: a drafted token survives with the target's
probability of it (llama.cpp's rule; eaglewire's rejection sampling accepts at least as often).

Shapes: S draft steps, T tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglewire.acceptance.replay import accepted_after
from eaglewire.acceptance.trace import DraftTrace
from eaglewire.engines.interface import ChainRule


def rule_of(engine: ChainRule | str) -> ChainRule:
    """The chain rule itself, or the rule of the engine so named."""
    if isinstance(engine, ChainRule):
        return engine
    from eaglewire import engines

    try:
        return engines.get(engine).chain_rule
    except ValueError:
        raise ValueError(f"engine {engine!r}: tune knows {', '.join(engines.names(aliases=False))}") from None


@dataclass(frozen=True, order=True)
class Shape:
    """A chain: up to ``n_max`` drafted tokens, stopped below ``p_min``; n_max 0 = plain decoding."""

    n_max: int
    p_min: float = 0.0
    n_min: int = 0
    block: bool = False  # a DFlash block: the n_max tokens come from one draft pass

    @property
    def plain(self) -> bool:
        return self.n_max == 0

    def label(self, engine: ChainRule | str) -> str:
        """The shape as the engine's launch spells it (``engine``: its chain rule or its name)."""
        return "plain" if self.plain else rule_of(engine).label(self.n_max, self.p_min, self.n_min, self.block)

    def bench_config(self) -> str:
        """The shape as bench's --configs writes it (min-prob = p-min)."""
        if self.plain:
            return "1,0,0,0"
        base = f"1,{self.n_max},1,{self.n_max + 1}"
        return base if self.p_min == 0 else f"{base},{self.p_min:g}"


@dataclass(frozen=True)
class RoundShape:
    """One round: ``drafted`` tokens verified after the root, ``steps`` draft forwards run,
    ``gained`` tokens produced (accepted + the target's own), all possibly expected values."""

    drafted: float
    steps: float
    gained: float


def drafted_tokens(trace: DraftTrace, column: int, shape: Shape, engine: ChainRule | str) -> tuple[int, int]:
    """(tokens a round drafts, draft steps it runs) for a round whose last verified position is ``column``,
    under ``engine``'s chain rule (the rule or the engine's name)."""
    rule = rule_of(engine)
    n = min(shape.n_max, trace.steps)
    if rule.token_stop:
        probs = trace.prob_top[:n, column]  # [n]
        below = (probs < shape.p_min).nonzero()
        d = int(below[0]) if len(below) else n
        steps = 1 if trace.block else min(d + 1, n)  # a block: one pass, however many it keeps
        if d < shape.n_min:
            d = 0
        return d, steps
    path = torch.cumprod(trace.prob[:n, column], dim=0)  # [n] path probability from the root
    below = (path < shape.p_min).nonzero()
    d = int(below[0]) if len(below) else n
    return d, 1 if trace.block else min(d, n - 1)


def greedy_rounds(trace: DraftTrace, shape: Shape, engine: str) -> list[RoundShape]:
    """The rounds a greedy chain runs over the trace's output, from the first token after the prompt;
    rounds whose window would pass the text's end are left out (the trace cannot judge them)."""
    out, p = [], trace.prompt_len
    while p + trace.steps < trace.length - 1:
        column = p - 1
        d, steps = drafted_tokens(trace, column, shape, engine)
        m = accepted_after(trace.right[:d], column)  # the leading right steps among those drafted
        out.append(RoundShape(drafted=d, steps=steps, gained=m + 1))
        p += m + 1
    return out


def sampled_rounds(trace: DraftTrace, shape: Shape, engine: str) -> list[RoundShape]:
    """Expected rounds at every position of the output: the j-th drafted token survives with
    probability prod_{i<=j} target_prob[i]."""
    out = []
    for column in range(trace.prompt_len - 1, trace.length - 1 - trace.steps):
        d, steps = drafted_tokens(trace, column, shape, engine)
        survive = torch.cumprod(trace.target_prob[:d, column], dim=0)  # [d]
        out.append(RoundShape(drafted=d, steps=steps, gained=1.0 + float(survive.sum())))
    return out


def rounds(traces: list[DraftTrace], shape: Shape, engine: str, *, sampled: bool) -> list[RoundShape]:
    walk = sampled_rounds if sampled else greedy_rounds
    return [r for trace in traces for r in walk(trace, shape, engine)]


def tau(round_list: list[RoundShape]) -> float:
    """Tokens per round (τ), bonus included."""
    return sum(r.gained for r in round_list) / max(len(round_list), 1)
