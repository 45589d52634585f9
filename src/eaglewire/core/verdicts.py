"""A check's verdict, the unit every diagnosis reports (the doctor's report collects them; an engine's own serving
checks make them too, so the type lives below both)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

VERDICTS = ("ok", "warn", "fail", "skip", "inconclusive")


@dataclass
class Check:
    name: str
    verdict: str  # ok / warn / fail / skip / inconclusive (too little evidence to judge)
    summary: str
    evidence: list[str] = field(default_factory=list)
    fix: str | None = None

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r} is not one of {VERDICTS}")


class Findings(Protocol):
    """Where checks go (the doctor's report)."""

    def add(self, check: Check) -> None: ...


def flags_check(engine: str, problems: list[tuple[str, str, str]]) -> Check:
    """The "serving flags" check of a lint's (verdict, what, fix) problems."""
    worst = "fail" if any(v == "fail" for v, _, _ in problems) else ("warn" if problems else "ok")
    return Check("serving flags", worst, f"{engine} flags: " + ("nothing silently changed" if not problems
                                                                else f"{len(problems)} problem(s)"),
                 [what for _, what, _ in problems], fix="; ".join(f for _, _, f in problems) or None)
