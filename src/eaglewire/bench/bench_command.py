"""``eaglewire bench``: one target and one draft, several speculation configs (and HF
baselines) on the same prompts; per config tokens/s, τ, per-position acceptance and time split.

τ counts tokens per target verify pass, bonus included, as the engine's accept length does
(the token the prefill produces is no verify pass's): 1.0 for plain decoding.
  τ pooled       all requests' verify-pass tokens / all requests' verify passes
  τ per-request  the mean over requests of each request's own τ (short replies weigh as much
                 as long ones, so the two differ when acceptance varies with reply length)
"""

from __future__ import annotations

import json
import logging
import shlex
import time
from dataclasses import asdict, dataclass, field, fields, replace
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm

from eaglewire.core.device import device_field
from eaglewire.core.configs import RESOLVED_KEY
from eaglewire.model.checkpoint import FAMILY_CLASSES, load_draft, read_draft, read_draft_config
from eaglewire.core.generation import GenerationStats
from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder
from eaglewire.decode.sampling import MAX_NEW_TOKENS, SamplingParams
from eaglewire.decode.text import encode_prompt, stop_token_ids
from eaglewire.core.fileio import atomic_write_text
from eaglewire.core.locks import directory_lock
from eaglewire.engines import Ability, export_draft, get as get_engine, names as engine_names
from eaglewire.engines.command_settings import EngineRunConfig
from eaglewire.engines.interface import Shape
from eaglewire.core.precision import DECODE_DTYPE_HELP, DTYPE_CHOICES, dtype_name
from eaglewire.core.presets import DEFAULT_TARGET
from eaglewire.core.prompts import Prompt, load_prompts
from eaglewire.decode.load import decode_precision, load_decode_target
from eaglewire.model.target import Target, load_target


log = logging.getLogger(__name__)

COMPARE_METHODS = ("hf", "hf-pld")
ENGINES = engine_names(Ability.RUN_HERE, aliases=False)
IN_PROCESS = next(n for n in ENGINES if get_engine(n).in_process)  # eaglewire's own engine, run in this process
PLD_TOKENS = 10  # prompt_lookup_num_tokens of the hf-pld baseline
HELDOUT = "sharegpt-heldout"
SPECULATIVE_METHODS = tuple(FAMILY_CLASSES)  # a speculative row's method is its draft's family
RECOMMENDED = "recommended"


