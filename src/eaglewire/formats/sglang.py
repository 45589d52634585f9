"""SGLang's EAGLE-3 draft format (``LlamaForCausalLMEagle3``).

The EAGLE reference layout plus ``target_hidden_size`` and the nested
``eagle_config.eagle_aux_hidden_state_layer_ids``, the only place SGLang reads ids from
(a missing or broken config falls back to boundaries ``[2, L//2, L-3]`` without error).
SGLang's ``fc`` is hard-coded to ``3 * target_hidden_size`` inputs, it uses ``d2t`` (as
``hot_token_id``), ignores ``t2d`` and shares the target's embedding. Tensor names are
eaglewire's native names. Pure functions only.
"""

from __future__ import annotations

import json
from typing import Any

from eaglewire.contract import SGLANG_RULE_VERSIONS
from eaglewire.draft import DraftConfig
from eaglewire.formats.eagle import ARCHITECTURE, FormatError, llama_layer_config, parse_llama_layer

SGLANG_NUM_AUX = 3


def check_exportable(cfg: DraftConfig) -> None:
    """Raise FormatError when SGLang cannot load a draft of this shape."""
    if cfg.num_aux != SGLANG_NUM_AUX:
        raise FormatError(
            f"SGLang cannot serve this draft: it fuses {cfg.num_aux} target states, but SGLang's "
            f"LlamaForCausalLMEagle3 hard-codes fc to 3 x target_hidden_size inputs. Retrain with "
            "3 aux boundaries, or export with --to vllm (vLLM sizes fc from the id list)")


def build_config(cfg: DraftConfig, ids: list[int]) -> dict[str, Any]:
    """config.json of a SGLang draft whose config ids are ``ids`` (already in SGLang's convention)."""
    return {
        "architectures": [ARCHITECTURE],
        **llama_layer_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True},
    }


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


def serving_md(*, draft_path: str, target_name: str, boundaries: list[int], ids: list[int],
               sglang_rule: str, ambiguity: str | None, num_steps: int) -> str:
    """SERVING.md for a SGLang export: exact launch flags and which SGLang versions wire it right."""
    who = ("every SGLang version (both of its id rules agree here)" if ambiguity is None
           else f"only {SGLANG_RULE_VERSIONS[sglang_rule]}")
    lines = [
        "# Serving this draft with SGLang", "",
        f"Exported by eaglewire for the rule `{sglang_rule}`. The draft reads target boundaries "
        f"{boundaries}; `eagle_config.eagle_aux_hidden_state_layer_ids` is {json.dumps(ids)}, from "
        f"which {who} capture exactly those boundaries.", "",
    ]
    if ambiguity is not None:
        lines += [f"**Warning:** {ambiguity}. On the other versions, re-export with "
                  "`--sglang-rule` set for them; the wrong version feeds the draft other layers "
                  "without any error.", ""]
    lines += [
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
        "ignores `t2d` and shares the target's embedding.", "",
    ]
    return "\n".join(lines)
