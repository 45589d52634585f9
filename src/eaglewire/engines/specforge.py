"""SpecForge (import only): how its ids read, and its EAGLE-3 checkpoints.

SpecForge trains drafts for SGLang and writes SGLang's file layout (``LlamaForCausalLMEagle3``,
``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``; ids in the nested
``eagle_config.eagle_aux_hidden_state_layer_ids``). Its ids always mean "output of layer i"
(HF ``hidden_states[i + 1]``, boundary ``i + 1``, so boundaries 1..L-1) on every target — the
reading SGLang's ``llama.py``-style model files share, but not every file (engines/sglang.py);
its default ``[1, L//2-1, L-4]`` is boundaries ``[2, L//2, L-3]``.
"""

from __future__ import annotations

from typing import Any

from eaglewire.core.contract import EngineConventionError
import eaglewire.engines.sglang as sglang

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
    ids, notes = sglang.config_ids(config, reader="SpecForge")
    return {"specforge": ids}, notes


def parse_config(d: dict[str, Any], *, where: str = "config.json"
                 ) -> tuple[dict[str, Any], list[int] | None, list[str]]:
    """(layer fields + draft_vocab_size/target_hidden_size, SpecForge ids or None, notes).

    The file layout is SGLang's; only the meaning of the ids differs.
    """
    return sglang.parse_config(d, where=where, reader="SpecForge")


def reads_export(engine: str, *, boundaries: list[int], ids: list[int], num_layers: int,
                 target_arch: str | None) -> list[str]:
    """SERVING.md lines: how SpecForge reads the directory another ``engine``'s export wrote."""
    if engine != "sglang":
        return []
    return ["- SpecForge (and `eaglewire import --from specforge`) reads the nested ids as \"output of layer "
            "i\" (boundary i + 1) on every target: right only where SGLang adds 1 too. Import it with "
            "`eaglewire import --from sglang`, which applies this target's rule."]
