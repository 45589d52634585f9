"""What a training run carries from step to step and keeps across an interruption: its position, history
and state file (weights, optimiser, schedule and torch's generator: ``--resume`` continues exactly where the
run stopped), its metrics file cut back to the step it resumes from, and the lineage of ``--init-draft`` runs."""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any

import torch

from eaglewire.core.fileio import atomic_torch_save, atomic_write_text
from eaglewire.train.curves import Curves
from eaglewire.train.train_config import EAGLE3_DRAFT_VOCAB, TrainConfig

STATE_FILE = "train_state.pt"
METRICS_FILE = "metrics.jsonl"


class TrainingError(RuntimeError):
    """Training cannot go on (NaN/inf, mismatched resume); the last good checkpoint is kept."""


@dataclass
class TrainResult:
    out: str
    steps: int
    epochs_done: float
    train_tokens: int
    seconds: float
    final_eval: dict[str, float]
    finished: bool  # False when stopped by --minutes / --max-steps / --early-stop before the planned end
    timers: dict[str, float]  # seconds in data, target head, draft forward, backward (this run)
    throughput: dict[str, float | None] = field(default_factory=dict)  # tokens_per_s, tflops, mfu (this run's steps)
    stop_reason: str | None = None  # why it ended before the planned end, in words (--early-stop)


@dataclass(kw_only=True)
class Position:
    """Where the run stands; stored in the state file as a dict (resume reads it back)."""
    step: int = 0
    epoch: int = 0
    batch: int = 0  # micro-batches of this rank's plan already taken in this epoch
    tokens: int = 0


@dataclass(kw_only=True)
class History:
    evals: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0  # training time of the earlier runs (resume)
    stop_reason: str | None = None  # set when --early-stop ends the run (a resume stays stopped)


@dataclass(kw_only=True)
class RunState:
    """What one ``Trainer.run`` carries from step to step."""
    draft: torch.nn.Module  # Eagle3Draft or DFlashDraft
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    plans: list[list[list[int]]]  # per epoch: batches of sequence indices
    per_epoch: int  # optimizer steps per epoch
    total_steps: int
    coverage: float  # draft-vocabulary coverage of the training tokens
    start: float  # perf_counter at the start of this run (of its last save at the end)
    position: Position
    history: History
    window: torch.Tensor  # [positions, 5] float64 on the device: StepCounts fields summed since the last log row
    metrics_file: IO[str] | None
    bar: Any  # tqdm
    stopped_early: bool = False
    curves: Curves | None = None  # --report-to tensorboard (rank 0)
    log_time: float = 0.0  # perf_counter and tokens at the last log row: the window's tokens/s
    log_tokens: int = 0
    # Steps whose non-finite-loss flag (a device tensor) is not read yet: (position before the step, its
    # micro-batches, flag [M + 1]: this rank's micro-batch losses, whether any rank's was not finite). Read when a
    # log row, evaluation or save is due.
    unchecked: list[tuple[Position, list[list[int]], torch.Tensor]] = field(default_factory=list)
    flops_per_token: float | None = None  # the draft's training FLOPs per token (None: not counted for the family)
    step_tokens: int = 0  # tokens and seconds of this run's logged windows (evaluation and saves left out)
    step_seconds: float = 0.0


def init_lineage(path: str, training: dict[str, Any]) -> list[dict[str, Any]]:
    """The chain of runs a --init-draft run continues, oldest first: where each started and what
    it trained (steps, tokens, seconds), so a continued draft still states its whole budget."""
    own = {"draft": str(path), **{k: training.get(k) for k in ("steps", "train_tokens", "seconds")}}
    return list(training.get("init_draft") or []) + [own]


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the rows of the metrics file ``path`` up to ``step``, atomically: a run resumed from
    the checkpoint of ``step`` redoes (and logs again) the steps after it; a fresh run keeps none."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a row cut off by the crash
            continue
        if isinstance(row, dict) and row.get("step", 0) <= step:
            keep.append(line + "\n")
    atomic_write_text(path, "".join(keep))


def save_state(out: Path, config: TrainConfig, run: RunState) -> None:
    """``out``'s state file: what ``--resume`` continues from."""
    atomic_torch_save({"config": config.identity(), "draft": run.draft.state_dict(),
                       "optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(),
                       "rng": torch.get_rng_state(), "position": asdict(run.position), "history": asdict(run.history)},
                      out / STATE_FILE)


def load_state(out: Path, config: TrainConfig) -> dict[str, Any] | None:
    """The state file in ``out`` when ``config`` resumes (None for a fresh run), refused when it was written with
    other settings than ``config``'s (``TrainConfig.identity``) or when a fresh run would overwrite it."""
    path = out / STATE_FILE
    if not config.resume:
        if path.exists():
            raise TrainingError(f"{out} already holds a training run; pass --resume to continue "
                                "it, or choose another --out")
        return None
    if not path.exists():
        raise TrainingError(f"--resume: {path} does not exist; nothing to resume (drop --resume to start)")
    state = torch.load(path, weights_only=False)
    now = config.identity()
    # A field the stored run predates had its default then.
    defaults = {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING}
    was = {k: state["config"].get(k, defaults.get(k)) for k in now}
    if was.get("family") == "dflash" and was.get("draft_vocab_size") == EAGLE3_DRAFT_VOCAB:
        was["draft_vocab_size"] = None  # recorded before DFlash read it, when it meant the whole vocabulary
    diff = {k: (was[k], v) for k, v in now.items() if was[k] != v}
    if diff:
        lines = "; ".join(f"{k} was {a!r}, now {b!r}" for k, (a, b) in diff.items())
        raise TrainingError(f"--resume: {out} was trained with a different configuration ({lines}); "
                            "resume with the same settings or start a new --out")
    return state
