"""SGLang's EAGLE-3 draft format (``LlamaForCausalLMEagle3``), as SGLang 0.5.23 reads it.

The EAGLE reference layout plus ``target_hidden_size`` and the nested
``eagle_config.eagle_aux_hidden_state_layer_ids``, the only place SGLang reads ids from
(model_runner_components/spec_aux_hidden_state.py; a missing or broken config falls back to
boundaries ``[2, L//2, L-3]`` without error). What the ids mean depends on the target's
model file (contract.py). SGLang sizes ``fc`` from ``num_aux_hidden_states``, else from the
nested id list, else 3 (models/llama_eagle3.py); it uses ``d2t`` (as ``hot_token_id``),
ignores ``t2d`` and shares the target's embedding. Tensor names are eaglewire's native names.

An eaglewire export also writes the boundaries as the top-level
``eagle_aux_hidden_state_layer_ids``: SGLang never looks there, and vLLM looks there first,
so vLLM loading the SGLang export captures the same boundaries. Pure functions only.
"""

from __future__ import annotations

import json
from typing import Any

from eaglewire.contract import SGLANG_VERSION, VLLM_VERSION
from eaglewire.draft import DraftConfig
from eaglewire.formats.eagle import ARCHITECTURE, FormatError, llama_layer_config, parse_llama_layer


def build_config(cfg: DraftConfig, ids: list[int], boundaries: list[int] | None = None, *,
                 dtype: str | None = None) -> dict[str, Any]:
    """config.json of a SGLang draft: ``ids`` in SGLang's convention for the target's model
    file (nested); ``boundaries`` for vLLM (top level) and the dtype engines should run it
    in, when given (an eaglewire export gives both; SpecForge writes neither)."""
    config = {
        "architectures": [ARCHITECTURE],
        **llama_layer_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True},
    }
    if dtype is not None:
        config["torch_dtype"] = dtype
    if boundaries is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(boundaries)
    return config


def num_aux(d: dict[str, Any]) -> int:
    """How many aux states SGLang sizes ``fc`` for (models/llama_eagle3.py)."""
    if d.get("num_aux_hidden_states") is not None:
        return int(d["num_aux_hidden_states"])
    nested = d.get("eagle_config") if isinstance(d.get("eagle_config"), dict) else {}
    ids = nested.get("eagle_aux_hidden_state_layer_ids")
    return len(ids) if ids else 3


def config_ids(d: dict[str, Any], *, reader: str = "SGLang") -> tuple[list[int] | None, list[str]]:
    """(ids from ``eagle_config``, notes); None when absent (the engine then uses its default)."""
    notes = []
    nested = d.get("eagle_config") or {}
    if not isinstance(nested, dict):
        raise FormatError(f"eagle_config is {nested!r}; expected an object holding "
                          "eagle_aux_hidden_state_layer_ids")
    ids = nested.get("eagle_aux_hidden_state_layer_ids")
    top = d.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and top is not None:
        notes.append(f"ids {top} sit at the top level of the config, where {reader} never looks; "
                     f"{reader} falls back to its default layers, and so does this import. If the "
                     "draft was trained on those ids, move them into eagle_config and import again")
    if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, int) for i in ids)):
        raise FormatError(f"eagle_config.eagle_aux_hidden_state_layer_ids is {ids!r}; expected a list "
                          "of integers")
    return ids, notes


def parse_config(d: dict[str, Any], *, where: str = "config.json", reader: str = "SGLang"
                 ) -> tuple[dict[str, Any], list[int] | None, list[str]]:
    """(layer fields + draft_vocab_size/target_hidden_size, ids or None, notes); ``reader``
    names the tool whose reading the notes describe."""
    archs = d.get("architectures") or []
    notes = []
    if archs and ARCHITECTURE not in archs:
        notes.append(f"architectures is {archs}, not [{ARCHITECTURE!r}]; read as an EAGLE-3 draft anyway")
    layer = parse_llama_layer(d, where=where)
    ids, id_notes = config_ids(d, reader=reader)
    extra = {"draft_vocab_size": d.get("draft_vocab_size"), "target_hidden_size": d.get("target_hidden_size")}
    return {**layer, **extra}, ids, notes + id_notes


def serving_md(*, draft_path: str, target_name: str, boundaries: list[int], ids: list[int], target_arch: str,
               model_file: str, vllm_reading: str, ambiguity: str | None, num_steps: int) -> str:
    """SERVING.md for a SGLang export: exact launch flags, and how other engines read the directory."""
    lines = [
        "# Serving this draft with SGLang", "",
        f"Exported by eaglewire for SGLang {SGLANG_VERSION} and a `{target_arch}` target, whose ids SGLang "
        f"reads in `{model_file}`. The draft reads target boundaries {boundaries}; "
        f"`eagle_config.eagle_aux_hidden_state_layer_ids` is {json.dumps(ids)}, from which that model file "
        "captures exactly those boundaries.", "",
        " ".join(["**The ids are only right for this target's model file.**", *([ambiguity] if ambiguity else []),
                  "Export again for another target; the wrong reading feeds the draft other layers without "
                  "any error."]), "",
        "Chain drafting (top-k 1; SGLang requires num-draft-tokens = num-steps + 1):", "",
        "```bash",
        f"python -m sglang.launch_server --model-path {target_name} \\",
        "    --speculative-algorithm EAGLE3 \\",
        f"    --speculative-draft-model-path {draft_path} \\",
        f"    --speculative-num-steps {num_steps} --speculative-eagle-topk 1 "
        f"--speculative-num-draft-tokens {num_steps + 1}",
        "```", "",
        "Tree drafting (SGLang's defaults): `--speculative-num-steps 5 --speculative-eagle-topk 4 "
        "--speculative-num-draft-tokens 8`. Add `--tp N` to shard the target over N GPUs.", "",
        f"`--model-path` must be the very target the draft was trained for ({target_name}); a "
        "requantized or fine-tuned target lowers acceptance. SGLang uses this draft's `d2t`, "
        "ignores `t2d` and shares the target's embedding; it sizes `fc` from the id list.", "",
        "## Other engines loading this directory", "",
        f"- vLLM {VLLM_VERSION}: {vllm_reading}",
        "- SpecForge (and `eaglewire import --from specforge`) reads the nested ids as \"output of layer "
        "i\" (boundary i + 1) on every target: right only where SGLang adds 1 too. Import it with "
        "`eaglewire import --from sglang`, which applies this target's rule.",
        "- llama.cpp reads neither this config nor its ids: give it eaglewire's llama.cpp export of the "
        "native draft.", "",
    ]
    return "\n".join(lines)
