"""Export eaglewire drafts for serving engines; import drafts other tools made.

| format           | export | import | config ids mean (contract.py)                       |
|------------------|--------|--------|-----------------------------------------------------|
| sglang           | yes    | yes    | SGLang's rule for the target's model file           |
| vllm/speculators | yes    | yes    | boundaries verbatim (vLLM sorts them)               |
| llamacpp (GGUF)  | yes    | -      | boundaries verbatim, exactly 3 (formats/llamacpp.py) |
| specforge        | -      | yes    | output of layer i (boundary i + 1)                  |
| eagle            | -      | yes    | none: hard-coded [2, L//2, L-3]                     |

An export writes ``config.json``, ``model.safetensors`` and ``SERVING.md`` (launch flags, and
how the other engines would read the directory) and records the contract under the config
key ``eaglewire`` (engines ignore unknown keys). The target's architecture picks the SGLang
rule (the draft's contract records it). An import reads the ids in the tool's convention (a
recorded contract wins), checks dimensions against the target and writes a native draft.
native -> export -> import is the identity. ``read_ids`` is the one reader of where each
engine keeps its ids; the doctor uses it too.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eaglewire.checkpoint import CHECKPOINT_FORMAT, save_draft
from eaglewire.contract import (ContractError, EngineConventionError, HiddenStateContract, default_aux_boundaries,
                                from_engine, model_file, sglang_ambiguity)
from eaglewire.contract import target_arch as target_arch_key
from eaglewire.draft import DraftConfig
from eaglewire.formats import eagle, llamacpp, sglang, specforge, speculators
from eaglewire.formats.export import (RECORD_KEY, ExportReport, check_choice, default_target_arch,
                                      export_native)
from eaglewire.formats.eagle import FormatError
from eaglewire.target import Target

log = logging.getLogger(__name__)

EXPORT_FORMATS: tuple[str, ...] = ("sglang", "vllm", "speculators", "llamacpp")
IMPORT_FORMATS: tuple[str, ...] = ("sglang", "specforge", "speculators", "vllm", "eagle")
_MODULES = {"sglang": sglang, "specforge": specforge, "eagle": eagle, "speculators": speculators,
            "vllm": speculators}
_CONVENTIONS = {**{f: f for f in _MODULES}, "vllm": "speculators"}  # format -> contract.py engine

__all__ = ["EXPORT_FORMATS", "IMPORT_FORMATS", "ExportReport", "FormatError", "ImportReport",
           "export_draft", "import_draft", "infer_boundaries", "read_checkpoint", "read_ids"]


@dataclass(kw_only=True)
class ImportReport:
    format: str
    src_dir: Path
    out_dir: Path
    engine_ids: list[int] | None  # as read from the checkpoint's config (None: absent)
    aux_boundaries: list[int]
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        ids = "no ids" if self.engine_ids is None else f"config ids {self.engine_ids}"
        return "\n".join([f"imported {self.format} draft {self.src_dir} to {self.out_dir}: {ids} "
                          f"-> boundaries {self.aux_boundaries}"] + [f"note: {n}" for n in self.notes])


# ---------------------------------------------------------------- boundaries

def read_ids(engine: str, config: dict[str, Any]) -> tuple[dict[str, list[int] | None], list[str]]:
    """Where ``engine`` finds its aux ids in ``config``: (label -> ids, None for its default;
    notes). The one reader of each engine's keys: import and the doctor both use it."""
    if engine in ("sglang", "specforge"):
        ids, notes = sglang.config_ids(config, reader="SGLang" if engine == "sglang" else "SpecForge")
        return {engine: ids}, notes
    if engine in ("vllm", "speculators"):
        return speculators.id_readings(config), []
    if engine == "eagle":
        return {"eagle": None}, []
    raise ValueError(f"engine {engine!r} is not one of sglang, specforge, vllm, speculators, eagle")