@dataclass(kw_only=True)
class BenchConfig:
    target: str = field(default=DEFAULT_TARGET, metadata={"help": "preset name, HF model directory or .gguf file"})
    draft: str | None = field(default=None, metadata={"help": "draft directory (needed by configs with steps > 0 and by sharegpt-heldout)"})
    dataset: str = field(default="mt-bench", metadata={"help": f"mt-bench, humaneval, {HELDOUT} (the draft's held-out ShareGPT conversations) or a JSONL file"})
    configs: str = field(default="1,0,0,0;1,5,1,6;1,6,4,24", metadata={"help": "';'-separated batch,steps,topk,draft-tokens[,min-prob]; steps 0 = plain decoding (write 1,0,0,0); min-prob: --draft-min-prob of `generate` (llama.cpp: --spec-draft-p-min); `recommended`: plain and what `eaglewire tune` recommends for the engine"})
    compare: list[str] | None = field(default=None, metadata={"help": "baselines on the same prompts: hf (model.generate), hf-pld (prompt lookup decoding)"})
    max_new_tokens: int = field(default=MAX_NEW_TOKENS, metadata={"help": "tokens generated per prompt at most"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy; > 0 samples"})
    num_prompts: int | None = field(default=None, metadata={"help": "use the first N prompts of the dataset"})
    out: str | None = field(default=None, metadata={"help": "report directory; None: runs/bench/<dataset name>"})
    warmup: int = field(default=1, metadata={"help": "untimed prompts run first for every config (kernels, caches)"})
    seed: int = field(default=0, metadata={"help": "sampling seed of prompt i is seed + i"})
    device: str = device_field()
    dtype: list[str] = field(default_factory=lambda: ["auto"], metadata={
        "help": DECODE_DTYPE_HELP + "; several comma-separated (e.g. fp32,bf16) run eaglewire's configs once per "
                "dtype, side by side on the same prompts, each compared with its own dtype's plain row"})
    allow_target_mismatch: list[str] | None = field(default=None, metadata={"help": "target fingerprint fields allowed to differ from the draft's"})
    engine: list[str] = field(default_factory=lambda: [IN_PROCESS], metadata={"help": f"{', '.join(ENGINES)}, or several comma-separated (side by side on the same prompts)"})
    run: EngineRunConfig = field(default_factory=EngineRunConfig)  # its fields are flags of their own
    concurrency: list[int] | None = field(default=None, metadata={
        "help": "requests in flight at once (e.g. 1,4,8): each config decoded with that many clients (eaglewire's "
                "engine batching them in process, or one server per config launched here with that many slots); "
                "a table and a plot of throughput against concurrency"})
    schedule: str | None = field(default=None, metadata={
        "help": "with --concurrency: a schedule from `tune --concurrency`, run as a row of its own"})

    def __post_init__(self) -> None:
        runs = [] if self.configs == RECOMMENDED else parse_configs(self.configs)
        if self.concurrency is not None:
            self._check_concurrency(runs)
        elif self.schedule is not None:
            raise ValueError("--schedule runs as a row of --concurrency: give --concurrency too")
        if self.configs == RECOMMENDED and len(self.engine) != 1:
            raise ValueError(f"--configs {RECOMMENDED} is tuned for one engine; give one of --engine "
                             f"{', '.join(ENGINES)}, not {','.join(self.engine)}")
        if self.configs == RECOMMENDED and self.draft is None:
            raise ValueError(f"--configs {RECOMMENDED} tunes a draft: give --draft DIR")
        unknown_engines = sorted(set(self.engine) - set(ENGINES))
        if unknown_engines or not self.engine or len(set(self.engine)) < len(self.engine):
            raise ValueError(f"--engine {','.join(self.engine)}: give one or more of {', '.join(ENGINES)}, each once")
        for name in self.engine:
            if not get_engine(name).in_process:
                server_runs(runs, name)  # a config the engine cannot run is an error now, not after loading
        unknown = sorted(set(self.compare or ()) - set(COMPARE_METHODS))
        if unknown:
            raise ValueError(f"--compare {','.join(unknown)}: unknown baseline; choose from {', '.join(COMPARE_METHODS)}")
        if self.compare and len(set(self.compare)) < len(self.compare):
            raise ValueError(f"--compare {','.join(self.compare)} names a baseline twice")
        for name, low in (("max_new_tokens", 1), ("num_prompts", 1), ("warmup", 0)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not self.dtype or len(set(self.dtype)) < len(self.dtype) or set(self.dtype) - set(DTYPE_CHOICES):
            raise ValueError(f"--dtype {','.join(self.dtype)}: give one or more of {', '.join(DTYPE_CHOICES)}, each once")
        speculative = [config_label(r) for r in runs if r is not None]
        if self.draft is None and speculative:
            raise ValueError(f"config {speculative[0]} speculates and needs a draft: give --draft DIR "
                             "(or keep only steps-0 configs such as 1,0,0,0)")
        if self.draft is None and self.dataset == HELDOUT:
            raise ValueError(f"--dataset {HELDOUT} reads the held-out conversations recorded in the draft: give --draft DIR")

    def _check_concurrency(self, runs: list[SpecConfig | None]) -> None:
        if len(self.engine) != 1 or self.compare:
            raise ValueError(f"--concurrency loads one engine at a time (--engine {IN_PROCESS}, or one of "
                             f"{', '.join(e for e in ENGINES if e != IN_PROCESS)} launched here), no --compare")
        if self.schedule is not None and self.engine != [IN_PROCESS]:
            raise ValueError(f"--schedule switches shapes by load, which only eaglewire's engine does; "
                             f"{self.engine[0]} keeps its launch's shape (bench each launch: plain and the chains)")
        if self.configs == RECOMMENDED or None not in runs:
            raise ValueError("--concurrency compares every config with plain decoding at the same load: list "
                             "1,0,0,0 in --configs")
        if not self.concurrency or any(c < 1 for c in self.concurrency) or sorted(set(self.concurrency)) != self.concurrency:
            raise ValueError(f"--concurrency takes ascending request counts >= 1, got {self.concurrency}")
        if len(self.dtype) != 1:
            raise ValueError("--concurrency runs one --dtype at a time")
        if self.schedule is not None and self.draft is None:
            raise ValueError("--schedule chooses between speculation and plain decoding: give the --draft it was "
                             "tuned for")

    @property
    def runs(self) -> list[SpecConfig | None]:
        return parse_configs(self.configs)

    @property
    def out_dir(self) -> Path:
        name = self.dataset if self.dataset in ("mt-bench", "humaneval", HELDOUT) else Path(self.dataset).stem
        return Path(self.out) if self.out else Path("runs/bench") / name

    def command_line(self) -> str:
        """The ``eaglewire bench`` command that reproduces this run (every value spelled out)."""
        parts = ["eaglewire", "bench"]
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "run"}
        values.update({f.name: getattr(self.run, f.name) for f in fields(self.run)})
        for name, value in values.items():
            if value is not None:
                parts += ["--" + name.replace("_", "-"), ",".join(map(str, value)) if isinstance(value, list) else str(value)]
        return shlex.join(parts)


CONFIG_FORMAT = "batch,steps,topk,draft-tokens[,min-prob] (e.g. 1,5,1,6 or 1,5,1,6,0.1)"


def config_label(spec: SpecConfig | None) -> str:
    """A bench config as ``--configs`` writes it: ``1,0,0,0`` for plain decoding (None)."""
    if spec is None:
        return "1,0,0,0"
    base = f"1,{spec.num_steps},{spec.topk},{spec.num_draft_tokens}"
    return base if spec.min_prob == 0 else f"{base},{spec.min_prob:g}"


def server_runs(runs: list[SpecConfig | None], engine: str, family: str = "eagle3") -> list[SpecConfig | None]:
    """The configs a server engine runs: plain and chains (trees are eaglewire's alone). A chain of ``steps``
    is the engine's chain of that many drafted tokens; min-prob, the probability a draft token must reach, is
    its probability stop where it has one. No chain left, or a shape the engine cannot launch, is an error."""
    spec = get_engine(engine)
    chains = [r for r in runs if r is None or r.topk == 1]
    if not any(r is not None for r in chains) and any(r is not None for r in runs):
        trees = ";".join(config_label(r) for r in runs if r is not None)
        raise ValueError(f"--configs {trees}: {spec.runtime.label} drafts chains only (topk 1); add a chain such as "
                         f"1,3,1,4 for --engine {engine}")
    for run in chains:
        why = spec.runtime.can_run(shape_of(run), family)
        if why:
            raise ValueError(f"config {config_label(run)}: {why}")
    return chains


def shape_of(run: SpecConfig | None) -> Shape:
    """A bench config as a server launch's shape (None: plain)."""
    from eaglewire.concurrency.server_measurement import launched_shape

    return Shape() if run is None else launched_shape(run)


def parse_config(part: str) -> SpecConfig | None:
    """``"1,5,1,6"`` / ``"1,5,1,6,0.1"`` -> SpecConfig, ``"1,0,0,0"`` -> None (plain decoding);
    every inconsistency is an error naming the config."""
    fields_ = part.replace(" ", "").split(",")
    try:
        values = [int(x) for x in fields_[:4]] + [float(x) for x in fields_[4:]]
    except ValueError:
        values = []
    if len(values) not in (4, 5):
        raise ValueError(f"config {part!r} is not {CONFIG_FORMAT}; separate configs with ';'")
    batch, steps, topk, tokens, min_prob = (values + [0.0])[:5]
    if batch != 1:
        shape = f"1,{steps},{topk},{tokens}" + (f",{min_prob:g}" if min_prob else "")
        raise ValueError(f"config {part!r}: batch {batch} is not supported; the engine decodes one "
                         f"sequence at a time, so use batch 1 ({shape})")
    if steps == 0:
        if (topk, tokens, min_prob) != (0, 0, 0):
            raise ValueError(f"config {part!r}: steps 0 means no speculation, so topk, draft tokens and "
                             "min-prob must be 0 too; write 1,0,0,0")
        return None
    try:
        return SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=tokens, min_prob=min_prob)
    except ValueError as e:  # SpecConfig checks every field
        raise ValueError(f"config {part!r} ({CONFIG_FORMAT}): {e}") from None


def parse_configs(text: str) -> list[SpecConfig | None]:
    """``"1,0,0,0;1,5,1,6;1,5,1,6,0.1"`` -> [None, SpecConfig, SpecConfig] (None: plain decoding)."""
    runs: list[SpecConfig | None] = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        run = parse_config(part)
        if run in runs:
            raise ValueError(f"config {config_label(run)} is given twice in --configs")
        runs.append(run)
    if not runs:
        raise ValueError("--configs is empty; give e.g. '1,0,0,0;1,5,1,6'")
    return runs


# ------------------------------------------------------------------ metrics (pure)

def _per_pass(stats: list[GenerationStats], lengths: str) -> float | None:
    """The sum of every request's per-pass ``lengths`` list / all verify passes; None without any."""
    passes = sum(s.rounds for s in stats)
    return sum(sum(getattr(s, lengths)) for s in stats) / passes if passes else None


def tau_pooled(stats: list[GenerationStats]) -> float | None:
    """All verify-pass tokens / all verify passes; None without any verify pass."""
    return _per_pass(stats, "accept_lengths")


def tau_per_request(stats: list[GenerationStats]) -> float | None:
    """Mean over requests (with at least one verify pass) of each request's τ."""
    taus = [s.accept_length for s in stats if s.rounds]
    return sum(taus) / len(taus) if taus else None


def verified_per_pass(stats: list[GenerationStats]) -> float | None:
    """All tokens the target verified (roots included) / all verify passes."""
    return _per_pass(stats, "verified_lengths")


def position_acceptance(stats: list[GenerationStats]) -> list[float]:
    """Share of all verify passes whose draft token at depth d+1 was accepted."""
    passes = sum(s.rounds for s in stats)
    depth = max((len(s.position_accepts) for s in stats), default=0)
    return [sum(s.position_accepts[d] for s in stats if d < len(s.position_accepts)) / max(passes, 1)
            for d in range(depth)]


def time_split(stats: list[GenerationStats]) -> dict[str, float]:
    """Seconds in draft / verify / prefill / other (the rest of the wall time), and the total."""
    split = {k: sum(getattr(s, f"{k}_seconds") for s in stats) for k in ("draft", "verify", "prefill", "total")}
    split["other"] = max(split["total"] - split["draft"] - split["verify"] - split["prefill"], 0.0)
    return split


@dataclass
class Row:
    """One report line: an engine config (plain / eagle3) or an HF baseline, over all prompts."""

    name: str  # "1,5,1,6", "llamacpp 1,3,1,4", or "hf" / "hf-pld"
    method: str  # plain | eagle3 | dflash | hf | hf-pld
    stats: list[GenerationStats]  # one per prompt
    outputs: list[list[int]]  # new token ids per prompt
    engine_name: str = IN_PROCESS  # who decoded: eaglewire (and the HF baselines) or a server engine
    dtype: str = ""  # what eaglewire's engine decoded in (fp32 | bf16); "" for a server engine

    @property
    def engine(self) -> bool:
        return self.method in ("plain", *SPECULATIVE_METHODS)

    @property
    def new_tokens(self) -> int:
        return sum(s.new_tokens for s in self.stats)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / max(sum(s.total_seconds for s in self.stats), 1e-9)


def plain_row(row: Row, rows: list[Row]) -> Row | None:
    """The plain (steps 0) row of the engine that decoded ``row`` (eaglewire's for HF baselines)."""
    engine = row.engine_name if row.engine else IN_PROCESS
    return next((r for r in rows if r.method == "plain" and r.engine_name == engine and r.dtype == row.dtype), None)


def speedup(row: Row, rows: list[Row]) -> float | None:
    """tokens/s relative to the same engine's plain (steps 0) row; None without one."""
    plain = plain_row(row, rows)
    return row.tokens_per_second / plain.tokens_per_second if plain and plain.tokens_per_second else None


def same_output_as_plain(row: Row, rows: list[Row]) -> int | None:
    """How many prompts got exactly the same engine's plain tokens; None without a plain row or for it."""
    plain = plain_row(row, rows)
    if plain is None or row is plain:
        return None
    return sum(a == b for a, b in zip(row.outputs, plain.outputs))


def same_output_across_engines(row: Row, rows: list[Row]) -> int | None:
    """For a server engine's row: prompts whose output equals eaglewire's plain row's, up to the stop
    token (eaglewire keeps it, a server may drop it); None without both rows."""
    ours = next((r for r in rows if r.method == "plain" and r.engine_name == IN_PROCESS), None)  # the first dtype's
    if row.engine_name == IN_PROCESS or ours is None or not row.engine:
        return None
    return sum(a[:len(b)] == b and len(a) - len(b) <= 1 or b[:len(a)] == a and len(b) - len(a) <= 1
               for a, b in zip(ours.outputs, row.outputs))


@dataclass
class BenchResult:
    config: BenchConfig
    prompts: list[Prompt]
    rows: list[Row]
    command: str


# ------------------------------------------------------------------ prompts

def heldout_prompts(draft_config: dict, conversations: str | Path, limit: int | None = None) -> list[Prompt]:
    """First user turns of the conversations a draft's training held out, in recorded order."""
    from eaglewire.data.conversations import LoadReport, iter_conversations

    training = draft_config.get("training") or {}
    ids = training.get("heldout_sequence_ids")
    if not ids:
        raise ValueError("the draft records no held-out conversations (training.heldout_sequence_ids in its "
                         "config.json; `eaglewire train` writes them); use --dataset mt-bench, humaneval or a JSONL file")
    wanted = list(ids[:limit] if limit else ids)
    found: dict[str, Prompt] = {}
    for conv in iter_conversations(conversations, report=LoadReport(path=str(conversations))):
        if conv.id in wanted and conv.id not in found:
            user = next(m["content"] for m in conv.messages if m["role"] == "user")
            found[conv.id] = Prompt(conv.id, user, True)
            if len(found) == len(wanted):
                break
    missing = [i for i in wanted if i not in found]
    if missing:
        raise ValueError(f"{len(missing)} held-out conversation(s) of the draft (e.g. {missing[:3]}) are not in "
                         f"{conversations}; the draft was trained on {training.get('data')!r}, not on this file")
    return [found[i] for i in wanted]


def bench_prompts(config: BenchConfig) -> list[Prompt]:
    if config.dataset == HELDOUT:
        from eaglewire.data.prepare import resolve_data

        return heldout_prompts(read_draft_config(config.draft), resolve_data("sharegpt"), config.num_prompts)
    return load_prompts(config.dataset, config.num_prompts)


# ------------------------------------------------------------------ running

def _hf_generate(target, ids: list[int], gen_config, seed: int) -> tuple[list[int], GenerationStats]:
    """One seeded HF ``generate`` call, timed; τ does not apply (no verify passes recorded)."""
    input_ids = torch.tensor([ids], device=target.device)  # [1, T]
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[target.device] if target.device.type == "cuda" else []), \
            torch.inference_mode():
        torch.manual_seed(seed)
        out = target.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                    generation_config=gen_config)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    new = out[0, len(ids):].tolist()
    stopped = bool(new) and new[-1] in gen_config.eos_token_id
    return new, GenerationStats(prompt_tokens=len(ids), new_tokens=len(new), total_seconds=seconds,
                                finish_reason="stop" if stopped else "length")


