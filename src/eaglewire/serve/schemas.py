"""The wire format of ``eaglewire serve``: what comes in and what goes out.

In: request bodies parsed and validated strictly (UTF-8 JSON sent as ``application/json``: other
types are 415, so a browser page cannot post one without a CORS preflight; a string is not an
integer, a float is not an integer; text must be valid Unicode) with unknown fields ignored as OpenAI's API does,
fields it cannot honour (tools, non-text content parts) refused, and the prompt token ids they
stand for. Out: response models and stream chunks in OpenAI's shapes, and /metrics through
prometheus_client. Around: ASGI middleware for the body size, the bearer API key and for counting
responses by status. Every error is ``{"error": {"message", "type", "param", "code"}}`` with
``param`` naming the offending field (``messages[0].role``), ``code`` null or a string such as
``context_length_exceeded`` (OpenAI's error object), and a message that says what would be right.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from collections import Counter
from typing import Any, ClassVar, Literal

from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from tokenizers import decoders

from eaglewire.core.generation import GenerationStats
from eaglewire.decode.text import encode_prompt

MAX_STOP_STRINGS = 16
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # torch.Generator.manual_seed overflows outside it


class ErrorObject(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None  # as OpenAI's: null or a string token ("context_length_exceeded"), never a number


class ErrorResponse(BaseModel):
    error: ErrorObject


class APIError(Exception):
    """An error the client caused (or must be told about), sent as an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, param=self.param, type=self.type, code=self.code)


def error_body(message: str, *, param: str | None = None, type: str = "invalid_request_error",
               code: str | None = None) -> dict:
    return ErrorResponse(error=ErrorObject(message=message, type=type, param=param, code=code)).model_dump()


# -- requests ---------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """Name the part type we cannot take, before the union says only "should be a valid string"."""
        for i, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"part {i} is of type {kind!r}; only text content parts are supported "
                                 "({\"type\": \"text\", \"text\": ...}); send that part as text or leave it out")
        return content

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
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])  # what torch.Generator takes
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


def _unsupported(field: str, why: str):
    """A validator refusing a field this server cannot honour (silently ignoring it would mislead)."""

    def check(cls, value):
        if value not in (None, [], "none", "auto"):  # what clients send to mean "not used"
            raise ValueError(f"{field} is not supported by this server ({why}); leave {field} unset")
        return value

    return field_validator(field)(classmethod(check))


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None

    _no_tools = _unsupported("tools", "no function calling")
    _no_tool_choice = _unsupported("tool_choice", "no function calling")
    _no_functions = _unsupported("functions", "no function calling")
    _no_function_call = _unsupported("function_call", "no function calling")

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value is not None and value != {"type": "text"}:
            raise ValueError("response_format is not supported by this server (no JSON mode or schemas); "
                             "leave response_format unset or {\"type\": \"text\"}")
        return value

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
    return_token_ids: bool = False  # vLLM's field: the generated ids in choices[0].token_ids

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


