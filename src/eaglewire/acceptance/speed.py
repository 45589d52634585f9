"""One engine and one draft, end to end: the engine's round costs and its own text measured, the
draft traced along that text, every chain shape predicted and one recommended (plain decoding
when none pays).

A DFlash draft (``is_block_draft``) is ranked by block shapes instead: n = 1 .. block_size - 1
tokens drafted from one pass, a round costing verify(n + 1) + one block pass (``costs.py``);
``--max-steps`` bounds EAGLE-3 chains only. llama.cpp runs a block of n_max + 1 tokens, so each
n is traced at its own block length and a few n are probed (``block_probe_sizes``), the others
read between them.

``eaglewire tune`` reports it; the doctor's speed check and bench's ``--configs recommended`` call
it for their own engine and prompts. ``SpeedQuery`` holds the defaults (``TuneConfig`` takes its
own from it).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from eaglewire.acceptance.costs import EngineCosts, fit_block_costs, fit_costs, stated_costs
from eaglewire.acceptance.recommend import (DEFAULT_P_MINS, Prediction, Recommendation, block_shapes, predict, rank,
                                            recommend, shapes)
from eaglewire.acceptance.trace import trace_blocks, trace_text
from eaglewire.model.dflash_blocks import is_block_draft
from eaglewire.engines import Ability, export_draft, get as engine, names as engine_names
from eaglewire.engines.interface import ChainRule, RunSettings, ServedFiles

log = logging.getLogger(__name__)

EAGLEWIRE = "eaglewire"  # the engine in this process: timed directly, no server
MEASURED_ENGINES = engine_names(Ability.RUN_HERE, aliases=False)  # timed here
STATED_ENGINES = engine_names(Ability.STATED_COSTS, aliases=False)  # a stated cost model (GPU engines)
DEFAULT_PROMPTS = 12  # τ varies from prompt to prompt: 6 MT-bench prompts read 1.47-1.68
COSTS = ("auto", "measured", "stated")  # auto: measured where the engine runs here, else the stated model

Progress = Callable[[str], None]


def chain_rule(name: str) -> ChainRule:
    """How engine ``name`` stops a chain and spells a shape (SGLang stops as eaglewire does)."""
    return engine(name).chain_rule


@dataclass(frozen=True, kw_only=True)
class SpeedQuery:
    """What a speed ranking measures: an engine (measured here, or a stated cost model), how many
    tokens per prompt, and the shapes it ranks."""

    engine: str = EAGLEWIRE  # MEASURED_ENGINES are timed here, STATED_ENGINES take the stated costs
    max_new_tokens: int = 128  # tokens per prompt
    max_steps: int = 6  # longest chain ranked (and probed)
    p_mins: tuple[float, ...] = DEFAULT_P_MINS  # probability stops ranked
    temperature: float = 0.0  # 0 = greedy; > 0: sampled rounds, expected acceptance
    seed: int = 0  # sampling seed of prompt i is seed + i
    verify_cost: float = 0.02  # stated: a verify pass costs 1 + this x (tokens - 1) plain steps
    draft_cost: float = 0.05  # stated: a draft step costs this many plain steps
    stated: bool = False  # take the stated cost model even where the engine runs here

    def __post_init__(self) -> None:
        engines = tuple(dict.fromkeys(MEASURED_ENGINES + STATED_ENGINES))
        if self.engine not in engines:
            raise ValueError(f"engine {self.engine!r}: the speed ranking knows {', '.join(engines)}")
        if self.stated and self.engine not in STATED_ENGINES:
            raise ValueError(f"engine {self.engine!r} has no stated cost model; it is measured here")
        if not self.stated and self.engine not in MEASURED_ENGINES:
            raise ValueError(f"engine {self.engine!r} does not run here: rank it with the stated cost model")

    @property
    def rule(self) -> ChainRule:
        return chain_rule(self.engine)


def measured_here(name: str, costs: str, settings: RunSettings) -> tuple[bool, str | None]:
    """(whether ``--costs`` means timing engine ``name`` here, a note when auto fell back to the stated model)."""
    if costs not in COSTS:
        raise ValueError(f"--costs {costs!r} is not one of {', '.join(COSTS)}")
    spec = engine(name)
    if costs == "stated" or (costs == "auto" and not spec.can(Ability.RUN_HERE)):
        return False, None
    why_not = spec.runtime.available(settings) if spec.runtime is not None else None
    if costs == "measured" and not spec.can(Ability.RUN_HERE):
        raise ValueError(f"--costs measured: {name} does not run here; its costs can only be stated")
    if why_not and costs == "auto" and spec.stated_costs:
        return False, f"{why_not}; ranked with the stated cost model instead"
    if why_not:
        raise ValueError(why_not)
    return True, None


@dataclass(frozen=True)
class ServerSetup:
    """What an engine's server probes launch: its files, how it runs, where its logs go."""

    files: ServedFiles
    settings: RunSettings
    log_dir: Path


