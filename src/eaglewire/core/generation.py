"""What one generated answer cost and accepted: the counters every decoder and serving engine reports.

Eaglewire's own decoder fills them as it runs; an engine runtime fills them from the server's own counters
(llama-server's timings, vLLM's /metrics), so bench, tune and the doctor read one type whichever engine ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # per verify round, bonus included (the output may keep fewer of the last)
    verified_lengths: list[int] = field(default_factory=list)  # tokens per verify round, root included
    position_accepts: list[int] = field(default_factory=list)  # rounds that accepted depth d+1
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    finish_reason: str = "length"

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def accept_length(self) -> float:
        """τ: tokens per target verify pass, bonus included (1.0 without speculation)."""
        return sum(self.accept_lengths) / max(self.rounds, 1)

    @property
    def verified_per_round(self) -> float:
        """Tokens the target verified per pass, root included (1.0 without speculation)."""
        return sum(self.verified_lengths) / max(self.rounds, 1)

    @property
    def position_acceptance(self) -> list[float]:
        """Share of rounds whose draft token at depth d+1 was accepted."""
        return [a / max(self.rounds, 1) for a in self.position_accepts]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / max(self.total_seconds, 1e-9)

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "rounds": self.rounds,
                "accept_length": round(self.accept_length, 3), "accept_lengths": self.accept_lengths,
                "verified_per_round": round(self.verified_per_round, 3),
                "position_acceptance": [round(x, 3) for x in self.position_acceptance],
                "draft_seconds": round(self.draft_seconds, 3), "verify_seconds": round(self.verify_seconds, 3),
                "prefill_seconds": round(self.prefill_seconds, 3), "total_seconds": round(self.total_seconds, 3),
                "tokens_per_second": round(self.tokens_per_second, 2), "finish_reason": self.finish_reason}
