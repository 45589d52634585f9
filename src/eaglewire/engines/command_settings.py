"""The settings of ``eaglewire export``, ``import`` and ``engines``, and ``EngineRunConfig`` (how bench and tune
run an engine): every flag, its default and help, checked once (core/configs.py turns the fields into flags
and ``--config`` keys). Their choices are the registry's engine names, so they sit above the engines."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from eaglewire.engines import llamacpp, sglang, vllm
from eaglewire.engines import Ability, names as engine_names
from eaglewire.engines import export_draft
from eaglewire.engines.export import ExportConfig
from eaglewire.engines.interface import InstallSettings, RunSettings
from eaglewire.engines.llamacpp import DRAFT_OUTTYPES, TARGET_OUTTYPES

EXPORT_FORMATS = engine_names(Ability.EXPORT)
IMPORT_FORMATS = engine_names(Ability.IMPORT)
ENGINE_ACTIONS = ("install", "which")
# third-party engines `eaglewire engines` installs or finds: those with an installer, in name order
INSTALLABLE_ENGINES = tuple(sorted(engine_names(Ability.INSTALL, aliases=False)))

_ALLOW_HELP = ("target fingerprint fields allowed to differ from the draft's, e.g. weights_sha256 for a "
               "requantized target")


def _choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{flag} {value!r} is not one of {', '.join(choices)}")


@dataclass(kw_only=True)
class ExportCommandConfig:
    """``eaglewire export``: which draft, to which engine, where; ``export`` holds how it is written
    (the library's ``ExportConfig``, every default once)."""

    draft: str = field(metadata={"help": "native draft directory, or `reference` (the shipped draft)"})
    to: str = field(metadata={"choices": EXPORT_FORMATS, "help": "the engine format to write"})
    out: str = field(metadata={"help": "output directory"})
    allow_target_mismatch: list[str] | None = field(default=None, metadata={"help": _ALLOW_HELP})
    export: ExportConfig = field(default_factory=ExportConfig)  # its fields are flags of their own

    def __post_init__(self) -> None:
        _choice("--to", self.to, EXPORT_FORMATS)
        _choice("--outtype", self.export.outtype, DRAFT_OUTTYPES)
        _choice("--target-outtype", self.export.target_outtype, TARGET_OUTTYPES)

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
    vllm_python: str | None = field(default=None, metadata={
        "help": "vllm: use this python (any that can `import vllm`) instead of eaglewire's own venv"})
    sglang_python: str | None = field(default=None, metadata={
        "help": "sglang: use this python (one whose sgl_kernel has the CPU ops) instead of eaglewire's own venv"})
    kernel_source: str | None = field(default=None, metadata={
        "help": "sglang: build the CPU kernels from this archive, sgl-kernel directory or git URL[@commit] "
                "(default: the pinned archive in ../shared/third_party)"})

    def __post_init__(self) -> None:
        _choice("ACTION", self.action, ENGINE_ACTIONS)
        _choice("ENGINE", self.engine, INSTALLABLE_ENGINES)
        if self.jobs is not None and self.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {self.jobs}")
        if self.engine != vllm.NAME and self.vllm_python is not None:
            raise ValueError("--vllm-python is for `engines ... vllm`")
        if self.engine != sglang.NAME and (self.sglang_python is not None or self.kernel_source is not None):
            raise ValueError("--sglang-python and --kernel-source are for `engines ... sglang`")
        if self.engine != llamacpp.NAME and (self.llamacpp_dir or self.build):
            raise ValueError("--llamacpp-dir and --build are for `engines ... llamacpp`")
        if self.engine == vllm.NAME and self.jobs:
            raise ValueError("--jobs is for the engines built here (llamacpp, sglang)")

    def settings(self) -> InstallSettings:
        """What the engine's installer is handed (each flag belongs to one engine, checked above)."""
        return InstallSettings(install=self.llamacpp_dir or self.vllm_python or self.sglang_python, jobs=self.jobs,
                               build=self.build, source=self.kernel_source, export=export_draft)


@dataclass(kw_only=True)
class EngineRunConfig:
    """How bench and tune run an engine that is launched here as a server (``interface.RunSettings``)."""

    engine_target: str | None = field(default=None, metadata={
        "help": "the engine's own target file (llamacpp: a GGUF; default: the weights eaglewire runs, exported)"})
    engine_draft: str | None = field(default=None, metadata={
        "help": "the engine's own draft file or directory (default: --draft exported to the engine's format)"})
    engine_threads: int = field(default=RunSettings.threads, metadata={"help": "threads the engine runs on, pinned"})
    engine_dir: str | None = field(default=None, metadata={
        "help": "the engine install to use (llamacpp: a build directory or llama-server; vllm: a python with vllm)"})
    engine_flags: str | None = field(default=None, metadata={
        "help": "more launch flags for every launch, quoted (e.g. '-fa off')"})

    def __post_init__(self) -> None:
        if self.engine_threads < 1:
            raise ValueError(f"--engine-threads must be >= 1, got {self.engine_threads}")

    def settings(self) -> RunSettings:
        return RunSettings(threads=self.engine_threads, flags=tuple(shlex.split(self.engine_flags or "")),
                           install=self.engine_dir, target_file=self.engine_target, draft_file=self.engine_draft)
