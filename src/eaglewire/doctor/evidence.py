"""How much the doctor's measurements can tell: binomial noise on accuracies over judged tokens.

Judged tokens (n): held-out reply positions whose target next token is in the draft vocabulary,
the denominator of acc@0. An accuracy over n such tokens is a binomial proportion; two layouts
measured on the same tokens differ by noise up to about two standard errors of the difference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

Z = 2.0  # standard errors: ~95% two-sided
MIN_LEAD = 0.02  # acc@0 differences below this do not matter in practice, however many tokens
USEFUL_ACC0 = 0.05  # below this a draft accepts next to nothing: it "predicts nothing"


def wilson_bounds(acc: float, n: int, z: float = Z) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``acc`` over ``n`` trials (sane at 0 and 1)."""
    if n <= 0:
        return 0.0, 1.0
    centre = acc + z * z / (2 * n)
    half = z * math.sqrt(acc * (1 - acc) / n + z * z / (4 * n * n))
    scale = 1 + z * z / n
    return max(0.0, (centre - half) / scale), min(1.0, (centre + half) / scale)


def predicts_nothing(acc: float, n: int) -> bool:
    """The evidence shows acc@0 below USEFUL_ACC0 (its upper bound is under it)."""
    return wilson_bounds(acc, n)[1] < USEFUL_ACC0


def lead_noise(a: float, b: float, n: int) -> float:
    """Noise on the difference of two accuracies over the same ``n`` tokens: Z standard errors of
    the difference of two binomial proportions, sqrt((a(1-a) + b(1-b)) / n) (as if independent,
    which overstates it a little for positively correlated layouts), at least MIN_LEAD."""
    return max(MIN_LEAD, Z * math.sqrt((a * (1 - a) + b * (1 - b)) / max(n, 1)))


@dataclass
class SweepJudgement:
    verdict: str  # ok / fail / inconclusive
    summary: str
    evidence: list[str] = field(default_factory=list)
    best: list[int] = field(default_factory=list)


def judge_sweep(acc: dict[tuple[int, ...], float], declared: list[int], n: int) -> SweepJudgement:
    """Whether the declared layout reads best, within noise, or clearly not; inconclusive when no
    layout predicts anything (nothing to rank)."""
    ranked = sorted(acc.items(), key=lambda kv: -kv[1])
    (best, top) = ranked[0]
    mine = acc[tuple(declared)]
    if predicts_nothing(top, n):
        return SweepJudgement("inconclusive", f"no layout scores above chance (best acc@0 {top:.3f} over {n:,} "
                              f"judged tokens): nothing to rank", [], list(best))
    others = [(layout, a) for layout, a in ranked if list(layout) != declared]
    how = (f"noise ±{{:.3f}}: {Z:g} binomial standard errors of the difference over {n:,} judged tokens, "
           f"at least {MIN_LEAD}")
    if not others:
        return SweepJudgement("ok", f"the declared layout {declared} is the only candidate", [], list(declared))
    rival, r = others[0]  # the best other layout
    tol = lead_noise(mine, r, n)
    line = f"declared {declared} acc@0 {mine:.3f}; best other {list(rival)} {r:.3f}; " + how.format(tol)
    if r > mine + tol:
        return SweepJudgement("fail", f"the draft reads {list(rival)} best, not the {declared} its contract "
                              f"declares (by {r - mine:.3f}, beyond noise)", [line], list(rival))
    if r > mine:
        summary = (f"the declared layout {declared} is within noise of the best of {len(acc)} candidates, "
                   f"{list(rival)} ({r - mine:.3f} behind)")
    elif r == mine:
        summary = f"the declared layout {declared} ties for best of {len(acc)} candidates with {list(rival)}"
    elif mine - r <= tol:
        summary = (f"the declared layout {declared} scores best of {len(acc)} candidates, within noise of "
                   f"{list(rival)} ({mine - r:.3f} ahead)")
    else:
        summary = (f"the declared layout {declared} is the best of {len(acc)} candidates, beyond noise "
                   f"({mine - r:.3f} ahead of {list(rival)})")
    return SweepJudgement("ok", summary, [line], list(declared) if mine >= r else list(rival))
