"""What a round costs in an engine: a verify side that depends on the tokens verified, plus draft steps.

round seconds(k verified, s draft steps) = verify(k) + s * draft_step

``verify(k)`` holds everything a round pays besides the draft's own steps: the target's pass
over k tokens, its head over k rows, copying the layer states out, the draft's context update
on them, sampling and the engine's bookkeeping. It is measured per k from chains run with no
probability stop (every round then verifies n + 1 tokens), and ``draft_step`` from the draft
time those runs report as the number of steps changes. Engines whose costs are not measured
here (SGLang, vLLM on a GPU) take a stated model instead.

A DFlash draft drafts a round's tokens in one pass: a round runs one "step" (``draft_step`` = one
block pass), whatever it proposes. Where the pass's length follows the shape (llama.cpp runs
n_max + 1 block tokens), ``draft_pass`` holds its seconds per n_max and ``round_seconds`` reads it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class ChainProbe:
    """One engine run of a chain with ``n`` drafted tokens per round (no probability stop)."""

    n: int
    rounds: int
    decode_seconds: float  # generation time after the prompt
    draft_seconds: float  # the part the engine itself reports as drafting
    steps_per_round: int  # draft forwards per round (llama.cpp: n, eaglewire: n - 1)


@dataclass(frozen=True)
class PlainProbe:
    tokens: int
    decode_seconds: float


def linear_at(points: dict[int, float], k: float) -> float:
    """The piecewise-linear curve through ``points`` (x -> y) at ``k``, extended past its ends
    by the nearest segment's slope."""
    known = sorted(points)
    if not known:
        raise ValueError("no verify cost is known")
    if len(known) == 1:
        return points[known[0]]
    lo = max([x for x in known if x <= k], default=known[0])
    hi = min([x for x in known if x > k], default=known[-1])
    if lo == hi:  # past the last measured k (or before the first): extend the nearest slope
        lo, hi = (known[-2], known[-1]) if k > known[-1] else (known[0], known[1])
    slope = (points[hi] - points[lo]) / (hi - lo)
    return points[lo] + slope * (k - lo)


@dataclass
class EngineCosts:
    engine: str
    plain_step: float  # seconds per token, plain decoding
    verify: dict[int, float]  # k tokens verified -> seconds of a round besides its draft steps
    draft_step: float  # seconds per draft forward
    source: str = "measured"
    notes: list[str] = field(default_factory=list)
    draft_pass: dict[int, float] = field(default_factory=dict)  # n_max -> seconds of one block pass (DFlash)

    def verify_at(self, k: float) -> float:
        """verify(k), linear between measured k and beyond them (k may be an expected value)."""
        return linear_at(self.verify, k)

    def round_seconds(self, verified: float, steps: float, n_max: int | None = None) -> float:
        """``steps`` draft forwards, each a block pass of ``n_max`` where ``draft_pass`` is known."""
        step = linear_at(self.draft_pass, n_max) if self.draft_pass and n_max is not None else self.draft_step
        return self.verify_at(verified) + steps * step

    def to_dict(self) -> dict:
        out = asdict(self)
        out["verify"] = {str(k): v for k, v in sorted(self.verify.items())}
        out["draft_pass"] = {str(k): v for k, v in sorted(self.draft_pass.items())}
        return out


def median_slope(xs: list[float], ys: list[float]) -> float:
    """Theil-Sen: the median of the slopes between every pair of points with different x."""
    slopes = sorted((ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))
                    if xs[j] != xs[i])
    mid = len(slopes) // 2
    return slopes[mid] if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2


