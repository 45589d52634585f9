"""The HTTP side of ``eaglewire serve``: ``create_app``, the FastAPI app serving one ``SpecDecoder``
with OpenAI's API.

Request bodies are size-checked before anything parses them (413), validated on the event loop
and tokenized off it (one tokenizer thread; a prompt that cannot fit the context is refused before
tokenizing), then admitted to the ``DecodeWorker`` (decode_worker.py), whose text deltas come back
to the request's coroutine and leave as one answer or a stream of chunks. A client that goes away
frees its slot at once. Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
GET /health, GET /metrics (Prometheus text, metrics.py; ``--per-request-spec-decode-metrics`` puts
vLLM's per-request ``metrics.speculative_decoding`` in each whole answer: ``doctor --engine-url``
reads either). With an API key every /v1 route, and /metrics unless ``metrics_public``, needs
``Authorization: Bearer``. Bodies must be ``application/json`` (415 otherwise) and arrive within
``request_timeout`` seconds (408 otherwise).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from eaglewire.decode.batch_engine import engine_schedule
from eaglewire.concurrency.schedule import Schedule
from eaglewire.decode.spec_decoder import SpecDecoder
from eaglewire.decode.sampling import SamplingParams
from eaglewire.serve.api_errors import APIError, error_body
from eaglewire.serve.decode_worker import DecodeWorker, Delta, Done, Event, Failed, Job
from eaglewire.serve.metrics import Metrics
from eaglewire.serve.middleware import BearerAuth, CountRequests, LimitBody
from eaglewire.serve.request_bodies import ChatCompletionRequest, CompletionRequest, parse_body, validation_error
from eaglewire.serve.serve_config import MAX_REQUEST_BYTES, PER_REQUEST_LEVELS, REQUEST_TIMEOUT_SECONDS
from eaglewire.serve.response_bodies import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                             ChatCompletion, ChatCompletionChunk, ChatDelta, Completion,
                                             CompletionChoice, CompletionChunk, new_id, usage)
from eaglewire.serve.token_budget import chat_prompt_ids, completion_prompt_ids, max_token_chars, token_budget

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25  # how often a waiting request checks that its client is still there
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


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
               engine_thread: bool = True, per_request_metrics: str = "none", max_batch: int = 16,
               schedule: Schedule | None = None) -> FastAPI:
    """The FastAPI app serving ``decoder`` as ``model_name``; its engine thread lives with the app's lifespan.

    ``max_queue`` bounds the requests in flight (decoding + waiting); ``max_context`` (prompt +
    generated tokens) defaults to the target's max_position_embeddings; a request body over
    ``max_request_bytes`` gets 413, one not received within ``request_timeout`` seconds 408 (None:
    no limit). With ``api_key``, /metrics needs it too unless ``metrics_public``. ``engine_thread=False`` starts no engine thread: ``serve_app``
    runs the engine on the thread that loaded the models. ``per_request_metrics`` (vLLM's
    --per-request-spec-decode-metrics levels: none, summary, detailed) puts each answer's
    speculative acceptance in its ``metrics.speculative_decoding``, as vLLM 0.33.0 does. At most ``max_batch``
    requests decode at once (continuous batching); ``schedule`` says, per batch size, whether a step drafts and in
    which shape (None: the decoder's shape at every size).
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
    schedule = schedule or Schedule.fixed(decoder.spec if decoder.drafter is not None else None)
    engine_schedule(decoder, schedule)  # refuses a schedule that speculates without a draft
    metrics = Metrics(1 + schedule.max_steps, ROUTES)
    worker = DecodeWorker(decoder, max_queue, metrics, own_thread=engine_thread,
                          per_request_metrics=per_request_metrics, max_batch=max_batch, schedule=schedule)
    service = _Service(decoder, model_name, max_context, worker)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        log.info("serving %s (context %d tokens, up to %d requests at once; %s)", model_name, max_context,
                 max_batch, schedule.describe() if decoder.drafter is not None else "no draft")
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
