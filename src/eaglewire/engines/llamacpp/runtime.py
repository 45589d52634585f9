"""llama.cpp as an engine that runs here (``interface.Runtime``): the GGUFs it serves, a llama-server launched
at a chain shape, each answer's own counters as ``GenerationStats``, and the drafting totals its log prints.
bench and tune talk to ``RUNTIME`` only."""

from __future__ import annotations

import re
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator

from eaglewire.core.generation import GenerationStats
from eaglewire.engines.interface import (Answer, DraftTotals, ExportDraft, RunSettings, ServedFiles, Shape,
                                         needs_exporter)
from eaglewire.engines.llamacpp.failure import LlamaCppError
from eaglewire.engines.llamacpp.installation import BUILD, INSTALL_HINT, find_server, require_server, server_build
from eaglewire.engines.llamacpp.readings import NAME
from eaglewire.engines.llamacpp.server import LlamaServer, chain_config, complete, metrics, plain_server_config

WARMUP_TOKENS = 32  # the first request of a fresh llama-server runs several times slower
STATS_VERBOSITY = ["-lv", "4"]  # the level at which llama-server prints its drafting statistics
_STATS = re.compile(r"draft-(?:eagle3|dflash): #calls\(b,g,a\) =\s*(\d+)\s+(\d+)\s+(\d+).*?dur\(b,g,a\) = ([\d.]+), ([\d.]+), ([\d.]+) ms")
SPEC_DRAFTS = "spec_decode_num_drafts_total"


def draft_stats(log_text: str) -> tuple[int, float] | None:
    """llama-server's last cumulative EAGLE-3 or DFlash statistics line (``-lv 4``) -> (draft calls, draft ms):
    the time its ``common_speculative_draft`` spent drafting, one call per round."""
    found = _STATS.findall(log_text)
    if not found:
        return None
    last = found[-1]
    return int(last[1]), float(last[4])


