"""Replaying a greedy chain on the training-time unroll: what the engine should accept, round by round.

Decoding and the TTT unroll are one computation: the j-th token a chain drafts after its last
verified position t is step j at position t in training. So on the target's own greedy text
the tokens each round accepts follow from the unroll's per-step verdicts alone, and the doctor
can compare the engine with them round by round. A decoding path that feeds the draft anything
else (wrong positions, the states of a neighbouring token, a stale cache entry) disagrees, even
where τ alone would look plausible. It also predicts τ without the product formula's bias:
rounds start right after a rejected token, where the draft is weaker than on average.

Shapes: S draft steps, T tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def accepted_after(right: torch.Tensor, t: int) -> int:
    """right [S, T] bool (step j at position t right) -> the drafted tokens a greedy chain of S
    accepts when its last verified state is at position t: the leading steps right at t."""
    n = 0
    while n < right.shape[0] and bool(right[n, t]):
        n += 1
    return n


def round_starts(prompt_len: int, accept_lengths: list[int]) -> list[int]:
    """The position of each round's root token (the last one the target produced): the first
    root follows the prompt, and each round moves on by the tokens it accepted plus the bonus."""
    starts, p = [], prompt_len
    for length in accept_lengths:
        starts.append(p)
        p += length
    return starts


@dataclass
class RoundAgreement:
    rounds: int = 0  # rounds compared (their drafted window lies inside the known text)
    agree: int = 0  # rounds that accepted exactly what the replay says
    measured_tokens: int = 0  # tokens those rounds produced in the engine (bonus included)
    replayed_tokens: int = 0  # tokens the replay says they would produce

    def add(self, other: "RoundAgreement") -> None:
        self.rounds += other.rounds
        self.agree += other.agree
        self.measured_tokens += other.measured_tokens
        self.replayed_tokens += other.replayed_tokens

    @property
    def share(self) -> float:
        return self.agree / max(self.rounds, 1)

    @property
    def measured_tau(self) -> float:
        return self.measured_tokens / max(self.rounds, 1)

    @property
    def replayed_tau(self) -> float:
        return self.replayed_tokens / max(self.rounds, 1)


def compare_rounds(right: torch.Tensor, prompt_len: int, accept_lengths: list[int]) -> RoundAgreement:
    """right [S, T] over the prompt and the engine's own greedy output; accept_lengths the
    engine's tokens per round (bonus included). Rounds whose window reaches past the text are
    left out: the unroll cannot judge tokens it has not seen."""
    S, T = right.shape
    out = RoundAgreement()
    for p, length in zip(round_starts(prompt_len, accept_lengths), accept_lengths):
        if p + S >= T:
            break
        replayed = accepted_after(right, p - 1)
        out.rounds += 1
        out.agree += int(length - 1 == replayed)
        out.measured_tokens += length
        out.replayed_tokens += replayed + 1
    return out
