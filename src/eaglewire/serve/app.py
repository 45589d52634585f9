"""``eaglewire serve``: an OpenAI-compatible HTTP server in front of one ``SpecDecoder``.

Request bodies are size-checked before anything parses them (413), validated on the event loop
and tokenized off it (one tokenizer thread; a prompt that cannot fit the context is refused before
tokenizing), then wait in a bounded queue for the engine, which decodes them one at a time (a
decoder holds one sequence) on one thread — under ``serve`` the thread that loaded the models,
with HTTP on a thread beside it — and sends text deltas back to the request's coroutine. A slot
is a request admitted and not finished: the one being decoded plus those waiting; beyond
``max_queue`` slots a request gets 429 with Retry-After. A client that goes away frees its slot
at once and its generation stops after the current round. On shutdown (``Server``) requests get
``graceful_timeout`` seconds; the app then ends those still running (a stream with an error event
and [DONE]) rather than leave uvicorn to cut them off. Routes: POST /v1/chat/completions, POST
/v1/completions, GET /v1/models, GET /health, GET /metrics (Prometheus text, prometheus_client;
its speculative counters are vLLM 0.33.0's names under the ``eaglewire_`` prefix, so one reader
serves both, and ``--per-request-spec-decode-metrics`` puts vLLM's per-request
``metrics.speculative_decoding`` in each whole answer: ``doctor --engine-url`` reads either).
With an API key every /v1 route, and /metrics unless ``metrics_public``, needs ``Authorization:
Bearer``. Bodies must be ``application/json`` (415 otherwise) and arrive within
``request_timeout`` seconds (408 otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import queue
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import AsyncIterator, Union

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from eaglewire.core.generation import GenerationStats
from eaglewire.decode.engine import SpecConfig, SpecDecoder
from eaglewire.decode.sampling import SamplingParams
from eaglewire.decode.text import TextStream
from eaglewire.core.precision import DECODE_DTYPE_HELP, DTYPE_CHOICES
from eaglewire.decode.load import load_decoder
from eaglewire.serve.schemas import (APIError, AssistantMessage, BearerAuth, ChatChoice, ChatChunkChoice,
                                      ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatDelta,
                                      Completion, CompletionChoice, CompletionChunk, CompletionRequest,
                                      CountRequests, LimitBody, Metrics, PER_REQUEST_LEVELS, PerRequestMetrics,
                                      chat_prompt_ids, completion_prompt_ids, error_body, max_token_chars, new_id,
                                      parse_body, spec_decoding_metrics, token_budget, usage, validation_error)
from eaglewire.core.tokens import stop_token_ids

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25  # how often a waiting request checks that its client is still there
MAX_REQUEST_BYTES = 4 << 20  # a full 128k-token context of text is ~0.5 MB of JSON; 8k (SmolLM2) ~40 kB
REQUEST_TIMEOUT_SECONDS = 30.0  # 4 MB at a slow 1 Mbit/s; a client that sends less than it declared waits no longer
RETRY_AFTER_SECONDS = 1  # a 429's hint: slots free as requests finish, typically within seconds
CUT_MARGIN_SECONDS = 1.0  # uvicorn cancels what is still running this long after the app ended it
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


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
        steps = self.decoder.spec.num_steps if self.decoder.draft is not None else 0
        job.emit(Done(stats.finish_reason, stats.prompt_tokens, stats.new_tokens, produced,
                      spec_decoding_metrics(stats, steps, self.per_request_metrics)))


# -- the HTTP side -------------------------------------------------------------

async def _events(job: Job, request: Request) -> AsyncIterator[Event]:
    """The job's events up to Done or Failed; stops early (no more events) if the client left."""
    while True:
        try:
            event = await asyncio.wait_for(job.events.get(), POLL_SECONDS)
        except asyncio.TimeoutError:
            event = None
        if await request.is_disconnected():
            return
        if event is not None:
            yield event
            if not isinstance(event, Delta):
                return


