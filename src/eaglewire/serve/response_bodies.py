"""What goes out of ``eaglewire serve``: responses and stream chunks in OpenAI's shapes, and a whole
answer's speculative acceptance as vLLM 0.33.0 reports it per request (``metrics.speculative_decoding``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from eaglewire.serve.serve_config import PER_REQUEST_LEVELS
from eaglewire.core.generation import GenerationStats


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