def _hf_config(config: BenchConfig, stops: list[int], pad_id: int, pld: bool, max_new_tokens: int):
    """Sampling set in full here, so the target's generation_config.json cannot change it."""
    from transformers import GenerationConfig

    common = dict(max_new_tokens=max_new_tokens, eos_token_id=stops, pad_token_id=pad_id, num_beams=1,
                  min_length=0, repetition_penalty=1.0, no_repeat_ngram_size=0,
                  prompt_lookup_num_tokens=PLD_TOKENS if pld else None)
    if config.temperature == 0:
        return GenerationConfig(do_sample=False, **common)
    return GenerationConfig(do_sample=True, temperature=config.temperature, top_p=1.0, top_k=0, **common)


def tune_for_bench(config: BenchConfig, *, target=None):
    """``--configs recommended``: the speed ranking ``eaglewire tune`` reports, for the bench's engine
    on other prompts of the same set (those after the bench's own), at its temperature and length;
    written to tune.json in the report directory."""
    from eaglewire.acceptance.speed import DEFAULT_PROMPTS, SpeedQuery, encoded_prompts, rank_speed, server_setup

    dataset = config.dataset if config.dataset != HELDOUT else "mt-bench"
    offset = config.num_prompts if config.num_prompts else 0
    query = SpeedQuery(engine=config.engine[0], max_new_tokens=min(config.max_new_tokens, 128),
                       temperature=config.temperature, seed=config.seed)
    if target is None:
        target = load_decode_target(config.target, device=config.device, dtype=config.dtype[0])
    draft, contract = load_draft(config.draft, target=target, device=target.device, dtype=target.dtype)[:2]
    prompts = encoded_prompts(target.tokenizer, dataset, offset, DEFAULT_PROMPTS)
    server = None
    if not get_engine(query.engine).in_process:
        server = server_setup(query.engine, config.draft, config.target, config.out_dir, config.run.settings(),
                              allow=frozenset(config.allow_target_mismatch or ()))
    ranking = rank_speed(query, target, draft, contract, prompts, server=server)
    settings = {"draft": config.draft, "target": config.target, "dataset": dataset, "offset": offset,
                "num_prompts": DEFAULT_PROMPTS, **asdict(query)}
    config.out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(config.out_dir / "tune.json", json.dumps(ranking.report(settings, key=RESOLVED_KEY), indent=2) + "\n")
    return ranking


