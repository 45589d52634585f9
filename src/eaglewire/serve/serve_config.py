"""``eaglewire serve``'s settings: every flag, its default and help, checked once. No web framework here, so the
other commands parse their flags without importing one (an environment whose fastapi cannot import still trains)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from eaglewire.core.device import device_field
from eaglewire.core.precision import DECODE_DTYPE_HELP, DTYPE_CHOICES
from eaglewire.decode.spec_config import SpecConfig

MAX_REQUEST_BYTES = 4 << 20  # a full 128k-token context of text is ~0.5 MB of JSON; 8k (SmolLM2) ~40 kB
REQUEST_TIMEOUT_SECONDS = 30.0  # 4 MB at a slow 1 Mbit/s; a client that sends less than it declared waits no longer
PER_REQUEST_LEVELS = ("none", "summary", "detailed")  # vLLM's --per-request-spec-decode-metrics


@dataclass(kw_only=True)
class ServeConfig:
    target: str = field(metadata={"help": "preset name, HF directory or .gguf file of the target"})
    draft: str | None = field(default=None, metadata={"help": "draft directory (none: plain decoding)"})
    spec: SpecConfig = field(default_factory=SpecConfig)  # its fields are the --speculative-* flags
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = 8000
    max_queue: int = field(default=64, metadata={"help": "most requests in flight (decoding + waiting); 429 beyond"})
    max_batch: int = field(default=16, metadata={
        "help": "most requests decoded at once (continuous batching; vLLM's --max-num-seqs); the rest wait"})
    schedule: str | None = field(default=None, metadata={
        "help": "a schedule file from `eaglewire tune --concurrency`: per batch size, the shape that pays or plain "
                "(default: the --speculative-* shape at every batch size)"})
    api_key: str | None = field(default=None, metadata={
        "help": "require 'Authorization: Bearer KEY' on /v1 and /metrics"})
    metrics_public: bool = field(default=False, metadata={"help": "serve /metrics without the --api-key"})
    max_context: int | None = field(default=None, metadata={
        "help": "prompt + generated tokens per request (default: the target's max_position_embeddings)"})
    max_request_bytes: int = field(default=MAX_REQUEST_BYTES, metadata={
        "help": "largest request body accepted, in bytes; 413 beyond, before it is parsed"})
    request_timeout: float = field(default=REQUEST_TIMEOUT_SECONDS, metadata={
        "help": "seconds a request body may take to arrive; 408 beyond"})
    device: str = device_field()
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
        if self.max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {self.max_batch}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"--max-context must be >= 2, got {self.max_context}")
        if self.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be >= 1, got {self.max_request_bytes}")
        if self.request_timeout <= 0:
            raise ValueError(f"--request-timeout must be > 0 seconds, got {self.request_timeout}")
        if self.graceful_timeout < 0:
            raise ValueError(f"--graceful-timeout must be >= 0 seconds, got {self.graceful_timeout}")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``eaglewire serve``, one per ServeConfig field."""
    from eaglewire.core.configs import add_config_args

    add_config_args(parser, ServeConfig)