def server_setup(name: str, draft_dir: str, target: str, work_dir: Path, settings: RunSettings, *,
                 allow: frozenset[str] = frozenset()) -> ServerSetup:
    """The files engine ``name`` serves (the user's own where ``settings`` names them, else exported into
    ``work_dir``); server logs go to ``work_dir``."""
    runtime = engine(name).runtime
    why_not = runtime.available(settings)
    if why_not:
        raise ValueError(why_not)
    work_dir.mkdir(parents=True, exist_ok=True)
    files = runtime.files(draft_dir, target, work_dir, settings, export=export_draft, allow=allow)
    return ServerSetup(files, settings, work_dir)


def encoded_prompts(tokenizer, dataset: str, offset: int, count: int) -> list[list[int]]:
    """Token ids of ``count`` prompts of ``dataset`` from number ``offset`` on (through the chat template
    where the set is chat)."""
    from eaglewire.decode.text import encode_prompt
    from eaglewire.core.prompts import load_prompts

    prompts = load_prompts(dataset)[offset:offset + count]
    if not prompts:
        raise ValueError(f"--offset {offset} leaves no prompt in {dataset}")
    return [encode_prompt(tokenizer, p.text, chat=p.chat) for p in prompts]



def measure(query: SpeedQuery, target, draft, contract, prompts: list[list[int]], say: Progress,
            server: ServerSetup | None = None) -> tuple[EngineCosts, list[list[int]]]:
    """(the engine's costs, its plain outputs per prompt): probed for engines that run here, stated
    otherwise (whose outputs eaglewire's engine stands in for: greedy text is the target's)."""
    from eaglewire.acceptance.engine_timing import probe_eaglewire, probe_server
    from eaglewire.core.tokens import stop_token_ids

    spec = engine(query.engine)
    remote = not query.stated and spec.runtime is not None
    if remote and server is None:
        raise ValueError(f"engine {query.engine!r} is timed on its own files: pass server=server_setup(...)")
    stops = set(stop_token_ids(target.tokenizer, target.model))
    steps = list(range(1, query.max_steps + 1))
    common = dict(max_new_tokens=query.max_new_tokens, temperature=query.temperature, seed=query.seed,
                  progress=say)
    block = is_block_draft(draft)
    if remote:
        if block:
            steps = block_probe_sizes(draft.config.block_size)
        probe = probe_server(spec, server.files, server.settings, prompts, steps=steps, log_dir=server.log_dir,
                             **common)
        costs = (fit_block_costs if block else fit_costs)(spec.name, probe.plain, probe.chains)
        if any(c.draft_seconds == 0 for c in probe.chains):
            costs.notes.append(f"{spec.runtime.label} does not time its drafting apart: a round's whole time is on "
                               "the verify side, exact for the chains probed (no probability stop)")
        return costs, probe.outputs
    if not query.stated and block:
        from eaglewire.acceptance.engine_timing import probe_eaglewire_blocks

        probe, times = probe_eaglewire_blocks(target, draft, contract, prompts, stop_ids=stops, **common)
        plain_step = probe.plain.decode_seconds / max(probe.plain.tokens, 1)
        return EngineCosts(engine=EAGLEWIRE, plain_step=plain_step, verify=times.verify, draft_step=times.draft_pass,
                           notes=["DFlash: one block pass per round (the draft's forward and the target's lm_head "
                                  "over the block), timed directly beside the target runner's verify(k); the "
                                  "engine's own per-round bookkeeping is not in it"]), probe.outputs
    if not query.stated:
        probe = probe_eaglewire(target, draft, contract, prompts, steps=steps, stop_ids=stops, **common)
        return fit_costs(EAGLEWIRE, probe.plain, probe.chains), probe.outputs
    probe = probe_eaglewire(target, None, None, prompts, steps=[], stop_ids=stops, **common)
    costs = stated_costs(query.engine, verify_per_token=query.verify_cost, draft_step=query.draft_cost,
                         max_k=draft.config.block_size - 1 if block else query.max_steps)
    if block:
        costs.notes.append(f"DFlash: a round runs one draft pass (--draft-cost {query.draft_cost:g} plain steps) "
                           "whatever it proposes")
    return costs, probe.outputs