def run_bench(config: BenchConfig, *, target=None, progress: bool = True) -> BenchResult:
    """Every config and baseline on the same prompts: eaglewire's engine (target and draft loaded
    once) and/or llama-server (started per config). The only bench writing ``config.out_dir``."""
    with directory_lock(config.out_dir, what=f"--out {config.out_dir}"):
        return _run_bench(config, target=target, progress=progress)


def _run_bench(config: BenchConfig, *, target, progress: bool) -> BenchResult:
    check_draft_family(config)
    targets: list[tuple[str, Target]] = []
    if IN_PROCESS in config.engine or config.compare:  # the HF baselines need the target loaded too
        targets = decode_targets(config, target)
    if config.configs == RECOMMENDED:
        tuned = tune_for_bench(config, target=targets[0][1] if targets else None)
        log.info("tune: %s", tuned.recommendation.reason)
        choice = tuned.recommendation.choice.shape
        config = replace(config, configs="1,0,0,0" if choice.plain else f"1,0,0,0;{choice.bench_config()}")
    prompts = bench_prompts(config)
    rows: list[Row] = []
    if targets:
        tok = targets[0][1].tokenizer
        encoded = [encode_prompt(tok, p.text, chat=p.chat) for p in prompts]
        runs = config.runs if IN_PROCESS in config.engine else []
        rows += _run_eaglewire(config, targets, encoded, runs, progress)
    else:
        from eaglewire.model.target import load_tokenizer

        tok = target.tokenizer if target is not None else load_tokenizer(config.target)
        encoded = [encode_prompt(tok, p.text, chat=p.chat) for p in prompts]
    for name in config.engine:
        if not get_engine(name).in_process:
            rows += _run_server(name, config, encoded, progress)
    return BenchResult(config=config, prompts=prompts, rows=rows, command=config.command_line())


