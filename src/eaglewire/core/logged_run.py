"""A command run to a log file, one stage of a long install: its stage line to the progress callback first, the
command line and all its output appended to the log, and on failure an error carrying the log's last lines."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path


def log_tail(logfile: Path, lines: int = 15) -> str:
    try:
        return "".join(logfile.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return ""


def run_logged(cmd: list[str], logfile: Path, stage: str, progress: Callable[[str, "float | None"], None], *,
               error: type[Exception] = RuntimeError, timeout: float = 3600.0, env: Mapping[str, str] | None = None,
               cwd: Path | None = None) -> None:
    """Run ``cmd`` (stdin closed) with its output appended to ``logfile``; ``error`` with the log's tail when it
    exits non-zero or runs past ``timeout`` seconds."""
    progress(stage, None)
    with open(logfile, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  timeout=timeout, env=None if env is None else dict(env), cwd=cwd)
        except subprocess.TimeoutExpired:
            raise error(f"{stage}: still running after {timeout:.0f} s; log {logfile}") from None
    if proc.returncode != 0:
        raise error(f"{stage} failed (exit {proc.returncode}); log {logfile}:\n{log_tail(logfile)}")
