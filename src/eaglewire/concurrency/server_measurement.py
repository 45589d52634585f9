"""Whether a draft pays at a given load in an engine launched here as a server (llama-server, vLLM): the running
server loaded with that many streams at once, timed whole.

Per shape (plain, then each chain) one server, launched with as many slots as the largest batch size. At each batch
size B, B streams start together, each sending ``each`` requests back to back that decode ``each * tokens`` tokens
past EOS in all (the batch stays B while timed; a speculative stream ends when its own rounds do, and one request a
stream would time the slowest stream's rounds against the mean's count), the streams' later requests arriving spread
out (``stream_lengths``), a warm-up load and then ``repeats`` timed ones. The
engine's own counter of verify passes that checked a draft (``RunningServer.spec_rounds``) splits a load's wall
time into rounds:

    a round's cost at B  = wall / (rounds / B)               every stream runs rounds / B of them
    a plain step at B    = wall / (each * (tokens - 1))      each request's first token comes with its prefill

Each chain's tokens a round (tau) come from the same loads: an engine may accept less with others in flight
(llama.cpp b11434 here: 1.28 tokens a round with 4 requests in flight against 1.53 alone, same outputs), so each
batch size is predicted with its own; tau alone (one request at a time over the tune prompts, EOS honoured) is
reported beside it. The predictions (B * tau / round), the noise rule and the schedule are concurrency/measurement.py's
own. Neither engine switches its shape by batch size, so the schedule says which launch
pays up to which load (``launch_advice``).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from eaglewire.concurrency.measurement import (ConcurrencyReport, Progress, StepCost, predict, schedule_from)
from eaglewire.concurrency.schedule import Schedule, concurrent, shape_name
from eaglewire.decode.spec_config import SpecConfig
from eaglewire.engines.interface import RunningServer, RunSettings, ServedFiles, Shape


def launched_shape(spec: SpecConfig) -> Shape:
    """The server launch of a chain shape; a tree is eaglewire's alone."""
    if spec.topk != 1:
        raise ValueError(f"{shape_name(spec)}: a server engine drafts chains; give chains (steps,1,steps+1)")
    return Shape(n_max=spec.num_steps, p_min=spec.min_prob)


def stream_lengths(stream: int, batch: int, tokens: int, each: int) -> list[int]:
    """The lengths of one stream's ``each`` requests: ``each * tokens`` in all, the first shifted by the stream's place
    (``tokens / 2`` .. ``1.5 * tokens``) so the streams' later requests arrive spread out, as users' do. In lockstep,
    plain streams would end and prefill together in one step while speculative ones (each ending when its own rounds
    do) prefilled apart, a stall each: a bias against speculation that no user's traffic has."""
    if each == 1:
        return [tokens]
    first = tokens // 2 + (stream * tokens) // batch
    return [first, *[tokens] * (each - 2), each * tokens - first - (each - 2) * tokens]


def load_once(server: RunningServer, prompts: list[list[int]], batch: int, tokens: int, each: int = 1) -> float:
    """Seconds for ``batch`` streams started together, each sending ``each`` requests back to back that decode
    ``each * tokens`` tokens past EOS in all (greedy; ``stream_lengths``). Back to back keeps the batch full: a
    speculative stream ends when its own rounds do, so a single request each would time the slowest stream's rounds
    while counting the mean's."""
    def stream(b: int) -> list[tuple[int, list[int]]]:
        return [(n, server.complete(prompts[(b * each + r) % len(prompts)], max_new_tokens=n, temperature=0.0,
                                    seed=b, ignore_eos=True))
                for r, n in enumerate(stream_lengths(b, batch, tokens, each))]

    with ThreadPoolExecutor(max_workers=batch) as pool:
        start = time.perf_counter()
        answers = [a for answers in pool.map(stream, range(batch)) for a in answers]
        seconds = time.perf_counter() - start
    short = [(len(a), n) for n, a in answers if len(a) != n]
    if short:
        raise RuntimeError(f"the server answered {short[0][0]} tokens where {short[0][1]} were asked past EOS: it does "
                           "not honour ignore_eos, so the batch cannot be held while timed")
    return seconds


@dataclass
class LoadCost:
    """One (batch size, shape)'s timed loads: the seconds of a step or round, and tokens a round under that load."""

    cost: StepCost
    tau: float | None  # None: plain