def _is_json_type(content_type: str | None) -> bool:
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def _invalid_text(data: Any, path: str = "") -> tuple[str, str, int] | None:
    """(param, text, offset) of the first string in ``data`` that is not valid Unicode (a lone
    surrogate such as ``"\\ud800"``: JSON can escape one, UTF-8 cannot encode it), else None."""
    stack = [(path, data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                return where, value, e.start
        elif isinstance(value, dict):
            stack += [(f"{where}.{k}" if where else str(k), v) for k, v in reversed(value.items())]
        elif isinstance(value, (list, tuple)):
            stack += [(f"{where}[{i}]", v) for i, v in reversed(list(enumerate(value)))]
    return None


def parse_body(model: type[BaseModel], body: bytes, content_type: str | None) -> Any:
    """The request body as ``model``, or APIError 415 (not sent as JSON) / 400 saying what is wrong with it.

    Only ``application/json`` (or a ``+json`` type) is read: a page in a browser can send a
    ``text/plain`` or form body to any local server without a CORS preflight, so taking those
    would let any web page drive a server that has no --api-key."""
    if not _is_json_type(content_type):
        raise APIError(415, f"the request body must be sent with Content-Type: application/json (this request "
                       f"said {content_type or 'nothing'!r}); send it as JSON, e.g. curl --json or "
                       "-H 'Content-Type: application/json'", code="unsupported_media_type")
    if not body:
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: it is not UTF-8 text (byte 0x{body[e.start]:02x} "
                       f"at offset {e.start}); send a JSON object encoded as UTF-8") from None
    try:
        data = json.loads(text)
        req = model.model_validate(data)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON ({e.msg}); send a JSON object") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply to read; send a flatter JSON object") from None
    except ValidationError as e:  # located as FastAPI locates body errors, for validation_error
        raise validation_error([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None
    except ValueError as e:  # json's own limits, e.g. an integer of more than 4,300 digits
        reason = str(e).split(";")[0]  # not Python's advice to the server (set_int_max_str_digits)
        raise APIError(400, f"the request body is not valid JSON ({reason}); send a JSON object") from None
    if bad := _invalid_text(req.model_dump(exclude_defaults=True)):
        param, value, at = bad
        raise APIError(400, f"{param} is not valid Unicode text: it holds the lone surrogate "
                       f"{ascii(value[at])} at character {at}; send UTF-8 text (a surrogate pair must be "
                       "complete, e.g. \\ud83d\\ude00)", param=param)
    return req


# -- prompts -------------------------------------------------------------------

def max_token_chars(tokenizer) -> int | None:
    """The most characters one token can stand for, where that is known without tokenizing; else None.

    For a byte-level BPE tokenizer without a normalizer every token is a fixed byte string, written
    one character per byte, and a character is at least one byte: a token covers at most
    len(longest token) characters of the text. (Tokenizers that normalize, which may delete
    characters, or have an unknown token, which may swallow a whole word, get no such bound.)
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    return max(len(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))


def check_prompt_chars(chars: int, token_chars: int | None, max_context: int, param: str) -> None:
    """Refuse, without tokenizing, a prompt of ``chars`` characters that cannot fit the context.

    The safe direction: the bound must be a floor on the prompt's tokens, so it can only say "too
    long" when tokenizing would say so too. ``chars / token_chars`` is one (no token covers more
    than ``token_chars`` characters). "A token is at least one byte" is a ceiling (tokens <= bytes):
    refusing by it (chars > context) would turn away prompts that fit, e.g. 8,000 '#' are 100 tokens.
    """
    if token_chars is None:
        return
    least = -(-chars // token_chars)
    if least >= max_context:
        raise APIError(400, f"{param} is {chars} characters, so at least {least} tokens (no token of this model is "
                       f"longer than {token_chars} characters), which leaves no room in this model's context of "
                       f"{max_context} tokens; shorten it", param=param, code="context_length_exceeded")

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


def chat_prompt_ids(tokenizer, req: ChatCompletionRequest, max_context: int, token_chars: int | None) -> list[int]:
    """The messages through the target's chat template, with the assistant's turn opened (refused
    before tokenizing when the rendered text cannot fit ``max_context``)."""
    messages = [m.as_template_message() for m in req.messages]
    try:
        if token_chars is not None:  # rendering is cheap; tokenizing megabytes is not
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            check_prompt_chars(len(text), token_chars, max_context, "messages")
        return encode_prompt(tokenizer, messages, chat=True)
    except APIError:
        raise
    except Exception as e:  # the template rejects the conversation (e.g. roles out of order)
        raise APIError(400, f"messages do not fit the model's chat template: {e}", param="messages") from e


def completion_prompt_ids(tokenizer, req: CompletionRequest, vocab_size: int, max_context: int,
                          token_chars: int | None) -> list[int]:
    """A text prompt tokenized as is (no template; refused before tokenizing when it cannot fit
    ``max_context``), or token ids checked against the vocabulary."""
    if isinstance(req.prompt, str) or isinstance(req.prompt[0], str):
        text = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
        check_prompt_chars(len(text), token_chars, max_context, "prompt")
        return encode_prompt(tokenizer, text, chat=False)
    bad = [t for t in req.prompt if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"prompt holds token ids outside [0, {vocab_size}): {bad[:5]}", param="prompt")
    return list(req.prompt)


# -- responses ----------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _now() -> int:
    return int(time.time())


def _is_none(value: Any) -> bool:
    return value is None


class SpeculativeDecodingMetrics(BaseModel):
    """One request's speculative acceptance, in vLLM 0.33.0's shape and meaning
    (vllm/entrypoints/generate/base/protocol.py, SpeculativeDecodingMetrics; filled as
    vllm/v1/metrics/stats.py RequestSpecDecodeMetrics.to_dict does)."""

    mean_acceptance_length: float  # 1 + accepted / verify steps (bonus included)
    draft_acceptance_rate: float  # accepted / drafted
    acceptance_histogram: list[int]  # [j]: verify steps that accepted exactly j drafted tokens (num_spec_tokens + 1)
    num_spec_steps: int
    num_accepted_draft_tokens: int
    num_draft_tokens: int
    num_spec_tokens: int
    per_step_accepted: list[int] | None = Field(None, exclude_if=_is_none)  # "detailed" only
    per_step_drafted: list[int] | None = Field(None, exclude_if=_is_none)


class PerRequestMetrics(BaseModel):
    """A response's ``metrics`` (vLLM's PerRequestMetrics: only its speculative part is filled)."""

    speculative_decoding: SpeculativeDecodingMetrics | None = None


PER_REQUEST_LEVELS = ("none", "summary", "detailed")  # vLLM's --per-request-spec-decode-metrics


def spec_decoding_metrics(stats: GenerationStats, num_spec_tokens: int, level: str) -> PerRequestMetrics | None:
    """``stats``' verify rounds as vLLM reports them per request (None at level "none" or
    without speculation). A round drafted ``verified - 1`` tokens and accepted ``accept - 1``;
    a round that drafted nothing is no speculative step (vLLM counts only drafts)."""
    if level not in PER_REQUEST_LEVELS:
        raise ValueError(f"per-request spec decode metrics level {level!r} is not one of {PER_REQUEST_LEVELS}")
    if level == "none" or num_spec_tokens < 1:
        return None
    rounds = [(a - 1, v - 1) for a, v in zip(stats.accept_lengths, stats.verified_lengths) if v > 1]  # drafted ones
    accepted, drafted = [a for a, _ in rounds], [d for _, d in rounds]
    histogram = [0] * (num_spec_tokens + 1)
    for j in accepted:
        histogram[min(j, num_spec_tokens)] += 1
    steps, n_accepted, n_drafted = len(accepted), sum(accepted), sum(drafted)
    detailed = level == "detailed"
    return PerRequestMetrics(speculative_decoding=SpeculativeDecodingMetrics(
        mean_acceptance_length=1.0 + n_accepted / steps if steps else 1.0,
        draft_acceptance_rate=n_accepted / n_drafted if n_drafted else 0.0,
        acceptance_histogram=histogram, num_spec_steps=steps, num_accepted_draft_tokens=n_accepted,
        num_draft_tokens=n_drafted, num_spec_tokens=num_spec_tokens,
        per_step_accepted=accepted if detailed else None, per_step_drafted=drafted if detailed else None))


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str


class _ResponseHeader(BaseModel):
    """The fields every completion response and chunk starts with, in OpenAI's order (a subclass
    narrows ``object`` to its literal; the field keeps its place)."""

    id: str
    object: str
    created: int = Field(default_factory=_now)
    model: str


class ChatCompletion(_ResponseHeader):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    metrics: PerRequestMetrics | None = Field(None, exclude_if=_is_none)  # --per-request-spec-decode-metrics


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=_is_none)  # with return_token_ids, as vLLM's



class Completion(_ResponseHeader):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage
    metrics: PerRequestMetrics | None = Field(None, exclude_if=_is_none)  # --per-request-spec-decode-metrics


class ChatDelta(BaseModel):
    """What a chunk adds: the role (first chunk), text, or nothing (the chunk with the finish reason)."""

    role: Literal["assistant"] | None = Field(None, exclude_if=_is_none)
    content: str | None = Field(None, exclude_if=_is_none)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_ResponseHeader):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]  # empty in the last chunk of stream_options={"include_usage": true}
    usage: Usage | None = Field(None, exclude_if=_is_none)


class CompletionChunk(_ResponseHeader):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, exclude_if=_is_none)


# -- /metrics -------------------------------------------------------------------

class Metrics:
    """Counters for /metrics; updated from the engine thread and the event loop."""

    def __init__(self, max_accept: int, routes: tuple[str, ...]) -> None:
        self._lock, self.routes = threading.Lock(), routes
        self.requests: Counter[tuple[str, int]] = Counter()
        self.cancelled = self.prompt_tokens = self.generated = 0
        self.accept_counts = [0] * max_accept  # rounds whose accept length was i + 1
        self.position_accepts = [0] * (max_accept - 1)  # rounds that accepted draft depth i + 1
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted = 0  # rounds that drafted, vLLM's counters
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
            for a, v in zip(stats.accept_lengths, stats.verified_lengths):
                if v > 1:  # a round that drafted: vLLM's num_drafts
                    self.spec_drafts += 1
                    self.spec_draft_tokens += v - 1
                    self.spec_accepted += a - 1
            self.generation_seconds += stats.total_seconds
            if not cancelled:
                self.last_tokens_per_second = stats.tokens_per_second

    def families(self, *, waiting: int, running: int) -> list:
        """The metrics as prometheus_client metric families (a snapshot)."""
        requests = CounterMetricFamily("eaglewire_requests", "HTTP requests by route and status code",
                                       labels=["path", "status"])
        position = GaugeMetricFamily("eaglewire_position_acceptance",
                                     "share of verify passes that accepted draft depth d", labels=["position"])
        with self._lock:
            for (path, status), n in sorted(self.requests.items()):
                requests.add_metric([path, str(status)], n)
            rounds = sum(self.accept_counts)
            cumulative = [sum(self.accept_counts[:i + 1]) for i in range(len(self.accept_counts))]
            accept = HistogramMetricFamily(
                "eaglewire_accept_length", "tokens per target verify pass (bonus token included)",
                buckets=[(str(i + 1), n) for i, n in enumerate(cumulative)] + [("+Inf", rounds)],
                sum_value=sum((i + 1) * n for i, n in enumerate(self.accept_counts)))
            for d, n in enumerate(self.position_accepts):
                position.add_metric([str(d + 1)], n / max(rounds, 1))
            return self._spec_counters() + [
                requests,
                CounterMetricFamily("eaglewire_requests_cancelled", "generations stopped by a client that left",
                                    value=self.cancelled),
                CounterMetricFamily("eaglewire_prompt_tokens", "prompt tokens prefilled", value=self.prompt_tokens),
                CounterMetricFamily("eaglewire_generated_tokens", "tokens generated", value=self.generated),
                accept, position,
                CounterMetricFamily("eaglewire_generation_seconds", "seconds the engine spent generating",
                                    value=self.generation_seconds),
                GaugeMetricFamily("eaglewire_tokens_per_second", "decode speed of the last finished request",
                                  value=self.last_tokens_per_second),
                GaugeMetricFamily("eaglewire_queue_depth", "requests waiting for the engine", value=waiting),
                GaugeMetricFamily("eaglewire_requests_running", "requests being generated", value=running),
            ]

    def _spec_counters(self) -> list:
        """vLLM 0.33.0's speculative counters (vllm/v1/spec_decode/metrics.py, SpecDecodingProm)
        under eaglewire's prefix, ``position`` from 0 as vLLM's; none without a draft, as vLLM."""
        if not self.position_accepts:
            return []
        per_pos = CounterMetricFamily("eaglewire_spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=["position"])
        for d, n in enumerate(self.position_accepts):
            per_pos.add_metric([str(d)], n)
        return [CounterMetricFamily("eaglewire_spec_decode_num_drafts", "Number of spec decoding drafts.",
                                    value=self.spec_drafts),
                CounterMetricFamily("eaglewire_spec_decode_num_draft_tokens", "Number of draft tokens.",
                                    value=self.spec_draft_tokens),
                CounterMetricFamily("eaglewire_spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                    value=self.spec_accepted),
                per_pos]

    def render(self, *, waiting: int, running: int) -> bytes:
        """The Prometheus text exposition (format 0.0.4), written by prometheus_client."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Snapshot(self.families(waiting=waiting, running=running)))
        return generate_latest(registry)


