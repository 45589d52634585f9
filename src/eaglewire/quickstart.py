"""``eaglewire quickstart``: the whole pipeline on the embedded default, in one command.

fetch target + data -> regenerate a small ShareGPT slice with the target's own replies ->
capture -> train a draft within a time budget -> doctor -> bench on MT-bench -> one summary
table and a report folder. Every stage records itself in ``stages.json``; a re-run reuses
finished stages and resumes an interrupted one.
"""

from __future__ import annotations

import json
import logging
import math
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from eaglewire.core.device import device_field, resolve_device
from eaglewire.core.fileio import atomic_write_json
from eaglewire.core.precision import DTYPE_CHOICES, resolve_precision
from eaglewire.core.locks import directory_lock
from eaglewire.core.presets import DEFAULT_TARGET
from eaglewire.model.target import Target, load_target
from eaglewire.train.plan import EPOCHS, MAX_CONVERSATIONS, REPLAN_OFF_BY, DataPlan, paced, plan_data

if TYPE_CHECKING:
    from eaglewire.data.prepare import PrepareConfig
    from eaglewire.data.regenerate import Pace, RegenerateReport

log = logging.getLogger(__name__)

STAGES_FILE = "stages.json"
BATCH_TOKENS = 2048  # the training stage's batch
EVAL_INTERVAL = 50  # steps between held-out evaluations (~100 s at the ~1,000 tokens/s of a 2-core machine in bf16)
EARLY_STOP = 3  # evaluations without a new held-out low before training stops
OVERFIT_GAP = 0.15  # train acc@0 above held-out acc@0 by more than this: said in the summary
# The shipped reference draft on MT-bench first turns, greedy, 2 threads (BENCHMARKS.md, "MT-bench
# and HumanEval with the reference draft"): two runs of the same configs on one host read 1.32x and
# 1.13x for its fastest config, so a range is all that section supports. Cited, not re-measured: stage 5b
# was measured so; stage 6 (shipped since) accepts more on the same prompts (τ 1.56 -> 1.64 for a chain of 3,
# BENCHMARKS.md "The reference draft for SmolLM2-135M"), so the range holds as a floor.
@dataclass(frozen=True)
class Recipe:
    """How the training conversations get their replies (``--replies``; the held-out ones are always the target's
    own), and what the plan aims for with them."""

    prepare: dict[str, Any]  # PrepareConfig's fields
    passes: int  # over the data (train/plan.py)
    most: int  # conversations at most
    probe: int = 8  # conversations the plan's data probe prepares (data_rate.PROBE_CONVERSATIONS: one batch)


RECIPES: dict[str, Recipe] = {
    # every reply the target's own: the best matched, the slowest to get
    "regenerate": Recipe({"regenerate": True}, passes=EPOCHS, most=MAX_CONVERSATIONS),
    # the first reply the target's own, the conversation ending there
    "first-turn": Recipe({"regenerate": True, "max_turns": 1}, passes=EPOCHS, most=2 * MAX_CONVERSATIONS),
    # the dataset's own replies as they are: the target's labels on another writer's text, many times faster to
    # get, so new data each pass (~2 MiB of states a conversation: the cap is ~8 GiB)
    # (its probe: 32 conversations, the first capture batches being slow while oneDNN builds its kernels: 8 read 1.3 s
    # a conversation where the stage captured at 0.6)
    "dataset": Recipe({}, passes=1, most=4000, probe=32),
}
# Held-out acc@0 (the target's own replies) against the ShareGPT tokens a draft was trained on, one pass each
# (BENCHMARKS.md, "What data buys": 0.09M to 0.65M from scratch, then new data in stages): more time buys more data.
DATA_CURVE = ((0.09e6, 0.187), (0.27e6, 0.245), (0.65e6, 0.310), (2.07e6, 0.378), (3.06e6, 0.411))
REFERENCE = {"config": "1,5,4,12,0.1", "speedup_low": 1.13, "speedup_high": 1.32, "tau": 1.61}
REFERENCE_RECIPE = "sh benchmarks/reference_draft.sh"
REFERENCE_HOURS = 9.5  # that recipe's wall time on 2 CPU cores (benchmarks/reference_draft.sh)