def answer_stats(answer: dict, verify_steps: int | None, num_steps: int):
    """GenerationStats of one llama-server answer, from its own counters.

    llama.cpp reports per request only the drafted and accepted totals (``timings.draft_n``,
    ``draft_n_accepted``); ``verify_steps`` (from /metrics) gives the rounds, else every round is
    taken to draft the full chain. The rounds' accept lengths are spread evenly, so sums and
    means (τ) are llama.cpp's own, per-round detail is not. Plain: one pass per token after
    the first.
    """
    t = answer.get("timings") or {}
    tokens = list(answer.get("tokens") or [])
    drafted, accepted = int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0))
    if drafted:
        rounds = verify_steps if verify_steps else -(-drafted // max(num_steps, 1))
        base, extra = divmod(accepted, max(rounds, 1))
        accept = [1 + base + (1 if r < extra else 0) for r in range(rounds)]  # sums to rounds + accepted
        vbase, vextra = divmod(drafted, max(rounds, 1))
        verified = [1 + vbase + (1 if r < vextra else 0) for r in range(rounds)]
    else:
        accept = verified = [1] * max(len(tokens) - 1, 0)
    prompt_s, gen_s = float(t.get("prompt_ms", 0.0)) / 1e3, float(t.get("predicted_ms", 0.0)) / 1e3
    stopped = answer.get("stop_type") in ("eos", "word") or bool(answer.get("stopped_eos"))
    return GenerationStats(prompt_tokens=int(t.get("prompt_n", 0)), new_tokens=len(tokens), accept_lengths=accept,
                           verified_lengths=verified, prefill_seconds=prompt_s, total_seconds=prompt_s + gen_s,
                           finish_reason="stop" if stopped else "length")


class RunningLlamaServer:
    """One launched llama-server (``RunningServer``): greedy or sampled completions with no prompt cache, each
    with its counters; ``draft_totals`` reads the statistics its log prints (launched with ``draft_timing``)."""

    def __init__(self, server: LlamaServer, shape: Shape) -> None:
        self.server, self.shape, self.url = server, shape, server.url
        self.requests = 0

    def generate(self, ids: list[int], *, max_new_tokens: int, temperature: float, seed: int) -> Answer:
        before = metrics(self.url)
        answer = complete(self.url, ids, n_predict=max_new_tokens, temperature=temperature, seed=seed)
        after = metrics(self.url)
        self.requests += 1
        steps = int(after[SPEC_DRAFTS] - before[SPEC_DRAFTS]) if before and after and SPEC_DRAFTS in before else None
        return Answer(list(answer.get("tokens") or []), answer_stats(answer, steps, self.shape.n_max))

    def complete(self, ids: list[int], *, max_new_tokens: int, temperature: float, seed: int,
                 ignore_eos: bool = False) -> list[int]:
        answer = complete(self.url, ids, n_predict=max_new_tokens, temperature=temperature, seed=seed,
                          ignore_eos=ignore_eos)
        return list(answer.get("tokens") or [])

    def spec_rounds(self) -> int | None:
        if self.shape.plain:
            return None
        counts = metrics(self.url)
        return None if not counts or SPEC_DRAFTS not in counts else int(counts[SPEC_DRAFTS])

    def draft_totals(self, timeout: float = 10.0) -> DraftTotals | None:
        """The statistics once the last request's line is in the log (written as the slot is released, around
        the answer); None for a plain launch or without them."""
        if self.shape.plain:
            return None
        deadline = time.monotonic() + timeout
        while True:
            text = self.server.log_path.read_text(errors="replace")
            if len(_STATS.findall(text)) >= self.requests or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        found = draft_stats(text)
        return None if found is None else DraftTotals(rounds=found[0], draft_seconds=found[1] / 1e3)


def launch_config(files: ServedFiles, shape: Shape, settings: RunSettings, *, draft_timing: bool = False):
    """The llama-server launch of ``shape``: a greedy chain of n-max tokens with n-min 0 (``--spec-type`` once, the
    draft family's: llama.cpp keeps every type given, so a second would run both drafts), ``settings.flags`` on
    every launch; ``draft_timing``: at ``-lv 4``, where it prints its drafting statistics."""
    if not shape.plain and files.draft is None:
        raise LlamaCppError(f"a {shape.label()} launch needs a draft GGUF")
    extra = [*settings.flags, *(STATS_VERBOSITY if draft_timing and not shape.plain else [])]
    if shape.plain and settings.slots > 1:  # llama-server splits -c over its slots
        return plain_server_config(files.target, slots=settings.slots, threads=settings.threads,
                                   ctx_per_slot=settings.ctx_per_slot, extra=extra)
    config = chain_config(files.target, files.draft, threads=settings.threads, n_max=shape.n_max, p_min=shape.p_min,
                          extra=extra, family=files.family)
    return replace(config, slots=settings.slots, ctx_size=max(config.ctx_size, settings.ctx_per_slot) * settings.slots)


class LlamaCppRuntime:
    label = "llama.cpp"
    install_hint = INSTALL_HINT

    def available(self, settings: RunSettings) -> str | None:
        return None if find_server(settings.install) else f"llama.cpp is not installed: {INSTALL_HINT}"

    def version(self, settings: RunSettings) -> str:
        return server_build(require_server(settings.install)) or BUILD

    def files(self, draft_dir: str | None, target: str, work_dir: Path, settings: RunSettings, *,
              export: ExportDraft | None = None, allow: frozenset[str] = frozenset()) -> ServedFiles:
        """The GGUFs given (``settings.target_file`` / ``draft_file``), else exported into ``work_dir``/llamacpp-export
        (the target in f32, the draft with llama.cpp's converter); no draft: the target alone."""
        from eaglewire.model.checkpoint import read_draft

        family = read_draft(draft_dir).family if draft_dir else "eagle3"
        given_target = Path(settings.target_file) if settings.target_file else None
        given_draft = Path(settings.draft_file) if settings.draft_file else None
        if given_target and (given_draft or draft_dir is None):
            return ServedFiles(given_target, given_draft, family)
        if draft_dir is None:
            from eaglewire.engines.llamacpp.gguf import target_architecture, target_gguf
            from eaglewire.engines.llamacpp.installation import require_tree
            from eaglewire.model.target import resolve_target_path

            target_dir = resolve_target_path(target)
            return ServedFiles(target_gguf(target_dir, target_architecture(target_dir), "f32",
                                           tree=require_tree(settings.install)), None, family)
        export_draft = needs_exporter(export)
        out = Path(work_dir) / "llamacpp-export"
        report = export_draft(draft_dir, NAME, out, target_outtype="f32", llamacpp_dir=settings.install,
                              threads=settings.threads, allow=set(allow))
        draft = given_draft or out / next(f for f in report.files if f.startswith("draft-"))
        return ServedFiles(given_target or out / "target-f32.gguf", draft, family)

    def can_run(self, shape: Shape, family: str) -> str | None:
        return None  # chains of any length, with or without a probability stop, for both families

    def draft_steps(self, n_max: int, family: str) -> int:
        return 1 if family == "dflash" else n_max  # a DFlash block is one pass; EAGLE-3 runs one forward a token

    @contextmanager
    def serve(self, files: ServedFiles, shape: Shape, settings: RunSettings, *, log_path: Path,
              draft_timing: bool = False) -> Iterator[RunningLlamaServer]:
        """llama-server at ``shape`` (greedy chains: n-min 0), threads pinned; ``draft_timing``: at the log level
        that prints its drafting statistics (``draft_totals``)."""
        config = launch_config(files, shape, settings, draft_timing=draft_timing)
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with LlamaServer(require_server(settings.install), config, log_path=Path(log_path)) as server:
            yield RunningLlamaServer(server, shape)


RUNTIME = LlamaCppRuntime()