class _Snapshot:
    """A prometheus_client collector of families taken at one scrape."""

    def __init__(self, families: list) -> None:
        self._families = families

    def collect(self):
        return iter(self._families)


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
    """ASGI middleware: /v1 routes, and /metrics unless ``metrics_public``, need ``Authorization:
    Bearer <api_key>`` (checked before the body; the scheme is case-insensitive, as RFC 9110 has it)."""

    def __init__(self, app, api_key: str, metrics_public: bool = False) -> None:
        self.app, self.expected, self.metrics_public = app, api_key.encode(), metrics_public

    def _guarded(self, path: str) -> bool:
        return path.startswith("/v1") or (path == "/metrics" and not self.metrics_public)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self._guarded(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization", b"").strip()
            scheme, _, key = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.expected):
                if not given or (scheme.lower() == b"bearer" and not key.strip()):
                    why = "no API key was given"
                elif scheme.lower() != b"bearer":
                    why = f"the Authorization scheme is {scheme.decode(errors='replace')!r}, not Bearer"
                else:
                    why = "the API key is wrong"
                body = error_body(f"{why}; send the server's --api-key as 'Authorization: Bearer KEY'",
                                  code="invalid_api_key")
                response = JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class LimitBody:
    """ASGI middleware: a request body over ``max_bytes`` is refused with 413 before anything parses
    it — at once by its Content-Length, else as soon as the bytes received pass the limit — and one
    not received whole within ``timeout`` seconds with 408 (a client that declares more than it
    sends would otherwise hold its connection, and a slot of uvicorn's, forever)."""

    def __init__(self, app, max_bytes: int, timeout: float | None = None) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(f"{int(declared)} bytes", scope, receive, send)
        chunks: list[bytes] = []
        try:
            async with asyncio.timeout(self.timeout):
                size = 0
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # the client left before sending it all
                        return
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > self.max_bytes:
                        return await self._refuse(f"more than {self.max_bytes} bytes", scope, receive, send)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            body = error_body(f"the request body did not arrive within {self.timeout:g} s (--request-timeout): "
                              f"{sum(map(len, chunks))} of {declared.decode() or 'an unknown number of'} bytes came; "
                              "send the whole body, or as many bytes as Content-Length says", code="request_timeout")
            return await JSONResponse(body, 408, headers={"Connection": "close"})(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:  # later reads: disconnect detection
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, size: str, scope, receive, send) -> None:
        body = error_body(f"the request body is {size}, over this server's limit of {self.max_bytes} bytes "
                          f"(--max-request-bytes); send a shorter request or raise the limit")
        await JSONResponse(body, 413)(scope, receive, send)
