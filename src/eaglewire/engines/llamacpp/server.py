"""A llama-server process and its HTTP API: ``LlamaServer`` runs it as a subprocess (a context
manager: started and health-checked on entry, stopped on exit); ``complete`` and ``metrics`` talk
to any running llama-server (its Prometheus counters read with ``prometheus_client``'s parser).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from eaglewire.engines.llamacpp.failure import LlamaCppError, exit_cause
from eaglewire.engines.serving.served_counts import (OTHER_TRAFFIC, ServedCounts, ServedError, log_tail, other_traffic, post_json,
                                            wait_healthy)
from eaglewire.engines.serving.server_process import free_port

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ServerConfig:
    """One llama-server launch. ``draft`` None: plain decoding."""

    model: Path
    draft: Path | None = None
    threads: int = 2  # -t, -tb, and for the draft -td, -tbd: pinned, as measuring needs
    n_max: int = 3  # --spec-draft-n-max: the chain length (llama.cpp's default)
    n_min: int = 0  # --spec-draft-n-min: drafts shorter than this are dropped
    p_min: float = 0.0  # --spec-draft-p-min: stop drafting below this draft probability
    ctx_size: int = 4096
    extra: list[str] = field(default_factory=list)
    slots: int = 1  # -np: requests decoded together (continuous batching, -cb, when more than one)
    spec_type: str = "draft-eagle3"  # --spec-type: draft-eagle3, or draft-dflash for a DFlash GGUF

    def __post_init__(self) -> None:
        for name, low in (("threads", 1), ("n_max", 1), ("n_min", 0), ("ctx_size", 64), ("slots", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"llama-server {name} must be >= {low}, got {getattr(self, name)}")
        if self.n_min > self.n_max:
            raise ValueError(f"llama-server n_min {self.n_min} exceeds n_max {self.n_max}: no draft would be used")
        if not 0.0 <= self.p_min <= 1.0:
            raise ValueError(f"llama-server p_min {self.p_min} must be in [0, 1]")


def chain_config(model: Path, draft: Path | None, *, threads: int, n_max: int, p_min: float = 0.0,
                 extra: list[str] | None = None, family: str = "eagle3") -> ServerConfig:
    """The launch of a greedy chain of ``n_max`` draft tokens (n-min 0, stopped below ``p_min``);
    ``n_max`` 0: plain decoding, ``draft`` unused. ``extra`` flags go to every launch. ``family``
    dflash: the draft is a DFlash GGUF (``--spec-type draft-dflash``: one block of n_max + 1)."""
    if n_max == 0:
        return ServerConfig(model=model, threads=threads, extra=list(extra or []))
    return ServerConfig(model=model, draft=draft, threads=threads, n_max=n_max, n_min=0, p_min=p_min,
                        extra=list(extra or []), spec_type=SPEC_TYPES[family])


# llama-server's --spec-type of each draft family's GGUF (common/speculative.cpp's names)
SPEC_TYPES = {"eagle3": "draft-eagle3", "dflash": "draft-dflash"}


def spec_flags(n_max: int, n_min: int = 0, p_min: float = 0.0, spec_type: str = "draft-eagle3") -> list[str]:
    """llama.cpp's flags for a greedy chain of ``n_max`` draft tokens (``spec_type`` draft-dflash: a block
    of up to n_max, clamped to block_size - 1)."""
    return ["--spec-type", spec_type, "--spec-draft-n-max", str(n_max), "--spec-draft-n-min", str(n_min),
            "--spec-draft-p-min", f"{p_min:g}"]


def server_args(config: ServerConfig, *, port: int, host: str = "127.0.0.1") -> list[str]:
    """The llama-server command line (without the binary) for ``config``."""
    t = str(config.threads)
    args = ["-m", str(config.model), "--host", host, "--port", str(port), "-t", t, "-tb", t,
            "-c", str(config.ctx_size), "-np", str(config.slots), "--metrics", "--no-webui"]
    if config.slots > 1:
        args.append("-cb")
    if config.draft is not None:
        args += ["-md", str(config.draft), *spec_flags(config.n_max, config.n_min, config.p_min, config.spec_type),
                 "-td", t, "-tbd", t]
    return args + list(config.extra)


class LlamaServer:
    """``with LlamaServer(binary, config) as server:`` a running llama-server at ``server.url``.

    Waits for ``/health`` (model loaded) on entry; raises LlamaCppError with the tail of its
    log when it exits early (an unloadable GGUF, an unsupported target) or does not come up.
    """

    def __init__(self, binary: Path, config: ServerConfig, *, log_path: Path | None = None,
                 startup_timeout: float = 600.0) -> None:
        self.binary, self.config, self.startup_timeout = Path(binary), config, startup_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._proc: subprocess.Popen | None = None
        self._log = None

    @property
    def command(self) -> list[str]:
        return [str(self.binary), *server_args(self.config, port=self.port)]

    def __enter__(self) -> LlamaServer:
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._log = open(self.log_path, "w")
        log.info("starting %s", " ".join(self.command))
        self._proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        def exited(rc: int) -> None:
            hint = ("; rebuild it for this CPU: eaglewire engines install llamacpp (it reconfigures a build "
                    "made for another CPU or by an earlier eaglewire)" if rc == -signal.SIGILL else "")
            raise LlamaCppError(f"llama-server exited with {rc} ({exit_cause(rc)}) while starting "
                                f"({' '.join(self.command)}){hint}:\n{self.log_tail()}")

        def timed_out() -> None:
            raise LlamaCppError(f"llama-server did not become ready within {self.startup_timeout:.0f} s:\n"
                                f"{self.log_tail()}")

        wait_healthy(self.url, exited=self._proc.poll, timeout=self.startup_timeout, on_exit=exited,
                     on_timeout=timed_out)

    @property
    def returncode(self) -> int | None:
        """The process's exit status once it has ended (negative: the signal that killed it), else None."""
        return None if self._proc is None else self._proc.poll()

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log_path, lines)

    def __exit__(self, *exc) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


