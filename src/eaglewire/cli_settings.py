"""The settings of ``eaglewire generate`` and ``eaglewire contract``, the commands without a library
module of their own: every flag, its default and help, checked once (core/configs.py turns the fields
into flags and ``--config`` keys)."""

from __future__ import annotations

from dataclasses import dataclass, field

from eaglewire.core.device import device_field
from eaglewire.decode.spec_config import SpecConfig
from eaglewire.decode.sampling import MAX_NEW_TOKENS
from eaglewire.core.precision import DECODE_DTYPE_HELP, DTYPE_CHOICES
from eaglewire.core.presets import DEFAULT_TARGET

_TARGET_HELP = "preset name, HF model directory or .gguf file"


@dataclass(kw_only=True)
class GenerateConfig:
    target: str = field(default=DEFAULT_TARGET, metadata={"help": _TARGET_HELP})
    draft: str | None = field(default=None, metadata={"help": "draft directory (none: plain decoding)"})
    prompt: str = field(metadata={"help": "the prompt text"})
    chat: bool = field(default=False, metadata={"help": "wrap the prompt in the target's chat template"})
    max_new_tokens: int = field(default=MAX_NEW_TOKENS, metadata={"help": "tokens generated at most"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy; > 0 samples"})
    top_p: float = field(default=1.0, metadata={"help": "sample from the most probable tokens whose probabilities "
                                                        "add up to this (1 = all)"})
    seed: int | None = field(default=None, metadata={"help": "sampling seed (none: unseeded)"})
    stop: list[str] | None = field(default=None, metadata={"repeat": True, "help": "stop string (repeatable)"})
    device: str = device_field()
    dtype: str = field(default="auto", metadata={"choices": DTYPE_CHOICES, "help": DECODE_DTYPE_HELP})
    spec: SpecConfig = field(default_factory=SpecConfig)  # its fields are the --speculative-* flags

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1] (1 = off), got {self.top_p}")


@dataclass(kw_only=True)
class ContractConfig:
    target: str = field(default=DEFAULT_TARGET, metadata={"help": _TARGET_HELP + " (read for its layers and "
                                                                                  "architecture)"})
    num_layers: int | None = field(default=None, metadata={"help": "the target's layer count: skip loading the target"})
    aux_boundaries: list[int] | None = field(default=None, metadata={
        "help": "the boundary layout to translate, e.g. 3,16,28 (default [2, L//2, L-3])"})
    target_arch: str | None = field(default=None, metadata={
        "help": "the target's architecture (llama, qwen3, deepseek_v3, ...; default: the target's own; with "
                "--num-layers and none: every SGLang model file)"})

    def __post_init__(self) -> None:
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"--num-layers must be >= 1, got {self.num_layers}")
