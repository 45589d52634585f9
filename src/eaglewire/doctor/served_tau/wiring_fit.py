"""The served-wiring candidates' common ground: a ``Wiring`` (one way a server may run the draft), its replay of
the greedy chain on the server's own text, and how far that replay is from the server's counters in units of
binomial noise (``fit``, ``judge``). ``diagnosis.py`` builds the candidates and the check; ``probes.py`` asks the
server more where several fit. Shapes: B rows, S draft steps, T tokens, H hidden size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from eaglewire.doctor.evidence import MIN_LEAD, Z
from eaglewire.engines.serving.served_counts import AcceptanceRates

POST_NORM = -1  # a layout entry: boundary L after the target's final norm (what HF's hidden_states[-1] holds)


@dataclass(frozen=True)
class Wiring:
    """One way a server may run the draft: the boundaries it feeds and the fields it reads otherwise."""

    layout: tuple[int, ...]  # boundaries fed, in order (POST_NORM: boundary L after the final norm)
    label: str  # short: "[0, 2, 15]", "norm_before_residual true"
    what: str  # what the server does: "feeds boundaries [0, 2, 15] (...)"
    trained: str  # what training did instead: "on [2, 15, 27]", "without it"
    fix: str | None = None  # the config line that gives the trained wiring back
    from_config: bool = False  # what the engine reads from --engine-config: first among equally good matches
    # what it reads otherwise (fix_proof.LAYOUT, a config field): None where no reading of a config shows it
    aspect: str | None = None
    dropped: str = ""  # why the fix first written for it is not printed as is (fix_proof.prove)
    # what the user's --engine-config holds as trained for it: the one line that fixes it, "make the server load ..."
    remedy: str | None = None
    # one of several seeded samples of a hypothesis whose acceptance depends on which rows it is (another model's
    # embedding, lm_head, d2t): the served copy holds rows none of them is, so the family is judged with its spread
    stand_in: bool = False
    # () -> (the draft as the server runs it, a batch transform or None); None: the trained draft
    build: Callable[[], tuple[Any, Callable | None]] | None = field(default=None, compare=False, repr=False)


# ---------------------------------------------------------------- matching


@dataclass
class Fit:
    """One wiring's replay on the server's text against the server's own counters."""

    wiring: Wiring
    replayed: AcceptanceRates
    served_per_position: list[float]
    per_position: list[float]  # replayed, as many as served
    noise: list[float]  # each position's half-width
    tau_noise: float
    score: float  # the largest |served - replayed| over positions and τ, in units of its noise

    @property
    def matches(self) -> bool:
        return self.score <= 1.0

    @property
    def widest(self) -> float:
        return max(self.noise, default=0.0)


def rate_noise(p: float, n: int) -> float:
    """Half-width of a per-draft rate ``p`` over ``n`` drafts: Z binomial standard errors, at least MIN_LEAD."""
    return max(MIN_LEAD, Z * math.sqrt(max(p * (1 - p), 0.0) / max(n, 1)))


def tau_noise(per_position: list[float], n: int) -> float:
    """Half-width of τ over ``n`` drafts whose position i is accepted at rate ``per_position[i]``: Z standard
    errors of the accepted count per draft (P(A > i) = per_position[i]), at least SERVED_TAU_TOLERANCE."""
    from eaglewire.doctor.served_tau.served_replay import SERVED_TAU_TOLERANCE

    mean = sum(per_position)
    square = sum((2 * i + 1) * p for i, p in enumerate(per_position))
    return max(SERVED_TAU_TOLERANCE, Z * math.sqrt(max(square - mean * mean, 0.0) / max(n, 1)))


def _padded(values: list[float], n: int) -> list[float]:
    return list(values[:n]) + [0.0] * (n - len(values))


@dataclass(frozen=True)
class Spread:
    """How far a family of stand-ins' replays of the same text lie apart: Z sample standard deviations of each
    position's rate and of τ. Added to the binomial noise (in quadrature) when one of them is judged."""

    per_position: tuple[float, ...] = ()
    tau: float = 0.0


def family_spread(replays: list[AcceptanceRates]) -> Spread:
    """The ``Spread`` of several stand-ins' replays of one text (none for fewer than two)."""
    if len(replays) < 2:
        return Spread()

    def sd(values: list[float]) -> float:
        mean = sum(values) / len(values)
        return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))

    positions = max(len(r.per_position) for r in replays)
    rates = [_padded(r.per_position, positions) for r in replays]
    return Spread(tuple(Z * sd([r[i] for r in rates]) for i in range(positions)), Z * sd([r.tau for r in replays]))


def fit(served: AcceptanceRates, wiring: Wiring, replayed: AcceptanceRates, spread: Spread = Spread()) -> Fit:
    """How far ``replayed`` (``wiring``'s replay on the server's text) is from the server's counters, per
    position (where the server counts them) and in τ, each in units of its noise over the server's drafts
    (widened by ``spread`` for a stand-in: its family's own spread on the same text)."""
    n = served.drafts
    positions = max(len(served.accepted_per_pos), len(replayed.accepted_per_pos)) if served.accepted_per_pos else 0
    mine = _padded(replayed.per_position, positions)
    theirs = _padded(served.per_position, positions)
    wide = _padded(list(spread.per_position), positions)
    noise = [math.hypot(rate_noise(p, n), w) for p, w in zip(mine, wide)]
    tau_half = math.hypot(tau_noise(_padded(replayed.per_position, len(replayed.accepted_per_pos)), n), spread.tau)
    gaps = [abs(s - r) / h for s, r, h in zip(theirs, mine, noise)] + [abs(served.tau - replayed.tau) / tau_half]
    return Fit(wiring, replayed, theirs, mine, noise, tau_half, max(gaps))


