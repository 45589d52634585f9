"""Whether a draft pays at a given load in an engine launched here as a server (llama-server, vLLM): the running
server loaded with that many streams at once, timed whole.

Per shape (plain, then each chain) one server, launched with as many slots as the largest batch size. At each batch
size B, B streams start together, each decoding ``tokens`` tokens past EOS (the batch stays B while timed), a warm-up
load and then ``repeats`` timed ones. The engine's own counter of verify passes that checked a draft
(``RunningServer.spec_rounds``) splits a load's wall time into rounds:

    a round's cost at B  = wall / (rounds / B)     every sequence runs rounds / B of them
    a plain step at B    = wall / (tokens - 1)     the first token comes with the prefill

Each chain's tokens a round (tau) come from the same loads: an engine may accept less with others in flight
(llama.cpp b11434 here: 1.28 tokens a round with 4 requests in flight against 1.53 alone, same outputs), so each
batch size is predicted with its own; tau alone (one request at a time over the tune prompts, EOS honoured) is
reported beside it. The predictions (B * tau / round), the noise rule and the schedule are acceptance/concurrency.py's
own. Neither engine switches its shape by batch size, so the schedule says which launch
pays up to which load (``launch_advice``).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from eaglewire.acceptance.concurrency import (ConcurrencyReport, Progress, StepCost, predict, schedule_from)
from eaglewire.decode.schedule import Schedule, shape_name
from eaglewire.decode.spec_config import SpecConfig
from eaglewire.engines.interface import RunningServer, RunSettings, ServedFiles, Shape


def launched_shape(spec: SpecConfig) -> Shape:
    """The server launch of a chain shape; a tree is eaglewire's alone."""
    if spec.topk != 1:
        raise ValueError(f"{shape_name(spec)}: a server engine drafts chains; give chains (steps,1,steps+1)")
    return Shape(n_max=spec.num_steps, p_min=spec.min_prob)


def load_once(server: RunningServer, prompts: list[list[int]], batch: int, tokens: int) -> float:
    """Seconds for ``batch`` streams started together, each decoding exactly ``tokens`` tokens (greedy)."""
    def one(i: int) -> list[int]:
        return server.complete(prompts[i % len(prompts)], max_new_tokens=tokens, temperature=0.0, seed=i,
                               ignore_eos=True)

    with ThreadPoolExecutor(max_workers=batch) as pool:
        start = time.perf_counter()
        answers = list(pool.map(one, range(batch)))
        seconds = time.perf_counter() - start
    short = [len(a) for a in answers if len(a) != tokens]
    if short:
        raise RuntimeError(f"the server answered {short[0]} tokens where {tokens} were asked past EOS: it does not "
                           "honour ignore_eos, so the batch cannot be held while timed")
    return seconds


@dataclass
class LoadCost:
    """One (batch size, shape)'s timed loads: the seconds of a step or round, and tokens a round under that load."""

    cost: StepCost
    tau: float | None  # None: plain


def measure_load(server: RunningServer, prompts: list[list[int]], batch: int, *, speculative: bool, tokens: int,
                 warmup: int, repeats: int) -> LoadCost:
    """The seconds of one step (plain) or one round (speculative) at ``batch``, one value per timed load, and the
    tokens a round the loads' sequences averaged (an engine may accept less under load than alone)."""
    for _ in range(warmup):
        load_once(server, prompts, batch, tokens)
    seconds, rounds_total = [], 0
    for _ in range(repeats):
        before = server.spec_rounds() if speculative else None
        wall = load_once(server, prompts, batch, tokens)
        if not speculative:
            seconds.append(wall / (tokens - 1))
            continue
        rounds = (server.spec_rounds() or 0) - (before or 0)
        if rounds <= 0:
            raise RuntimeError("the server counted no drafting round under load: is the draft in use?")
        seconds.append(wall / (rounds / batch))
        rounds_total += rounds
    tau = repeats * batch * (tokens - 1) / rounds_total if speculative else None
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
                               batches: list[int], shapes: list[SpecConfig], *, tokens: int = 32,
                               max_new_tokens: int = 64, warmup: int = 1, repeats: int = 5, log_dir: Path,
                               progress: Progress = lambda _: None) -> ConcurrencyReport:
    """Plain and every chain of ``shapes`` launched by ``runtime`` (a ``Runtime``) with ``max(batches)`` slots,
    each loaded at every batch size: the costs, taus, predictions and the schedule."""
    from dataclasses import replace

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
                progress(f"{runtime.label} {shape.label()}: {B} streams x {tokens} tokens, {repeats} loads")
                loads[(B, name)] = measure_load(server, prompts, B, speculative=spec is not None, tokens=tokens,
                                                warmup=warmup, repeats=repeats)
    costs = {key: load.cost for key, load in loads.items()}
    # each batch size predicted with the acceptance its own loads had: an engine may accept less with others in flight
    predictions = [p for B in batches
                   for p in predict(costs, {name: loads[(B, name)].tau for name in alone}, shapes, [B])]
    under_load = "; ".join(f"{name}: {tau:.2f} alone, " + ", ".join(f"{loads[(B, name)].tau:.2f} at {B}"
                                                                    for B in batches)
                           for name, tau in alone.items())
    return ConcurrencyReport(costs, alone, predictions, schedule_from(predictions),
                             [f"{runtime.label} launched with {launched.slots} slots on {settings.threads} threads; "
                              f"{tokens} tokens a stream past EOS, {repeats} loads a batch size",
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
        lines.append(f"expecting {loads} concurrent requests: {what}")
        low = r.max_batch + 1
    crossover = schedule.crossover
    if crossover not in (None, -1):
        lines.append(f"a speculative launch loses above {crossover} concurrent requests (the engine cannot switch "
                     "its shape by load)")
    return lines
