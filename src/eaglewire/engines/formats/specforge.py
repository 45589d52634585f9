"""SpecForge (import only): how its ids read, and its EAGLE-3 checkpoints.

SpecForge trains drafts for SGLang and writes SGLang's file layout (``LlamaForCausalLMEagle3``,
``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``; ids in the nested
``eagle_config.eagle_aux_hidden_state_layer_ids``). Its ids always mean "output of layer i"
(HF ``hidden_states[i + 1]``, boundary ``i + 1``, so boundaries 1..L-1) on every target — the
reading SGLang's ``llama.py``-style model files share, but not every file (engines/sglang/readings.py);
its default ``[1, L//2-1, L-4]`` is boundaries ``[2, L//2, L-3]``.
"""

from __future__ import annotations

import json
from typing import Any

from eaglewire.core.contract import EngineConventionError
from eaglewire.engines.interface import EngineSpec, Exporter, IdReading, Importer
from eaglewire.engines.formats.eagle3_layout import FormatError, eagle_config_ids, parse_eagle3_config
import eaglewire.engines.formats.zlab_layout as zlab

NAME = "specforge"


def to_ids(boundaries: list[int], num_layers: int, arch: str | None) -> list[int]:
    for b in boundaries:
        if b in (0, num_layers):
            raise EngineConventionError(
                f"SpecForge cannot express boundary {b}: its id would be {b - 1}, and SpecForge "
                + ("rejects negative ids" if b == 0 else
                   "reads HF hidden_states[L], which is post-norm, not the pre-norm state"))
    return [b - 1 for b in boundaries]


def to_boundaries(ids: list[int], num_layers: int, arch: str | None) -> list[int]:
    if any(i < 0 for i in ids):
        raise EngineConventionError(f"SpecForge ids {ids} contain a negative id; SpecForge rejects them")
    return [i + 1 for i in ids]


def read_ids(config: dict[str, Any]) -> tuple[dict[str, list[int] | None], list[str]]:
    """Where SpecForge keeps its ids: SGLang's nested key."""
    ids, notes = eagle_config_ids(config, reader="SpecForge")
    return {"specforge": ids}, notes


def parse_config(d: dict[str, Any], *, where: str = "config.json"
                 ) -> tuple[dict[str, Any], list[int] | None, list[str]]:
    """(layer fields + draft_vocab_size/target_hidden_size, SpecForge ids or None, notes).

    The file layout is SGLang's; only the meaning of the ids differs.
    """
    return parse_eagle3_config(d, where=where, reader="SpecForge")


def reads_export(engine: str, *, boundaries: list[int], ids: list[int], num_layers: int,
                 target_arch: str | None) -> list[str]:
    """SERVING.md lines: how SpecForge reads the directory another ``engine``'s export wrote."""
    if engine != "sglang":
        return []
    return ["- SpecForge (and `eaglewire import --from specforge`) reads the nested ids as \"output of layer "
            "i\" (boundary i + 1) on every target: right only where SGLang adds 1 too. Import it with "
            "`eaglewire import --from sglang`, which applies this target's rule."]


# ---------------------------------------------------------------- DFlash (z-lab's layout, alias zlab)
# SpecForge 0.2.0 trains DFlash drafts with z-lab's own class (specforge/modeling/draft/dflash.py
# DFlashDraftModel.__init__: ``dflash_config.get("target_layer_ids", build_target_layer_ids(num_target_layers,
# num_hidden_layers))``; extract_context_feature reads ``hidden_states[layer_id + 1]``, the OUTPUT of layer id)
# and saves it with save_pretrained: z-lab's layout (engines/formats/dflash_layout.py). id = boundary - 1: the layout's
# own ids and its export are engines/formats/zlab_layout.py's (llama.cpp's converter reads the layout too).
ALIASES = ("zlab",)
DFLASH_CITED = "specforge/modeling/draft/dflash.py DFlashDraftModel.__init__ + extract_context_feature (offset 1)"


def dflash_default_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's (and SGLang's) build_target_layer_ids: the ids a config without target_layer_ids means."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def read_dflash_ids(config: dict[str, Any]) -> tuple[dict[str, list[int] | None], list[str]]:
    """Where z-lab's code finds the ids: ``dflash_config.target_layer_ids`` (None: its default)."""
    ids = (config.get("dflash_config") or {}).get("target_layer_ids")
    if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, int) for i in ids)):
        raise FormatError(f"dflash_config.target_layer_ids is {ids!r}; expected a list of integers")
    return {"zlab dflash_config.target_layer_ids": ids}, []


def dflash_config_fix(declared: list[int], num_layers: int, arch: str | None, config: dict[str, Any]) -> str:
    """The exact key and value that make z-lab's readers take ``declared``."""
    written = (config.get("dflash_config") or {}).get("target_layer_ids")
    try:
        want = zlab.to_ids(declared, num_layers, arch)
    except EngineConventionError as e:
        return str(e)
    return (f'dflash_config.target_layer_ids is {json.dumps(written)}; write "dflash_config": {{"target_layer_ids": '
            f"{json.dumps(want)}}} (z-lab ids are layer outputs: boundary - 1), or re-export with "
            "`eaglewire export --to zlab`")


def parse_dflash_config(d: dict[str, Any], *, where: str = "config.json"
                        ) -> tuple[dict[str, Any], list[int] | None, list[str]]:
    """(DFlashConfig fields but num_aux / vocab_size, z-lab ids or None, notes) of a z-lab directory."""
    from eaglewire.engines.formats.dflash_layout import is_speculators, parse

    if is_speculators(d):
        raise FormatError(f"{where} is a speculators DFlash config; import it with --from speculators")
    fields, _ = parse(d, where=where)
    found, notes = read_dflash_ids(d)
    ids = next(iter(found.values()))
    if ids is None:
        L = d.get("num_target_layers")
        if L is None:
            raise FormatError(f"{where}: no dflash_config.target_layer_ids and no num_target_layers: the layers "
                              "the draft reads are unknown")
        ids = dflash_default_ids(int(L), fields["num_hidden_layers"])
        notes.append(f"no dflash_config.target_layer_ids: z-lab's build_target_layer_ids({L}, "
                     f"{fields['num_hidden_layers']}) = {ids}")
    return fields, ids, notes


def export(draft, fmt, out, config, *, target=None, allow=frozenset(), others=None):
    """SpecForge's (z-lab's) layout holds DFlash drafts; an EAGLE-3 draft for SpecForge is SGLang's layout."""
    raise FormatError("an EAGLE-3 draft has no z-lab export: SpecForge reads SGLang's EAGLE-3 layout, so export "
                      "it with --to sglang (z-lab's layout is for DFlash drafts)")


SPEC = EngineSpec(
    name=NAME, aliases=ALIASES, reads_export=reads_export,
    eagle3=IdReading(to_ids=to_ids, to_boundaries=to_boundaries, read_ids=read_ids),
    dflash=IdReading(to_ids=zlab.to_ids, to_boundaries=zlab.to_boundaries, read_ids=read_dflash_ids),
    exporter=Exporter(export=export, export_dflash=zlab.export),
    importer=Importer(parse_config=parse_config, parse_dflash_config=parse_dflash_config),
    linter=None,
)