# ------------------------------------------------------------------ talking to it

def _post(url: str, body: dict, timeout: float) -> dict:
    return post_json(url, body, timeout=timeout, who="llama-server", error=LlamaCppError, hint="")


def complete(url: str, prompt_ids: list[int], *, n_predict: int, temperature: float = 0.0, seed: int = 0,
             timeout: float = 900.0, ignore_eos: bool = False) -> dict:
    """``/completion`` of the token ids ``prompt_ids`` (no prompt cache, so every request prefills
    alike): greedy at temperature 0, else plain temperature sampling (llama-server's default
    top-k 40 / top-p 0.95 / min-p 0.05 switched off, as eaglewire samples); ``ignore_eos``: all ``n_predict``
    tokens. The answer carries ``tokens`` and llama.cpp's ``timings``."""
    sampling = {"temperature": 0.0, "top_k": 1} if temperature == 0 else {
        "temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    body = {"prompt": list(prompt_ids), "n_predict": n_predict, **sampling,
            "seed": seed, "cache_prompt": False, "return_tokens": True, "stream": False, "ignore_eos": ignore_eos}
    return _post(url.rstrip("/") + "/completion", body, timeout)


def metrics(url: str, timeout: float = 30.0) -> dict[str, float] | None:
    """llama-server's Prometheus counters (``llamacpp:`` prefix dropped); None when it runs
    without ``--metrics``."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as r:
            text = r.read().decode()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        raise LlamaCppError(f"no llama-server answers at {url}: {e}") from e
    return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus exposition text -> {sample name without the ``llamacpp:`` prefix: value}; a
    labelled sample keeps its labels in the key (``name{a="x"}``); timestamps are dropped."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[sample.name.removeprefix("llamacpp:") + (f"{{{labels}}}" if labels else "")] = float(sample.value)
    return out


def plain_server_config(model: Path, *, slots: int, threads: int, ctx_per_slot: int = 4096,
                        extra: list[str] | None = None) -> ServerConfig:
    """A plain (no draft) launch serving ``slots`` requests at once, each with ``ctx_per_slot``
    tokens of context: llama-server splits ``-c`` over its slots, so ``-c`` is their product.
    What regeneration through llama-server starts."""
    if ctx_per_slot < 64:
        raise ValueError(f"llama-server ctx_per_slot must be >= 64, got {ctx_per_slot}")
    return ServerConfig(model=Path(model), threads=threads, slots=slots, ctx_size=slots * ctx_per_slot,
                        extra=list(extra or []))


# ------------------------------------------------------------------ served acceptance (doctor --engine-url)
# Read from llama.cpp b11434: per request, ``timings.draft_n`` / ``timings.draft_n_accepted``
# (tools/server/server-common.cpp, result_timings::to_json; only when it drafted); counters, with
# --metrics, in tools/server/server-task.cpp, server_task_result_metrics::to_json:
# ``llamacpp:spec_decode_num_drafts_total`` (verify steps), ``..._num_draft_tokens_total``,
# ``..._num_accepted_tokens_total`` and ``..._num_accepted_tokens_per_pos_total{position="i"}``
# from 0 — vLLM's names under llama.cpp's prefix. A verify step is counted once per drafted round
# (tools/server/server-context.cpp, slot.stats.n_draft_verif_steps).

SPEC_DRAFTS = "spec_decode_num_drafts_total"
SPEC_PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"


def _per_pos(counters: dict[str, float]) -> list[int]:
    found = {}
    for key, value in counters.items():
        if key.startswith(SPEC_PER_POS + '{position="'):
            found[int(key.split('"')[1])] = int(value)
    return [found.get(i, 0) for i in range(max(found) + 1)] if found else []


# Other clients' work: tools/server/server-task.cpp (b11434) exports the counter tokens_predicted_total (tokens
# generated) and the gauge requests_processing (slots processing), with --metrics.
GENERATED, RUNNING = "tokens_predicted_total", "requests_processing"
# Measured (BENCHMARKS.md, "Many requests at once"): the same replies took chain 3 959 rounds alone and 1,316 with 8
# clients; common/speculative.cpp's EAGLE-3 process() "assumes per-seq tokens are contiguous within the ubatch".
LOAD_CHANGES_ACCEPTANCE = ("llama.cpp b11434 accepts fewer drafted tokens with other requests in flight (1.54 -> "
                           "1.12 tokens a round at 1 -> 8 clients, the same replies; BENCHMARKS.md)")


def measure_served(url: str, prompts: list[list[int]], *, max_new_tokens: int, timeout: float = 900.0):
    """Greedy completions of ``prompts`` from the llama-server at ``url`` and what it says it
    accepted: drafted and accepted tokens from each answer's timings, verify steps and
    per-position acceptance from the counters' difference (--metrics)."""
    from eaglewire.engines.llamacpp.readings import NAME

    try:
        before = metrics(url)
        answers = [complete(url, p, n_predict=max_new_tokens, timeout=timeout) for p in prompts]
        after = metrics(url)
    except LlamaCppError as e:
        raise ServedError(str(e)) from e
    timings = [a.get("timings") or {} for a in answers]
    out = ServedCounts(engine=NAME, outputs=[list(a.get("tokens") or []) for a in answers],
                       draft_tokens=sum(int(t.get("draft_n", 0)) for t in timings),
                       accepted=sum(int(t.get("draft_n_accepted", 0)) for t in timings), source="mixed")
    if before is None or after is None or SPEC_DRAFTS not in after:
        raise ServedError(f"the llama-server at {url} exports no {SPEC_DRAFTS} (it runs without --metrics, or "
                          "without a draft): restart it with --metrics and -md draft.gguf --spec-type draft-eagle3")
    out.others = other_traffic(generated=(before.get(GENERATED), after.get(GENERATED)),
                               running=(before.get(RUNNING), after.get(RUNNING)), own_tokens=sum(map(len, out.outputs)),
                               requests=len(out.outputs), load_changes_acceptance=LOAD_CHANGES_ACCEPTANCE)
    out.drafts = int(after[SPEC_DRAFTS] - before.get(SPEC_DRAFTS, 0))
    start, end = _per_pos(before), _per_pos(after)
    out.accepted_per_pos = [e - (start[i] if i < len(start) else 0) for i, e in enumerate(end)]
    out.notes.append(f"drafted and accepted tokens from each answer's timings; verify steps and per-position "
                     f"acceptance from the {OTHER_TRAFFIC}")
    return out


def served_version(url: str, timeout: float = 30.0) -> str | None:
    """The build a running llama-server reports (``/props`` ``build_info``, e.g. ``b11434-1a2b3c4``: the build number
    kept, ``b11434``); None when it answers none."""
    import json
    import re

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/props", timeout=timeout) as r:
            info = json.loads(r.read().decode()).get("build_info")
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError, AttributeError):
        return None
    found = re.match(r"b?(\d+)", str(info or ""))
    return f"b{found.group(1)}" if found else None