def spreads(replays: list[tuple[Wiring, AcceptanceRates]]) -> dict[str, Spread]:
    """label -> the spread of its stand-ins' replays (``family_spread``), for each family of stand-ins."""
    families: dict[str, list[AcceptanceRates]] = {}
    for w, r in replays:
        if w.stand_in:
            families.setdefault(w.label, []).append(r)
    return {label: family_spread(rs) for label, rs in families.items()}


def judge(served: AcceptanceRates, replays: list[tuple[Wiring, AcceptanceRates]]) -> tuple[Fit | None, list[Fit]]:
    """(the wiring that reproduces the server's counters within noise, or None; every fit, closest first): the
    closest of those within noise, what the engine reads from its config before any other. A stand-in is judged
    with its family's spread on this text."""
    wide = spreads(replays)
    ranked = sorted((fit(served, w, r, wide.get(w.label, Spread()) if w.stand_in else Spread()) for w, r in replays),
                    key=lambda f: f.score)
    matches = sorted((f for f in ranked if f.matches), key=lambda f: not f.wiring.from_config)
    return (matches[0] if matches else None), ranked


def still_fitting(ranked: list[Fit]) -> list[Fit]:
    """The fits within noise, and with them every stand-in of a family one of whose stand-ins is: a family is
    judged by its spread, which needs all of its stand-ins."""
    families = {f.wiring.label for f in ranked if f.matches and f.wiring.stand_in}
    return [f for f in ranked if f.matches or (f.wiring.stand_in and f.wiring.label in families)]


def by_candidate(fits: list[Fit]) -> list[list[Fit]]:
    """``fits`` gathered by candidate, each in the place of its first fit (closest first where ``fits`` are ranked):
    a family of stand-ins is one candidate, its fits together; any other fit is one alone."""
    out: dict[Any, list[Fit]] = {}
    for f in fits:
        out.setdefault(("family", f.wiring.label) if f.wiring.stand_in else id(f), []).append(f)
    return list(out.values())


# ---------------------------------------------------------------- replaying


def capture_texts(target, draft, prompts: list[list[int]], outputs: list[list[int]], boundaries: set[int]) -> list:
    """The (prompt, server output) pairs as ``measure.EvalBatch``es (right-padded, a few sequences each),
    captured once at ``boundaries`` (POST_NORM: L after the final norm); a row's reply (loss mask) is the output, its
    name "text i" for the i-th pair."""
    from eaglewire.doctor.measure import Sequence, capture_batches

    sequences = []
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        if output:
            text = torch.tensor(list(prompt) + list(output))  # [T]
            sequences.append(Sequence(f"text {i}", text, torch.arange(len(text)) >= len(prompt)))
    if not sequences:
        return []
    batches = capture_batches(target, draft, sequences, sorted(b for b in boundaries if b >= 0))
    if POST_NORM in boundaries:
        for batch in batches:
            with torch.no_grad():
                last = batch.states[target.num_layers].to(target.device, target.dtype)  # [B, T, H]
                batch.states[POST_NORM] = target.decoder.norm(last).float()
    return batches


def replay_wiring(wiring: Wiring, draft, batches: list, steps: int):
    """``wiring``'s replay of the greedy chain on every captured text (``served.replay_chain``'s rounds)."""
    served, transform = built(wiring, draft)
    return replay_built(wiring.layout, served, transform, batches, steps)


def built(wiring: Wiring, draft) -> tuple[Any, Callable | None]:
    """(the draft as ``wiring`` runs it, the batch transform it needs or None): build once, replay often."""
    return wiring.build() if wiring.build is not None else (draft, None)


def replay_built(layout, served, transform: Callable | None, batches: list, steps: int):
    """A built wiring's (``built``) replay of the greedy chain on every captured text, fed ``layout``."""
    from eaglewire.doctor.served_tau.served_replay import Replayed

    total = Replayed(accepted_per_pos=[0] * steps)
    for _, one in replay_rows(layout, served, transform, batches, steps):
        total.add(one)
    return total


def replay_rows(layout, served, transform: Callable | None, batches: list, steps: int):
    """(each captured text's name, a built wiring's replay of the greedy chain on it), fed ``layout``."""
    from eaglewire.doctor.measure import step_rightness
    from eaglewire.doctor.served_tau.served_replay import replay_chain

    for batch in batches:
        judged = batch if transform is None else transform(batch)
        right = step_rightness(served, judged, list(layout), steps=steps)  # [B, S, T]
        for row, length in enumerate(batch.lengths):
            prompt_len = int(batch.loss_mask[row].int().argmax())
            yield batch.names[row], replay_chain(right[row, :, :length], prompt_len)
