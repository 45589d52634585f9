"""The speculators (vLLM) EAGLE-3 format, as speculators 0.9 writes and reads it.

``config.json``: ``speculators_model_type: "eagle3"``, ``architectures: ["Eagle3Speculator"]``,
``transformer_layer_config`` (a Llama config of the draft layer; its ``vocab_size`` is the
target's), ``draft_vocab_size``, ``target_hidden_size``, the norm flags, top-level
``eagle_aux_hidden_state_layer_ids`` (boundaries verbatim: 0 = embedding output, L = last
pre-norm state) and ``speculators_config {algorithm, proposal_methods,
default_proposal_method, verifier {name_or_path, architectures}}``, ``torch_dtype``.
``transformer_layer_config`` also carries ``num_aux_hidden_states``: vLLM 0.33.0 builds the
draft's config from that object alone and counts aux states only from
``num_aux_hidden_states`` or a nested ``eagle_config`` id list, else 3
(models/llama_eagle3.py), so without it a draft on other than 3 boundaries does not load.
Tensors: ``embed_tokens.weight`` (the target's, in the target's stored dtype: vLLM shares
the target's embedding only when the two are exactly equal), ``fc.weight``, ``layers.0.*``,
``norm.weight``, ``lm_head.weight`` and, only for a reduced vocabulary, ``d2t`` / ``t2d``
(speculators has no such buffers for a full-vocabulary draft).

The norm flags, and what an eaglewire draft is:
- ``norm_before_residual``: the residual is ``hidden_norm(h)`` instead of ``h``. Ours is the
  un-normed ``h``: false. vLLM reads a *missing* flag as true, so it is always written.
- ``norm_output``: the post-norm state is fed to the next step (Eagle 3.1). We feed the
  pre-norm state: false.
- ``norm_before_fc`` / ``fc_norm``: an RMSNorm on the aux states before ``fc``. We have none.
Pure functions only.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from eaglewire.contract import SGLANG_VERSION, VLLM_VERSION
from eaglewire.draft import DraftConfig
from eaglewire.formats.eagle import FormatError, llama_layer_config, parse_llama_layer

ARCHITECTURE = "Eagle3Speculator"
MODEL_TYPE = "eagle3"

# flag -> (our value, what a different value would mean)
NORM_FLAGS: dict[str, tuple[bool, str]] = {
    "norm_before_residual": (False, "its residual is the normed hidden state"),
    "norm_output": (False, "it feeds its post-norm state to the next step (Eagle 3.1)"),
    "norm_before_fc": (False, "it normalises the concatenated aux states before fc"),
    "fc_norm": (False, "it normalises each aux state before fc"),
}


def build_config(cfg: DraftConfig, boundaries: list[int], *, verifier_name: str | None,
                 verifier_architecture: str, num_steps: int, dtype: str) -> dict[str, Any]:
    """config.json of a speculators export; ``boundaries`` are written verbatim as the ids."""
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": MODEL_TYPE,
        "torch_dtype": dtype,
        "transformer_layer_config": {**llama_layer_config(cfg), "num_aux_hidden_states": cfg.num_aux},
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        **{flag: value for flag, (value, _) in NORM_FLAGS.items()},
        "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": list(boundaries),
        "speculators_config": {
            "algorithm": MODEL_TYPE,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_steps,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name, "architectures": [verifier_architecture]},
        },
    }


def parse_config(d: dict[str, Any], *, where: str = "config.json"
                 ) -> tuple[dict[str, Any], list[int] | None, list[str]]:
    """(layer fields + draft_vocab_size/target_hidden_size, ids or None, notes).

    Raises FormatError for anything an eaglewire draft cannot compute exactly (other norm
    placements, another layer type, another speculator type).
    """
    kind = d.get("speculators_model_type")
    if kind != MODEL_TYPE:
        hint = ("it has no speculators_model_type (a SGLang/SpecForge config? use --from sglang or specforge)"
                if kind is None else f"it is a speculators {kind!r} checkpoint")
        raise FormatError(f"{where} is not a speculators EAGLE-3 config: {hint}")
    layer_cfg = d.get("transformer_layer_config")
    if not isinstance(layer_cfg, dict):
        raise FormatError(f"{where}: transformer_layer_config is missing or not an object")
    notes = []
    for flag, (ours, meaning) in NORM_FLAGS.items():
        value = d.get(flag)
        if value is None:
            if flag == "norm_before_residual":
                notes.append("norm_before_residual is missing: read as false (speculators' default), "
                             "but vLLM reads a missing flag as true; set it explicitly before serving")
        elif bool(value) != ours:
            raise FormatError(f"{where}: {flag} is {value}: {meaning}; an eaglewire draft cannot "
                              "compute that exactly, so it cannot be imported")
    # speculators reads a layer config without model_type as Qwen3
    layer = parse_llama_layer({"model_type": "qwen3", **layer_cfg}, where=f"{where} transformer_layer_config")
    try:
        readings = id_readings(d)
    except FormatError as e:
        raise FormatError(f"{where}: {e}") from e
    ids = next(iter(readings.values()))  # a speculators config keeps them at the top level: one reading
    fc_states = num_aux(d)
    if ids is not None and fc_states != len(ids):
        notes.append(f"vLLM sizes fc for {fc_states} aux states (num_aux_hidden_states in "
                     f"transformer_layer_config, else 3) but the config names {len(ids)} ids; vLLM cannot "
                     "load it until transformer_layer_config.num_aux_hidden_states is set")
    extra = {"draft_vocab_size": d.get("draft_vocab_size"), "target_hidden_size": d.get("target_hidden_size")}
    return {**layer, **extra}, ids, notes


def id_readings(d: dict[str, Any]) -> dict[str, list[int] | None]:
    """Where vLLM 0.33.0 finds the ids in any draft config: label -> ids (None: its default).

    Both runners read the top-level ids first. Without them, the default V2 runner
    (v1/worker/gpu/spec_decode/eagle/eagle3_utils.get_eagle3_aux_layers_from_config) reads
    ``eagle_config.layer_ids`` and the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``;
    gpu_model_runner._get_eagle3_aux_layers_from_config) ``eagle_config.eagle_aux_hidden_state_layer_ids``.
    """
    top = d.get("eagle_aux_hidden_state_layer_ids")
    nested = d.get("eagle_config") if isinstance(d.get("eagle_config"), dict) else {}
    v2, v1 = nested.get("layer_ids") or None, nested.get("eagle_aux_hidden_state_layer_ids") or None
    if top or v1 == v2:
        readings = {f"vllm {VLLM_VERSION}": top or v2}
    else:
        readings = {f"vllm {VLLM_VERSION} (V2 runner, the default)": v2, f"vllm {VLLM_VERSION} (V1 runner)": v1}
    for ids in readings.values():
        if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, int) for i in ids)):
            raise FormatError(f"aux layer ids {ids!r}; expected a list of integers")
    return readings


def num_aux(d: dict[str, Any]) -> int:
    """How many aux states vLLM 0.33.0 sizes ``fc`` for (models/llama_eagle3.py): from the
    config it builds (a speculators config: ``transformer_layer_config`` only)."""
    src = d.get("transformer_layer_config") if d.get("speculators_model_type") else d
    src = src if isinstance(src, dict) else {}
    if src.get("num_aux_hidden_states") is not None:
        return int(src["num_aux_hidden_states"])
    nested = src.get("eagle_config") if isinstance(src.get("eagle_config"), dict) else {}
    ids = nested.get("eagle_aux_hidden_state_layer_ids")
    return len(ids) if ids else 3


def to_speculators_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Native tensor names -> speculators names (``midlayer.`` -> ``layers.0.``)."""
    return {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
            for k, v in state.items()}


