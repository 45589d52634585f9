"""The wire format of ``eaglewire serve``: what comes in and what goes out.

In: request models, validated strictly (a string is not an integer, a float is not an integer)
with unknown fields ignored as OpenAI's API does, and the prompt token ids they stand for.
Out: response objects and stream chunks in OpenAI's shapes, and the Prometheus text of /metrics.
Around: ASGI middleware for the bearer API key and for counting responses by status.
Every error is ``{"error": {"message", "type", "param", "code"}}`` with ``param`` naming the
offending field (``messages[0].role``) and a message that says what would be right.
"""

from __future__ import annotations

import hmac
import threading
import time
import uuid
from collections import Counter
from typing import Any, ClassVar, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from eaglewire.decode.engine import GenerationStats
from eaglewire.decode.text import encode_prompt

MAX_STOP_STRINGS = 16


class APIError(Exception):
    """An error the client caused (or must be told about), sent as an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return error_body(self.message, param=self.param, type=self.type, code=self.code)


def error_body(message: str, *, param: str | None = None, type: str = "invalid_request_error",
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- requests ---------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_template_message(self) -> dict[str, str]:
        """The message as a chat template takes it (text parts joined, developer -> system)."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class StreamOptions(_Strict):
    include_usage: bool = False


class _Generation(_Strict):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # not OpenAI's; vLLM and SGLang take it too (0: off)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported (got {n}); send {n} separate requests instead")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed (got {len(stops)})")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty; drop the empty string")
        return stop

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    default_tokens: ClassVar[int | None] = None  # without max_tokens: as many as the context leaves

    def requested_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _reject_logprobs(value):
    if value:
        raise ValueError("logprobs are not supported by this server; leave logprobs unset")
    return value


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("messages is empty; send at least one message, e.g. "
                             "[{\"role\": \"user\", \"content\": \"Hello\"}]")
        return messages

    _no_logprobs = field_validator("logprobs")(classmethod(lambda cls, v: _reject_logprobs(v)))

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Generation):
    default_tokens: ClassVar[int] = 16  # OpenAI's legacy completions stop at 16 tokens unless told
    prompt: str | list[int] | list[str]
    logprobs: int | None = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) and len(prompt) != 1:
            raise ValueError(f"only one prompt per request is supported (got {len(prompt)}); "
                             "send one request per prompt")
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt is an empty list; send a string or a list of token ids")
        return prompt

    _no_logprobs = field_validator("logprobs")(classmethod(lambda cls, v: _reject_logprobs(v)))

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported by this server; leave echo unset")
        return echo


# -- validation errors --------------------------------------------------------

def _is_union_tag(part: Any) -> bool:
    """pydantic adds the union member it tried (``str``, ``list[int]``) to an error's location."""
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "list", "dict"})


def _param(loc: tuple) -> str | None:
    parts = [p for p in loc[1:] if not _is_union_tag(p)] if loc and loc[0] == "body" else list(loc)
    text = ""
    for p in parts:
        text += f"[{p}]" if isinstance(p, int) else (f".{p}" if text else str(p))
    return text or None


def _given(error: dict) -> str:
    given = repr(error.get("input"))
    return given if len(given) <= 60 else given[:57] + "..."


def validation_error(errors: list[dict]) -> APIError:
    """FastAPI's validation errors -> one OpenAI-style 400 naming the first bad field."""
    if not errors:
        return APIError(400, "the request body is invalid")
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return APIError(400, f"the request body is not valid JSON ({detail}); send a JSON object")
    param = _param(tuple(first["loc"]))
    if param is None:
        return APIError(400, f"the request body must be a JSON object ({first['msg']}, got {_given(first)})")
    if first["type"] == "missing":
        return APIError(400, f"{param} is required", param=param)
    if first["type"] == "value_error":  # our validators' messages name the field and the fix
        reason = str(first["ctx"]["error"]) if "ctx" in first else first["msg"]
        return APIError(400, reason if reason.startswith(param) else f"{param}: {reason}", param=param)
    # A union field fails once per member: "a valid string or a valid list".
    msgs = list(dict.fromkeys(e["msg"] for e in errors if _param(tuple(e["loc"])) == param))
    msgs = msgs[:1] + [m.removeprefix("Input should be ") for m in msgs[1:]]
    return APIError(400, f"{param}: {' or '.join(msgs)} (got {_given(first)})", param=param)


# -- prompts -------------------------------------------------------------------

def token_budget(prompt_ids: list[int], requested: int | None, max_context: int, prompt_param: str,
                 tokens_param: str, default: int | None = None) -> int:
    """The number of tokens to generate: the request's, else ``default``, else all the context leaves."""
    if not prompt_ids:
        raise APIError(400, f"{prompt_param} is empty after tokenization; send some text", param=prompt_param)
    room = max_context - len(prompt_ids)
    if room < 1:
        raise APIError(400, f"{prompt_param} is {len(prompt_ids)} tokens, which leaves no room in this model's "
                       f"context of {max_context} tokens; shorten it", param=prompt_param,
                       code="context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise APIError(400, f"{tokens_param} {requested} plus the prompt's {len(prompt_ids)} tokens exceeds this "
                       f"model's context of {max_context} tokens; set {tokens_param} to at most {room}",
                       param=tokens_param, code="context_length_exceeded")
    return requested