def infer_boundaries(fmt: str, ids: list[int] | None, num_layers: int, *,
                     target_arch: str | None = None) -> tuple[list[int], list[str]]:
    """(boundaries a ``fmt`` checkpoint with config ``ids`` was made for, notes).

    Missing ids, and every EAGLE reference checkpoint, mean the default [2, L//2, L-3]
    that every tool falls back to; the notes say so. sglang ids are read with the rule of
    the target's model file (``target_arch``, required); a note names the target families
    on which SGLang reads them differently.
    """
    convention = _CONVENTIONS[check_choice(fmt, IMPORT_FORMATS, "format")]
    if ids is None or convention == "eagle":
        bounds = default_aux_boundaries(num_layers)
        why = ("the EAGLE reference code hard-codes its aux layers" if convention == "eagle"
               else "the config carries no aux layer ids")
        return bounds, [f"{why}: assuming the default boundaries {bounds} ([2, L//2, L-3]) that every "
                        "tool falls back to; a draft trained on other layers would be fed the wrong states"]
    arch = target_arch if convention in ("sglang", "speculators") else None
    try:
        bounds = from_engine(ids, num_layers, convention, target_arch=arch)
    except EngineConventionError as e:
        raise type(e)(f"config ids {ids} ({fmt} convention) do not fit this {num_layers}-layer target: {e}. "
                      "Was the draft made for another target?") from e
    notes = []
    if convention == "sglang":
        f = model_file("sglang", arch)
        ambiguity = sglang_ambiguity(bounds, ids, num_layers)
        notes.append(f"read ids {ids} as boundaries {bounds} with the rule of {f.path} ({target_arch_key(arch)} "
                     f"target){'; ' + ambiguity if ambiguity else ''}")
    if list(ids) != bounds and convention == "speculators":
        notes.append(f"vLLM sorts the ids: {ids} feeds boundaries {bounds} in that order")
    return bounds, notes


def _recorded_boundaries(record: dict[str, Any], bounds: list[int], target: Target,
                         allow: frozenset[str] | set[str]) -> tuple[list[int], list[str]]:
    """The boundaries of the contract an eaglewire export recorded (checked against
    ``target``), preferred over ``bounds`` read from the config ids."""
    contract = HiddenStateContract.from_dict(record)
    notes = contract.check_target(target.fingerprint, what="the exported draft", allow=allow)
    recorded = list(contract.aux_boundaries)
    if recorded != bounds:
        notes.append(f"the config ids read as boundaries {bounds}, but eaglewire exported this draft for "
                     f"{recorded}; using the recorded {recorded}")
    return recorded, notes


# ---------------------------------------------------------------- import