def decode_targets(config: BenchConfig, target: Target | None) -> list[tuple[str, Target]]:
    """(precision, target) per ``--dtype``, in order: each dtype resolved on this machine and the target loaded in
    it once; a target handed in (tests, quickstart) is used as it is, for one dtype."""
    if target is not None:
        if len(config.dtype) > 1:
            raise ValueError(f"--dtype {','.join(config.dtype)}: a target handed in decodes in its own dtype only")
        return [(dtype_name(target.dtype), target)]
    out: list[tuple[str, Target]] = []
    for requested in config.dtype:
        precision = decode_precision(requested, config.device)
        if precision.name in (name for name, _ in out):
            raise ValueError(f"--dtype {','.join(config.dtype)}: {requested} is {precision.name} on this machine, "
                             "listed already; give each precision once")
        full = next((t for _, t in out if t.dtype == torch.float32), None)  # cast down from it: read the file once
        loaded = (full.in_dtype(precision.dtype) if full is not None
                  else load_target(config.target, device=config.device, dtype=precision.dtype))
        out.append((precision.name, loaded))
    return out


def _run_eaglewire(config: BenchConfig, targets: list[tuple[str, Target]], encoded: list[list[int]],
                   runs: list[SpecConfig | None], progress: bool) -> list[Row]:
    """Every config once per dtype (row names prefixed with it when there are several) and the HF baselines (on
    the first dtype's target), prompt-major."""
    jobs = []  # (row name, method, dtype, generate(prompt index, ids, max new tokens) -> (tokens, stats))
    for dtype, target in targets:
        jobs += _engine_jobs(config, target, runs, dtype=dtype, prefix=f"{dtype} " if len(targets) > 1 else "")
    first = targets[0][1]
    stops = stop_token_ids(first.tokenizer, first.model)
    pad_id = first.tokenizer.pad_token_id if first.tokenizer.pad_token_id is not None else stops[0]

    def hf(pld: bool, i: int, ids: list[int], max_new: int):
        return _hf_generate(first, ids, _hf_config(config, stops, pad_id, pld, max_new), config.seed + i)

    for method in config.compare or ():
        jobs.append((method, method, "", partial(hf, method == "hf-pld")))

    for *_, generate in jobs:
        for i, ids in enumerate(encoded[:config.warmup]):
            generate(i, ids, min(16, config.max_new_tokens))
    # Prompt-major: every config runs each prompt back to back, so a busy neighbour or a
    # thermal drift on a shared machine hits all configs alike (ratios stay honest).
    results: list[list[tuple[list[int], GenerationStats]]] = [[] for _ in jobs]
    for i, ids in enumerate(tqdm(encoded, desc="bench", unit="prompt", disable=not progress)):
        for j, (*_, generate) in enumerate(jobs):
            results[j].append(generate(i, ids, config.max_new_tokens))
    return [Row(name, method, [st for _, st in res], [toks for toks, _ in res], dtype=dtype)
            for (name, method, dtype, _), res in zip(jobs, results)]


