"""SpecForge's EAGLE-3 checkpoints (import only).

SpecForge trains drafts for SGLang and writes SGLang's file layout (``LlamaForCausalLMEagle3``,
``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``; ids in the nested
``eagle_config.eagle_aux_hidden_state_layer_ids``). Its ids always mean "output of layer i"
(HF ``hidden_states[i + 1]``, boundary ``i + 1``) on every target — the reading SGLang's
``llama.py``-style model files share, but not every file (contract.py); its default
``[1, L//2-1, L-4]`` is boundaries ``[2, L//2, L-3]``. Pure functions only.
"""

from __future__ import annotations

from typing import Any

from eaglewire.formats.sglang import parse_config as parse_sglang_config


def parse_config(d: dict[str, Any], *, where: str = "config.json"
                 ) -> tuple[dict[str, Any], list[int] | None, list[str]]:
    """(layer fields + draft_vocab_size/target_hidden_size, SpecForge ids or None, notes).

    The file layout is SGLang's; only the meaning of the ids differs (see contract.py).
    """
    return parse_sglang_config(d, where=where, reader="SpecForge")