def read_checkpoint(src: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, every tensor in *.safetensors, else in pytorch_model*.bin) of a directory."""
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} is not a draft checkpoint directory: no config.json (expected "
                                "config.json plus model.safetensors or pytorch_model.bin)")
    try:
        config = json.loads((src / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise FormatError(f"{src / 'config.json'} is not valid JSON: {e}") from e
    if config.get("format") == CHECKPOINT_FORMAT:
        raise FormatError(f"{src} is already an eaglewire draft; use it directly, no import needed")
    state: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(path)))
    for path in [] if state else sorted(src.glob("pytorch_model*.bin")):
        obj = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise FormatError(f"{path} does not hold a flat dict of tensors (a state dict)")
        state.update(obj)
    if not state:
        raise FileNotFoundError(f"{src} holds no weights: expected *.safetensors or pytorch_model*.bin")
    return config, state


def _check_dims(cfg: DraftConfig, target: Target, where: str) -> None:
    for name, ours, theirs in (("target_hidden_size", cfg.target_hidden_size, target.hidden_size),
                               ("vocab_size", cfg.vocab_size, target.vocab_size)):
        if ours != theirs:
            raise ContractError(f"{where}: {name} is {ours} but target {target.spec} has {theirs}: the draft "
                                "was made for another target (or the wrong target was given)")


def _check_embedding(embed: torch.Tensor | None, target: Target, allow: frozenset[str] | set[str]) -> list[str]:
    """The checkpoint's own copy of the target embedding must be this target's."""
    if embed is None:
        return []
    ours = target.embed_tokens.weight.detach().to("cpu", torch.float32)
    if tuple(embed.shape) != tuple(ours.shape):
        raise ContractError(f"embed_tokens.weight is {tuple(embed.shape)} but target {target.spec}'s "
                            f"embedding is {tuple(ours.shape)}: the draft was made for another target")
    rel = float((embed.float() - ours).norm() / ours.norm().clamp_min(1e-12))
    if rel <= 1e-2:
        return []
    msg = (f"embed_tokens.weight differs from target {target.spec}'s embedding (relative difference "
           f"{rel:.3g}): the draft was trained on other target weights")
    if "weights_sha256" in allow:
        return [msg + "; allowed, eaglewire uses the target's embedding"]
    raise ContractError(msg + ". If deliberate (e.g. a requantized target), allow it with "
                        "--allow-target-mismatch weights_sha256")


def import_draft(src_dir: str | Path, from_: str, target: Target, out_dir: str | Path, *,
                 target_arch: str | None = None, allow: frozenset[str] | set[str] = frozenset()
                 ) -> ImportReport:
    """Convert a ``from_`` checkpoint directory into a native draft for ``target`` in ``out_dir``.

    sglang ids are read with the rule of the target's model file (``target_arch``, default:
    the target's own architecture).

    Raises FormatError (unreadable or unrepresentable checkpoint), ContractError (made for
    another target; ``allow`` may contain ``weights_sha256`` to accept a different
    embedding) or FileNotFoundError. Warnings land in the report's notes.
    """
    fmt = check_choice(from_, IMPORT_FORMATS, "import format")
    src, out = Path(src_dir), Path(out_dir)
    if out.resolve() == src.resolve():
        raise ValueError(f"the output directory {out} is the checkpoint being imported; choose another")
    config, state = read_checkpoint(src)
    where = str(src / "config.json")
    fields, ids, notes = _MODULES[fmt].parse_config(config, where=where)
    ht, vd = fields.pop("target_hidden_size"), fields.pop("draft_vocab_size")
    tensors, foreign = eagle.split_state(state, where=str(src))
    cfg = eagle.draft_config(fields, tensors, where=where, target_hidden_size=ht, draft_vocab_size=vd)
    _check_dims(cfg, target, where)
    arch = (default_target_arch(target_arch, target.fingerprint.architecture) if fmt == "sglang" else target_arch)
    bounds, more = infer_boundaries(fmt, ids, target.num_layers, target_arch=arch)
    record = (config.get(RECORD_KEY) or {}).get("contract")
    if record is not None:
        bounds, more = _recorded_boundaries(record, bounds, target, allow)
    notes += more + _check_embedding(foreign.get("embed_tokens.weight"), target, allow)
    if len(bounds) != cfg.num_aux:
        raise ContractError(f"{where}: the draft fuses {cfg.num_aux} target states (fc.weight is "
                            f"{tuple(tensors['fc.weight'].shape)}) but the config names {len(bounds)} "
                            f"aux layers ({bounds}); fix eagle_aux_hidden_state_layer_ids")
    d2t, t2d, vocab_notes = eagle.complete_vocab_maps(
        tensors.pop("d2t", None), tensors.pop("t2d", None), vocab_size=cfg.vocab_size,
        draft_vocab_size=cfg.draft_vocab_size, where=where)
    draft, notes = eagle.build_draft(cfg, tensors, d2t, t2d, where=where), notes + vocab_notes
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    keep = dtypes.pop() if len(dtypes) == 1 else torch.float32  # the source precision, bit for bit
    contract = HiddenStateContract(aux_boundaries=tuple(bounds), target=target.fingerprint)
    save_draft(out, draft, contract, {"imported_from": str(src), "format": fmt, "engine_ids": ids,
                                      "target": target.spec, "notes": notes}, dtype=keep)
    for note in notes:
        log.warning("%s", note)
    return ImportReport(format=fmt, src_dir=src, out_dir=out, engine_ids=ids, aux_boundaries=bounds, notes=notes)


# ---------------------------------------------------------------- export

def export_draft(draft_dir: str | Path, to: str, out_dir: str | Path, *, target_arch: str | None = None,
                 verifier_name: str | None = None, target: Target | None = None, num_steps: int = 5,
                 allow: frozenset[str] | set[str] = frozenset(), outtype: str = "q8_0",
                 target_outtype: str = "f16", llamacpp_dir: str | Path | None = None) -> ExportReport:
    """Write the native draft in ``draft_dir`` in the format of engine ``to`` to ``out_dir``:
    sglang / vllm / speculators by ``export.export_native``, llamacpp by ``llamacpp.export``
    (llama.cpp's converter over the vllm export; ``outtype``, ``target_outtype`` and
    ``llamacpp_dir`` are its alone)."""
    if check_choice(to, EXPORT_FORMATS, "export format") == "llamacpp":
        return llamacpp.export(draft_dir, out_dir, verifier_name=verifier_name, target=target, num_steps=num_steps,
                               allow=allow, outtype=outtype, target_outtype=target_outtype, llamacpp_dir=llamacpp_dir)
    return export_native(draft_dir, to, out_dir, target_arch=target_arch, verifier_name=verifier_name,
                         target=target, num_steps=num_steps, allow=allow)
