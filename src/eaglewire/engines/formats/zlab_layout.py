"""z-lab's DFlash layout as eaglewire writes it: the ids (``dflash_config.target_layer_ids`` = boundary - 1) and
the export directory. Not an engine: SpecForge writes this layout (its ``--to zlab`` export, engines/formats/specforge.py),
and llama.cpp's converter reads it (engines/llamacpp/dflash_export.py), so it lives below both. The layout's
config and tensors are engines/formats/dflash_layout.py's.

SpecForge 0.2.0 trains DFlash drafts with z-lab's own class (specforge/modeling/draft/dflash.py
DFlashDraftModel.__init__: ``dflash_config.get("target_layer_ids", build_target_layer_ids(num_target_layers,
num_hidden_layers))``; extract_context_feature reads ``hidden_states[layer_id + 1]``, the OUTPUT of layer id).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eaglewire.core.contract import EngineConventionError
from eaglewire.engines.formats.dflash_layout import zlab_config
from eaglewire.engines.export import ExportConfig, ExportReport, finish, record, serving_dtype, write_export
from eaglewire.model.checkpoint import DraftFiles


def to_ids(boundaries: list[int], num_layers: int, arch: str | None) -> list[int]:
    """z-lab's ``dflash_config.target_layer_ids`` for ``boundaries``: boundary - 1."""
    for b in boundaries:
        if b == 0:
            raise EngineConventionError(
                "z-lab's format cannot express boundary 0 (the embedding output): its id would be -1, and every "
                "reader of dflash_config.target_layer_ids refuses negative ids (SGLang's "
                "DFlashDraftConfig.resolve_target_layer_ids raises). Retrain without boundary 0, or serve with vLLM "
                "(speculators format, `--to vllm`) or eaglewire")
        if b == num_layers:
            raise EngineConventionError(
                f"z-lab's format cannot express boundary {num_layers}: its id {num_layers - 1} reads HF "
                f"hidden_states[{num_layers}], which is after the final norm, while SGLang, vLLM and llama.cpp read "
                "the pre-norm state there. Retrain without it, or serve with vLLM (`--to vllm`) or eaglewire")
    return [b - 1 for b in boundaries]


def to_boundaries(ids: list[int], num_layers: int, arch: str | None) -> list[int]:
    if any(i < 0 or i >= num_layers for i in ids):
        raise EngineConventionError(f"z-lab target_layer_ids {ids} leave [0, {num_layers}): no such layer output "
                                    f"on a {num_layers}-layer target")
    return [i + 1 for i in ids]


def export_config(draft: DraftFiles, engine: str, notes: list[str]) -> tuple[dict[str, Any], str]:
    """(config.json in z-lab's layout with the export record for ``engine``, the torch dtype it names); a note
    goes to ``notes`` when the target's stored dtype is unknown."""
    contract = draft.contract
    ids = to_ids(list(contract.aux_boundaries), contract.num_layers, None)
    dtype = serving_dtype(draft.target_spec, contract.target.dtype, notes)
    return {**zlab_config(draft.draft_config, ids, num_target_layers=contract.num_layers, dtype=dtype),
            **record(draft, None, engine)}, dtype


def export(draft: DraftFiles, fmt: str, out: Path, config: ExportConfig, *, target=None, allow=frozenset(),
           others=None) -> ExportReport:
    """Write a DFlash ``draft`` in z-lab's layout (what SGLang, vLLM and llama.cpp's converter load)."""
    contract = draft.contract
    bounds, L = list(contract.aux_boundaries), contract.num_layers
    ids = to_ids(bounds, L, None)
    notes: list[str] = []
    engine_config, _ = export_config(draft, "zlab", notes)
    serving = "\n".join([
        "# This DFlash draft in z-lab's layout", "",
        f"It reads target boundaries {bounds}; z-lab's `dflash_config.target_layer_ids` are layer outputs "
        f"(HF hidden_states[i + 1]), so they are {json.dumps(ids)}. SGLang, vLLM and llama.cpp's converter load "
        "this layout; `eaglewire export --to sglang | vllm | llamacpp` writes each one's own launch command.", ""])
    files = write_export(out, engine_config, draft.state(), serving)
    return finish(ExportReport(format=fmt, out_dir=out, aux_boundaries=bounds, engine_ids=ids, files=files,
                               notes=notes))
