"""What every export shares: its settings (``ExportConfig``, every default once), its report, the
contract record under ``RECORD_KEY``, the dtype engines should run the draft in, and writing the
directory. Each engine's own export lives in its module (``sglang.export``, ``vllm.export``,
``llamacpp.export``); ``engines.export_draft`` picks the engine by name.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eaglewire.model.checkpoint import DraftFiles
from eaglewire.core.contract import ContractError
from eaglewire.core.contract import target_arch as target_arch_key
from eaglewire.engines.formats.eagle3_layout import FormatError
from eaglewire.core.fileio import atomic_save_safetensors, atomic_write_json, atomic_write_text
from eaglewire.model.target import Target, load_target

log = logging.getLogger(__name__)

RECORD_KEY = "eaglewire"  # the config key under which every export records the native contract

# (engine being exported for, boundaries, its ids, num_layers, target_arch) -> SERVING.md lines
# saying how the other engines read that directory (engines.registry.other_readings).
OtherReadings = Callable[..., list[str]]


def check_choice(value: str, choices: tuple[str, ...], param: str) -> str:
    if value not in choices:
        raise ValueError(f"{param} {value!r} is not one of {', '.join(choices)}")
    return value


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """How ``eaglewire export`` writes a draft for an engine: every default once."""

    target_arch: str | None = field(default=None, metadata={"help": "the target's architecture as the engine loads it, for the engine's reading of the ids (default: the one the draft records), e.g. llama, qwen3, deepseek_v3"})
    verifier_name: str | None = field(default=None, metadata={"help": "target path or hub id written into the export (default: the recorded target, absolute when local)"})
    num_steps: int = field(default=5, metadata={"help": "speculative steps suggested in SERVING.md (and the speculators config)"})
    outtype: str = field(default="q8_0", metadata={"help": "llamacpp: the draft GGUF's weights (llamacpp.DRAFT_OUTTYPES)"})
    target_outtype: str = field(default="f16", metadata={"help": "llamacpp: the target GGUF written beside it, none: skip (llamacpp.TARGET_OUTTYPES)"})
    llamacpp_dir: str | None = field(default=None, metadata={"help": "llamacpp: a llama.cpp tree (default: the one `engines install` made)"})
    threads: int = field(default=2, metadata={"flag": "llamacpp-threads",  # --threads is torch's own
                                              "help": "llamacpp: the threads SERVING.md pins"})
    target_path: str | None = field(default=None, metadata={"help": "llamacpp: the target's directory or .gguf (default: the one the draft records)"})

    def __post_init__(self) -> None:
        if isinstance(self.num_steps, bool) or not isinstance(self.num_steps, int) or self.num_steps < 1:
            raise ValueError(f"num_steps {self.num_steps!r} must be an integer >= 1 (draft tokens per step)")
        if self.threads < 1:
            raise ValueError(f"--threads {self.threads} must be >= 1")


@dataclass(kw_only=True)
class ExportReport:
    format: str
    out_dir: Path
    aux_boundaries: list[int]
    engine_ids: list[int]  # as written into the engine's config
    files: list[str]
    notes: list[str] = field(default_factory=list)  # warnings and SGLang ambiguity sentences

    def summary(self) -> str:
        return "\n".join([f"exported for {self.format} to {self.out_dir}: boundaries {self.aux_boundaries} "
                          f"-> config ids {self.engine_ids}; launch flags in {self.out_dir / 'SERVING.md'}"]
                         + [f"note: {n}" for n in self.notes])


def default_target_arch(target_arch: str | None, architecture: str) -> str:
    """``target_arch`` if given, else the target's recorded HF architecture, as a contract key (a wrapped
    target's wrapper class as given: engines read it through the wrapper's own model file)."""
    from eaglewire.engines.formats.model_file import wrapper_key

    if wrapper_key(target_arch or architecture):
        return str(target_arch or architecture)
    try:
        return target_arch_key(target_arch or architecture)
    except ContractError as e:
        raise type(e)(f"{e}. The target records architecture {architecture!r}") from e


def record(draft: DraftFiles, arch: str | None, engine: str) -> dict[str, Any]:
    """The config entry every export carries: the native contract, whence, for which engine."""
    return {RECORD_KEY: {"contract": draft.contract.to_dict(), "exported_from": str(draft.path),
                         "target_arch": arch, "engine": engine}}


def write_export(out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], serving: str) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors",
                            metadata={"format": "pt"})
    atomic_write_json(out / "config.json", config)
    atomic_write_text(out / "SERVING.md", serving)
    return ["config.json", "model.safetensors", "SERVING.md"]


def load_export_target(draft: DraftFiles) -> Target:
    spec = draft.target_spec
    if not spec:
        raise FormatError(f"a speculators export stores the target's embedding, so it needs the target, and "
                          f"draft {draft.path} records none; pass the target (--target SPEC)")
    log.info("loading target %s for its embedding", spec)
    return load_target(spec, device="cpu", dtype="fp32")


def local_dir(spec: str | None) -> Path | None:
    path = Path(spec).expanduser() if spec else None
    return path.resolve() if path is not None and path.is_dir() else None


def verifier(config: ExportConfig, draft: DraftFiles) -> str | None:
    """The target as the engine should load it: ``verifier_name``, else the recorded target (an absolute
    path when it is a local directory; for a preset, the transformers directory eaglewire dequantized its
    GGUF into, since an engine cannot load a preset's name: ``vllm serve smollm2-135m`` fails)."""
    from eaglewire.core.presets import TARGET_PRESETS

    spec = draft.target_spec
    if config.verifier_name:
        return config.verifier_name
    if spec in TARGET_PRESETS:
        from eaglewire.model.target import resolve_target_path

        return str(resolve_target_path(spec))
    return str(local_dir(spec)) if local_dir(spec) else spec


def stored_dtype(spec: str | None) -> str | None:
    """The dtype a target checkpoint stores (its config.json; None when ``spec`` is not a
    local directory): what engines' ``--dtype auto`` should pick for the draft too (SGLang
    reads a missing ``torch_dtype`` as fp32 and then runs fp16)."""
    path = local_dir(spec)
    if path is not None and (path / "config.json").is_file():
        cfg = json.loads((path / "config.json").read_text())
        for c in (cfg, cfg.get("text_config") or {}):
            dtype = c.get("dtype") or c.get("torch_dtype")
            if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
                return dtype
    return None


def serving_dtype(spec: str | None, fallback: str, notes: list[str]) -> str:
    dtype = stored_dtype(spec)
    if dtype is None:
        dtype = fallback
        notes.append(f"target {spec!r} is not a local model directory, so its stored dtype is unknown: wrote "
                     f"torch_dtype {dtype} (the dtype the draft was made against). SGLang and vLLM run the draft "
                     "in that dtype; set it to the target's own (e.g. bfloat16) if that differs")
    return dtype


def finish(report: ExportReport) -> ExportReport:
    for note in report.notes:
        log.warning("%s", note)
    return report
