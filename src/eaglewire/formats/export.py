"""Exports written by eaglewire itself (SGLang, vLLM/speculators): the engine's config with its
ids, the weights under its names, ``SERVING.md``, and the native contract under ``RECORD_KEY``.
``formats/llamacpp.py`` builds its GGUF on the vLLM export here; ``formats.export_draft``
dispatches between the two.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

import eaglewire.formats.sglang as sglang
import eaglewire.formats.speculators as speculators
from eaglewire.checkpoint import read_draft_config
from eaglewire.contract import (SGLANG_VERSION, VLLM_VERSION, ContractError, EngineConventionError,
                                HiddenStateContract, engine_refusal, model_file, sglang_ambiguity, to_engine)
from eaglewire.contract import target_arch as target_arch_key
from eaglewire.draft import DraftConfig
from eaglewire.fileio import (
    atomic_save_safetensors,
    atomic_write_json,
    atomic_write_text,
)
from eaglewire.formats.eagle import FormatError
from eaglewire.presets import resolve_draft
from eaglewire.target import Target, load_target

log = logging.getLogger(__name__)

NATIVE_EXPORTS: tuple[str, ...] = ("sglang", "vllm", "speculators")
RECORD_KEY = "eaglewire"  # the config key under which every export records the native contract


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


def check_choice(value: str, choices: tuple[str, ...], param: str) -> str:
    if value not in choices:
        raise ValueError(f"{param} {value!r} is not one of {', '.join(choices)}")
    return value



def default_target_arch(target_arch: str | None, architecture: str) -> str:
    """``target_arch`` if given, else the target's recorded HF architecture, as a contract key."""
    try:
        return target_arch_key(target_arch or architecture)
    except ContractError as e:
        raise type(e)(f"{e}. The target records architecture {architecture!r}") from e


def _write_export(out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], serving: str) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors",
                            metadata={"format": "pt"})
    atomic_write_json(out / "config.json", config)
    atomic_write_text(out / "SERVING.md", serving)
    return ["config.json", "model.safetensors", "SERVING.md"]


def _load_export_target(config: dict[str, Any], src: Path) -> Target:
    spec = (config.get("training") or {}).get("target")
    if not spec:
        raise FormatError(f"a speculators export stores the target's embedding, so it needs the target, and "
                          f"draft {src} records none; pass the target (--target SPEC)")
    log.info("loading target %s for its embedding", spec)
    return load_target(spec, device="cpu", dtype="fp32")


def _local_dir(spec: str | None) -> Path | None:
    path = Path(spec).expanduser() if spec else None
    return path.resolve() if path is not None and path.is_dir() else None


def stored_dtype(spec: str | None) -> str | None:
    """The dtype a target checkpoint stores (its config.json; None when ``spec`` is not a
    local directory): what engines' ``--dtype auto`` should pick for the draft too (SGLang
    reads a missing ``torch_dtype`` as fp32 and then runs fp16)."""
    path = _local_dir(spec)
    if path is not None and (path / "config.json").is_file():
        cfg = json.loads((path / "config.json").read_text())
        for c in (cfg, cfg.get("text_config") or {}):
            dtype = c.get("dtype") or c.get("torch_dtype")
            if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
                return dtype
    return None


def _serving_dtype(spec: str | None, fallback: str, notes: list[str]) -> str:
    dtype = stored_dtype(spec)
    if dtype is None:
        dtype = fallback
        notes.append(f"target {spec!r} is not a local model directory, so its stored dtype is unknown: wrote "
                     f"torch_dtype {dtype} (the dtype the draft was made against). SGLang and vLLM run the draft "
                     "in that dtype; set it to the target's own (e.g. bfloat16) if that differs")
    return dtype


def _vllm_reading_of_sglang(bounds: list[int], ids: list[int], arch: str) -> str:
    why = engine_refusal("vllm", arch)
    if why:
        return f"serves no EAGLE-3 draft for this target: {why}."
    off = ("one layer off" if [i + 1 for i in ids] == bounds else "other boundaries") if ids != bounds else "the same"
    return (f"reads the top-level `eagle_aux_hidden_state_layer_ids` {json.dumps(bounds)} (written for it; SGLang "
            "never looks there) verbatim and captures the same boundaries. Without that key its V1 runner would "
            f"read the nested SGLang ids {json.dumps(ids)} verbatim ({off}) and its default V2 runner would fall "
            "back to [2, L//2, L-3]: do not remove it.")


def _sglang_ids_note(bounds: list[int], L: int, arch: str | None) -> str:
    if arch is None:
        return "this target's architecture has no SGLang reading in eaglewire (pass --target-arch)"
    try:
        ids = to_engine(bounds, L, "sglang", target_arch=arch)
    except EngineConventionError as e:
        return f"SGLang cannot serve this draft on this target: {e}"
    return f"its nested ids would be {json.dumps(ids)} for this `{arch}` target"


