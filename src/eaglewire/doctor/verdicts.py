"""The doctor's verdicts and how they are shown: terminal text and JSON."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

from eaglewire.core.configs import RESOLVED_KEY

VERDICTS = ("ok", "warn", "fail", "skip", "inconclusive")

# Exit codes: passed 0, failed 1 (2 is the CLI's user error), inconclusive 3: too little evidence
# to pass, and nothing found wrong.
EXIT_CODES = {"passed": 0, "failed": 1, "inconclusive": 3}


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


@dataclass
class LayoutRow:
    layout: list[int]
    labels: list[str]  # why it is a candidate: declared, serving reading, shift, window
    acc0: float
    counted: int


@dataclass
class DoctorReport:
    draft: str
    target: str
    checks: list[Check] = field(default_factory=list)
    layouts: list[LayoutRow] = field(default_factory=list)
    resolved_config: dict[str, Any] = field(default_factory=dict)  # the run's flags by name (config_record)
    facts: dict[str, Any] = field(default_factory=dict)  # sequences, counted tokens, seconds
    accuracy: dict[str, float] = field(default_factory=dict)  # acc@0, cond acc@j in isolation (JSON only; checks print them)
    served: dict[str, Any] = field(default_factory=dict)  # --engine-url: served τ, per position, the replay's (JSON)
    engine_release: str | None = None  # --engine-url: the release whose reading judges the server ("vLLM 0.32.0")
    engine_version: str | None = None  # --engine-url: the version the server reports ("0.32.0"), if it says one
    traffic: dict[str, Any] = field(default_factory=dict)  # --traffic: acceptance per slice of traffic (JSON)
    sampling: dict[str, Any] = field(default_factory=dict)  # the temperature users sample at: τ there and greedy (JSON)
    concurrency: dict[str, Any] = field(default_factory=dict)  # --concurrency: the speed check per batch size (JSON)
    stage_seconds: dict[str, float] = field(default_factory=dict)  # where the run's time went, by stage (JSON)

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Add the seconds spent inside to ``stage`` (a run's breakdown, in the JSON report)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self.stage_seconds[stage] = round(self.stage_seconds.get(stage, 0.0) + spent, 2)

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        return check

    @property
    def failed(self) -> bool:
        return any(c.verdict == "fail" for c in self.checks)

    @property
    def status(self) -> str:
        """failed (any check failed), inconclusive (none failed, one could not judge), or passed."""
        if self.failed:
            return "failed"
        return "inconclusive" if any(c.verdict == "inconclusive" for c in self.checks) else "passed"

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def to_dict(self) -> dict[str, Any]:
        return {"draft": self.draft, "target": self.target, "ok": self.status == "passed", "status": self.status,
                "checks": [asdict(c) for c in self.checks], "layouts": [asdict(r) for r in self.layouts],
                "facts": self.facts, "accuracy": self.accuracy, RESOLVED_KEY: self.resolved_config} | \
            {k: v for k, v in (("served", self.served), ("traffic", self.traffic), ("sampling", self.sampling),
                               ("concurrency", self.concurrency), ("stage_seconds", self.stage_seconds)) if v}

    def render(self) -> str:
        lines = [f"eaglewire doctor: draft {self.draft} on target {self.target}"]
        if self.facts:
            lines.append("  " + ", ".join(f"{k.replace('_', ' ')} {_fmt(v)}" for k, v in self.facts.items()))
        lines.append("")
        width = max(len(c.name) for c in self.checks) if self.checks else 0
        tags = max([5] + [len(c.verdict) for c in self.checks])
        pad = " " * (tags + 1)
        for c in self.checks:
            lines.append(f"{c.verdict.upper():<{tags}} {c.name:<{width}}  {c.summary}")
            lines += [f"{pad}{'':<{width}}  · {e}" for e in c.evidence]
            if c.fix:
                lines.append(f"{pad}{'':<{width}}  fix: {c.fix}")
        if self.layouts:
            lines += ["", "layout sweep (draft acc@0 on held-out reply tokens, fed as in training)"]
            best = max(r.acc0 for r in self.layouts)
            tied = best == min(r.acc0 for r in self.layouts)  # nothing to tell apart
            for r in sorted(self.layouts, key=lambda r: -r.acc0):
                mark = "  <- best" if r.acc0 == best and not tied else ""
                lines.append(f"  {str(r.layout):<16} {r.acc0:6.3f}  {', '.join(r.labels)}{mark}")
        count = {v: sum(c.verdict == v for c in self.checks) for v in VERDICTS}
        lines += ["", f"{self.status.upper()}: {count['fail']} failed, {count['inconclusive']} inconclusive, "
                      f"{count['warn']} warning(s), {count['ok']} ok"]
        return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)
