"""``train --report-to``: the training curves, beside metrics.jsonl, where HF Trainer and SpecForge
users look for them. ``tensorboard``: event files in ``--out/runs`` (HF Trainer's ``runs/`` under
its output directory; ``tensorboard --logdir OUT/runs``), with HF's tag names: ``train/loss``,
``train/acc_0``, ``train/learning_rate``, ``train/tokens_per_s``, ``eval/loss``, ``eval/acc_0``, ...

A resumed run writes a new event file into the same folder with ``purge_step`` at the step after
its checkpoint, so TensorBoard drops the steps the crashed run logged past it (as metrics.jsonl
is truncated), and the curve stays one curve.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping

log = logging.getLogger(__name__)

REPORT_TO = ("none", "tensorboard")
RUNS_DIR = "runs"
# metrics.jsonl key -> HF Trainer's name for it
_HF_NAMES = {"lr": "learning_rate"}


def require(report_to: str) -> None:
    """Fail at start, naming what to install, when ``report_to`` needs a package that is absent."""
    if report_to not in REPORT_TO:
        raise ValueError(f"--report-to {report_to!r} is not one of {', '.join(REPORT_TO)}")
    if report_to == "tensorboard":
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError as e:
            raise RuntimeError("--report-to tensorboard needs the tensorboard package, which is not installed: "
                               "pip install 'eaglewire[tensorboard]' (or pip install tensorboard), or drop "
                               f"--report-to ({e})") from e


class Curves:
    """Scalars to one TensorBoard run folder; ``close`` flushes them."""

    def __init__(self, log_dir: Path, *, resume_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self._writer = SummaryWriter(str(log_dir), purge_step=resume_step + 1 if resume_step else None)

    def add(self, prefix: str, step: int, values: Mapping[str, object]) -> None:
        """Every number in ``values`` as ``prefix/name`` at ``step`` (``val_`` dropped: eval/loss)."""
        for key, value in values.items():
            if key in ("step", "eval", "epoch") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name = _HF_NAMES.get(key, key.removeprefix("val_"))
            self._writer.add_scalar(f"{prefix}/{name}", float(value), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def open_curves(report_to: str, out: Path, *, resume_step: int = 0) -> Curves | None:
    """The curves writer of ``--report-to`` in ``out`` (None for ``none``)."""
    require(report_to)
    if report_to == "none":
        return None
    curves = Curves(out / RUNS_DIR, resume_step=resume_step)
    log.info("training curves: tensorboard --logdir %s", curves.log_dir)
    return curves
