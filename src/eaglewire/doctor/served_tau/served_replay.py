"""The greedy chain replayed round by round on a server's own text (the replay the served check and the
served-wiring diagnosis both compare the server's counters with). Shapes: S draft steps, T tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eaglewire.acceptance.replay import accepted_after
from eaglewire.engines.serving.served_counts import AcceptanceRates, add_lists

# A server wired as trained accepts what the replay accepts on its own text, up to the last round
# of each answer (a server may draft past the tokens it returns) and near-ties that its verify
# and the doctor's capture round apart: served τ this far from the replay is no fault by itself.
SERVED_TAU_TOLERANCE = 0.05


@dataclass
class Replayed(AcceptanceRates):
    """The greedy chain replayed on the training-time unroll of a text, round by round."""

    drafts: int = 0  # rounds that drafted
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    judged: int = 0  # output tokens whose target argmax was compared with the text
    agreeing: int = 0  # ... and equal to it

    def add(self, other: "Replayed") -> None:
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted += other.accepted
        self.accepted_per_pos = add_lists(self.accepted_per_pos, other.accepted_per_pos)
        self.judged += other.judged
        self.agreeing += other.agreeing

    @property
    def text_agreement(self) -> float:
        return self.agreeing / self.judged if self.judged else 1.0


def replay_chain(right: torch.Tensor, prompt_len: int) -> Replayed:
    """right [S, T] bool over prompt + a greedy output -> the rounds a greedy chain of S drafts
    there: each drafts at most the tokens left in the text (llama.cpp caps a draft at the tokens
    remaining, tools/server/server-context.cpp get_n_draft_max) and accepts its leading right steps."""
    S, T = right.shape
    out = Replayed(accepted_per_pos=[0] * S)
    p = prompt_len  # the round's root: the last token the target produced
    while (room := T - p - 1) > 0:
        k = min(S, room)
        a = accepted_after(right[:k], p - 1)
        out.drafts += 1
        out.draft_tokens += k
        out.accepted += a
        for i in range(a):
            out.accepted_per_pos[i] += 1
        p += a + 1
    return out
