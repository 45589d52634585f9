"""The transformers directory a server engine (SGLang, vLLM) loads for eaglewire's ``--target``."""

from __future__ import annotations

from pathlib import Path


def served_target(target: str | Path, engine: str, error: type[Exception]) -> Path:
    """A preset's dequantized directory (the one eaglewire makes from its GGUF, as ``export.verifier`` names it),
    an HF directory itself; a .gguf refused with ``error``: ``engine`` here serves a transformers directory."""
    from eaglewire.core.presets import TARGET_PRESETS
    from eaglewire.model.target import resolve_target_path

    spec = str(target)
    if spec in TARGET_PRESETS:
        return resolve_target_path(spec)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        raise error(f"{engine} here serves a transformers directory, not the GGUF {path}: pass the target's model "
                    "directory (or a preset name, whose dequantized directory eaglewire makes)")
    return resolve_target_path(str(path)).resolve()
