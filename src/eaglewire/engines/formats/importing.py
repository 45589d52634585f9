"""Importing drafts other tools made: read the checkpoint directory, parse its config with the
engine's own reader (``parse_config``), read the ids in the engine's convention (a contract an
eaglewire export recorded wins), check dimensions and embedding against the target, write a
native draft. native -> export -> import is the identity. ``engines.import_draft`` picks the
engine by name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eaglewire.core.errors import CorruptFileError, read_json_object, reading
from eaglewire.model.checkpoint import CHECKPOINT_FORMAT, DAMAGED_DRAFT, save_draft
from eaglewire.core.contract import ContractError, HiddenStateContract
from eaglewire.model.draft import DraftConfig
from eaglewire.engines.formats import eagle3_layout
from eaglewire.engines.export import RECORD_KEY, default_target_arch
from eaglewire.engines.formats.eagle3_layout import FormatError
from eaglewire.model.target import Target

log = logging.getLogger(__name__)


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


def read_checkpoint(src: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, every tensor in *.safetensors, else in pytorch_model*.bin) of a directory."""
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} is not a draft checkpoint directory: no config.json (expected "
                                "config.json plus model.safetensors or pytorch_model.bin)")
    config = read_json_object(src / "config.json", DAMAGED_DRAFT)
    if config.get("format") == CHECKPOINT_FORMAT:
        raise FormatError(f"{src} is already an eaglewire draft; use it directly, no import needed")
    state: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        with reading(path, DAMAGED_DRAFT):
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
    rel = eagle3_layout.relative_difference(embed, ours)
    if rel <= eagle3_layout.SAME_WEIGHTS_TOLERANCE:
        return []
    msg = (f"embed_tokens.weight differs from target {target.spec}'s embedding (relative difference "
           f"{rel:.3g}): the draft was trained on other target weights")
    if "weights_sha256" in allow:
        return [msg + "; allowed, eaglewire uses the target's embedding"]
    raise ContractError(msg + ". If deliberate (e.g. a requantized target), allow it with "
                        "--allow-target-mismatch weights_sha256")


def import_checkpoint(src_dir: str | Path, fmt: str, engine, target: Target, out_dir: str | Path, *,
                      infer: Callable[..., tuple[list[int], list[str]]], target_arch: str | None = None,
                      allow: frozenset[str] | set[str] = frozenset()) -> ImportReport:
    """Convert a ``fmt`` checkpoint directory (``engine``: its registry entry) into a native draft
    for ``target`` in ``out_dir``; ``infer``: ``engines.infer_boundaries``.

    Ids read per model file (sglang) use the rule of the target's (``target_arch``, default:
    the target's own architecture).

    Raises FormatError (unreadable or unrepresentable checkpoint), ContractError (made for
    another target; ``allow`` may contain ``weights_sha256`` to accept a different
    embedding) or FileNotFoundError. Warnings land in the report's notes.
    """
    src, out = Path(src_dir), Path(out_dir)
    if out.resolve() == src.resolve():
        raise ValueError(f"the output directory {out} is the checkpoint being imported; choose another")
    config, state = read_checkpoint(src)
    where = str(src / "config.json")
    fields, ids, notes = engine.importer.parse_config(config, where=where)
    ht, vd = fields.pop("target_hidden_size"), fields.pop("draft_vocab_size")
    tensors, foreign = eagle3_layout.split_state(state, where=str(src))
    cfg = eagle3_layout.draft_config(fields, tensors, where=where, target_hidden_size=ht, draft_vocab_size=vd)
    _check_dims(cfg, target, where)
    arch = (default_target_arch(target_arch, target.fingerprint.architecture) if engine.needs_target_arch
            else target_arch)
    bounds, more = infer(fmt, ids, target.num_layers, target_arch=arch)
    record = (config.get(RECORD_KEY) or {}).get("contract")
    if record is not None:
        bounds, more = _recorded_boundaries(record, bounds, target, allow)
    notes += more + _check_embedding(foreign.get("embed_tokens.weight"), target, allow)
    if len(bounds) != cfg.num_aux:
        raise ContractError(f"{where}: the draft fuses {cfg.num_aux} target states (fc.weight is "
                            f"{tuple(tensors['fc.weight'].shape)}) but the config names {len(bounds)} "
                            f"aux layers ({bounds}); fix eagle_aux_hidden_state_layer_ids")
    d2t, t2d, vocab_notes = eagle3_layout.complete_vocab_maps(
        tensors.pop("d2t", None), tensors.pop("t2d", None), vocab_size=cfg.vocab_size,
        draft_vocab_size=cfg.draft_vocab_size, where=where)
    draft, notes = eagle3_layout.build_draft(cfg, tensors, d2t, t2d, where=where), notes + vocab_notes
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    keep = dtypes.pop() if len(dtypes) == 1 else torch.float32  # the source precision, bit for bit
    contract = HiddenStateContract(aux_boundaries=tuple(bounds), target=target.fingerprint)
    save_draft(out, draft, contract, {"imported_from": str(src), "format": fmt, "engine_ids": ids,
                                      "target": target.spec, "notes": notes}, dtype=keep)
    for note in notes:
        log.warning("%s", note)
    return ImportReport(format=fmt, src_dir=src, out_dir=out, engine_ids=ids, aux_boundaries=bounds, notes=notes)