@dataclass(kw_only=True)
class QuickstartConfig:
    out: str = field(default="runs/quickstart", metadata={"help": "report folder (data, draft, doctor, bench, summary)"})
    target: str = field(default=DEFAULT_TARGET, metadata={"help": "preset name, HF model directory or .gguf file"})
    data: str = field(default="sharegpt", metadata={"help": "conversations: preset or file"})
    num_conversations: int | None = field(default=None, metadata={
        "help": "conversations regenerated and captured for training; default: sized to this machine's measured "
                "training speed and data stage, so regeneration and training fill the wall clock of 48 conversations "
                "plus --minutes, and re-planned when the data stage's own pace is off by more than "
                f"{round(100 * REPLAN_OFF_BY)} percent (eaglewire/train/plan.py)"})
    heldout_conversations: int = field(default=24, metadata={"help": "conversations after the training ones, "
                                                                     "regenerated and captured for the doctor only"})
    max_length: int = field(default=512, metadata={"help": "tokens per training sequence"})
    max_new_tokens: int = field(default=128, metadata={"help": "reply length when regenerating"})
    replies: str = field(default="dataset", metadata={"choices": tuple(RECIPES), "help": "the training "
                         "conversations' replies: regenerate (every one the target's own), first-turn (the first one, "
                         "the conversation ending there) or dataset (the data's own, captured as they are); the "
                         "held-out conversations are the target's own either way"})
    minutes: float = field(default=20.0, metadata={"help": "training time budget (with --num-conversations; sized "
                                                           "with the data otherwise)"})
    device: str = device_field()
    dtype: str = field(default="auto", metadata={"choices": DTYPE_CHOICES, "help": "training's and tune's and bench's "
                       "precision: auto (bf16 where the CPU computes it natively, else fp32), fp32, bf16"})
    ttt_steps: int = field(default=3, metadata={"help": "training-time-test steps"})
    draft_vocab_size: int = field(default=8192, metadata={"help": "draft vocabulary size"})
    bench_dataset: str = field(default="mt-bench", metadata={"help": "prompts for the benchmark"})
    bench_prompts: int = field(default=8, metadata={"help": "prompts benchmarked"})
    tune_prompts: int = field(default=8, metadata={"help": "prompts tune measures (after the bench's own)"})
    bench_tokens: int = field(default=128, metadata={"help": "new tokens per benchmark prompt"})
    # The one-token chain and the low-threshold tree are the configs that pay first (BENCHMARKS.md).
    bench_configs: str = field(default="1,0,0,0;1,1,1,2;1,4,1,5;1,4,4,8;1,5,4,12,0.1",
                               metadata={"help": "bench --configs"})

    def __post_init__(self) -> None:
        if self.minutes <= 0:
            raise ValueError(f"--minutes must be > 0, got {self.minutes}")
        if self.num_conversations is not None and self.num_conversations < 1:
            raise ValueError(f"--num-conversations must be >= 1, got {self.num_conversations}")
        for name in ("heldout_conversations", "max_length", "max_new_tokens", "bench_prompts",
                     "bench_tokens", "tune_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


class Stages:
    """``stages.json``: what each finished stage produced (re-runs skip those)."""

    def __init__(self, out: Path, config: QuickstartConfig) -> None:
        self.path = out / STAGES_FILE
        self.done: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {}
        if self.done.get("config", asdict(config)) != asdict(config):
            raise ValueError(f"{out} holds a quickstart with other settings; use another --out or delete it")
        self.done["config"] = asdict(config)

    def record(self, name: str, result: dict[str, Any]) -> None:
        self.done[name] = result
        atomic_write_json(self.path, self.done, indent=1)


def run_quickstart(config: QuickstartConfig, *, target: Target | None = None, progress: bool = True) -> dict[str, Any]:
    with directory_lock(config.out, what=f"--out {config.out}"):
        return _run_quickstart(config, target, progress)


def _run_quickstart(config: QuickstartConfig, target: Target | None, progress: bool) -> dict[str, Any]:
    from eaglewire.bench.bench_command import BenchConfig, run_bench
    from eaglewire.bench.bench_report import write_report
    from eaglewire.doctor import DoctorConfig, run_doctor
    from eaglewire.train.loop import train
    from eaglewire.train.train_config import TrainConfig

    out = Path(config.out)
    stages = Stages(out, config)
    if target is None:  # regenerated, captured and trained in one precision: bf16 where native (the plan timed it)
        precision = resolve_precision(config.dtype, resolve_device(config.device))
        target = load_target(config.target, device=config.device, dtype=precision.name)
    data, heldout, draft = out / "data", out / "heldout", out / "draft"

    if "plan" not in stages.done:
        stages.record("plan", plan_stage(config, target, progress=progress).record())
    plan = plan_in_force(stages)
    print(f"plan: {plan.describe()}")
    if "prepare" not in stages.done:
        replies = "the target regenerates the replies of" if RECIPES[config.replies].prepare.get("regenerate") \
            else "the target's states are captured on the data's own replies in"
        _banner(f"1/6 prepare: {replies} {plan.conversations} conversations (--replies {config.replies})")
        loaded = DataPlan(**stages.done["plan"]).conversations  # a re-plan ends the stage early: resumes match
        stages.record("prepare", prepare_stage(config, data, target, offset=0, count=loaded, progress=progress,
                                               pace=pace_data(stages)))
        plan = plan_in_force(stages)
    if "heldout" not in stages.done:
        _banner(f"2/6 prepare the doctor's data: {config.heldout_conversations} conversations training never sees")
        stages.record("heldout", prepare_stage(config, heldout, target, offset=plan.conversations,
                                               count=config.heldout_conversations, progress=progress,
                                               replies="regenerate"))
    if "train" not in stages.done:
        minutes = training_minutes(plan, stages.done["prepare"]["seconds"])
        _banner(f"3/6 train: a draft within {minutes:g} minutes (re-run to resume)")
        tokens = stages.done["prepare"]["tokens"]
        epochs = max(1, math.floor(minutes * 60 * plan.tokens_per_second / max(tokens, 1)))
        # validated on the held-out conversations (the target's own replies, whatever the recipe), stopped early
        # once their loss stops falling
        r = train(TrainConfig(out=str(draft), target=config.target, data=str(data), ttt_steps=config.ttt_steps,
                              draft_vocab_size=config.draft_vocab_size, epochs=epochs, minutes=minutes,
                              lr=1e-3, batch_tokens=BATCH_TOKENS, val_data=str(heldout),
                              val_sequences=config.heldout_conversations, eval_interval=EVAL_INTERVAL,
                              early_stop=EARLY_STOP, save_interval=25, dtype=config.dtype, device=str(target.device),
                              resume=(draft / "train_state.pt").exists()),
                  target=target, progress=progress)
        stages.record("train", {"minutes": minutes, "steps": r.steps, "epochs": round(r.epochs_done, 2),
                                "tokens": r.train_tokens,
                                "seconds": round(r.seconds, 1), "finished": r.finished, "stop_reason": r.stop_reason,
                                **last_training_window(draft), **r.final_eval})
    if "doctor" not in stages.done:
        _banner("4/6 doctor: is the draft wired as it was trained? (on the held-out conversations)")
        # whole sequences, as trained: the doctor's shorter default would judge a fraction of each reply
        report = run_doctor(DoctorConfig(draft=str(draft), target=config.target, device=str(target.device),
                                         data=str(heldout), tune=False,
                                         num_sequences=config.heldout_conversations, max_length=config.max_length,
                                         json=str(out / "doctor.json")), target=target)
        (out / "doctor.txt").write_text(report.render() + "\n")
        print(report.render())
        evidence = next((c.summary for c in report.checks if c.name == "evidence"), "")
        stages.record("doctor", {"ok": report.status == "passed", "status": report.status, "evidence": evidence,
                                 "verdicts": {c.name: c.verdict for c in report.checks}})
    decode_target = None  # the target in the decoding precision, loaded once for tune and bench
    if "tune" not in stages.done or "bench" not in stages.done:
        decode_target = decoding_target(config, target)
    if "tune" not in stages.done:
        _banner(f"5/6 tune: which shape pays in eaglewire's engine, on {config.tune_prompts} prompts")
        stages.record("tune", tune_stage(config, draft, decode_target))
    if "bench" not in stages.done:
        configs = bench_configs(config.bench_configs, stages.done["tune"])
        _banner(f"6/6 bench: {config.bench_prompts} other {config.bench_dataset} prompts, with and without the "
                "draft (tune's choice included)")
        bc = BenchConfig(target=config.target, draft=str(draft), device=str(decode_target.device),
                         dataset=config.bench_dataset,
                         configs=configs, num_prompts=config.bench_prompts,
                         max_new_tokens=config.bench_tokens, out=str(out / "bench"))
        result = run_bench(bc, target=decode_target, progress=progress)
        write_report(result, bc.out_dir)
        stages.record("bench", json.loads((bc.out_dir / "bench.json").read_text())["rows"])
    summary = summary_rows(stages.done)
    text = "\n".join(f"| {k} | {v} |" for k, v in summary)
    (out / "summary.md").write_text(f"# eaglewire quickstart\n\n| stage | result |\n|---|---|\n{text}\n")
    return stages.done


def training_minutes(plan: DataPlan, data_seconds: float) -> float:
    """The training stage's budget: what the plan's wall clock leaves after the data stage as it ran (the plan's
    own minutes where --num-conversations fixed the slice), at least one minute."""
    if not plan.sized:
        return plan.train_minutes
    return round(max(plan.budget_seconds - data_seconds, 60.0) / 60, 2)


def last_training_window(draft: Path) -> dict[str, float]:
    """The training figures of the run's last logged window (``train_acc_0``, ``train_loss``), to set beside the
    held-out ones: a gap between them is the draft learning its data by heart."""
    rows = [json.loads(line) for line in (draft / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if not r.get("eval")]
    return {f"train_{k}": rows[-1][k] for k in ("loss", "acc_0") if rows and k in rows[-1]}


def plan_stage(config: QuickstartConfig, target: Target, *, progress: bool = False) -> DataPlan:
    """Time a training step here and, unless --num-conversations fixes the slice, the data stage on its own first
    conversations (seconds); then size the data and the training budget to them."""
    import tempfile

    from eaglewire.data.data_rate import data_seconds_per_conversation

    precision = resolve_precision(config.dtype, target.device)
    recipe = RECIPES[config.replies]
    with tempfile.TemporaryDirectory(prefix="eaglewire-plan-") as scratch:
        sample = Path(scratch) / "data"
        data = data_seconds_per_conversation(target, prepare_config(config, Path(config.out) / "data", target,
                                                                    offset=0, count=None),
                                             sample=recipe.probe, progress=progress, keep=sample)
        speed = training_speed(config, target, sample, Path(scratch) / "draft")
    if config.num_conversations is not None:
        return plan_data(tokens_per_second=round(speed, 1), minutes=config.minutes, precision=precision.name,
                         conversations=config.num_conversations, tokens_per_conversation=data["tokens"],
                         passes=recipe.passes, most=recipe.most)
    return plan_data(tokens_per_second=round(speed, 1), minutes=config.minutes, precision=precision.name,
                     data_seconds=round(data["seconds"], 2), capture_seconds=round(data["capture"], 2),
                     tokens_per_conversation=data["tokens"], passes=recipe.passes, most=recipe.most)


PROBE_STEPS = 8  # training steps the plan's probe runs on the data probe's sample; the first 2 (kernels built) are
# left out of its speed


def training_speed(config: QuickstartConfig, target: Target, data: Path, out: Path) -> float:
    """Training tokens/s here, measured as training runs: ``train`` itself, the quickstart's settings, on the data
    probe's own shards (a synthetic step on random states read 474 tokens/s in the quickstart's process and 2,284
    alone, where its training ran at 1,080: issue 74), its median step after the first two."""
    from eaglewire.train.loop import train
    from eaglewire.train.train_config import TrainConfig

    train(TrainConfig(out=str(out), target=config.target, data=str(data), ttt_steps=config.ttt_steps,
                      draft_vocab_size=config.draft_vocab_size, epochs=PROBE_STEPS, max_steps=PROBE_STEPS, lr=1e-3,
                      batch_tokens=BATCH_TOKENS, val_sequences=1, eval_interval=10 * PROBE_STEPS,
                      save_interval=10 * PROBE_STEPS, log_interval=1, dtype=config.dtype, device=str(target.device)),
          target=target, progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    speeds = sorted(r["tokens_per_s"] for r in rows if not r.get("eval") and r["step"] > 2)
    if not speeds:
        raise RuntimeError(f"the training probe in {out} logged no step after its first two")
    return speeds[len(speeds) // 2]


def plan_in_force(stages: Stages) -> DataPlan:
    """The plan the stages run to: the data stage's re-plan where its own pace re-planned, else the probed one."""
    return plan_in_force_of(stages.done)


def plan_in_force_of(done: dict[str, Any]) -> DataPlan:
    return DataPlan(**done.get("replan", done["plan"]))


def pace_data(stages: Stages) -> Pace:
    """The data stage's check of the plan (``regenerate``'s ``pace``): after each batch, the plan in force says how
    many conversations to regenerate in all; a re-plan at the stage's own pace is recorded and said."""
    def pace(done: int, report: RegenerateReport) -> int:
        plan = plan_in_force(stages)
        now = paced(plan, regenerated=report.conversations_run, seconds=report.seconds, done=done)
        if now != plan:
            stages.record("replan", now.record())
            _say(f"re-plan after {done} conversations: {now.describe()}")
        return now.conversations
    return pace


def decoding_target(config: QuickstartConfig, target: Target) -> Target:
    """The target tune and bench decode with, in ``--dtype``'s precision (capture and the doctor keep ``target``)."""
    from eaglewire.decode.load import decode_precision

    dtype = decode_precision(config.dtype, target.device).dtype
    if target.dtype == torch.float32 or dtype == target.dtype:  # cast down (or nothing): the same weights
        return target.in_dtype(dtype)
    return load_target(config.target, device=target.device, dtype=dtype)  # widening a cast copy would not restore them


def exit_code(done: dict[str, Any]) -> int:
    """0 when every stage ran and the doctor found no fault; 1 when it found one. An inconclusive
    doctor is said in the summary, not an error of the job."""
    return 1 if done["doctor"].get("status") == "failed" else 0


def prepare_config(config: QuickstartConfig, out: Path, target: Target, *, offset: int,
                   count: int | None, replies: str | None = None) -> PrepareConfig:
    """The data stage's settings: ``count`` conversations after ``offset``, their replies as ``replies`` (default
    ``--replies``) has them, captured."""
    from eaglewire.data.prepare import PrepareConfig

    return PrepareConfig(out=str(out), target=config.target, device=str(target.device), data=config.data,
                         offset=offset, num_conversations=count, max_length=config.max_length,
                         max_new_tokens=config.max_new_tokens, **RECIPES[replies or config.replies].prepare)


def prepare_stage(config: QuickstartConfig, out: Path, target: Target, *, offset: int, count: int, progress: bool,
                  pace: Pace | None = None, replies: str | None = None) -> dict[str, Any]:
    """A data stage: ``prepare_config``'s, its regeneration at ``pace``; what it wrote, for ``stages.json``."""
    from eaglewire.data.prepare import prepare

    s = prepare(prepare_config(config, out, target, offset=offset, count=count, replies=replies), target=target,
                progress=progress,
                pace=pace)
    return {"sequences": s.sequences, "tokens": s.tokens, "reply_tokens": s.loss_tokens, "seconds": round(s.seconds, 1)}


def tune_stage(config: QuickstartConfig, draft: Path, target: Target) -> dict[str, Any]:
    """``eaglewire tune`` for eaglewire's engine, on prompts after the bench's own when the set has them."""
    from eaglewire.core.prompts import load_prompts
    from eaglewire.tune.tune_command import TuneConfig, run_tune

    available = len(load_prompts(config.bench_dataset))
    offset = config.bench_prompts if available >= config.bench_prompts + config.tune_prompts else 0
    tune = TuneConfig(draft=str(draft), target=config.target, device=str(target.device), dataset=config.bench_dataset,
                      offset=offset,
                      num_prompts=min(config.tune_prompts, available), max_new_tokens=max(config.bench_tokens, 16),
                      max_steps=4, out=str(Path(config.out) / "tune.json"))
    result = run_tune(tune, target=target)
    print(result.format())
    choice = result.recommendation.choice
    return {"engine": "eaglewire", "reason": result.recommendation.reason, "plain": choice.shape.plain,
            "bench_config": choice.shape.bench_config(), "predicted_speedup": round(choice.speedup, 3),
            "prompts": tune.num_prompts, "offset": offset}


def bench_configs(configs: str, tune: dict[str, Any]) -> str:
    """The bench's configs, with tune's choice added when it is a shape the list lacks: the summary's
    recommendation needs tune's prediction measured on the bench's prompts."""
    names = configs.split(";")
    if not tune["plain"] and tune["bench_config"] not in names:
        names.append(tune["bench_config"])
    return ";".join(names)


def summary_rows(done: dict[str, Any]) -> list[tuple[str, str]]:
    p, t, d = done["prepare"], done["train"], done["doctor"]
    h = done.get("heldout")
    rows = [("plan", DataPlan(**done["plan"]).describe())] if "plan" in done else []
    rows += [("re-plan", DataPlan(**done["replan"]).describe())] if "replan" in done else []
    rows += [("data", f"{p['sequences']} sequences, {p['tokens']:,} tokens ({p['reply_tokens']:,} reply tokens), "
                     f"{p['seconds']:,.0f} s"
             + (f"; held out for the doctor: {h['sequences']} sequences ({h['reply_tokens']:,} reply tokens)"
                if h else "")),
            ("training", f"{t['steps']} steps, {t['tokens']:,} tokens, {t['seconds']:,.0f} s"
                         + ("" if t["finished"] else f" ({t.get('stop_reason') or 'time budget reached'})")),
            ("held-out acc@0 / cond acc@1", heldout_row(t))]
    if "plan" in done:
        rows.append(("more time", more_time_row(plan_in_force_of(done), t["tokens"])))
    rows.append(("doctor", d.get("status", "passed" if d["ok"] else "failed").upper()
                 + (f" ({d['evidence']})" if d.get("evidence") else "") + ": "
                 + ", ".join(f"{k} {v}" for k, v in d["verdicts"].items())))
    for row in done["bench"]:
        tau = f", τ {row['tau_pooled']:.2f}" if row.get("tau_pooled") else ""
        speed = f", {row['speedup']:.2f}x" if row.get("speedup") else ""
        rows.append((f"bench {row['name']}", f"{row['tokens_per_second']:.1f} tok/s{tau}{speed}"))
    if "tune" in done:
        rows.append(("tune's prediction (eaglewire's engine)", done["tune"]["reason"]))
    rows += verdict_rows(done["bench"], done.get("tune"))
    rows.append(("tune for llama.cpp", "eaglewire tune --engine llamacpp --draft <out>/draft (exports the GGUFs, "
                                       "times llama-server; docs/llamacpp.md)"))
    return rows


def curve_acc(tokens: float) -> float:
    """Held-out acc@0 that ``tokens`` of one-pass training read on ``DATA_CURVE`` (log-linear between its points,
    the ends held)."""
    points = DATA_CURVE
    if tokens <= points[0][0]:
        return points[0][1]
    for (t0, a0), (t1, a1) in zip(points, points[1:]):
        if tokens <= t1:
            return a0 + (a1 - a0) * math.log(tokens / t0) / math.log(t1 / t0)
    return points[-1][1]


def more_time_row(plan: DataPlan, trained_tokens: int, extra_minutes: float = 30.0) -> str:
    """What ``extra_minutes`` more would buy at this machine's measured rates: the tokens a minute of the data stage
    and one pass of training adds, read on ``DATA_CURVE``."""
    per_token = plan.seconds_per_conversation / plan.tokens_per_conversation + plan.passes / plan.tokens_per_second
    more = extra_minutes * 60 / per_token  # tokens
    return (f"+{extra_minutes:g} min here adds ~{more / 1e6:.2f}M tokens of new data (one pass): held-out acc@0 "
            f"about {curve_acc(trained_tokens + more):.2f} by the data curve in BENCHMARKS.md (\"What data buys\"; "
            f"{curve_acc(trained_tokens):.2f} at this run's {trained_tokens / 1e6:.2f}M); `--minutes` sets it")


def heldout_row(t: dict[str, Any]) -> str:
    """Held-out acc@0 / cond acc@1 (the target's own replies, conversations training never saw) beside the last
    training window's acc@0, and what their gap says."""
    row = f"{t.get('val_acc_0', 0):.3f} / {t.get('val_cond_acc_1', 0):.3f}"
    if "train_acc_0" not in t:
        return row
    gap = t["train_acc_0"] - t.get("val_acc_0", 0)
    row += f" (training's last steps: acc@0 {t['train_acc_0']:.3f}"
    return row + (f"; {gap:.2f} above held out: the draft learnt its data by heart, more data would pay more than "
                  "more passes)" if gap > OVERFIT_GAP else ")")


def spec_flags(config: str) -> str:
    """``generate``/``serve`` flags of a bench config ``batch,steps,topk,draft-tokens[,min-prob]``:
    its SpecConfig's fields, as configs.py spells them."""
    from eaglewire.bench.bench_command import parse_config
    from eaglewire.core.configs import config_to_args

    return shlex.join(config_to_args(parse_config(config)))


def verdict_rows(bench: list[dict[str, Any]], tune: dict[str, Any] | None) -> list[tuple[str, str]]:
    """One recommendation: a shape only when tune chose it on its prompts *and* bench measured it
    faster than plain on its own, else plain decoding and why; then what the reference draft gets
    and what a draft worth serving costs."""
    ref = REFERENCE
    reference = (f"the shipped reference draft (`--draft reference`) gets {ref['speedup_low']:.2f}-"
                 f"{ref['speedup_high']:.2f}x plain with {ref['config']} on MT-bench first turns (τ {ref['tau']}, "
                 "two runs, BENCHMARKS.md)")
    recipe = (f"a draft worth serving takes ~{REFERENCE_HOURS} h on 2 CPU cores: {REFERENCE_RECIPE} "
              "(~4.8M captured tokens, 1M of them the target's own replies, against this run's few thousand)")
    measured = {r["name"]: r for r in bench if r.get("method") == "eagle3" and r.get("speedup")}
    if tune is None or tune["plain"]:
        best = max(measured.values(), key=lambda r: r["speedup"], default=None)
        why = (tune["reason"] if tune else "tune did not run") + (
            f"; bench's fastest config, {best['name']}, read {best['speedup']:.2f}x on other prompts"
            if best else "")
        return [("serve with", f"plain decoding (no --draft): {why}"), ("a draft that pays", f"{reference}; {recipe}")]
    shape = tune["bench_config"]
    row = measured.get(shape)
    if row is not None and row["speedup"] > 1:
        return [("serve with", f"{shape}: {row['speedup']:.2f}x plain decoding in bench, "
                               f"{tune['predicted_speedup']:.2f}x predicted by tune on other prompts, both at 1 "
                               f"concurrent request (`eaglewire serve --draft <out>/draft {spec_flags(shape)}`; for "
                               "many at once, `eaglewire tune --draft <out>/draft --concurrency 1,2,4,8 "
                               "--schedule-out <out>/schedule.json` says up to which load it pays, and `serve "
                               "--schedule` follows it)"),
                ("for more speed", f"{reference}; {recipe}")]
    read = f"{row['speedup']:.2f}x" if row else "not measured"
    return [("serve with", f"plain decoding (no --draft): tune predicted {shape} at {tune['predicted_speedup']:.2f}x "
                           f"plain, but bench read it {read} on other prompts: the draft does not pay reliably yet"),
            ("a draft that pays", f"{reference}; {recipe}")]


def _banner(text: str) -> None:
    print(f"\n== {text}", flush=True)
    log.info("%s", text)


def _say(text: str) -> None:
    """A line to the terminal above the progress bar being drawn, and to the log."""
    tqdm.write(text)
    log.info("%s", text)