def check_vocab_maps(cfg: DraftConfig, d2t: torch.Tensor) -> bool:
    """True when d2t/t2d must be written (a reduced vocabulary). A full-vocabulary draft
    with a permuted d2t has no speculators form: FormatError."""
    if cfg.draft_vocab_size < cfg.vocab_size:
        return True
    if bool(d2t.any()):
        raise FormatError("this full-vocabulary draft permutes token ids (d2t is not all zeros); "
                          "speculators drops d2t when the draft vocabulary equals the target's, so "
                          "the export would predict the wrong tokens. Rebuild the vocabulary as identity, "
                          "or export with --to sglang (which keeps d2t)")
    return False


def verifier_notes(name: str | None, *, is_local_path: bool) -> list[str]:
    """A warning when engines cannot load the verifier by ``name`` (not a path, not an HF id)."""
    if name is not None and (is_local_path or name.count("/") == 1):
        return []
    return [f"verifier name {name!r} is neither a local path nor a Hugging Face id; vLLM and speculators "
            "load the verifier by that name, so pass the target's path or id (--verifier-name)"]


def serving_md(*, draft_path: str, target_name: str, boundaries: list[int], num_steps: int,
               sglang_ids: str) -> str:
    """SERVING.md for a vLLM / speculators export: exact launch flags, and how other engines
    read the directory (``sglang_ids``: the ids the SGLang export would carry, or why none)."""
    spec = json.dumps({"method": "eagle3", "model": draft_path, "num_speculative_tokens": num_steps})
    return "\n".join([
        "# Serving this draft with vLLM", "",
        f"speculators EAGLE-3 format, for vLLM {VLLM_VERSION}. The draft reads target boundaries {boundaries}; "
        f"vLLM takes `eagle_aux_hidden_state_layer_ids` {json.dumps(boundaries)} verbatim, sorted (0 = "
        "embedding output, L = last layer before the final norm), on every target model it serves EAGLE-3 "
        f"for, and sizes `fc` from `transformer_layer_config.num_aux_hidden_states` ({len(boundaries)}).", "",
        "```bash",
        f"vllm serve {target_name} \\",
        f"    --speculative-config '{spec}'",
        "```", "",
        "vLLM drafts chains (`num_speculative_tokens` tokens per step). Add "
        "`--tensor-parallel-size N` to shard the target over N GPUs.", "",
        f"The target must be the very one the draft was trained for ({target_name}); a requantized "
        "or fine-tuned target lowers acceptance. `embed_tokens.weight` is that target's embedding in its "
        "stored dtype, so vLLM shares the target's own (it does only when the two are exactly equal).", "",
        "## Other engines loading this directory", "",
        f"- SGLang {SGLANG_VERSION} cannot load it (it has no `Eagle3Speculator` architecture). Use "
        f"`eaglewire export --to sglang` instead: {sglang_ids}.",
        "- Copying these ids into a SGLang config would be wrong: SGLang adds 1 to them on most target "
        "model files (contract.py), one layer off.",
        "- llama.cpp reads neither this config nor its ids: give it eaglewire's llama.cpp export of the "
        "native draft.", "",
    ])