def measure_load(server: RunningServer, prompts: list[list[int]], batch: int, *, speculative: bool, tokens: int,
                 warmup: int, repeats: int, each: int = 1) -> LoadCost:
    """The seconds of one step (plain) or one round (speculative) at ``batch``, one value per timed load (``each``
    requests a stream), and the tokens a round the loads' sequences averaged (an engine may accept less under load
    than alone)."""
    for _ in range(warmup):
        load_once(server, prompts, batch, tokens, each)
    seconds, rounds_total = [], 0
    decoded = each * (tokens - 1)  # a stream's tokens after each request's prefill token
    for _ in range(repeats):
        before = server.spec_rounds() if speculative else None
        wall = load_once(server, prompts, batch, tokens, each)
        if not speculative:
            seconds.append(wall / decoded)
            continue
        rounds = (server.spec_rounds() or 0) - (before or 0)
        if rounds <= 0:
            raise RuntimeError("the server counted no drafting round under load: is the draft in use?")
        seconds.append(wall / (rounds / batch))
        rounds_total += rounds
    tau = repeats * batch * decoded / rounds_total if speculative else None
    return LoadCost(StepCost(seconds), tau)


def measure_tau(server: RunningServer, prompts: list[list[int]], max_new_tokens: int) -> float:
    """Tokens a round, greedy, the prompts sent one at a time (EOS honoured); the prefill's token not counted."""
    before = server.spec_rounds() or 0
    tokens = sum(max(len(server.complete(ids, max_new_tokens=max_new_tokens, temperature=0.0, seed=i)) - 1, 0)
                 for i, ids in enumerate(prompts))
    rounds = (server.spec_rounds() or 0) - before
    if rounds <= 0:
        raise RuntimeError("the server counted no drafting round: is the draft in use?")
    return tokens / rounds


def measure_server_concurrency(runtime, files: ServedFiles, settings: RunSettings, prompts: list[list[int]],
                               batches: list[int], shapes: list[SpecConfig], *, tokens: int = 64, each: int = 2,
                               max_new_tokens: int = 64, warmup: int = 1, repeats: int = 5, log_dir: Path,
                               progress: Progress = lambda _: None) -> ConcurrencyReport:
    """Plain and every chain of ``shapes`` launched by ``runtime`` (a ``Runtime``) with ``max(batches)`` slots,
    each loaded at every batch size: the costs, taus, predictions and the schedule."""
    launched = replace(settings, slots=max(batches))
    loads: dict[tuple[int, str], LoadCost] = {}
    alone: dict[str, float] = {}
    for spec in [None, *shapes]:
        shape = Shape() if spec is None else launched_shape(spec)
        name = "plain" if spec is None else shape_name(spec)
        progress(f"{runtime.label} {shape.label()}: launching with {launched.slots} slots")
        log = Path(log_dir) / f"load-{name.replace(' ', '-')}.log"
        with runtime.serve(files, shape, launched, log_path=log) as server:
            if spec is not None:
                progress(f"{runtime.label} {shape.label()}: tau over {len(prompts)} prompts x {max_new_tokens} tokens")
                alone[name] = measure_tau(server, prompts, max_new_tokens)
            for B in batches:
                progress(f"{runtime.label} {shape.label()}: {B} streams x {each} requests x {tokens} tokens, "
                         f"{repeats} loads")
                loads[(B, name)] = measure_load(server, prompts, B, speculative=spec is not None, tokens=tokens,
                                                warmup=warmup, repeats=repeats, each=each)
    costs = {key: load.cost for key, load in loads.items()}
    # each batch size predicted with the acceptance its own loads had: an engine may accept less with others in flight
    predictions = [p for B in batches
                   for p in predict(costs, {name: loads[(B, name)].tau for name in alone}, shapes, [B])]
    under_load = "; ".join(f"{name}: {tau:.2f} alone, " + ", ".join(f"{loads[(B, name)].tau:.2f} at {B}"
                                                                    for B in batches)
                           for name, tau in alone.items())
    return ConcurrencyReport(costs, alone, predictions, schedule_from(predictions),
                             [f"{runtime.label} launched with {launched.slots} slots on {settings.threads} threads; "
                              f"{each} requests of {tokens} tokens past EOS back to back a stream, {repeats} loads "
                              "a batch size",
                              f"tokens a round under load (each batch size predicted with its own): {under_load}"])


def launch_advice(schedule: Schedule, spell) -> list[str]:
    """What to launch, for an engine whose shape is fixed at launch: per range of loads, the launch that pays
    there (``spell(shape)``: the engine's own spelling of a chain) and where it stops paying."""
    lines = []
    low = 1
    for i, r in enumerate(schedule.ranges):
        last = i == len(schedule.ranges) - 1
        loads = f"{low} or more" if last else (f"{low}" if low == r.max_batch else f"{low}-{r.max_batch}")
        what = "launch it plain" if r.shape is None else f"launch it with {spell(r.shape)}"
        lines.append(f"expecting {concurrent(loads)}: {what}")
        low = r.max_batch + 1
    crossover = schedule.crossover
    if crossover not in (None, -1):
        lines.append(f"a speculative launch loses above {concurrent(crossover)} (the engine cannot switch "
                     "its shape by load)")
    return lines