def chat_prompt_ids(tokenizer, req: ChatCompletionRequest) -> list[int]:
    """The messages through the target's chat template, with the assistant's turn opened."""
    try:
        return encode_prompt(tokenizer, [m.as_template_message() for m in req.messages], chat=True)
    except Exception as e:  # the template rejects the conversation (e.g. roles out of order)
        raise APIError(400, f"messages do not fit the model's chat template: {e}", param="messages") from e


def completion_prompt_ids(tokenizer, req: CompletionRequest, vocab_size: int) -> list[int]:
    """A text prompt tokenized as is (no template), or token ids checked against the vocabulary."""
    if isinstance(req.prompt, str) or isinstance(req.prompt[0], str):
        text = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
        return encode_prompt(tokenizer, text, chat=False)
    bad = [t for t in req.prompt if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"prompt holds token ids outside [0, {vocab_size}): {bad[:5]}", param="prompt")
    return list(req.prompt)


# -- responses ----------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_response(rid: str, model: str, text: str, finish_reason: str, use: dict) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
              "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": use}


def completion_response(rid: str, model: str, text: str, finish_reason: str, use: dict) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": use}


def chat_chunk(rid: str, model: str, delta: dict, finish_reason: str | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [choice]}


def completion_chunk(rid: str, model: str, text: str, finish_reason: str | None = None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice]}


def usage_chunk(rid: str, model: str, obj: str, use: dict) -> dict:
    """The extra last chunk of ``stream_options={"include_usage": true}``: no choices, the usage."""
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": use}


# -- /metrics -------------------------------------------------------------------

class Metrics:
    """Counters for /metrics; updated from the engine thread and the event loop."""

    def __init__(self, max_accept: int, routes: tuple[str, ...]) -> None:
        self._lock, self.routes = threading.Lock(), routes
        self.requests: Counter[tuple[str, int]] = Counter()
        self.cancelled = self.prompt_tokens = self.generated = 0
        self.accept_counts = [0] * max_accept  # rounds whose accept length was i + 1
        self.position_accepts = [0] * (max_accept - 1)  # rounds that accepted draft depth i + 1
        self.generation_seconds, self.last_tokens_per_second = 0.0, 0.0

    def count_request(self, path: str, status: int) -> None:
        with self._lock:
            self.requests[(path if path in self.routes else "other", status)] += 1

    def observe(self, stats: GenerationStats, *, cancelled: bool) -> None:
        with self._lock:
            self.cancelled += cancelled
            self.prompt_tokens += stats.prompt_tokens
            self.generated += stats.new_tokens
            for n in stats.accept_lengths:
                self.accept_counts[min(n, len(self.accept_counts)) - 1] += 1
            for d, n in enumerate(stats.position_accepts[:len(self.position_accepts)]):
                self.position_accepts[d] += n
            self.generation_seconds += stats.total_seconds
            if not cancelled:
                self.last_tokens_per_second = stats.tokens_per_second

    def render(self, *, waiting: int, running: int) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            out.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
            out.extend(f"{name}{labels} {value:g}" for labels, value in samples)

        with self._lock:
            metric("eaglewire_requests_total", "counter", "HTTP requests by route and status code",
                   [(f'{{path="{p}",status="{s}"}}', n) for (p, s), n in sorted(self.requests.items())])
            metric("eaglewire_requests_cancelled_total", "counter", "generations stopped by a client that left",
                   [("", self.cancelled)])
            metric("eaglewire_prompt_tokens_total", "counter", "prompt tokens prefilled", [("", self.prompt_tokens)])
            metric("eaglewire_generated_tokens_total", "counter", "tokens generated", [("", self.generated)])
            rounds, cumulative, buckets = sum(self.accept_counts), 0, []
            for i, n in enumerate(self.accept_counts):
                cumulative += n
                buckets.append((f'_bucket{{le="{i + 1}"}}', cumulative))
            accept_sum = sum((i + 1) * n for i, n in enumerate(self.accept_counts))
            metric("eaglewire_accept_length", "histogram", "tokens per target verify pass (bonus token included)",
                   buckets + [('_bucket{le="+Inf"}', rounds), ("_sum", accept_sum), ("_count", rounds)])
            metric("eaglewire_position_acceptance", "gauge", "share of verify passes that accepted draft depth d",
                   [(f'{{position="{d + 1}"}}', n / max(rounds, 1)) for d, n in enumerate(self.position_accepts)])
            metric("eaglewire_generation_seconds_total", "counter", "seconds the engine spent generating",
                   [("", self.generation_seconds)])
            metric("eaglewire_tokens_per_second", "gauge", "decode speed of the last finished request",
                   [("", self.last_tokens_per_second)])
        metric("eaglewire_queue_depth", "gauge", "requests waiting for the engine", [("", waiting)])
        metric("eaglewire_requests_running", "gauge", "requests being generated", [("", running)])
        return "\n".join(out) + "\n"


# -- middleware: the API key, and responses counted for /metrics --------------

class CountRequests:
    """ASGI middleware: count every HTTP response by route and status for /metrics."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.count_request(scope["path"], status)


class BearerAuth:
    """ASGI middleware: /v1 routes need ``Authorization: Bearer <api_key>`` (checked before the body)."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                why = "no API key was given" if not given else "the API key is wrong"
                body = error_body(f"{why}; send the server's --api-key as 'Authorization: Bearer KEY'",
                                  code="invalid_api_key")
                response = JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)