def _engine_jobs(config: BenchConfig, target: Target, runs: list[SpecConfig | None], *, dtype: str, prefix: str):
    """eaglewire's engine on ``target`` (and the draft, in the target's dtype) for every config: the jobs."""
    draft = contract = None
    method = "eagle3"
    if any(r is not None for r in runs):
        method = read_draft(config.draft).family
        draft, contract, _ = load_draft(config.draft, target=target, allow=set(config.allow_target_mismatch or ()),
                                        device=target.device, dtype=target.dtype)
    stops = stop_token_ids(target.tokenizer, target.model)

    def engine(decoder: SpecDecoder, i: int, ids: list[int], max_new: int):
        sampling = SamplingParams(temperature=config.temperature, seed=config.seed + i)
        return decoder.generate(ids, max_new_tokens=max_new, sampling=sampling, stop_token_ids=set(stops))

    jobs = []
    for run in runs:
        try:
            decoder = SpecDecoder(target) if run is None else SpecDecoder(target, draft, contract, run)
        except ValueError as e:  # a shape the draft cannot draft (a DFlash block's length)
            raise ValueError(f"config {config_label(run)} ({CONFIG_FORMAT}): {e}") from None
        jobs.append((prefix + config_label(run), "plain" if run is None else method, dtype, partial(engine, decoder)))
    return jobs


