"""The settings of ``eaglewire export``, ``import`` and ``engines``: every flag, its default and
help, checked once (configs.py turns the fields into flags and ``--config`` keys)."""

from __future__ import annotations

from dataclasses import dataclass, field

from eaglewire.formats import EXPORT_FORMATS, IMPORT_FORMATS
from eaglewire.formats.llamacpp import DRAFT_OUTTYPES, TARGET_OUTTYPES

ENGINE_ACTIONS = ("install", "which")
INSTALLABLE_ENGINES = ("llamacpp",)  # third-party engines `eaglewire engines` installs or finds

_ALLOW_HELP = ("target fingerprint fields allowed to differ from the draft's, e.g. weights_sha256 for a "
               "requantized target")


def _choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{flag} {value!r} is not one of {', '.join(choices)}")


@dataclass(kw_only=True)
class ExportSettings:
    """How the library writes an export (``formats.export_draft``'s keyword arguments). On the engines
    branch this is ``engines.export.ExportConfig``: at the merge, that class takes this one's place."""

    target_arch: str | None = field(default=None, metadata={
        "help": "the target's architecture, whose model file sets the engine's reading of the ids (default: the "
                "one the draft records), e.g. llama, qwen3, deepseek_v3"})
    verifier_name: str | None = field(default=None, metadata={
        "help": "target path or hub id written into the export (default: the recorded target, as an absolute "
                "path when it is a local directory)"})
    num_steps: int = field(default=5, metadata={"help": "speculative steps suggested in SERVING.md"})
    outtype: str = field(default="q8_0", metadata={"choices": DRAFT_OUTTYPES, "help": "llamacpp: the draft GGUF's weights"})
    target_outtype: str = field(default="f16", metadata={
        "choices": TARGET_OUTTYPES, "help": "llamacpp: also write the target as GGUF of this type (none: skip)"})
    llamacpp_dir: str | None = field(default=None, metadata={
        "help": "llamacpp: a llama.cpp tree (default: the one `engines install` made)"})

    def __post_init__(self) -> None:
        _choice("--outtype", self.outtype, DRAFT_OUTTYPES)
        _choice("--target-outtype", self.target_outtype, TARGET_OUTTYPES)
        if self.num_steps < 1:
            raise ValueError(f"--num-steps must be >= 1, got {self.num_steps}")


@dataclass(kw_only=True)
class ExportConfig:
    draft: str = field(metadata={"help": "native draft directory, or `reference` (the shipped draft)"})
    to: str = field(metadata={"choices": EXPORT_FORMATS, "help": "the engine format to write"})
    out: str = field(metadata={"help": "output directory"})
    allow_target_mismatch: list[str] | None = field(default=None, metadata={"help": _ALLOW_HELP})
    export: ExportSettings = field(default_factory=ExportSettings)  # its fields are flags of their own

    def __post_init__(self) -> None:
        _choice("--to", self.to, EXPORT_FORMATS)

    @property
    def allow(self) -> set[str]:
        return set(self.allow_target_mismatch or ())


@dataclass(kw_only=True)
class ImportConfig:
    src: str = field(metadata={"positional": True, "help": "the checkpoint directory to import"})
    format: str = field(metadata={"flag": "from", "choices": IMPORT_FORMATS, "help": "whose checkpoint it is"})
    target: str = field(metadata={"help": "the target the draft serves: preset name, HF model directory or .gguf file"})
    out: str = field(metadata={"help": "native draft directory to write"})
    target_arch: str | None = field(default=None, metadata={
        "help": "the target's architecture whose SGLang model file reads the ids (default: the target's own)"})
    allow_target_mismatch: list[str] | None = field(default=None, metadata={"help": _ALLOW_HELP})

    def __post_init__(self) -> None:
        _choice("--from", self.format, IMPORT_FORMATS)

    @property
    def allow(self) -> set[str]:
        return set(self.allow_target_mismatch or ())


@dataclass(kw_only=True)
class EnginesConfig:
    action: str = field(metadata={"positional": True, "choices": ENGINE_ACTIONS,
                                  "help": "install: download and build it once; which: what the commands will use"})
    engine: str = field(metadata={"positional": True, "choices": INSTALLABLE_ENGINES, "help": "the engine"})
    llamacpp_dir: str | None = field(default=None, metadata={
        "help": "use this llama.cpp build (directory or llama-server binary)"})
    jobs: int | None = field(default=None, metadata={"help": "parallel compile jobs (default: all cores)"})
    build: bool = field(default=False, metadata={"help": "build into the cache even when llama-server is on PATH"})

    def __post_init__(self) -> None:
        _choice("ACTION", self.action, ENGINE_ACTIONS)
        _choice("ENGINE", self.engine, INSTALLABLE_ENGINES)
        if self.jobs is not None and self.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {self.jobs}")
