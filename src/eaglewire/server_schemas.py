"""The OpenAI wire format of ``eaglewire serve``: request models, error bodies and response objects.

Requests are validated strictly (a string is not an integer, a float is not an integer) and
unknown fields are ignored, as OpenAI's own API does. Every error the server sends is
``{"error": {"message", "type", "param", "code"}}`` with ``param`` naming the offending field
(``messages[0].role``) and a message that says what would be right.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

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

    def requested_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


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

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: bool | None) -> bool | None:
        if logprobs:
            raise ValueError("logprobs are not supported by this server; leave logprobs unset")
        return logprobs

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Generation):
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

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: int | None) -> int | None:
        if logprobs:
            raise ValueError("logprobs are not supported by this server; leave logprobs unset")
        return logprobs

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


def _describe(error: dict) -> str:
    if error["type"] == "value_error":
        return str(error["ctx"]["error"]) if "ctx" in error else error["msg"]
    given = repr(error.get("input"))
    given = given if len(given) <= 60 else given[:57] + "..."
    return f"{error['msg']} (got {given})"


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
        return APIError(400, f"the request body must be a JSON object ({_describe(first)})")
    if first["type"] == "missing":
        return APIError(400, f"{param} is required", param=param)
    # A union field fails once per member; say all the ways it could have been right.
    same = [e for e in errors if _param(tuple(e["loc"])) == param]
    reasons = list(dict.fromkeys(_describe(e) for e in same))
    return APIError(400, f"{param}: " + "; or ".join(reasons), param=param)


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
