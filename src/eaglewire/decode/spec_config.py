"""The speculation flags, one definition: SGLang's num-steps / eagle-topk / num-draft-tokens and eaglewire's
--draft-min-prob, checked together (``check_spec_flags``), never silently adjusted."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from eaglewire.decode.tree import max_tree_tokens


@dataclass(kw_only=True)
class SpecConfig:
    """Named as SGLang names them: --speculative-num-steps / -eagle-topk / -num-draft-tokens.

    ``min_prob`` (``--draft-min-prob``, eaglewire's own) sets a least path probability (the
    product of the draft's probabilities from the root): drafting stops at a level whose nodes
    all fall below it and only nodes reaching it are verified, so a draft drafts deep where it is
    sure and verifies the root alone where it is not. 0 keeps SGLang's fixed shape.
    """

    # The one definition of the speculation flags: configs.add_config_args turns these fields
    # into generate's and serve's flags, bench's config strings parse into SpecConfigs.
    num_steps: int = field(default=5, metadata={
        "flag": "speculative-num-steps", "help": "draft steps per round (the tree's depth)"})
    topk: int = field(default=4, metadata={
        "flag": "speculative-eagle-topk", "help": "children drafted per node (1: a chain)"})
    num_draft_tokens: int = field(default=8, metadata={
        "flag": "speculative-num-draft-tokens", "help": "tree tokens verified per round, root included"})
    min_prob: float = field(default=0.0, metadata={
        "flag": "draft-min-prob",
        "help": "verify only draft tokens whose path probability reaches this; 0 = SGLang's fixed shape"})

    def __post_init__(self) -> None:
        check_spec_flags(self.num_steps, self.topk, self.num_draft_tokens)
        if not 0.0 <= self.min_prob < 1.0:
            raise ValueError(f"{spec_flag('min_prob')} must be in [0, 1) (0 = off), got {self.min_prob}")

    @classmethod
    def chain(cls, num_steps: int, *, min_prob: float = 0.0) -> SpecConfig:
        """A chain of ``num_steps`` drafted tokens (topk 1, so ``num_steps + 1`` verified)."""
        return cls(num_steps=num_steps, topk=1, num_draft_tokens=num_steps + 1, min_prob=min_prob)

    @property
    def min_score(self) -> float:
        """The least cumulative log-probability a drafted node needs."""
        return math.log(self.min_prob) if self.min_prob > 0 else -math.inf


def spec_flag(name: str) -> str:
    """The command-line flag of SpecConfig field ``name`` (``num_steps`` -> ``--speculative-num-steps``)."""
    return "--" + SpecConfig.__dataclass_fields__[name].metadata["flag"]


def check_spec_flags(num_steps: int, topk: int, num_draft_tokens: int) -> None:
    """Inconsistent flags are an error that says what to set, never a silent adjustment."""
    steps, k, tokens = spec_flag("num_steps"), spec_flag("topk"), spec_flag("num_draft_tokens")
    if num_steps < 1:
        raise ValueError(f"{steps} must be >= 1, got {num_steps}")
    if topk < 1:
        raise ValueError(f"{k} must be >= 1, got {topk}")
    if topk == 1 and num_draft_tokens != num_steps + 1:
        raise ValueError(
            f"{k} 1 drafts a chain of {steps} {num_steps} tokens, so "
            f"{tokens} must be {num_steps + 1} (got {num_draft_tokens}); set "
            f"{tokens} {num_steps + 1}, or {steps} {num_draft_tokens - 1}")
    most = max_tree_tokens(num_steps, topk)
    if not 2 <= num_draft_tokens <= most:
        raise ValueError(
            f"{tokens} {num_draft_tokens} is outside [2, {most}]: a tree of "
            f"{num_steps} steps with top-{topk} holds at most {most} tokens (root included); set "
            f"{tokens} to at most {most} or raise {steps}/{k.removeprefix('--speculative')}")