def fit_costs(engine: str, plain: PlainProbe, chains: list[ChainProbe]) -> EngineCosts:
    """Costs from a plain run and chain runs: draft_step is the slope of draft time per round
    over draft steps per round (the median of pairwise slopes, so one run slowed by a
    neighbour does not set it), verify(n + 1) the rest of each chain's round."""
    if plain.tokens < 1 or plain.decode_seconds <= 0:
        raise ValueError(f"the plain run produced {plain.tokens} tokens in {plain.decode_seconds:.3f} s: nothing to time")
    usable = [c for c in chains if c.rounds > 0]
    if not usable:
        raise ValueError("no chain run completed a round: nothing to time the draft and the verify by")
    xs = [c.steps_per_round for c in usable]
    ys = [c.draft_seconds / c.rounds for c in usable]
    notes = []
    if len(set(xs)) > 1:
        draft_step = median_slope(xs, ys)
    else:
        draft_step = ys[0] / max(xs[0], 1)
    if draft_step <= 0 and any(x > 0 and y > 0 for x, y in zip(xs, ys)):
        # the runs disagree (a neighbour slowed the shorter chains): a draft step is never free, so take the
        # least draft time per step through the origin (it folds the per-round fixed part in, an overestimate)
        draft_step = min(y / x for x, y in zip(xs, ys) if x > 0 and y > 0)
        notes.append(f"draft time did not grow with the chain length (a busy machine?): draft step "
                     f"{draft_step * 1e3:.2f} ms is the least draft time per step of the chains, not the slope")
    draft_step = max(draft_step, 0.0)
    verify: dict[int, float] = {}
    for c in usable:
        # the draft time not explained by steps (a fixed part per round) stays on the verify side
        verify[c.n + 1] = c.decode_seconds / c.rounds - draft_step * c.steps_per_round
    plain_step = plain.decode_seconds / plain.tokens
    if 1 not in verify and len(verify) >= 2:
        # a round that drafts nothing still pays the draft's context update: extend from k = 2, 3
        verify[1] = min(max(linear_at(verify, 1), plain_step), verify[min(verify)])
        notes.append("verify(1) extrapolated from the measured k (a round that drafts nothing)")
    return EngineCosts(engine=engine, plain_step=plain_step, verify=verify, draft_step=draft_step, notes=notes)


def stated_costs(engine: str, *, verify_per_token: float, draft_step: float, max_k: int) -> EngineCosts:
    """A cost model in units of one plain step, for engines not measured here: verify(k) =
    1 + verify_per_token * (k - 1), a draft step = ``draft_step``. On a GPU a small verify batch
    is memory-bound (about one step: verify_per_token ~0.01-0.05) and a one-layer draft costs
    about its share of the target's layers."""
    for name, value in (("verify_per_token", verify_per_token), ("draft_step", draft_step)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 (a fraction of a plain step), got {value}")
    verify = {k: 1.0 + verify_per_token * (k - 1) for k in range(1, max_k + 2)}
    return EngineCosts(engine=engine, plain_step=1.0, verify=verify, draft_step=draft_step, source="stated",
                       notes=[f"stated model: verify(k) = 1 + {verify_per_token:g} (k - 1) plain steps, "
                              f"a draft step = {draft_step:g} plain steps; speeds are relative to plain"])


def fit_block_costs(engine: str, plain: PlainProbe, chains: list[ChainProbe]) -> EngineCosts:
    """Costs of a DFlash draft from a plain run and block runs of n_max = n (no probability stop, so
    every round verifies n + 1 tokens and runs one block pass): the pass's seconds per n from the
    draft time per round, verify(n + 1) the rest of the round; n not probed are read between them."""
    if plain.tokens < 1 or plain.decode_seconds <= 0:
        raise ValueError(f"the plain run produced {plain.tokens} tokens in {plain.decode_seconds:.3f} s: nothing to time")
    usable = [c for c in chains if c.rounds > 0]
    if not usable:
        raise ValueError("no block run completed a round: nothing to time the draft and the verify by")
    passes = {c.n: max(c.draft_seconds / c.rounds, 0.0) for c in usable}
    verify = {c.n + 1: c.decode_seconds / c.rounds - passes[c.n] for c in usable}
    plain_step = plain.decode_seconds / plain.tokens
    notes = ["DFlash: one block pass per round, its seconds by n_max: "
             + ", ".join(f"{n}: {s * 1e3:.2f} ms" for n, s in sorted(passes.items()))]
    if 1 not in verify:
        verify[1] = min(max(linear_at(verify, 1), plain_step), verify[min(verify)])
        notes.append("verify(1) extrapolated from the measured k (a round that drafts nothing)")
    return EngineCosts(engine=engine, plain_step=plain_step, verify=verify, draft_step=passes[max(passes)],
                       notes=notes, draft_pass=passes)
