"""The decoding side of ``eaglewire serve``: ``DecodeWorker`` runs admitted requests (``Job``) through
one ``SpecDecoder``, one at a time (a decoder holds one sequence), in order, on one thread — under
``serve`` the thread that loaded the models, with HTTP on a thread beside it — and sends each its
events (text deltas, then how it ended) back to the request's coroutine. A slot is a request admitted
and not finished: the one being decoded plus those waiting; beyond ``max_queue`` slots a request gets
429 with Retry-After. A cancelled job frees its slot at once and its generation stops after the
current round.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Union

from eaglewire.core.generation import GenerationStats
from eaglewire.core.tokens import stop_token_ids
from eaglewire.decode.spec_decoder import SpecDecoder
from eaglewire.decode.sampling import SamplingParams
from eaglewire.decode.text import TextStream
from eaglewire.serve.api_errors import APIError
from eaglewire.serve.metrics import Metrics
from eaglewire.serve.response_bodies import PerRequestMetrics, spec_decoding_metrics

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1  # a 429's hint: slots free as requests finish, typically within seconds


@dataclass
class Delta:
    text: str


@dataclass
class Done:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int] = field(default_factory=list)  # the generated ids (return_token_ids)
    metrics: PerRequestMetrics | None = None  # speculative acceptance, with --per-request-spec-decode-metrics


@dataclass
class Failed:
    status: int
    message: str
    type: str = "server_error"
    code: str | None = None


Event = Union[Delta, Done, Failed]


@dataclass(eq=False)
class Job:
    """One admitted request: what to generate and the queue its events go back through."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    started: bool = False

    def emit(self, event: Event) -> None:
        """Hand an event to the request's coroutine (callable from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone: nobody is listening
            pass


class DecodeWorker:
    """Runs admitted jobs through the decoder, one at a time, in order, on one thread: its own
    (``start``) or the caller's (``run``; what ``serve_app`` does)."""

    def __init__(self, decoder: SpecDecoder, max_queue: int, metrics: Metrics, *, own_thread: bool = True,
                 per_request_metrics: str = "none") -> None:
        self.decoder, self.max_queue, self.metrics = decoder, max_queue, metrics
        self.per_request_metrics = per_request_metrics  # vLLM's levels: none, summary, detailed
        self.tokenizer = decoder.target.tokenizer
        self.stop_ids = set(stop_token_ids(self.tokenizer, decoder.target.model))
        self.closing = False
        self._held: set[Job] = set()  # admitted, not finished, not cancelled
        self._lock = threading.Lock()
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        # own_thread False: the caller runs ``run()`` on the thread that loaded the models (serve_app)
        self._thread = threading.Thread(target=self.run, name="eaglewire-decode", daemon=True) if own_thread else None

    def start(self) -> None:
        """Start the decoding thread (once; later calls, or a worker whose caller runs it, do nothing)."""
        if self._thread is not None and self._thread.ident is None:
            self._thread.start()

    def counts(self) -> tuple[int, int]:
        """(waiting, running) admitted jobs."""
        with self._lock:
            running = sum(j.started for j in self._held)
            return len(self._held) - running, running

    def submit(self, job: Job) -> None:
        """Admit ``job`` or raise APIError 429 (all slots taken) / 503 (shutting down)."""
        self.start()  # in case the app runs without its lifespan
        with self._lock:
            if self.closing:
                raise APIError(503, "the server is shutting down; retry on another server", type="server_error",
                               code="shutting_down")
            if len(self._held) >= self.max_queue:
                raise APIError(429, f"the server is busy: {len(self._held)} requests are in flight, the most it "
                               f"holds (--max-queue {self.max_queue}); retry later", type="rate_limit_error",
                               code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
            self._held.add(job)
        self._jobs.put(job)

    def cancel(self, job: Job) -> None:
        """Free the job's slot now; the worker stops it after the current round. Idempotent."""
        job.cancelled.set()
        self._release(job)

    def _release(self, job: Job) -> None:
        with self._lock:
            self._held.discard(job)

    def end_all(self, message: str) -> None:
        """End every admitted job now: its client is told ``message`` (503) and its slot freed."""
        with self._lock:
            held = list(self._held)
        for job in held:
            job.emit(Failed(503, message, "server_error", "shutting_down"))
            self.cancel(job)

    def close(self, timeout: float = 10.0) -> None:
        """Refuse new jobs, tell the admitted ones, stop the thread (waiting at most ``timeout``)."""
        with self._lock:
            self.closing = True
        self.end_all("the server shut down before this request finished")
        self._jobs.put(None)
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)

    def run(self) -> None:
        """Decode admitted jobs in order until ``close()``, on whichever thread calls it."""
        while (job := self._jobs.get()) is not None:
            if job.cancelled.is_set():  # its client left while it waited
                self.metrics.observe(GenerationStats(), cancelled=True)
                continue
            with self._lock:
                job.started = True
            try:
                self._generate(job)
            except Exception as e:  # decoding failed on this request; keep serving the next
                log.exception("generation failed")
                self._release(job)
                job.emit(Failed(500, f"generation failed: {type(e).__name__}: {e}"))
            finally:
                self._release(job)

    def _generate(self, job: Job) -> None:
        text, produced = TextStream(self.tokenizer, job.stops), []
        rounds = self.decoder.stream(job.prompt_ids, max_new_tokens=job.max_tokens, sampling=job.sampling,
                                     stop_token_ids=self.stop_ids, should_stop=text.stops if text.stops.stops else None)
        try:
            for tokens in rounds:
                if job.cancelled.is_set():
                    break
                produced += tokens
                if delta := text.push(tokens):
                    job.emit(Delta(delta))
        finally:
            rounds.close()
        stats, cancelled = self.decoder.stats, job.cancelled.is_set()
        self.metrics.observe(stats, cancelled=cancelled)
        log.debug("%s after %d tokens: accept length %.2f, %.1f tokens/s", "cancelled" if cancelled else
                  stats.finish_reason, stats.new_tokens, stats.accept_length, stats.tokens_per_second)
        if cancelled:
            return
        if tail := text.finish():
            job.emit(Delta(tail))
        self._release(job)  # before the client can hear it is done and send the next request
        steps = self.decoder.spec.num_steps if self.decoder.drafter is not None else 0
        job.emit(Done(stats.finish_reason, stats.prompt_tokens, stats.new_tokens, produced,
                      spec_decoding_metrics(stats, steps, self.per_request_metrics)))