# ---------------------------------------------------------------- DFlash

def is_dflash_dir(src_dir: str | Path) -> bool:
    """A directory whose config.json is a DFlash draft's (z-lab's or speculators' layout)."""
    from eaglewire.engines.formats.dflash_layout import is_dflash_config

    path = Path(src_dir) / "config.json"
    try:
        return path.is_file() and is_dflash_config(read_json_object(path, DAMAGED_DRAFT))
    except CorruptFileError:
        return False  # read_checkpoint names the broken file


def import_dflash(src_dir: str | Path, fmt: str, engine, target: Target, out_dir: str | Path, *,
                  from_engine: Callable[..., list[int]], target_arch: str | None = None,
                  allow: frozenset[str] | set[str] = frozenset()) -> ImportReport:
    """A DFlash directory (z-lab's layout ``--from zlab``/``specforge``, speculators' ``--from speculators``)
    as a native DFlash draft for ``target``: the ids read with ``fmt``'s own reading (``parse_dflash_config``,
    then ``from_engine``: ``engines.from_engine``, with ``family="dflash"``), an eaglewire export's recorded
    contract winning."""
    import eaglewire.engines.formats.dflash_layout as dflash

    src, out = Path(src_dir), Path(out_dir)
    if out.resolve() == src.resolve():
        raise ValueError(f"the output directory {out} is the checkpoint being imported; choose another")
    parse = engine.importer.parse_dflash_config
    if parse is None:
        raise FormatError(f"{src} holds a DFlash draft, which --from {fmt} does not read; import it with --from zlab "
                          "(z-lab / SpecForge layout) or --from speculators")
    config, state = read_checkpoint(src)
    where = str(src / "config.json")
    fields, ids, notes = parse(config, where=where)
    tensors, foreign = dflash.split_state(state)
    if fields["hidden_size"] != target.hidden_size:
        raise ContractError(f"{where}: hidden_size is {fields['hidden_size']} but target {target.spec} has "
                            f"{target.hidden_size}: the draft was made for another target")
    if fields.get("draft_vocab_size") is not None:  # pruned: the maps are the draft's own
        tensors.update(dflash.vocab_maps_of(foreign, fields["draft_vocab_size"], target.vocab_size, where=where))
    draft = dflash.build_draft(fields, tensors, vocab_size=target.vocab_size, where=where)
    dflash.check_head_rows(foreign.get("lm_head.weight"), draft, target, where=where)
    if ids is None:
        raise ContractError(f"{where}: the config names no target layers, so {fmt} would use its default; write "
                            "the ids the draft was trained on before importing")
    bounds = from_engine(ids, target.num_layers, engine.name, family="dflash",
                         target_arch=default_target_arch(target_arch, target.fingerprint.architecture)
                         if engine.needs_target_arch else target_arch)
    record = (config.get(RECORD_KEY) or {}).get("contract")
    if record is not None:
        bounds, more = _recorded_boundaries(record, bounds, target, allow)
        notes += more
    notes += _check_embedding(foreign.get("embed_tokens.weight"), target, allow)
    if len(bounds) != draft.config.num_aux:
        raise ContractError(f"{where}: the draft fuses {draft.config.num_aux} target states (fc.weight is "
                            f"{tuple(tensors['fc.weight'].shape)}) but the config names {len(bounds)} layers "
                            f"({ids}); fix the ids")
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    keep = dtypes.pop() if len(dtypes) == 1 else torch.float32
    contract = HiddenStateContract(aux_boundaries=tuple(bounds), target=target.fingerprint, family="dflash")
    save_draft(out, draft, contract, {"imported_from": str(src), "format": fmt, "engine_ids": ids,
                                      "target": target.spec, "notes": notes}, dtype=keep)
    for note in notes:
        log.warning("%s", note)
    return ImportReport(format=fmt, src_dir=src, out_dir=out, engine_ids=ids, aux_boundaries=bounds, notes=notes)
