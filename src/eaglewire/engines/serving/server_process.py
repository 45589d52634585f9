"""A server an engine runs as a process here: started in its own process group with its output to a log file,
waited for until ``/health`` answers, and on leaving stopped as a whole group (SIGTERM, then SIGKILL) and waited
for until no member is left, whatever the engine spawned (SGLang's scheduler and detokenizer, vLLM's EngineCore).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from eaglewire.engines.serving.served_counts import log_tail, wait_healthy

log = logging.getLogger(__name__)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ServerProcess:
    """``with ServerProcess(command, env, url=...) as p:`` the process serving at ``url`` until the block ends.

    ``error`` is raised with the log's tail when the process exits while starting or is not healthy within
    ``startup_timeout``; ``record()`` (how it was launched) is written beside the log as ``<log>.json`` once ready.
    """

    def __init__(self, command: Sequence[str], env: Mapping[str, str], *, url: str, label: str,
                 error: type[Exception], log_path: Path | None = None, startup_timeout: float = 900.0,
                 stop_timeout: float = 30.0, record: Callable[[], dict[str, Any]] | None = None) -> None:
        self.command, self.env, self.url, self.label = list(command), dict(env), url, label
        self.error, self.log_path = error, log_path
        self.startup_timeout, self.stop_timeout = startup_timeout, stop_timeout
        self._record = record
        self.seconds_to_ready: float | None = None
        self.proc: subprocess.Popen | None = None
        self._log = None

    def __enter__(self) -> ServerProcess:
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"{self.label.lower().replace('.', '')}-server-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        log.info("starting %s: %s", self.label, " ".join(self.command))
        start = time.monotonic()
        self.proc = subprocess.Popen(self.command, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_healthy(self.url, exited=self.proc.poll, timeout=self.startup_timeout, interval=0.5,
                         on_exit=self._exited, on_timeout=self._timed_out)
            self.seconds_to_ready = time.monotonic() - start
            if self._record is not None:
                self.log_path.with_name(self.log_path.name + ".json").write_text(json.dumps(self._record(), indent=2))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _exited(self, rc: int) -> None:
        raise self.error(f"{self.label} exited with {rc} while starting ({' '.join(self.command)}); "
                         f"log {self.log_path}:\n{self.log_tail()}")

    def _timed_out(self) -> None:
        raise self.error(f"{self.label} did not become ready within {self.startup_timeout:.0f} s; log "
                         f"{self.log_path}:\n{self.log_tail()}")

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, lines: int = 25) -> str:
        return log_tail(self.log_path, lines)

    def __exit__(self, *exc: object) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            pgid = proc.pid  # start_new_session: the leader's pid is the group's id
            for sig, wait in ((signal.SIGTERM, self.stop_timeout), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
                deadline = time.monotonic() + wait
                while time.monotonic() < deadline:
                    if proc.poll() is not None and not group_alive(pgid):
                        break
                    time.sleep(0.2)
                else:
                    log.warning("%s's process group %d outlived %s; sending the next signal", self.label, pgid,
                                sig.name)
                    continue
                break
            if proc.poll() is None:
                proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None


class ProcessServer:
    """A running server whose process is ``self.process``: what every engine's server class shares (its command,
    log, readiness, and the ``with`` block that starts and stops it)."""

    process: ServerProcess

    @property
    def command(self) -> list[str]:
        return self.process.command

    @property
    def log_path(self) -> Path | None:
        return self.process.log_path

    @property
    def seconds_to_ready(self) -> float | None:
        return self.process.seconds_to_ready

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def log_tail(self, lines: int = 25) -> str:
        return self.process.log_tail(lines)

    def __enter__(self):
        self.process.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.__exit__(*exc)


def cpu_list(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the CPU-list syntax vLLM's and SGLang's thread binding take)."""
    out, run = [], []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (a server's threads are pinned to the first of them)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
