"""`eaglewire tune`: measure an engine's costs and the draft's acceptance, predict every shape, recommend one."""

from __future__ import annotations

import json
import logging
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eaglewire.engines import names as engine_names
from eaglewire.engines.llamacpp.readings import NAME as LLAMACPP
from eaglewire.presets import DEFAULT_TARGET
from eaglewire.tune.costs import EngineCosts, fit_costs, stated_costs
from eaglewire.tune.recommend import DEFAULT_P_MINS, Prediction, Recommendation, predict, rank, recommend, shapes
from eaglewire.tune.trace import trace_text

log = logging.getLogger(__name__)



@dataclass(kw_only=True)
class TuneConfig:
    draft: str = field(metadata={"help": "draft directory or `reference`"})
    target: str = field(default=DEFAULT_TARGET, metadata={"help": "preset name or HF model directory (eaglewire's copy of the target)"})
    engine: str = field(default="eaglewire", metadata={"help": "eaglewire or llamacpp (measured here); sglang or vllm (stated cost model)"})
    dataset: str = field(default="mt-bench", metadata={"help": "mt-bench, humaneval or a JSONL file of prompts"})
    offset: int = field(default=40, metadata={"help": "prompts skipped first (bench measures the first ones: keep them apart)"})
    num_prompts: int = field(default=12, metadata={"help": "prompts timed and traced (τ varies from prompt to prompt: 6 MT-bench prompts read 1.47-1.68)"})
    max_new_tokens: int = field(default=128, metadata={"help": "tokens per prompt"})
    max_steps: int = field(default=6, metadata={"help": "longest chain ranked (and probed)"})
    p_mins: list[float] = field(default_factory=lambda: list(DEFAULT_P_MINS), metadata={"help": "probability stops ranked: llama.cpp's --spec-draft-p-min, eaglewire's --draft-min-prob"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy; > 0: sampled rounds, expected acceptance"})
    seed: int = field(default=0, metadata={"help": "sampling seed of prompt i is seed + i"})
    top: int = field(default=8, metadata={"help": "ranked shapes printed"})
    out: str | None = field(default=None, metadata={"help": "write the report as JSON here"})
    llamacpp_target: str | None = field(default=None, metadata={"help": "llama.cpp: target GGUF (default: an f32 GGUF of eaglewire's weights)"})
    llamacpp_draft: str | None = field(default=None, metadata={"help": "llama.cpp: draft GGUF (default: --draft exported, q8_0)"})
    llamacpp_threads: int = field(default=2, metadata={"help": "llama.cpp: -t/-tb/-td/-tbd"})
    llamacpp_dir: str | None = field(default=None, metadata={"help": "llama.cpp build to use"})
    llamacpp_flags: str | None = field(default=None, metadata={"help": "llama.cpp: more llama-server flags, quoted (e.g. '-fa off')"})
    verify_cost: float = field(default=0.02, metadata={"help": "sglang/vllm: a verify pass costs 1 + this x (tokens - 1) plain steps"})
    draft_cost: float = field(default=0.05, metadata={"help": "sglang/vllm: a draft step costs this many plain steps"})

    def __post_init__(self) -> None:
        engines = engine_names("run_here") + engine_names("stated_costs", aliases=False)
        if self.engine not in engines:
            raise ValueError(f"--engine {self.engine!r}: tune knows {', '.join(engines)}")
        for name, low in (("num_prompts", 1), ("max_new_tokens", 8), ("max_steps", 1), ("offset", 0), ("top", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")
        if any(not 0.0 <= p < 1.0 for p in self.p_mins):
            raise ValueError(f"--p-mins must each be in [0, 1), got {self.p_mins}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")

    @property
    def rule(self) -> str:
        """Whose chain-stopping rule the shapes follow (SGLang and vLLM stop as eaglewire does)."""
        return LLAMACPP if self.engine == LLAMACPP else "eaglewire"


@dataclass
class TuneResult:
    config: TuneConfig
    costs: EngineCosts
    ranked: list[Prediction]
    recommendation: Recommendation
    prompts: int
    traced_tokens: int

    def to_dict(self) -> dict:
        pred = lambda p: {**asdict(p), "shape": asdict(p.shape), "label": p.shape.label(self.config.rule),
                          "bench_config": p.shape.bench_config()}
        return {"config": asdict(self.config), "costs": self.costs.to_dict(),
                "ranked": [pred(p) for p in self.ranked],
                "recommendation": {"shape": pred(self.recommendation.choice), "reason": self.recommendation.reason},
                "prompts": self.prompts, "traced_tokens": self.traced_tokens}

    def format(self) -> str:
        c, engine = self.costs, self.config.rule
        unit = "plain steps" if c.source == "stated" else "ms"
        scale = 1.0 if c.source == "stated" else 1e3
        verify = ", ".join(f"{k}: {v * scale:.2f}" for k, v in sorted(c.verify.items()))
        lines = [f"tune: {self.config.engine}, {self.prompts} prompts x {self.config.max_new_tokens} tokens of "
                 f"{self.config.dataset} (from #{self.config.offset}), temperature {self.config.temperature:g}",
                 f"costs ({c.source}): plain step {c.plain_step * scale:.2f} {unit}; round besides draft steps, by "
                 f"tokens verified: {verify} {unit}; draft step {c.draft_step * scale:.2f} {unit}"]
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
    from eaglewire.decode.text import encode_prompt
    from eaglewire.prompts import load_prompts

    prompts = load_prompts(config.dataset)[config.offset:config.offset + config.num_prompts]
    if not prompts:
        raise ValueError(f"--offset {config.offset} leaves no prompt in {config.dataset}")
    return [encode_prompt(tokenizer, p.text, chat=p.chat) for p in prompts]


def work_dir(config: TuneConfig) -> Path:
    """Where tune writes besides its report: server logs, a GGUF export when none was given."""
    return Path(config.out).parent if config.out else Path("runs/tune")


def _llamacpp_files(config: TuneConfig) -> tuple[Path, Path]:
    if config.llamacpp_target and config.llamacpp_draft:
        return Path(config.llamacpp_target), Path(config.llamacpp_draft)
    from eaglewire.engines import export_draft

    out = work_dir(config) / "llamacpp-export"
    report = export_draft(config.draft, LLAMACPP, out, target_outtype="f32", llamacpp_dir=config.llamacpp_dir,
                    threads=config.llamacpp_threads)
    draft = Path(config.llamacpp_draft) if config.llamacpp_draft else out / next(
        f for f in report.files if f.startswith("draft-"))
    return (Path(config.llamacpp_target) if config.llamacpp_target else out / "target-f32.gguf"), draft


def measure(config: TuneConfig, target, draft, contract, prompts: list[list[int]], say) -> tuple[EngineCosts, list[list[int]]]:
    """(the engine's costs, its plain outputs per prompt): probed for eaglewire and llama.cpp, stated
    for SGLang and vLLM (whose outputs eaglewire's engine stands in for: greedy text is the target's)."""
    from eaglewire.tokens import stop_token_ids
    from eaglewire.tune.probe import probe_eaglewire, probe_llamacpp

    stops = set(stop_token_ids(target.tokenizer, target.model))
    steps = list(range(1, config.max_steps + 1))
    common = dict(max_new_tokens=config.max_new_tokens, temperature=config.temperature, seed=config.seed,
                  progress=say)
    if config.engine == LLAMACPP:
        from eaglewire.engines.llamacpp import require_server

        model, draft_gguf = _llamacpp_files(config)
        work_dir(config).mkdir(parents=True, exist_ok=True)
        probe = probe_llamacpp(require_server(config.llamacpp_dir), model, draft_gguf, prompts, steps=steps,
                               threads=config.llamacpp_threads, log_dir=work_dir(config),
                               flags=shlex.split(config.llamacpp_flags or ""), **common)
        return fit_costs(LLAMACPP, probe.plain, probe.chains), probe.outputs
    if config.engine == "eaglewire":
        probe = probe_eaglewire(target, draft, contract, prompts, steps=steps, stop_ids=stops, **common)
        return fit_costs("eaglewire", probe.plain, probe.chains), probe.outputs
    probe = probe_eaglewire(target, None, None, prompts, steps=[], stop_ids=stops, **common)
    return stated_costs(config.rule, verify_per_token=config.verify_cost, draft_step=config.draft_cost,
                        max_k=config.max_steps), probe.outputs


def run_tune(config: TuneConfig, *, target=None, loaded=None, prompts: list[list[int]] | None = None,
             progress=None) -> TuneResult:
    """``loaded``: (draft, contract) already loaded (the doctor's); ``prompts``: token ids to tune
    on instead of ``config.dataset``'s."""
    from eaglewire.checkpoint import load_draft
    from eaglewire.target import load_target

    say = progress or (lambda msg: log.info("%s", msg))
    target = target or load_target(config.target)
    draft, contract = loaded or load_draft(config.draft, target=target, device=target.device)[:2]
    prompts = prompts or tune_prompts(config, target.tokenizer)
    costs, outputs = measure(config, target, draft, contract, prompts, say)
    say("tracing the draft along the engine's outputs")
    traces = [trace_text(target, draft, list(contract.aux_boundaries), ids + out, len(ids), steps=config.max_steps,
                         temperature=config.temperature) for ids, out in zip(prompts, outputs)]
    sampled = config.temperature > 0
    ranked = rank([predict(s, traces, costs, sampled=sampled) for s in shapes(config.max_steps, tuple(config.p_mins))])
    result = TuneResult(config=config, costs=costs, ranked=ranked, recommendation=recommend(ranked, config.rule),
                        prompts=len(prompts), traced_tokens=sum(len(o) for o in outputs))
    if config.out:
        Path(config.out).parent.mkdir(parents=True, exist_ok=True)
        Path(config.out).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return result
