"""Whether a draft pays at a given load: round costs measured per batch size, a schedule from them.

Terms: B live sequences share each step; a shape (a chain or a tree) yields tau tokens a round per sequence,
measured by decoding the tune prompts one at a time in that shape (greedy: a sequence's rounds do not depend on
what else is in the batch). A step's cost is measured whole, as the engine runs it at B (draft, packed verify,
acceptance), not summed from isolated forwards, which price batched rounds too cheaply.

Predicted tokens/s of a shape at batch B: B * tau / step(B, shape); plain: B / step(B, plain). A shape is kept at B
only if it beats plain by more than the noise of the two costs measured there; the best kept shape (or plain) per
batch size becomes the schedule.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from eaglewire.concurrency.schedule import Schedule, ScheduleRange, concurrent, shape_name
from eaglewire.decode.spec_config import SpecConfig

Progress = Callable[[str], None]


@dataclass
class StepCost:
    """One (batch size, shape)'s measured steps."""

    seconds: list[float]  # each timed step

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def noise(self) -> float:
        """The relative uncertainty of the median: the steps' interquartile range over the median, over sqrt(n)."""
        if len(self.seconds) < 4:
            return 0.0
        q = statistics.quantiles(self.seconds, n=4)
        return (q[2] - q[0]) / self.median / len(self.seconds) ** 0.5


@dataclass
class Prediction:
    batch: int
    shape: SpecConfig | None
    tokens_per_second: float
    speedup: float  # over plain at the same batch size
    noise: float  # relative: the shape's and plain's costs' noise together
    kept: bool  # beats plain by more than the noise (plain: always)


@dataclass
class ConcurrencyReport:
    costs: dict[tuple[int, str], StepCost]  # (batch, shape name or "plain") -> its steps
    taus: dict[str, float]  # shape name -> tokens a round per sequence
    predictions: list[Prediction]
    schedule: Schedule
    notes: list[str] = field(default_factory=list)

    def format(self) -> str:
        taus = ", ".join(f"{name} {tau:.2f}" for name, tau in self.taus.items())
        lines = [f"tokens a round (tau, greedy): {taus}", "",
                 f"{'batch':>5}  {'shape':18} {'ms/step':>8} {'tok/s':>8} {'vs plain':>8}  {'noise':>6}  choice"]
        chosen = {b: self.schedule.shape_for(b) for b in sorted({p.batch for p in self.predictions})}
        for p in self.predictions:
            name = "plain" if p.shape is None else shape_name(p.shape)
            mark = "<-" if p.shape == chosen[p.batch] else verdict(p)
            lines.append(f"{p.batch:5}  {name:18} {1e3 * self.costs[(p.batch, name)].median:8.1f} "
                         f"{p.tokens_per_second:8.1f} {p.speedup:7.2f}x  {100 * p.noise:5.1f}%  {mark}")
        lines += ["", f"schedule: {self.schedule.describe()}"]
        crossover = self.schedule.crossover
        if crossover is None:
            lines.append("speculation pays at none of these batch sizes here: serve plain")
        elif crossover == -1:
            lines.append(f"speculation pays up to {concurrent(max(chosen))} (the most measured)")
        else:
            lines.append(f"speculation pays up to {concurrent(crossover)} here; above that serve plain")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def verdict(p: Prediction) -> str:
    """Why a prediction is not the choice: slower than plain, or faster by less than the noise."""
    if p.shape is None or p.kept:
        return ""
    return "slower than plain" if p.speedup <= 1 else "within noise"


def predict(costs: dict[tuple[int, str], StepCost], taus: dict[str, float], shapes: list[SpecConfig],
            batches: list[int]) -> list[Prediction]:
    """Every (batch, shape)'s tokens/s from its measured steps and its tau; plain first per batch."""
    out = []
    for B in batches:
        plain = costs[(B, "plain")]
        plain_tps = B / plain.median
        out.append(Prediction(B, None, plain_tps, 1.0, plain.noise, True))
        for shape in shapes:
            cost = costs[(B, shape_name(shape))]
            tps = B * taus[shape_name(shape)] / cost.median
            noise = cost.noise + plain.noise
            out.append(Prediction(B, shape, tps, tps / plain_tps, noise, tps / plain_tps > 1 + noise))
    return out


