"""Predicted tokens/s per shape, the ranking, and what to serve (plain decoding when nothing pays)."""

from __future__ import annotations

from dataclasses import dataclass

from eaglewire.acceptance.costs import EngineCosts
from eaglewire.acceptance.simulate import Shape, rounds, rule_of, tau
from eaglewire.acceptance.trace import DraftTrace
from eaglewire.engines.interface import ChainRule

DEFAULT_P_MINS = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9)
MARGIN = 0.03  # a shape must be predicted this much above plain to be worth serving


@dataclass(frozen=True)
class Prediction:
    shape: Shape
    tau: float  # tokens per round
    drafted: float  # drafted tokens per round
    round_seconds: float
    tokens_per_second: float
    speedup: float  # vs plain decoding in the same engine
    break_even_tau: float  # the τ this shape's round cost needs to match plain


def shapes(max_steps: int, p_mins: tuple[float, ...] = DEFAULT_P_MINS, rule: ChainRule | None = None) -> list[Shape]:
    """Plain and every chain up to ``max_steps`` at each probability stop (only p-min 0 where ``rule`` has none)."""
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    stops = p_mins if rule is None or rule.p_min_stops else (0.0,)
    return [Shape(0)] + [Shape(n, p) for n in range(1, max_steps + 1) for p in stops]


def block_shapes(block_size: int, engine: ChainRule | str, p_mins: tuple[float, ...] = DEFAULT_P_MINS) -> list[Shape]:
    """A DFlash draft's shapes: n = 1 .. block_size - 1 drafted tokens from one block (with p-min stops where the
    engine's rule stops blocks, llama.cpp's; eaglewire's chain of n without), and plain decoding."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    stops = p_mins if rule_of(engine).block_stops else (0.0,)
    return [Shape(0)] + [Shape(n, p, block=True) for n in range(1, block_size) for p in stops]


def predict(shape: Shape, traces: list[DraftTrace], costs: EngineCosts, *, sampled: bool) -> Prediction:
    if shape.plain:
        return Prediction(shape, 1.0, 0.0, costs.plain_step, 1.0 / costs.plain_step, 1.0, 1.0)
    rs = rounds(traces, shape, costs.engine, sampled=sampled)
    if not rs:
        raise ValueError("the traces hold no complete round: give longer outputs (--max-new-tokens)")
    seconds = sum(costs.round_seconds(r.drafted + 1, r.steps, shape.n_max) for r in rs) / len(rs)
    t = tau(rs)
    tps = t / seconds
    return Prediction(shape, t, sum(r.drafted for r in rs) / len(rs), seconds, tps, tps * costs.plain_step,
                      seconds / costs.plain_step)


def rank(predictions: list[Prediction]) -> list[Prediction]:
    return sorted(predictions, key=lambda p: -p.tokens_per_second)


@dataclass(frozen=True)
class Recommendation:
    choice: Prediction
    best_speculative: Prediction | None
    reason: str


MANY_REQUESTS = ("serving many requests at once, past some batch size plain decoding wins: "
                 "`eaglewire tune --concurrency 1,2,4,8` says where")


def recommend(ranked: list[Prediction], engine: ChainRule | str) -> Recommendation:
    plain = next(p for p in ranked if p.shape.plain)
    best = next((p for p in ranked if not p.shape.plain), None)
    if best is not None and best.tau <= 1.0:  # nothing accepted: timing noise cannot make that pay
        return Recommendation(plain, best, "plain decoding: the draft had no token accepted in any shape "
                                           "(τ 1.00); train it further")
    if best is not None and best.speedup >= 1 + MARGIN:
        return Recommendation(best, best, f"{best.shape.label(engine)}: predicted {best.speedup:.2f}x plain "
                                          f"at 1 concurrent request (τ {best.tau:.2f} against the "
                                          f"{best.break_even_tau:.2f} its round costs); {MANY_REQUESTS}")
    if best is None:
        return Recommendation(plain, None, "no speculative shape was ranked")
    return Recommendation(plain, best, (
        f"plain decoding: no shape pays in this engine at 1 concurrent request, nor will at more. The best, {best.shape.label(engine)}, is predicted "
        f"{best.speedup:.2f}x plain: its round costs {best.break_even_tau:.2f} plain steps "
        f"({best.round_seconds * 1e3:.1f} ms) and the draft reaches τ {best.tau:.2f} there; it would need "
        f"τ >= {best.break_even_tau * (1 + MARGIN):.2f}, or a cheaper round (verify and draft costs above)"))