# ------------------------------------------------------------------ an engine launched here as a server

def _run_server(engine: str, config: BenchConfig, encoded: list[list[int]], progress: bool) -> list[Row]:
    """One server of ``engine`` per config, started here (config-major: a server holds its own copy of the
    target, so they do not run side by side); no prompt cache, threads pinned; each answer's own counters."""
    runtime, settings, runs, files = _launch_setup(engine, config)
    rows = []
    for run in runs:
        log_path = config.out_dir / f"{engine}-{config_label(run).replace(',', '_')}.log"
        stats, outputs = [], []
        with runtime.serve(files, shape_of(run), settings, log_path=log_path) as server:
            for ids in encoded[:config.warmup]:
                server.generate(ids, max_new_tokens=min(16, config.max_new_tokens), temperature=config.temperature,
                                seed=config.seed)
            for i, ids in enumerate(tqdm(encoded, desc=f"{runtime.label} {config_label(run)}", unit="prompt",
                                         disable=not progress)):
                answer = server.generate(ids, max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                                         seed=config.seed + i)
                stats.append(answer.stats)
                outputs.append(answer.tokens)
        rows.append(Row(f"{engine} {config_label(run)}", "plain" if run is None else files.family, stats, outputs,
                        engine_name=engine))
    return rows


def _launch_setup(engine: str, config: BenchConfig):
    """What the bench launches of ``engine``: (its runtime, run settings, the configs it can run, the files it
    serves: the draft exported only where a config drafts)."""
    runtime, settings = get_engine(engine).runtime, config.run.settings()
    why = runtime.available(settings)
    if why:
        raise ValueError(why)
    family = read_draft(config.draft).family if config.draft is not None else "eagle3"
    runs = server_runs(config.runs, engine, family)
    needs_draft = any(r is not None for r in runs)
    files = runtime.files(config.draft if needs_draft else None, config.target, config.out_dir, settings,
                          export=export_draft, allow=frozenset(config.allow_target_mismatch or ()))
    return runtime, settings, runs, files


