"""The EAGLE-3 reference code (SafeAILab/EAGLE): import of its checkpoints.

Its config carries no aux ids: the code hard-codes boundaries ``[2, L//2, L-3]``, so a draft on
any other layout cannot run there. The file layout is the shared one (engines/formats/eagle3_layout.py).
"""

from __future__ import annotations

from typing import Any

from eaglewire.core.contract import EngineConventionError, default_aux_boundaries
from eaglewire.engines.interface import EngineSpec, IdReading, Importer
from eaglewire.engines.formats.eagle3_layout import parse_llama_layer

NAME = "eagle"


def to_ids(boundaries: list[int], num_layers: int, arch: str | None) -> list[int]:
    default = default_aux_boundaries(num_layers)
    if boundaries != default:
        raise EngineConventionError(
            f"the EAGLE reference code hard-codes boundaries {default} for a {num_layers}-layer "
            f"target; a draft on {boundaries} cannot run there. Serve it with vLLM, SGLang or eaglewire")
    return list(boundaries)


def to_boundaries(ids: list[int] | None, num_layers: int, arch: str | None) -> list[int]:
    """Whatever the config says: the hard-coded default."""
    return default_aux_boundaries(num_layers)


def read_ids(config: dict[str, Any]) -> tuple[dict[str, list[int] | None], list[str]]:
    """The reference code reads no ids: always its default."""
    return {"eagle": None}, []


# Why reading any of its checkpoints assumes the default boundaries (imports state it).
DEFAULT_ONLY = "the EAGLE reference code hard-codes its aux layers"


def parse_config(d: dict[str, Any], *, where: str = "config.json") -> tuple[dict[str, Any], None, list[str]]:
    """(layer fields + draft_vocab_size/target_hidden_size, ids, notes) of a reference config.

    The reference code reads no aux ids: ids are always None (its hard-coded default).
    """
    layer = parse_llama_layer(d, where=where)
    notes = []
    nested = d.get("eagle_config")
    if (isinstance(nested, dict) and nested.get("eagle_aux_hidden_state_layer_ids")) \
            or d.get("eagle_aux_hidden_state_layer_ids"):
        notes.append("the config lists aux layer ids, but the EAGLE reference code ignores them and "
                     "reads [2, L//2, L-3]; import with --from sglang or specforge to honour them")
    extra = {"draft_vocab_size": d.get("draft_vocab_size"), "target_hidden_size": d.get("target_hidden_size")}
    return {**layer, **extra}, None, notes


SPEC = EngineSpec(name=NAME, eagle3=IdReading(to_ids=to_ids, to_boundaries=to_boundaries, read_ids=read_ids),
                  importer=Importer(parse_config=parse_config, default_only=DEFAULT_ONLY))