def block_probe_sizes(block_size: int) -> list[int]:
    """The n_max a DFlash draft is probed at in llama.cpp: 1, 2, 4, ... and block_size - 1 (a server
    start each; verify and the pass are read between them for the others)."""
    out, n = [], 1
    while n < block_size - 1:
        out.append(n)
        n *= 2
    return out + [block_size - 1]


@dataclass
class SpeedRanking:
    costs: EngineCosts
    ranked: list[Prediction]
    recommendation: Recommendation
    prompts: int
    traced_tokens: int
    rule: ChainRule  # how the engine stops a chain and spells a shape (labels)

    def report(self, settings: dict, key: str = "config") -> dict:
        """The JSON report (tune.json): the ``settings`` it ran with (under ``key``), the costs, every
        shape ranked."""
        pred = lambda p: {**asdict(p), "shape": asdict(p.shape), "label": p.shape.label(self.rule),
                          "bench_config": p.shape.bench_config()}
        return {key: settings, "costs": self.costs.to_dict(),
                "ranked": [pred(p) for p in self.ranked],
                "recommendation": {"shape": pred(self.recommendation.choice), "reason": self.recommendation.reason},
                "prompts": self.prompts, "traced_tokens": self.traced_tokens}


def rank_speed(query: SpeedQuery, target, draft, contract, prompts: list[list[int]], *,
               server: ServerSetup | None = None, progress: Progress | None = None) -> SpeedRanking:
    """Measure ``query.engine`` on ``prompts``, trace ``draft`` along the engine's own outputs, and rank
    every shape up to ``query.max_steps`` (plain decoding included) by predicted tokens/s."""
    say = progress or (lambda msg: log.info("%s", msg))
    costs, outputs = measure(query, target, draft, contract, prompts, say, server)
    say("tracing the draft along the engine's outputs")
    sampled = query.temperature > 0
    layout = list(contract.aux_boundaries)
    if is_block_draft(draft):
        ranked = rank(_block_predictions(query, target, draft, layout, prompts, outputs, costs))
    else:
        traces = [trace_text(target, draft, layout, ids + out, len(ids), steps=query.max_steps,
                             temperature=query.temperature) for ids, out in zip(prompts, outputs)]
        ranked = rank([predict(s, traces, costs, sampled=sampled)
                       for s in shapes(query.max_steps, tuple(query.p_mins), query.rule)])
    return SpeedRanking(costs=costs, ranked=ranked, recommendation=recommend(ranked, query.rule), prompts=len(prompts),
                        traced_tokens=sum(len(o) for o in outputs), rule=query.rule)


def _block_predictions(query: SpeedQuery, target, draft, layout: list[int], prompts: list[list[int]],
                       outputs: list[list[int]], costs: EngineCosts) -> list[Prediction]:
    """Every block shape of a DFlash draft predicted on traces of the block length its engine runs:
    llama.cpp's n_max + 1, eaglewire's trained block."""
    bs = draft.config.block_size
    follows = engine(query.engine).block_follows_shape
    lens = list(range(2, bs + 1)) if follows else [bs]
    by_len = [trace_blocks(target, draft, layout, ids + out, len(ids), temperature=query.temperature, block_lens=lens)
              for ids, out in zip(prompts, outputs)]
    out = []
    for shape in block_shapes(bs, query.rule, tuple(query.p_mins)):
        length = shape.n_max + 1 if follows else bs
        out.append(predict(shape, [t[length] for t in by_len] if not shape.plain else [],
                           costs, sampled=query.temperature > 0))
    return out
