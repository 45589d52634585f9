"""`eaglewire tune`: measure an engine's costs and the draft's acceptance, predict every shape, recommend one."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from eaglewire.core.precision import DECODE_DTYPE_HELP, DTYPE_CHOICES
from eaglewire.acceptance.speed import (COSTS, DEFAULT_PROMPTS, SpeedQuery, SpeedRanking, chain_rule, encoded_prompts,
                                        measured_here, rank_speed, server_setup)
from eaglewire.core.configs import RESOLVED_KEY, config_record
from eaglewire.core.device import device_field
from eaglewire.core.fileio import atomic_write_text
from eaglewire.core.locks import directory_lock
from eaglewire.engines import Ability, get as get_engine, names as engine_names
from eaglewire.engines.command_settings import EngineRunConfig
from eaglewire.core.presets import DEFAULT_TARGET
from eaglewire.concurrency.schedule import parse_shapes

_QUERY = SpeedQuery()  # the defaults of what tune measures
IN_PROCESS_SHAPES = "1,1,2;2,1,3;3,1,4;5,4,12,0.1"  # --concurrency's shapes in eaglewire's engine
SERVER_SHAPES = "1,1,2;2,1,3;3,1,4"  # ... and in a server engine (chains only)


@dataclass(kw_only=True)
class TuneConfig:
    draft: str = field(metadata={"help": "draft directory or `reference`"})
    target: str = field(default=DEFAULT_TARGET, metadata={"help": "preset name or HF model directory (eaglewire's copy of the target)"})
    engine: str = field(default=_QUERY.engine, metadata={"help": "eaglewire, llamacpp, sglang or vllm (measured here); sglang or vllm with --costs stated: the stated GPU cost model"})
    costs: str = field(default="auto", metadata={"choices": COSTS, "help": "measured: time the engine here; stated: the stated GPU cost model (--verify-cost, --draft-cost); auto: measured where the engine runs here"})
    dataset: str = field(default="mt-bench", metadata={"help": "mt-bench, humaneval or a JSONL file of prompts"})
    offset: int = field(default=40, metadata={"help": "prompts skipped first (bench measures the first ones: keep them apart)"})
    num_prompts: int = field(default=DEFAULT_PROMPTS, metadata={"help": "prompts timed and traced (τ varies from prompt to prompt: 6 MT-bench prompts read 1.47-1.68)"})
    max_new_tokens: int = field(default=_QUERY.max_new_tokens, metadata={"help": "tokens per prompt"})
    max_steps: int = field(default=_QUERY.max_steps, metadata={"help": "longest chain ranked (and probed); a DFlash draft ranks 1 .. block_size - 1 drafted tokens"})
    p_mins: list[float] = field(default_factory=lambda: list(_QUERY.p_mins), metadata={"help": "probability stops ranked: llama.cpp's --spec-draft-p-min, eaglewire's --draft-min-prob"})
    temperature: float = field(default=_QUERY.temperature, metadata={"help": "0 = greedy; > 0: sampled rounds, expected acceptance"})
    seed: int = field(default=_QUERY.seed, metadata={"help": "sampling seed of prompt i is seed + i"})
    top: int = field(default=8, metadata={"help": "ranked shapes printed"})
    out: str | None = field(default=None, metadata={"help": "write the report as JSON here"})
    device: str = device_field()
    dtype: str = field(default="auto", metadata={"choices": DTYPE_CHOICES, "help": DECODE_DTYPE_HELP + "; eaglewire's "
                       "round costs are measured in it (a bf16 verify of several tokens costs other multiples of a "
                       "plain step than a fp32 one)"})
    run: EngineRunConfig = field(default_factory=EngineRunConfig)  # its fields are flags of their own
    concurrency: list[int] | None = field(default=None, metadata={"help": "batch sizes (e.g. 1,2,4,8,16): measure "
                                          "the engine at each (eaglewire's in process; llamacpp or vllm launched "
                                          "here and loaded with that many streams) and print the schedule of where "
                                          "the draft pays"})
    shapes: str | None = field(default=None, metadata={
        "help": "with --concurrency: ';'-separated steps,topk,draft-tokens[,min-prob] measured beside plain at each "
                f"batch size (default: {IN_PROCESS_SHAPES} for eaglewire: chains of 1-3 and the tree that pays on 2 "
                f"CPU cores at one request; {SERVER_SHAPES} for a server engine, which drafts chains)"})
    load_tokens: int = field(default=64, metadata={
        "help": "with --concurrency on llamacpp or vllm: tokens each request of a timed load decodes past EOS (two back "
                "to back a stream; about the replies your users get: a request's prefill is priced in with them)"})
    schedule_out: str | None = field(default=None, metadata={
        "help": "with --concurrency: write the schedule here, for `eaglewire serve --schedule`"})
    verify_cost: float = field(default=_QUERY.verify_cost, metadata={"help": "sglang/vllm: a verify pass costs 1 + this x (tokens - 1) plain steps"})
    draft_cost: float = field(default=_QUERY.draft_cost, metadata={"help": "sglang/vllm: a draft step costs this many plain steps"})

    def __post_init__(self) -> None:
        engines = tuple(dict.fromkeys(engine_names(Ability.RUN_HERE, aliases=False) + engine_names(Ability.STATED_COSTS, aliases=False)))
        if self.engine not in engines:
            raise ValueError(f"--engine {self.engine!r}: tune knows {', '.join(engines)}")
        for name, low in (("num_prompts", 1), ("max_new_tokens", 8), ("max_steps", 1), ("offset", 0), ("top", 1),
                          ("load_tokens", 8)):
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")
        if any(not 0.0 <= p < 1.0 for p in self.p_mins):
            raise ValueError(f"--p-mins must each be in [0, 1), got {self.p_mins}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.concurrency is not None:
            if not get_engine(self.engine).can(Ability.RUN_HERE) or self.costs == "stated":
                raise ValueError(f"--concurrency measures an engine that runs here under load; {self.engine} "
                                 f"{'is priced by --costs stated' if self.costs == 'stated' else 'does not run here'}"
                                 f": give --engine {' or '.join(engine_names(Ability.RUN_HERE, aliases=False))}")
            if not self.concurrency or any(b < 1 for b in self.concurrency) or self.concurrency != sorted(set(self.concurrency)):
                raise ValueError(f"--concurrency takes ascending batch sizes >= 1, got {self.concurrency}")
            parse_shapes(self.concurrency_shapes)
        elif self.schedule_out is not None or self.shapes is not None:
            raise ValueError(f"{'--schedule-out' if self.schedule_out else '--shapes'} goes with --concurrency: "
                             "give --concurrency too")

    @property
    def concurrency_shapes(self) -> str:
        """--shapes, or the default of the engine tuned (a server engine drafts chains)."""
        if self.shapes is not None:
            return self.shapes
        return IN_PROCESS_SHAPES if get_engine(self.engine).in_process else SERVER_SHAPES

    @property
    def rule(self) -> str:
        """Whose chain-stopping rule the shapes follow (SGLang and vLLM stop as eaglewire does)."""
        return chain_rule(self.engine)

    def measured(self) -> tuple[bool, str | None]:
        """(whether the engine is timed here, a note when auto fell back to the stated model)."""
        return measured_here(self.engine, self.costs, self.run.settings())

    def query(self) -> SpeedQuery:
        return SpeedQuery(engine=self.engine, stated=not self.measured()[0], max_new_tokens=self.max_new_tokens, max_steps=self.max_steps,
                          p_mins=tuple(self.p_mins), temperature=self.temperature, seed=self.seed,
                          verify_cost=self.verify_cost, draft_cost=self.draft_cost)


@dataclass
class TuneResult(SpeedRanking):
    config: TuneConfig

    def to_dict(self) -> dict:
        return self.report(config_record(self.config), key=RESOLVED_KEY)

    @property
    def blocks(self) -> bool:
        """Whether the draft was ranked by DFlash block shapes (one draft pass per round)."""
        return any(p.shape.block for p in self.ranked)

    def format(self) -> str:
        c, engine = self.costs, self.config.rule
        unit = "plain steps" if c.source == "stated" else "ms"
        scale = 1.0 if c.source == "stated" else 1e3
        verify = ", ".join(f"{k}: {v * scale:.2f}" for k, v in sorted(c.verify.items()))
        lines = [f"tune: {self.config.engine}, {self.prompts} prompts x {self.config.max_new_tokens} tokens of "
                 f"{self.config.dataset} (from #{self.config.offset}), temperature {self.config.temperature:g}",
                 f"costs ({c.source}): plain step {c.plain_step * scale:.2f} {unit}; round besides draft steps, by "
                 f"tokens verified: {verify} {unit}; "
                 + (f"one DFlash block pass per round {c.draft_step * scale:.2f} {unit}" if self.blocks else
                    f"draft step {c.draft_step * scale:.2f} {unit}")]
        lines += [f"  note: {n}" for n in c.notes]
        lines += ["", f"{'shape':58} {'tau':>5} {'drafted':>7} {'round':>9} {'tok/s':>8} {'vs plain':>8} {'break-even tau':>14}"]
        plain_shown = False
        for p in self.ranked[:self.config.top] + [p for p in self.ranked[self.config.top:] if p.shape.plain]:
            plain_shown |= p.shape.plain
            tps = f"{p.tokens_per_second:.1f}" if c.source != "stated" else "-"
            lines.append(f"{p.shape.label(engine):58} {p.tau:5.2f} {p.drafted:7.2f} "
                         f"{p.round_seconds * scale:7.2f}{'ms' if scale != 1 else 'st'} {tps:>8} {p.speedup:7.2f}x "
                         f"{p.break_even_tau:14.2f}")
        lines += ["", f"recommended: {self.recommendation.reason}",
                  f"  bench it: eaglewire bench --configs \"1,0,0,0;{self.recommendation.choice.shape.bench_config()}\""
                  if not self.recommendation.choice.shape.plain else "  bench it: eaglewire bench --configs recommended"]
        return "\n".join(lines)


def tune_prompts(config: TuneConfig, tokenizer) -> list[list[int]]:
    return encoded_prompts(tokenizer, config.dataset, config.offset, config.num_prompts)


def work_dir(config: TuneConfig) -> Path:
    """Where tune writes besides its report: server logs, a GGUF export when none was given."""
    return Path(config.out).parent if config.out else Path("runs/tune")


def run_tune(config: TuneConfig, *, target=None, prompts: list[list[int]] | None = None,
             progress=None) -> TuneResult:
    """``prompts``: token ids to tune on instead of ``config.dataset``'s. With ``config.out``, the
    only run writing that report."""
    if not config.out:
        return _run_tune(config, target=target, prompts=prompts, progress=progress)
    out = Path(config.out)
    with directory_lock(out.parent, what=f"--out {out}", name=f".{out.name}.lock"):
        return _run_tune(config, target=target, prompts=prompts, progress=progress)


def _run_tune(config: TuneConfig, *, target, prompts: list[list[int]] | None, progress) -> TuneResult:
    from eaglewire.decode.load import load_decode_target
    from eaglewire.model.checkpoint import load_draft

    target = target or load_decode_target(config.target, device=config.device, dtype=config.dtype)
    draft, contract = load_draft(config.draft, target=target, device=target.device, dtype=target.dtype)[:2]
    prompts = prompts or tune_prompts(config, target.tokenizer)
    query, (_, fallback) = config.query(), config.measured()
    server = None
    if not query.stated and get_engine(config.engine).runtime is not None:
        server = server_setup(config.engine, config.draft, config.target, work_dir(config), config.run.settings())
    ranking = rank_speed(query, target, draft, contract, prompts, server=server, progress=progress)
    if fallback:
        ranking.costs.notes.append(fallback)
    result = TuneResult(config=config, **vars(ranking))
    if config.out:
        Path(config.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(config.out, json.dumps(result.to_dict(), indent=2) + "\n")
    return result
