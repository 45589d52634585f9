"""What comes in to ``eaglewire serve``: request bodies parsed and validated strictly (UTF-8 JSON
sent as ``application/json``: other types are 415, so a browser page cannot post one without a CORS
preflight; a string is not an integer, a float is not an integer; text must be valid Unicode) with
unknown fields ignored as OpenAI's API does, and fields it cannot honour (tools, non-text content
parts) refused. A bad body is one ``APIError`` (api_errors.py) naming the first bad field.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from eaglewire.serve.api_errors import APIError

MAX_STOP_STRINGS = 16
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # torch.Generator.manual_seed overflows outside it


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