def export_native(draft_dir: str | Path, to: str, out_dir: str | Path, *, target_arch: str | None = None,
                 verifier_name: str | None = None, target: Target | None = None, num_steps: int = 5,
                 allow: frozenset[str] | set[str] = frozenset()) -> ExportReport:
    """Write the native draft in ``draft_dir`` in the format of engine ``to`` to ``out_dir``.

    The engine's reading is the one of the target's model file: ``target_arch`` (default: the
    architecture the draft's contract records). sglang: EngineConventionError for a layout
    that model file cannot capture. vllm/speculators: needs the target's embedding
    (``target``, else loaded from the spec the draft records; checked against the contract,
    ``allow`` as in ``HiddenStateContract.check_target``). ``verifier_name`` is the target's
    path or HF id as the engine should load it (default: the recorded target, as an absolute
    path when it is a local directory); ``num_steps`` the draft tokens per step in SERVING.md
    and the speculators config. Both write ``torch_dtype``: the target's stored dtype.
    """
    fmt = check_choice(to, NATIVE_EXPORTS, "export format")
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps {num_steps!r} must be an integer >= 1 (draft tokens per step)")
    src, out = resolve_draft(draft_dir), Path(out_dir)
    if out.resolve() == src.resolve():
        raise ValueError(f"the output directory {out} is the draft being exported; choose another")
    config = read_draft_config(src)
    contract = HiddenStateContract.from_dict(config["contract"])
    cfg = DraftConfig.from_dict(config["draft"])
    state = load_file(str(src / "model.safetensors"))
    bounds, L = list(contract.aux_boundaries), contract.num_layers
    spec = (config.get("training") or {}).get("target")
    name = verifier_name or (str(_local_dir(spec)) if _local_dir(spec) else spec)
    shown = name or "<the target's path or id>"
    if fmt == "sglang":
        arch = default_target_arch(target_arch, contract.target.architecture)
    else:
        try:
            arch = default_target_arch(target_arch, contract.target.architecture)
        except ContractError:
            if target_arch:
                raise
            arch = None  # vLLM reads ids verbatim on every model file that serves EAGLE-3
    record = {RECORD_KEY: {"contract": contract.to_dict(), "exported_from": str(src), "target_arch": arch,
                           "engine": f"sglang {SGLANG_VERSION}" if fmt == "sglang" else f"vllm {VLLM_VERSION}"}}
    if fmt == "sglang":
        ids = to_engine(bounds, L, "sglang", target_arch=arch)
        ambiguity = sglang_ambiguity(bounds, ids, L)
        notes = [ambiguity] if ambiguity else []
        dtype = _serving_dtype(spec, contract.target.dtype, notes)
        engine_config, tensors = {**sglang.build_config(cfg, ids, bounds, dtype=dtype), **record}, state
        serving = sglang.serving_md(draft_path=str(out.resolve()), target_name=shown, boundaries=bounds, ids=ids,
                                    target_arch=arch, model_file=model_file("sglang", arch).path,
                                    vllm_reading=_vllm_reading_of_sglang(bounds, ids, arch),
                                    ambiguity=ambiguity, num_steps=num_steps)
    else:
        ids = to_engine(bounds, L, "speculators", target_arch=arch)
        target = target if target is not None else _load_export_target(config, src)
        notes = contract.check_target(target.fingerprint, what=f"draft {src}", allow=allow)
        notes += speculators.verifier_notes(name, is_local_path=bool(name) and Path(name).expanduser().exists())
        stored = stored_dtype(target.spec)
        dtype = stored or _serving_dtype(spec, str(target.dtype).removeprefix("torch."), notes)
        engine_config = {**speculators.build_config(cfg, ids, verifier_name=name, num_steps=num_steps, dtype=dtype,
                                                    verifier_architecture=contract.target.architecture),
                         **record}
        keep_maps = speculators.check_vocab_maps(cfg, state["d2t"])
        tensors = speculators.to_speculators_names(
            {k: v for k, v in state.items() if keep_maps or k not in ("d2t", "t2d")})
        # the target's stored values: vLLM shares the target's embedding only when exactly equal
        tensors["embed_tokens.weight"] = target.embed_tokens.weight.detach().to("cpu", getattr(torch, dtype))
        serving = speculators.serving_md(draft_path=str(out.resolve()), target_name=shown, boundaries=bounds,
                                         num_steps=num_steps, sglang_ids=_sglang_ids_note(bounds, L, arch))
    files = _write_export(out, engine_config, tensors, serving)
    for note in notes:
        log.warning("%s", note)
    return ExportReport(format=fmt, out_dir=out, aux_boundaries=bounds, engine_ids=ids, files=files, notes=notes)
