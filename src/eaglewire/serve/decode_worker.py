"""The decoding side of ``eaglewire serve``: ``DecodeWorker`` decodes the admitted requests (``Job``) together, in
one ``BatchEngine`` (continuous batching: a request joins the running batch between steps and leaves it when it
ends), on one thread -- under ``serve`` the thread that loaded the models, with HTTP on a thread beside it -- and
sends each its events (text deltas, then how it ended) back to the request's coroutine.

A slot is a request admitted and not finished: those decoding (at most ``max_batch``) plus those waiting; beyond
``max_queue`` slots a request gets 429 with Retry-After. A cancelled job frees its slot at once and leaves the batch
before the next step; the others go on unchanged.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Union

from eaglewire.core.generation import GenerationStats
from eaglewire.core.tokens import stop_token_ids
from eaglewire.decode.batch_engine import BatchEngine, Sequence
from eaglewire.concurrency.schedule import Schedule
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
    text: TextStream | None = None  # its text so far, from the tokens (set when it joins the batch)

    def emit(self, event: Event) -> None:
        """Hand an event to the request's coroutine (callable from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone: nobody is listening
            pass


class DecodeWorker:
    """Decodes admitted jobs together in one ``BatchEngine``, on one thread: its own (``start``) or the caller's
    (``run``; what ``serve_app`` does). Jobs join in the order they came, as the batch has room."""

    def __init__(self, decoder: SpecDecoder, max_queue: int, metrics: Metrics, *, own_thread: bool = True,
                 per_request_metrics: str = "none", max_batch: int = 16, schedule: Schedule | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.decoder, self.max_queue, self.metrics, self.max_batch = decoder, max_queue, metrics, max_batch
        self.engine = BatchEngine(decoder, schedule)
        self.per_request_metrics = per_request_metrics  # vLLM's levels: none, summary, detailed
        self.tokenizer = decoder.target.tokenizer
        self.stop_ids = set(stop_token_ids(self.tokenizer, decoder.target.model))
        self.closing = False
        self._held: set[Job] = set()  # admitted, not finished, not cancelled
        self._lock = threading.Lock()
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._running: dict[Sequence, Job] = {}  # the batch's sequences and their jobs (the decoding thread's)
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
        """Free the job's slot now; it leaves the batch before the next step. Idempotent."""
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

    # -- the decoding thread ---------------------------------------------------

    def run(self) -> None:
        """Decode admitted jobs until ``close()``, on whichever thread calls it: take in what has arrived (waiting
        for work when the batch is empty), drop what was cancelled, run one step of the batch, tell each job."""
        waiting: collections.deque[Job] = collections.deque()
        while self._take_in(waiting):
            self._drop_cancelled()
            while waiting and len(self._running) < self.max_batch:
                self._join(waiting.popleft())
            if self._running:
                self._step()
        for seq, job in list(self._running.items()):
            self._leave(seq, job, cancelled=True)

    def _take_in(self, waiting: collections.deque[Job]) -> bool:
        """Move arrived jobs to ``waiting``, blocking only when nothing is decoding or waiting; False once closed."""
        block = not self._running and not waiting
        while True:
            try:
                job = self._jobs.get(block=block)
            except queue.Empty:
                return True
            if job is None:
                return False
            waiting.append(job)
            block = False

    def _drop_cancelled(self) -> None:
        for seq, job in list(self._running.items()):
            if job.cancelled.is_set():
                self._leave(seq, job, cancelled=True)

    def _join(self, job: Job) -> None:
        """Prefill ``job`` into the batch (or count it cancelled, if its client left while it waited)."""
        if job.cancelled.is_set():
            self.metrics.observe(GenerationStats(), cancelled=True)
            return
        with self._lock:
            job.started = True
        job.text = TextStream(self.tokenizer, job.stops)
        try:
            seq = self.engine.add(job.prompt_ids, max_new_tokens=job.max_tokens, sampling=job.sampling,
                                  stop_token_ids=self.stop_ids,
                                  should_stop=job.text.stops if job.text.stops.stops else None)
        except Exception as e:  # this request cannot be decoded; the others go on
            log.exception("prefill failed")
            self._fail(job, e)
            return
        self._running[seq] = job
        self._tell(seq, job)

    def _step(self) -> None:
        """One step of the batch; a failure ends every request in it (each told why), and serving goes on."""
        try:
            advanced = self.engine.step()
        except Exception as e:
            log.exception("a batched step failed")
            for seq, job in list(self._running.items()):
                self.engine.remove(seq)
                del self._running[seq]
                self._fail(job, e)
            return
        self.metrics.observe_step(len(advanced), self.engine.last_shape is not None)
        for seq in advanced:
            self._tell(seq, self._running[seq])

    def _tell(self, seq: Sequence, job: Job) -> None:
        """Send the job the text of ``seq``'s new tokens, and how it ended once it did."""
        if delta := job.text.push(seq.new):
            job.emit(Delta(delta))
        if seq.finished:
            self._leave(seq, job, cancelled=False)

    def _leave(self, seq: Sequence, job: Job, *, cancelled: bool) -> None:
        self.engine.remove(seq)
        self._running.pop(seq, None)
        stats = seq.stats
        self.metrics.observe(stats, cancelled=cancelled)
        log.debug("%s after %d tokens: accept length %.2f, %.1f tokens/s", "cancelled" if cancelled else
                  stats.finish_reason, stats.new_tokens, stats.accept_length, stats.tokens_per_second)
        if cancelled:
            self._release(job)
            return
        if tail := job.text.finish():
            job.emit(Delta(tail))
        self._release(job)  # before the client can hear it is done and send the next request
        job.emit(Done(stats.finish_reason, stats.prompt_tokens, stats.new_tokens, seq.produced,
                      spec_decoding_metrics(stats, self.engine.max_steps, self.per_request_metrics)))

    def _fail(self, job: Job, e: Exception) -> None:
        self._release(job)
        job.emit(Failed(500, f"generation failed: {type(e).__name__}: {e}"))
