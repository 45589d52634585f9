"""One engine and one draft, end to end: the engine's round costs and its own text measured, the
draft traced along that text, every chain shape predicted and one recommended (plain decoding
when none pays).

``eaglewire tune`` reports it; the doctor's speed check and bench's ``--configs recommended`` call
it for their own engine and prompts. ``SpeedQuery`` holds the defaults (``TuneConfig`` takes its
own from it).
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from eaglewire.acceptance.costs import EngineCosts, fit_costs, stated_costs
from eaglewire.acceptance.recommend import DEFAULT_P_MINS, Prediction, Recommendation, predict, rank, recommend, shapes
from eaglewire.acceptance.trace import trace_text
from eaglewire.engines import names as engine_names
from eaglewire.engines.eaglewire import NAME as EAGLEWIRE
from eaglewire.engines.llamacpp.readings import NAME as LLAMACPP

log = logging.getLogger(__name__)

MEASURED_ENGINES = engine_names("run_here")  # timed here
STATED_ENGINES = engine_names("stated_costs", aliases=False)  # a stated cost model (GPU engines)
DEFAULT_PROMPTS = 12  # τ varies from prompt to prompt: 6 MT-bench prompts read 1.47-1.68

Progress = Callable[[str], None]


def chain_rule(engine: str) -> str:
    """Whose chain-stopping rule the shapes follow (SGLang and vLLM stop as eaglewire does)."""
    return LLAMACPP if engine == LLAMACPP else EAGLEWIRE


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

    def __post_init__(self) -> None:
        engines = MEASURED_ENGINES + STATED_ENGINES
        if self.engine not in engines:
            raise ValueError(f"engine {self.engine!r}: the speed ranking knows {', '.join(engines)}")

    @property
    def rule(self) -> str:
        return chain_rule(self.engine)


@dataclass(frozen=True)
class LlamaCppSetup:
    """The llama-server binary and the GGUFs the llama.cpp probes time."""

    server: Path
    model: Path  # target GGUF
    draft: Path  # draft GGUF
    threads: int
    log_dir: Path
    flags: tuple[str, ...] = ()


def llamacpp_setup(draft_dir: str, work_dir: Path, *, target_gguf: str | None, draft_gguf: str | None,
                   llamacpp_dir: str | None, threads: int, flags: str | None) -> LlamaCppSetup:
    """The GGUFs given, or ``draft_dir`` exported into ``work_dir``/llamacpp-export (the target in
    f32) for those missing; server logs go to ``work_dir``."""
    from eaglewire.engines.llamacpp import require_server

    if target_gguf and draft_gguf:
        model, draft = Path(target_gguf), Path(draft_gguf)
    else:
        from eaglewire.engines import export_draft

        out = work_dir / "llamacpp-export"
        report = export_draft(draft_dir, LLAMACPP, out, target_outtype="f32", llamacpp_dir=llamacpp_dir,
                              threads=threads)
        draft = Path(draft_gguf) if draft_gguf else out / next(f for f in report.files if f.startswith("draft-"))
        model = Path(target_gguf) if target_gguf else out / "target-f32.gguf"
    work_dir.mkdir(parents=True, exist_ok=True)
    return LlamaCppSetup(server=require_server(llamacpp_dir), model=model, draft=draft, threads=threads,
                         log_dir=work_dir, flags=tuple(shlex.split(flags or "")))


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
            llamacpp: LlamaCppSetup | None = None) -> tuple[EngineCosts, list[list[int]]]:
    """(the engine's costs, its plain outputs per prompt): probed for eaglewire and llama.cpp, stated
    for SGLang and vLLM (whose outputs eaglewire's engine stands in for: greedy text is the target's)."""
    from eaglewire.acceptance.probe import probe_eaglewire, probe_llamacpp
    from eaglewire.core.tokens import stop_token_ids

    if query.engine == LLAMACPP and llamacpp is None:
        raise ValueError("engine 'llamacpp' is timed on its own GGUFs: pass llamacpp=llamacpp_setup(...)")
    stops = set(stop_token_ids(target.tokenizer, target.model))
    steps = list(range(1, query.max_steps + 1))
    common = dict(max_new_tokens=query.max_new_tokens, temperature=query.temperature, seed=query.seed,
                  progress=say)
    if query.engine == LLAMACPP:
        probe = probe_llamacpp(llamacpp.server, llamacpp.model, llamacpp.draft, prompts, steps=steps,
                               threads=llamacpp.threads, log_dir=llamacpp.log_dir, flags=list(llamacpp.flags),
                               **common)
        return fit_costs(LLAMACPP, probe.plain, probe.chains), probe.outputs
    if query.engine == EAGLEWIRE:
        probe = probe_eaglewire(target, draft, contract, prompts, steps=steps, stop_ids=stops, **common)
        return fit_costs(EAGLEWIRE, probe.plain, probe.chains), probe.outputs
    probe = probe_eaglewire(target, None, None, prompts, steps=[], stop_ids=stops, **common)
    return stated_costs(query.rule, verify_per_token=query.verify_cost, draft_step=query.draft_cost,
                        max_k=query.max_steps), probe.outputs


@dataclass
class SpeedRanking:
    costs: EngineCosts
    ranked: list[Prediction]
    recommendation: Recommendation
    prompts: int
    traced_tokens: int
    rule: str  # whose chain-stopping rule the shapes follow (labels)

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
               llamacpp: LlamaCppSetup | None = None, progress: Progress | None = None) -> SpeedRanking:
    """Measure ``query.engine`` on ``prompts``, trace ``draft`` along the engine's own outputs, and rank
    every shape up to ``query.max_steps`` (plain decoding included) by predicted tokens/s."""
    say = progress or (lambda msg: log.info("%s", msg))
    costs, outputs = measure(query, target, draft, contract, prompts, say, llamacpp)
    say("tracing the draft along the engine's outputs")
    traces = [trace_text(target, draft, list(contract.aux_boundaries), ids + out, len(ids), steps=query.max_steps,
                         temperature=query.temperature) for ids, out in zip(prompts, outputs)]
    sampled = query.temperature > 0
    ranked = rank([predict(s, traces, costs, sampled=sampled) for s in shapes(query.max_steps, tuple(query.p_mins))])
    return SpeedRanking(costs=costs, ranked=ranked, recommendation=recommend(ranked, query.rule), prompts=len(prompts),
                        traced_tokens=sum(len(o) for o in outputs), rule=query.rule)