def _sse(data: BaseModel | dict | str) -> str:
    if isinstance(data, BaseModel):
        data = data.model_dump_json()
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class _Service:
    """What the routes do: parse and tokenize a request, admit it, then answer it whole or as a
    stream of chunks."""

    def __init__(self, decoder: SpecDecoder, model_name: str, max_context: int, worker: DecodeWorker) -> None:
        self.target, self.model_name, self.max_context, self.worker = decoder.target, model_name, max_context, worker
        self.token_chars = max_token_chars(self.target.tokenizer)
        # One thread: a fast tokenizer used from two threads at once can fail ("Already borrowed").
        self.tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="eaglewire-tokenize")

    def check_model(self, req) -> None:
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"model {req.model!r} is not served here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def tokenize(self, encode, *args) -> list[int]:
        """``encode(tokenizer, *args)`` on the tokenizer thread: a long prompt does not stall the event loop."""
        call = partial(encode, self.target.tokenizer, *args)
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, call)

    def admit(self, req, prompt_ids: list[int], prompt_param: str, tokens_param: str) -> Job:
        """Check the request against the context, and queue it (APIError if it can't be)."""
        max_tokens = token_budget(prompt_ids, req.requested_tokens(), self.max_context, prompt_param, tokens_param,
                                  req.default_tokens)
        sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed)
        job = Job(prompt_ids, max_tokens, sampling, req.stop_list(), asyncio.get_running_loop())
        self.worker.submit(job)
        return job

    async def collect(self, job: Job, request: Request) -> tuple[str, Done]:
        """The whole text and how it ended; the job is cancelled if the client leaves first."""
        parts: list[str] = []
        try:
            async for event in _events(job, request):
                if isinstance(event, Failed):
                    raise APIError(event.status, event.message, type=event.type, code=event.code)
                if isinstance(event, Done):
                    return "".join(parts), event
                parts.append(event.text)
            raise APIError(499, "the client closed the connection")  # nobody reads this
        finally:
            self.worker.cancel(job)

    def _chunk(self, rid: str, chat: bool, text: str | None = None, finish_reason: str | None = None, *,
               role: bool = False) -> BaseModel:
        if chat:
            delta = ChatDelta(role="assistant", content="") if role else ChatDelta(content=text)
            return ChatCompletionChunk(id=rid, model=self.model_name,
                                       choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)])
        return CompletionChunk(id=rid, model=self.model_name,
                               choices=[CompletionChoice(text=text or "", finish_reason=finish_reason)])

    async def stream(self, job: Job, request: Request, rid: str, chat: bool,
                     include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: a chunk per text delta, one with the finish reason (or an error event), then [DONE]."""
        try:
            if chat:
                yield _sse(self._chunk(rid, chat, role=True))
            async for event in _events(job, request):
                if isinstance(event, Delta):
                    yield _sse(self._chunk(rid, chat, event.text))
                elif isinstance(event, Failed):
                    yield _sse(error_body(event.message, type=event.type, code=event.code))
                else:
                    yield _sse(self._chunk(rid, chat, None, event.finish_reason))
                    if include_usage:
                        use = usage(event.prompt_tokens, event.completion_tokens)
                        last = ChatCompletionChunk if chat else CompletionChunk
                        yield _sse(last(id=rid, model=self.model_name, choices=[], usage=use))
            yield _sse("[DONE]")
        finally:  # also when a client left mid-stream (this task is cancelled)
            self.worker.cancel(job)

    async def answer(self, req, job: Job, request: Request, chat: bool):
        rid = new_id("chatcmpl" if chat else "cmpl")
        if req.stream:
            return StreamingResponse(self.stream(job, request, rid, chat, req.include_usage),
                                     media_type="text/event-stream")
        text, done = await self.collect(job, request)
        use = usage(done.prompt_tokens, done.completion_tokens)
        if chat:
            choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=done.finish_reason)
            return JSONResponse(ChatCompletion(id=rid, model=self.model_name, choices=[choice], usage=use,
                                               metrics=done.metrics).model_dump())
        ids = done.token_ids if req.return_token_ids else None
        choice = CompletionChoice(text=text, finish_reason=done.finish_reason, token_ids=ids)
        return JSONResponse(Completion(id=rid, model=self.model_name, choices=[choice], usage=use,
                                       metrics=done.metrics).model_dump())

    async def chat(self, request: Request):
        req = parse_body(ChatCompletionRequest, await request.body(), request.headers.get("content-type"))
        self.check_model(req)
        ids = await self.tokenize(chat_prompt_ids, req, self.max_context, self.token_chars)
        tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        job = self.admit(req, ids, "messages", tokens_param)
        return await self.answer(req, job, request, chat=True)

    async def complete(self, request: Request):
        req = parse_body(CompletionRequest, await request.body(), request.headers.get("content-type"))
        self.check_model(req)
        ids = await self.tokenize(completion_prompt_ids, req, self.target.vocab_size, self.max_context,
                                  self.token_chars)
        job = self.admit(req, ids, "prompt", "max_tokens")
        return await self.answer(req, job, request, chat=False)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-style body; validation errors as 400, not FastAPI's 422."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        err = validation_error(list(e.errors()))
        return JSONResponse(err.body(), err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = f"{e.detail}: {request.method} {request.url.path}"
        if e.status_code in (404, 405):
            message += f"; this server has {', '.join(ROUTES)}"
        return JSONResponse(error_body(message), e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", type="server_error"), 500)


def _document_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Put the request models in /openapi.json (the routes parse their bodies themselves)."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            spec = generate()  # caches itself in app.openapi_schema
            components = spec.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(schema.pop("$defs", {}))
                components[model.__name__] = schema
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                spec["paths"][path]["post"]["requestBody"] = {"required": True,
                                                              "content": {"application/json": {"schema": ref}}}
        return app.openapi_schema

    app.openapi = openapi


def create_app(decoder: SpecDecoder, *, model_name: str, max_queue: int = 64, api_key: str | None = None,
               max_context: int | None = None, max_request_bytes: int = MAX_REQUEST_BYTES,
               request_timeout: float | None = REQUEST_TIMEOUT_SECONDS, metrics_public: bool = False,
               engine_thread: bool = True, per_request_metrics: str = "none") -> FastAPI:
    """The FastAPI app serving ``decoder`` as ``model_name``; its engine thread lives with the app's lifespan.

    ``max_queue`` bounds the requests in flight (decoding + waiting); ``max_context`` (prompt +
    generated tokens) defaults to the target's max_position_embeddings; a request body over
    ``max_request_bytes`` gets 413, one not received within ``request_timeout`` seconds 408 (None:
    no limit). With ``api_key``, /metrics needs it too unless ``metrics_public``. ``engine_thread=False`` starts no engine thread: ``serve_app``
    runs the engine on the thread that loaded the models. ``per_request_metrics`` (vLLM's
    --per-request-spec-decode-metrics levels: none, summary, detailed) puts each answer's
    speculative acceptance in its ``metrics.speculative_decoding``, as vLLM 0.33.0 does.
    """
    if per_request_metrics not in PER_REQUEST_LEVELS:
        raise ValueError(f"per_request_metrics must be one of {PER_REQUEST_LEVELS}, got {per_request_metrics!r}")
    if max_queue < 1:
        raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    if request_timeout is not None and request_timeout <= 0:
        raise ValueError(f"request_timeout must be > 0 seconds (or None: no limit), got {request_timeout}")
    if decoder.target.tokenizer is None:
        raise ValueError("the target has no tokenizer; load it with eaglewire.model.target.load_target")
    max_context = max_context or int(decoder.target.text_config.max_position_embeddings)
    metrics = Metrics(decoder.spec.num_steps + 1 if decoder.draft is not None else 1, ROUTES)
    worker = DecodeWorker(decoder, max_queue, metrics, own_thread=engine_thread,
                          per_request_metrics=per_request_metrics)
    service = _Service(decoder, model_name, max_context, worker)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        log.info("serving %s (context %d tokens, %s)", model_name, max_context,
                 "speculative" if decoder.draft is not None else "no draft")
        yield
        worker.close()
        service.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="eaglewire", lifespan=lifespan)
    app.state.worker, app.state.metrics = worker, metrics
    app.add_middleware(LimitBody, max_bytes=max_request_bytes, timeout=request_timeout)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key, metrics_public=metrics_public)  # before the body is read
    app.add_middleware(CountRequests, metrics=metrics)  # outermost: counts the 401s and 413s too
    _add_error_handlers(app)
    app.post("/v1/chat/completions")(service.chat)
    app.post("/v1/completions")(service.complete)
    _document_bodies(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest})

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "eaglewire",
                "max_model_len": max_context}
        return {"object": "list", "data": [card]}

    @app.get("/version")
    async def version():
        from eaglewire import __version__

        return {"version": __version__}  # what vLLM answers at /version: the doctor asks which engine it judges

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "shutting down"}, 503) if worker.closing else {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        waiting, running = worker.counts()
        return Response(metrics.render(waiting=waiting, running=running), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    return app


class Server(uvicorn.Server):
    """uvicorn's server for a ``create_app`` app. When shutdown begins, requests get the config's
    ``timeout_graceful_shutdown`` seconds; then the app ends those still running (a stream with an
    error event and [DONE], a whole answer with 503). uvicorn's own deadline comes a margin later,
    as a last resort: it cancels responses mid-way (the client loses the connection, the log a traceback)."""

    def __init__(self, config: uvicorn.Config) -> None:
        self.interrupted = False  # set by serve_app on SIGINT (Ctrl-C): the command then exits 130
        self.graceful_timeout = config.timeout_graceful_shutdown
        if self.graceful_timeout is not None:
            config.timeout_graceful_shutdown = self.graceful_timeout + CUT_MARGIN_SECONDS
        super().__init__(config)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.graceful_timeout is not None:
            worker: DecodeWorker = self.config.app.state.worker
            message = (f"the server shut down before this request finished (--graceful-timeout "
                       f"{self.graceful_timeout:g} s)")
            asyncio.get_running_loop().call_later(self.graceful_timeout, worker.end_all, message)
        await super().shutdown(sockets)


# -- the command ---------------------------------------------------------------

@dataclass(kw_only=True)
class ServeConfig:
    target: str = field(metadata={"help": "preset name, HF directory or .gguf file of the target"})
    draft: str | None = field(default=None, metadata={"help": "draft directory (none: plain decoding)"})
    spec: SpecConfig = field(default_factory=SpecConfig)  # its fields are the --speculative-* flags
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = 8000
    max_queue: int = field(default=64, metadata={"help": "most requests in flight (decoding + waiting); 429 beyond"})
    api_key: str | None = field(default=None, metadata={
        "help": "require 'Authorization: Bearer KEY' on /v1 and /metrics"})
    metrics_public: bool = field(default=False, metadata={"help": "serve /metrics without the --api-key"})
    max_context: int | None = field(default=None, metadata={
        "help": "prompt + generated tokens per request (default: the target's max_position_embeddings)"})
    max_request_bytes: int = field(default=MAX_REQUEST_BYTES, metadata={
        "help": "largest request body accepted, in bytes; 413 beyond, before it is parsed"})
    request_timeout: float = field(default=REQUEST_TIMEOUT_SECONDS, metadata={
        "help": "seconds a request body may take to arrive; 408 beyond"})
    device: str = "auto"
    dtype: str = field(default="auto", metadata={"choices": DTYPE_CHOICES, "help": DECODE_DTYPE_HELP})
    graceful_timeout: float = field(default=30.0, metadata={
        "help": "seconds in-flight requests get to finish on shutdown"})
    per_request_spec_decode_metrics: str = field(default="none", metadata={
        "choices": PER_REQUEST_LEVELS, "help": "each whole answer's speculative acceptance in its "
        "metrics.speculative_decoding, as vLLM's flag of this name: summary, or detailed (per verify step too)"})

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_queue < 1:
            raise ValueError(f"--max-queue must be >= 1, got {self.max_queue}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"--max-context must be >= 2, got {self.max_context}")
        if self.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be >= 1, got {self.max_request_bytes}")
        if self.request_timeout <= 0:
            raise ValueError(f"--request-timeout must be > 0 seconds, got {self.request_timeout}")
        if self.graceful_timeout < 0:
            raise ValueError(f"--graceful-timeout must be >= 0 seconds, got {self.graceful_timeout}")


def serve_app(server: Server, sockets: list[socket.socket] | None = None) -> bool:
    """Serve the server's app (made with ``engine_thread=False``) until SIGINT/SIGTERM: HTTP on a
    thread of its own, the engine on the calling thread, which should be the one that loaded the models.
    Returns whether the server started (False: e.g. the port was taken; uvicorn logged why).

    Why the engine must not move to a thread of its own: PyTorch's OpenMP runtime (libgomp) keeps
    a pool of worker threads per thread that runs parallel work, and the loading thread already has
    one. A second pool puts more threads than cores under libgomp, which then stops spinning
    between parallel regions, so every small GEMM of a decode step waits for its workers to wake:
    on 2 cores a one-row 576x1536 GEMM takes 2-3x as long on a second thread as on the first
    (benchmarks/engine_thread.py), and speculative serving was 54.8 ms/token instead of 40.3.
    """
    worker: DecodeWorker = server.config.app.state.worker
    on_main = threading.current_thread() is threading.main_thread()

    def on_signal(sig: int, frame) -> None:
        if server.force_exit:  # a third Ctrl-C: stop now, even in the middle of a long prefill
            raise KeyboardInterrupt
        server.interrupted = server.interrupted or sig == signal.SIGINT
        server.handle_exit(sig, frame)  # graceful shutdown; a second SIGINT cuts the grace period

    # uvicorn listens for signals only on the main thread: catch them here and let it shut down
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)} if on_main else {}

    def http() -> None:
        try:
            server.run(sockets=sockets)
        finally:  # however HTTP ended (shutdown, a port in use), the engine loop ends with it
            worker.close()

    thread = threading.Thread(target=http, name="eaglewire-http", daemon=True)
    thread.start()
    try:
        worker.run()
        thread.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return server.started


def serve(config: ServeConfig) -> int:
    """Load the target (and draft) and serve until SIGINT/SIGTERM; in-flight requests get
    ``graceful_timeout`` seconds to finish, the rest are told the server shut down. Returns the
    exit status: 0 after SIGTERM, 130 after Ctrl-C (SIGINT, as every command), 1 if the server
    could not start."""
    decoder = load_decoder(config.target, config.draft, config.spec, device=config.device, dtype=config.dtype)
    app = create_app(decoder, model_name=config.target, max_queue=config.max_queue, api_key=config.api_key,
                     max_context=config.max_context, max_request_bytes=config.max_request_bytes,
                     request_timeout=config.request_timeout, metrics_public=config.metrics_public,
                     engine_thread=False, per_request_metrics=config.per_request_spec_decode_metrics)
    if config.api_key is None and config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without --api-key: anyone who can reach it can use it", config.host)
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    log_config["handlers"]["access"]["stream"] = "ext://sys.stderr"  # stdout is not for diagnostics
    server = Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                                   log_config=log_config, timeout_graceful_shutdown=config.graceful_timeout))
    return exit_status(server, serve_app(server))


def exit_status(server: Server, started: bool) -> int:
    """What ``eaglewire serve`` exits with once ``serve_app`` returned."""
    if not started:
        return 1
    return 130 if server.interrupted else 0


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``eaglewire serve``, one per ServeConfig field."""
    from eaglewire.core.configs import add_config_args

    add_config_args(parser, ServeConfig)


def cmd_serve(args: argparse.Namespace) -> int:
    from eaglewire.core.configs import config_from_args

    return serve(config_from_args(ServeConfig, args))