def run_bench_concurrency(config: BenchConfig, *, progress: bool = True):
    """``--concurrency``: every config (plain first) and the schedule at each concurrency -> LoadRows."""
    from eaglewire.concurrency.closed_loop import bench_concurrency
    from eaglewire.concurrency.schedule import Schedule

    if not get_engine(config.engine[0]).in_process:
        return _server_concurrency(config, progress)
    target = load_decode_target(config.target, device=config.device, dtype=config.dtype[0])
    prompts = [encode_prompt(target.tokenizer, p.text, chat=p.chat) for p in bench_prompts(config)]
    decoders: dict[str, tuple[SpecDecoder, Schedule]] = {}
    draft = contract = None
    runs = sorted(config.runs, key=lambda r: r is not None)  # plain first
    if config.draft is not None:
        draft, contract, _ = load_draft(config.draft, target=target, allow=set(config.allow_target_mismatch or ()),
                                        device=target.device, dtype=target.dtype)
    for run in runs:
        decoder = SpecDecoder(target) if run is None else SpecDecoder(target, draft, contract, run)
        decoders[config_label(run)] = (decoder, Schedule.fixed(run))
    if config.schedule is not None:
        schedule = Schedule.load_for(config.schedule, target, config.draft)
        shapes = schedule.shapes or [SpecConfig()]
        decoders["schedule"] = (SpecDecoder(target, draft, contract, shapes[0]), schedule)
    return bench_concurrency(decoders, prompts, config.concurrency, max_new_tokens=config.max_new_tokens,
                             stop_token_ids=set(stop_token_ids(target.tokenizer, target.model)),
                             temperature=config.temperature, seed=config.seed, warmup=config.warmup, progress=progress)


def _server_concurrency(config: BenchConfig, progress: bool):
    """``--concurrency`` on an engine launched here: one server per config (plain first) with as many slots as the
    most clients, loaded at each concurrency -> LoadRows, level-major."""
    from eaglewire.concurrency.server_closed_loop import bench_server_concurrency
    from eaglewire.model.target import load_tokenizer

    engine = config.engine[0]
    runtime, settings, runs, files = _launch_setup(engine, config)
    runs = sorted(runs, key=lambda r: r is not None)  # plain first
    tok = load_tokenizer(config.target)
    prompts = [encode_prompt(tok, p.text, chat=p.chat) for p in bench_prompts(config)]
    launches = {f"{engine} {config_label(run)}": shape_of(run) for run in runs}
    return bench_server_concurrency(runtime, files, settings, launches, prompts, config.concurrency,
                                    max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                                    seed=config.seed, warmup=config.warmup, log_dir=config.out_dir, progress=progress)


def check_draft_family(config: BenchConfig) -> None:
    """What a DFlash draft cannot do here yet is refused before anything runs, saying what to use:
    ``--configs recommended`` traces the draft with the EAGLE-3 unroll."""
    family = read_draft(config.draft).family if config.draft is not None else "eagle3"
    if family == "eagle3":
        return
    if config.configs == RECOMMENDED:
        raise ValueError(f"--configs {RECOMMENDED} ranks shapes with the EAGLE-3 draft's trace, and {config.draft} "
                         f"is a {family} draft; give the shapes yourself, e.g. --configs '1,0,0,0;1,7,1,8' "
                         f"(steps at most the block size - 1)")
