"""An SGLang server process on this CPU, behind eaglewire's engine interface (``engines/interface.py``).

``SglangServer`` runs ``python -m sglang.launch_server`` (eaglewire's venv or the user's) through
``serving/server_process.py``: its own process group, its log to a file, ready when ``/health`` answers, stopped
as a group. ``launch_args`` and ``launch_env`` are the pure halves of the launch; ``SglangRuntime`` (``RUNTIME``)
is the ``Runtime`` bench and tune drive.

Read from SGLang 0.5.23: the CPU platform is chosen by ``SGLANG_USE_CPU_ENGINE=1`` (srt/platforms/__init__.py) and
``--device cpu``; its EAGLE path on a CPU needs the ``intel_amx`` attention backend (srt/speculative/draft_utils.py
maps no other for CPU), kept on a CPU without AMX by the installer's patch (``kernels.GATE_PATCH``) when
``SGLANG_CPU_KERNELS_BUILT`` is set; its OpenMP threads are bound by ``SGLANG_CPU_OMP_THREADS_BIND`` (a CPU list
per tensor-parallel rank, "|"-joined: srt/utils/numa_utils.py). A chain of n drafted tokens is EAGLE-3 with
``--speculative-num-steps n --speculative-eagle-topk 1 --speculative-num-draft-tokens n + 1``. Per request, the
native ``/generate`` answers ``meta_info`` with ``spec_verify_ct`` and ``spec_correct_drafts_histogram`` (served.py);
``/server_info`` says its version and the speculative settings it runs with.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglewire.core.generation import GenerationStats
from eaglewire.engines.interface import (Answer, DraftTotals, ExportDraft, RunSettings, ServedFiles, Shape,
                                         needs_exporter)
from eaglewire.engines.serving.server_process import ProcessServer, ServerProcess, allowed_cpus, cpu_list, free_port
from eaglewire.engines.serving.served_counts import get_text, post_json, samples, total
from eaglewire.engines.serving.served_target import served_target
from eaglewire.engines.sglang.installation import INSTALL_HINT, Installation, SglangError, find, require
from eaglewire.engines.sglang.kernels import KEEP_AMX_ENV
from eaglewire.engines.sglang.readings import SPEC_FLAGS
from eaglewire.engines.sglang.served import SPEC_VERIFY_CALLS

ENTRYPOINT = "sglang.launch_server"
ALGORITHMS = {"eagle3": "EAGLE3"}  # draft family -> --speculative-algorithm (DFlash: not on SGLang's CPU path here)
MAX_TOTAL_TOKENS = 16384  # the KV cache's tokens: SmolLM2's in a few hundred MB, far more than a load here needs
STARTUP_TIMEOUT = 900.0  # ~40 s with a draft on 2 idle cores (the tokenizer's start is most of it)
DTYPE = "bfloat16"  # the intel_amx backend's kernels compute in bf16/fp16
SHM_ROOT = Path("/dev/shm")
SHM_ADDR = "127.0.0.1"
HEAD_SIZE_MULTIPLE = 32  # the CPU extend-attention kernel's check (sgl-kernel csrc/cpu/extend.cpp: head_size % 32)


# ------------------------------------------------------------------ the launch (pure)

def refusal(shape: Shape, family: str) -> str | None:
    """Why SGLang cannot launch ``shape`` for a ``family`` draft here (None: it can)."""
    if shape.n_max < 0:
        return f"n_max {shape.n_max} is negative"
    if shape.p_min > 0:
        return (f"SGLang's EAGLE drafts a fixed chain of --speculative-num-steps tokens with topk 1 and has no "
                f"draft-probability stop, so p-min {shape.p_min:g} cannot be launched on it (use p-min 0)")
    if not shape.plain and family not in ALGORITHMS:
        return (f"eaglewire launches SGLang with {', '.join(ALGORITHMS)} drafts here; a {family} draft runs on "
                f"SGLang's CUDA path (--speculative-algorithm DFLASH), not on its CPU one")
    return None


def head_size_refusal(config: Mapping[str, Any], what: str) -> str | None:
    """Why SGLang's CPU attention cannot run the model of ``config`` (a config.json; None: it can). Its extend
    kernel takes head sizes that are multiples of 32 and stops the server with "invalid head_size" on the first
    prompt otherwise; MLA models (``kv_lora_rank``) run other kernels and are not judged here."""
    text = config.get("text_config") or config
    if "kv_lora_rank" in text or not text.get("num_attention_heads"):
        return None
    head = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    if head % HEAD_SIZE_MULTIPLE == 0:
        return None
    return (f"{what} has attention heads of size {head}, and SGLang's CPU attention kernel takes only multiples of "
            f"{HEAD_SIZE_MULTIPLE} (sgl-kernel csrc/cpu/extend.cpp): serve a model of a real shape (SmolLM2-135M: "
            f"64), or price SGLang with --costs stated")


def speculative_args(draft: Path, shape: Shape, family: str) -> list[str]:
    """SGLang's flags for a chain of ``shape.n_max`` drafted tokens: that many draft steps of one token each and
    n + 1 tokens verified (the root and the chain)."""
    why = refusal(shape, family)
    if why or shape.plain:
        raise ValueError(why or "a plain shape has no speculative flags")
    return ["--speculative-algorithm", ALGORITHMS[family], "--speculative-draft-model-path", str(draft),
            "--speculative-num-steps", str(shape.n_max), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(shape.n_max + 1)]


def launch_args(files: ServedFiles, shape: Shape, *, port: int, host: str = "127.0.0.1", dtype: str = DTYPE,
                max_total_tokens: int = MAX_TOTAL_TOKENS, max_running: int | None = None,
                flags: Sequence[str] = ()) -> list[str]:
    """launch_server's arguments for serving ``files`` at ``shape`` on the CPU: the intel_amx backend (its EAGLE
    path's only CPU backend), metrics on, no prefix cache (every request prefills alike, as the other engines here
    run), seed 0, and the scheduler asleep while idle (``--sleep-on-idle``: awake, its event loop holds a core at 100 %
    between requests, half of a 2-core machine, measured); ``flags`` last (they override)."""
    spec: list[str] = []
    if not shape.plain:
        if files.draft is None:
            raise ValueError(f"{shape.label()} needs a draft; ServedFiles has none")
        spec = speculative_args(files.draft, shape, files.family)
    args = ["--model-path", str(files.target), "--device", "cpu", "--attention-backend", "intel_amx",
            "--dtype", dtype, "--host", host, "--port", str(port), "--random-seed", "0", "--disable-radix-cache",
            "--enable-metrics", "--max-total-tokens", str(max_total_tokens), "--sleep-on-idle", *spec]
    if max_running is not None:
        args += ["--max-running-requests", str(max_running)]
    return args + list(flags)


def shm_segments(shm_port: int, uid: int | None = None, root: Path = SHM_ROOT) -> list[Path]:
    """The shared-memory segments a server launched with ``launch_env(shm_port=...)`` made: the CPU kernels'
    all-reduce buffer per rank, ``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` (sgl-kernel
    csrc/cpu/shm.cpp), 258 MiB each, which SGLang never unlinks."""
    uid = os.getuid() if uid is None else uid
    return sorted(root.glob(f"deepspeed_allreduce_buffer_{uid}_{SHM_ADDR}_{shm_port}_*"))


def launch_env(threads: int, *, cpus: Sequence[int], base: Mapping[str, str] | None = None,
               shm_port: int | None = None) -> dict[str, str]:
    """The server's environment: ``base`` (default: this process's) with SGLang's CPU platform chosen, the
    intel_amx backend kept (``KEEP_AMX_ENV``), its OpenMP threads bound to the first ``threads`` of ``cpus``, and
    nothing fetched or reported. OMP_NUM_THREADS is removed: SGLang sizes each rank's pool from its CPU list.
    ``shm_port``: the name its all-reduce segments take (MASTER_ADDR/MASTER_PORT, which SGLang keeps where set:
    srt/distributed/bootstrap.py ``_set_shm_master_env``), so that they can be removed (``shm_segments``)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if threads > len(cpus):
        raise SglangError(f"{threads} threads asked, but this process may run on {len(cpus)} CPUs ({cpu_list(cpus)})")
    env = dict(os.environ if base is None else base)
    env.pop("OMP_NUM_THREADS", None)
    env.update({"SGLANG_USE_CPU_ENGINE": "1", KEEP_AMX_ENV: "1",
                "SGLANG_CPU_OMP_THREADS_BIND": cpu_list(sorted(cpus)[:threads]),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1"})
    if shm_port is not None:
        env.update({"MASTER_ADDR": SHM_ADDR, "MASTER_PORT": str(shm_port)})
    return env


# ------------------------------------------------------------------ a request's own account (pure)

def request_stats(*, prompt_tokens: int, tokens: Sequence[int], meta_info: Mapping[str, Any],
                  wall_seconds: float) -> GenerationStats:
    """One request's ``GenerationStats`` from SGLang's ``meta_info``: its verify steps' histogram
    (``spec_correct_drafts_histogram[j]``: steps that accepted j drafted tokens) gives the accept lengths, sorted
    (their order is not reported); every step verified ``spec_num_proposed_drafts / spec_verify_ct`` drafted
    tokens. SGLang's steps account for every completion token (``spec_verify_ct + spec_num_correct_drafts ==
    completion_tokens`` in 0.5.23's answers: its ``spec_accept_length``), which is kept as it says; tokens no step
    accounts for (a plain launch) are rounds of one after the prefill's first token. Times:
    ``first_token_latency`` (the prefill) and ``e2e_latency``, else the wall time around the request."""
    finish = meta_info.get("finish_reason") or {}
    reason = finish.get("type") if isinstance(finish, Mapping) else str(finish)
    new = len(tokens)
    stats = GenerationStats(prompt_tokens=prompt_tokens, new_tokens=new, finish_reason=reason or "length")
    histogram = [int(n) for n in meta_info.get("spec_correct_drafts_histogram") or []]
    steps = int(meta_info.get("spec_verify_ct") or 0)
    accepted = [j for j, n in enumerate(histogram) for _ in range(n)] if steps else []
    proposed = int(meta_info.get("spec_num_proposed_drafts") or 0)
    width = proposed // steps if steps else 0
    stats.accept_lengths = [a + 1 for a in accepted]
    stats.verified_lengths = [width + 1] * len(accepted)
    undrafted = max(new - 1 - sum(stats.accept_lengths), 0)
    stats.accept_lengths += [1] * undrafted
    stats.verified_lengths += [1] * undrafted
    stats.position_accepts = [sum(1 for a in accepted if a > d) for d in range(width)]
    first, e2e = meta_info.get("first_token_latency"), meta_info.get("e2e_latency")
    if first is not None and e2e is not None:
        stats.prefill_seconds = float(first)
        stats.total_seconds = float(e2e)
    else:
        stats.total_seconds = wall_seconds
    return stats


def generate_body(ids: Sequence[int], *, max_new_tokens: int, temperature: float, seed: int,
                  ignore_eos: bool = False) -> dict[str, Any]:
    """``/generate`` of the token ids ``ids``: greedy at temperature 0, else plain temperature sampling (top-k,
    top-p and min-p off, as eaglewire samples), stopping at EOS as the target says (``ignore_eos``: not)."""
    params: dict[str, Any] = {"temperature": float(temperature), "max_new_tokens": max_new_tokens,
                              "ignore_eos": ignore_eos}
    if temperature > 0:
        params.update(top_p=1.0, top_k=-1, min_p=0.0, sampling_seed=seed)
    return {"input_ids": list(ids), "sampling_params": params, "stream": False}


# ------------------------------------------------------------------ talking to it

def server_info(url: str, timeout: float = 30.0) -> dict[str, Any] | None:
    """``/server_info`` (0.5.23; ``/get_server_info`` before, deprecated there): its version and every setting it
    runs with (None where it answers neither)."""
    for route in ("/server_info", "/get_server_info"):
        text = get_text(url.rstrip("/") + route, timeout=timeout, who="SGLang server")
        try:
            info = json.loads(text) if text else None
        except ValueError:
            info = None
        if isinstance(info, dict):
            return info
    return None


def served_version(url: str) -> str | None:
    """The version a running SGLang reports (``/get_server_info``'s ``version``)."""
    info = server_info(url)
    return None if info is None else info.get("version")


def flags_from_info(info: Mapping[str, Any]) -> str:
    """``/get_server_info``'s settings -> the speculative launch flags they mean (``readings.SPEC_FLAGS`` that are
    set: booleans as bare flags, None and False left out), after ``--model-path``."""
    from shlex import quote

    parts = ["--model-path", quote(str(info["model_path"]))] if info.get("model_path") else []
    for flag in SPEC_FLAGS:
        value = info.get(flag[2:].replace("-", "_"))
        if value is None or value is False:
            continue
        parts += [flag] if value is True else [flag, quote(json.dumps(value) if isinstance(value, (dict, list))
                                                           else str(value))]
    return " ".join(parts)


def served_flags(url: str) -> str | None:
    """The launch flags a running SGLang reports it runs with (``flags_from_info``); None where it reports none."""
    info = server_info(url)
    return None if info is None else flags_from_info(info)


def generate_raw(url: str, ids: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                 ignore_eos: bool = False, timeout: float = 1800.0) -> dict[str, Any]:
    return post_json(url.rstrip("/") + "/generate",
                     generate_body(ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                   ignore_eos=ignore_eos),
                     timeout=timeout, who="SGLang server", error=SglangError, hint="")


def generate(url: str, ids: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
             timeout: float = 1800.0) -> Answer:
    """One generation from the SGLang at ``url``, with its ``GenerationStats`` (``request_stats``)."""
    start = time.perf_counter()
    answer = generate_raw(url, ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                          timeout=timeout)
    wall = time.perf_counter() - start
    tokens = [int(t) for t in answer.get("output_ids") or []]
    stats = request_stats(prompt_tokens=len(ids), tokens=tokens, meta_info=answer.get("meta_info") or {},
                          wall_seconds=wall)
    return Answer(tokens=tokens, stats=stats)


def verify_calls(url: str) -> int | None:
    """``sglang:spec_verify_calls_total`` (every finished request's verify steps); None where it has none."""
    text = get_text(url.rstrip("/") + "/metrics", timeout=30.0, who="SGLang server")
    value = total(samples(text), SPEC_VERIFY_CALLS) if text else None
    return None if value is None else int(value)


# ------------------------------------------------------------------ the process

class SglangServer(ProcessServer):
    """``with SglangServer(installation, files, shape) as server:`` SGLang serving ``files`` at ``server.url``."""

    def __init__(self, installation: Installation, files: ServedFiles, shape: Shape, *, threads: int = 2,
                 flags: Sequence[str] = (), log_path: Path | None = None, startup_timeout: float = STARTUP_TIMEOUT,
                 max_running: int | None = None, dtype: str = DTYPE) -> None:
        why = refusal(shape, files.family)
        if why:
            raise ValueError(why)
        self.installation, self.files, self.shape, self.threads = installation, files, shape, threads
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = launch_args(files, shape, port=self.port, dtype=dtype, max_running=max_running, flags=flags)
        self.shm_port = free_port()
        self.env = launch_env(threads, cpus=allowed_cpus(), shm_port=self.shm_port)
        self.process = ServerProcess([str(installation.python), "-m", ENTRYPOINT, *self.args], self.env,
                                     url=self.url, label="SGLang", error=SglangError, log_path=log_path,
                                     startup_timeout=startup_timeout, record=lambda: self.record)

    def __exit__(self, *exc: object) -> None:
        """Stopped as a group, then its all-reduce segments removed (258 MiB of /dev/shm a launch otherwise)."""
        try:
            super().__exit__(*exc)
        finally:
            for segment in shm_segments(self.shm_port):
                segment.unlink(missing_ok=True)

    @property
    def record(self) -> dict[str, Any]:
        return {"command": self.command, "version": self.installation.version, "shape": self.shape.label(),
                "family": self.files.family, "threads": self.threads,
                "cpus": self.env["SGLANG_CPU_OMP_THREADS_BIND"], "seconds_to_ready": self.seconds_to_ready,
                "log": str(self.log_path)}

    # the RunningServer protocol
    def generate(self, ids: list[int], *, max_new_tokens: int, temperature: float, seed: int) -> Answer:
        return generate(self.url, ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)

    def complete(self, ids: list[int], *, max_new_tokens: int, temperature: float, seed: int,
                 ignore_eos: bool = False) -> list[int]:
        answer = generate_raw(self.url, ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                              ignore_eos=ignore_eos)
        return [int(t) for t in answer.get("output_ids") or []]

    def spec_rounds(self) -> int | None:
        return None if self.shape.plain else verify_calls(self.url)

    def draft_totals(self) -> DraftTotals | None:
        """Verify steps that checked a draft (``sglang:spec_verify_calls_total``, counted as requests finish);
        SGLang times no drafting apart (None). None for a plain launch."""
        rounds = self.spec_rounds()
        return None if rounds is None else DraftTotals(rounds=rounds, draft_seconds=None)


# ------------------------------------------------------------------ the Runtime

@dataclass
class SglangRuntime:
    """SGLang (0.5.23, CPU kernels built here) as bench and tune run it."""

    label: str = "SGLang"
    install_hint: str = INSTALL_HINT
    _found: dict[str | None, Installation] = field(default_factory=dict, repr=False)

    def _installation(self, settings: RunSettings) -> Installation:
        if settings.install not in self._found:
            self._found[settings.install] = require(settings.install)
        return self._found[settings.install]

    def available(self, settings: RunSettings) -> str | None:
        try:
            found = find(settings.install)
        except SglangError as e:
            return str(e)
        return None if found is not None else f"SGLang is not installed: {INSTALL_HINT}"

    def version(self, settings: RunSettings) -> str:
        return self._installation(settings).version or "unknown"

    def files(self, draft_dir: str | None, target: str, work_dir: Path, settings: RunSettings, *,
              export: ExportDraft | None = None, allow: frozenset[str] = frozenset()) -> ServedFiles:
        target_dir = served_target(settings.target_file or target, "SGLang", SglangError)
        _refuse_head_size(target_dir / "config.json", f"the target {target_dir}")
        if settings.draft_file:
            return ServedFiles(target=target_dir, draft=Path(settings.draft_file).expanduser().resolve())
        if draft_dir is None:
            return ServedFiles(target=target_dir, draft=None)
        out = Path(work_dir) / "sglang-export"
        needs_exporter(export)(draft_dir, "sglang", out, allow=allow)
        _refuse_head_size(out / "config.json", f"the draft {draft_dir}")
        return ServedFiles(target=target_dir, draft=out)

    def can_run(self, shape: Shape, family: str) -> str | None:
        return refusal(shape, family)

    def draft_steps(self, n_max: int, family: str) -> int:
        """One draft forward per drafted token (a chain, topk 1)."""
        return n_max

    def serve(self, files: ServedFiles, shape: Shape, settings: RunSettings, *, log_path: Path,
              draft_timing: bool = False) -> SglangServer:
        """SGLang at ``shape``, threads pinned, up to ``settings.slots`` requests decoded together.
        ``draft_timing`` changes nothing: SGLang times no drafting apart."""
        return SglangServer(self._installation(settings), files, shape, threads=settings.threads,
                            flags=settings.flags, log_path=log_path, max_running=max(settings.slots, 1))


def _refuse_head_size(config_path: Path, what: str) -> None:
    """Raise before a launch that SGLang would stop at its first prompt (see ``head_size_refusal``)."""
    if config_path.is_file():
        why = head_size_refusal(json.loads(config_path.read_text()), what)
        if why:
            raise SglangError(why)


RUNTIME = SglangRuntime()