def schedule_from(predictions: list[Prediction]) -> Schedule:
    """Per batch size the fastest kept choice; consecutive batch sizes with the same choice share a range (a range
    ends at its last measured batch size; sizes past the last measured run its choice)."""
    best: dict[int, Prediction] = {}
    for p in predictions:
        if p.kept and (p.batch not in best or p.tokens_per_second > best[p.batch].tokens_per_second):
            best[p.batch] = p
    ranges: list[ScheduleRange] = []
    for B in sorted(best):
        shape = best[B].shape
        if ranges and ranges[-1].shape == shape:
            ranges[-1] = ScheduleRange(B, shape)
        else:
            ranges.append(ScheduleRange(B, shape))
    return Schedule(ranges)


# -- measuring in eaglewire's engine ----------------------------------------------

def measure_tau(decoder, prompts: list[list[int]], shape: SpecConfig, max_new_tokens: int) -> float:
    """Tokens a round of ``shape``, greedy, the prompts decoded one at a time."""
    from eaglewire.decode.batch_engine import BatchEngine

    engine = BatchEngine(decoder, Schedule.fixed(shape))
    accepted, rounds = 0, 0
    for prompt in prompts:
        seq = engine.add(prompt, max_new_tokens=max_new_tokens)
        while engine.live:
            engine.step()
        accepted, rounds = accepted + sum(seq.stats.accept_lengths), rounds + seq.stats.rounds
    return accepted / max(rounds, 1)


def measure_steps(decoder, prompts: list[list[int]], batch: int, shape: SpecConfig | None, *, warmup: int,
                  repeats: int) -> StepCost:
    """Time ``repeats`` whole steps of ``batch`` sequences decoding in ``shape`` (None: plain), after ``warmup``."""
    from eaglewire.decode.batch_engine import BatchEngine

    engine = BatchEngine(decoder, Schedule.fixed(shape))
    budget = (warmup + repeats + 1) * (1 + (shape.num_steps if shape else 0)) + 1  # nobody finishes while timed
    for b in range(batch):
        engine.add(prompts[b % len(prompts)], max_new_tokens=budget, stop_token_ids=set())
    seconds = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        engine.step()
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
    for seq in list(engine.live):
        engine.remove(seq)
    return StepCost(seconds)


def measure_concurrency(decoder, prompts: list[list[int]], batches: list[int], shapes: list[SpecConfig], *,
                        max_new_tokens: int = 64, warmup: int = 2, repeats: int = 12,
                        progress: Progress = lambda _: None) -> ConcurrencyReport:
    """Step costs of plain and every shape at every batch size in ``decoder``'s engine, each shape's tau, the
    predictions and the schedule they give."""
    taus = {}
    for shape in shapes:
        progress(f"tau of {shape_name(shape)}: {len(prompts)} prompts x {max_new_tokens} tokens")
        taus[shape_name(shape)] = measure_tau(decoder, prompts, shape, max_new_tokens)
    costs: dict[tuple[int, str], StepCost] = {}
    for B in batches:
        for shape in [None, *shapes]:
            name = "plain" if shape is None else shape_name(shape)
            progress(f"batch {B}: {name}, {repeats} steps")
            costs[(B, name)] = measure_steps(decoder, prompts, B, shape, warmup=warmup, repeats=repeats)
    predictions = predict(costs, taus, shapes, batches)
    return ConcurrencyReport(costs, taus, predictions, schedule_from(predictions),
                             [f"{torch.get_num_threads()} threads, {decoder.target.dtype}"])
