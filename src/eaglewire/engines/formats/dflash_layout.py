"""What every engine's DFlash draft format shares: the two layouts the released code reads, pure.

- **z-lab's** (``DFlashDraftModel``, z-lab/dflash; SpecForge 0.2.0 ships the same class,
  specforge/modeling/draft/dflash.py): ``config.json`` is a Qwen3 config of the draft's layers plus
  ``architectures: ["DFlashDraftModel"]``, ``block_size``, ``num_target_layers`` and
  ``dflash_config: {target_layer_ids, mask_token_id, block_size}``; ``target_layer_ids`` are layer
  indices whose *output* is read (HF ``hidden_states[i + 1]``), so id = boundary - 1. SGLang
  (models/dflash.py ``DFlashDraftModel``), vLLM (models/registry.py ``DFlashDraftModel`` ->
  qwen3_dflash.py) and llama.cpp's converter (conversion/qwen.py ``DFlashModel``) load it.
- **speculators'** (``DFlashSpeculatorConfig``, speculators 0.9.0 models/dflash/config.py):
  ``speculators_model_type: "dflash"``, ``transformer_layer_config`` (the Qwen3 layer config),
  ``draft_vocab_size``, ``block_size``, ``target_hidden_size``, ``aux_hidden_state_layer_ids``
  (= z-lab id + 1 = boundary: its converter, convert/dflash/converter.py, adds 1), ``mask_token_id``,
  ``sliding_window_non_causal``, ``sample_from_anchor``, ``speculators_config``. vLLM loads it
  (transformers_utils/configs/speculators/algos.py ``update_dflash``); SGLang and llama.cpp's
  converter do not (no ``DFlashSpeculator`` architecture in either).

Tensors, both layouts: ``fc.weight``, ``hidden_norm.weight``, ``layers.{i}.*`` (Qwen3 attention
with q/k norms), ``norm.weight``: eaglewire's own names. Neither carries the embedding or the head
of a full-vocabulary draft (speculators' ``DFlashDraftModel`` drops ``embed_tokens`` on save and
``lm_head`` unless the draft vocabulary is reduced; its loader and every engine take the target's).
"""

from __future__ import annotations

from typing import Any

import torch

from eaglewire.engines.formats.eagle3_layout import FormatError, parse_rope
from eaglewire.model.dflash import DFlashConfig, DFlashDraft
from eaglewire.model.dflash_blocks import head_rows
from eaglewire.model.vocab import target_ids

ZLAB_ARCHITECTURE = "DFlashDraftModel"
SPECULATORS_ARCHITECTURE = "DFlashSpeculator"
SPECULATORS_MODEL_TYPE = "dflash"

# Tensors a DFlash checkpoint may carry that the draft does not own (the target's).
FOREIGN_TENSORS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")


def is_dflash_config(d: dict[str, Any]) -> bool:
    """A DFlash draft's config.json in either layout."""
    return (d.get("speculators_model_type") == SPECULATORS_MODEL_TYPE or isinstance(d.get("dflash_config"), dict)
            or ZLAB_ARCHITECTURE in (d.get("architectures") or []))


def is_speculators(d: dict[str, Any]) -> bool:
    return d.get("speculators_model_type") == SPECULATORS_MODEL_TYPE


def qwen3_layers(cfg: DFlashConfig) -> dict[str, Any]:
    """The draft's decoder layers as a Qwen3 config dict (vocab_size = the target's)."""
    scaling = dict(cfg.rope_parameters) or None
    return {
        "model_type": "qwen3", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size, "attention_bias": False, "tie_word_embeddings": False,
        "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
        "rope_parameters": {"rope_type": "default", **cfg.rope_parameters, "rope_theta": cfg.rope_theta},
    }


def zlab_config(cfg: DFlashConfig, target_layer_ids: list[int], *, num_target_layers: int,
                dtype: str | None = None) -> dict[str, Any]:
    """config.json in z-lab's layout; ``target_layer_ids`` in z-lab's convention (boundary - 1)."""
    out = {"architectures": [ZLAB_ARCHITECTURE], **qwen3_layers(cfg), "block_size": cfg.block_size,
           "num_target_layers": num_target_layers,
           "dflash_config": {"target_layer_ids": list(target_layer_ids), "mask_token_id": cfg.mask_token_id,
                             "block_size": cfg.block_size}}
    if dtype is not None:
        out["torch_dtype"] = dtype
    return out


def speculators_config(cfg: DFlashConfig, aux_ids: list[int], *, verifier_name: str | None,
                       verifier_architecture: str, dtype: str | None = None) -> dict[str, Any]:
    """config.json in speculators' layout (DFlashSpeculatorConfig's fields as its pydantic model
    serialises them); ``aux_ids`` = boundaries.

    ``sliding_window_non_causal`` is written true: vLLM 0.33.0's ``update_dflash`` sets
    ``dflash_config.causal = not sliding_window_non_causal`` and applies it to *every* draft layer, so
    speculators' default false would make vLLM run the block causally, which the draft was not trained
    for; speculators itself reads the flag only for sliding-window layers, which this draft has none of.
    """
    out = {
        "architectures": [SPECULATORS_ARCHITECTURE], "speculators_model_type": SPECULATORS_MODEL_TYPE,
        "transformer_layer_config": qwen3_layers(cfg), "draft_vocab_size": cfg.draft_vocab_size,
        "block_size": cfg.block_size, "target_hidden_size": cfg.target_hidden_size,
        "aux_hidden_state_layer_ids": list(aux_ids), "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": True, "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": SPECULATORS_MODEL_TYPE,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name, "architectures": [verifier_architecture]},
        },
    }
    if dtype is not None:
        out["torch_dtype"] = dtype
    return out


def layer_fields(d: dict[str, Any], *, where: str) -> dict[str, Any]:
    """DFlashConfig fields of the draft's layers (all but num_aux, vocab_size, block_size, mask_token_id)
    from a Qwen3 config dict (z-lab's top level, speculators' transformer_layer_config)."""
    model_type = d.get("model_type", "qwen3")
    if model_type != "qwen3":
        raise FormatError(f"{where}: the draft layers are model_type {model_type!r}; an eaglewire DFlash draft "
                          "has Qwen3 layers (q/k norms), as z-lab's and speculators' do")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if d.get(key) is None:
            raise FormatError(f"{where}: {key} is missing")
    if d.get("hidden_act", "silu") != "silu":
        raise FormatError(f"{where}: hidden_act {d.get('hidden_act')!r} is not supported; eaglewire drafts use silu")
    for flag in ("attention_bias", "mlp_bias"):
        if d.get(flag):
            raise FormatError(f"{where}: {flag} is true; eaglewire drafts have no biases")
    if "sliding_attention" in (d.get("layer_types") or []) or d.get("use_sliding_window"):
        raise FormatError(f"{where}: the draft has sliding-window layers; eaglewire DFlash drafts attend to the "
                          "whole context")
    heads, hidden = int(d["num_attention_heads"]), int(d["hidden_size"])
    theta, rope = parse_rope(d)
    return {"hidden_size": hidden, "target_hidden_size": hidden, "intermediate_size": int(d["intermediate_size"]),
            "num_hidden_layers": int(d["num_hidden_layers"]), "num_attention_heads": heads,
            "num_key_value_heads": int(d.get("num_key_value_heads") or heads),
            "head_dim": int(d.get("head_dim") or hidden // heads), "rms_norm_eps": float(d.get("rms_norm_eps", 1e-6)),
            "rope_theta": theta, "rope_parameters": rope,
            "max_position_embeddings": int(d.get("max_position_embeddings", 8192))}


def parse(d: dict[str, Any], *, where: str) -> tuple[dict[str, Any], int | None]:
    """(DFlashConfig fields but num_aux and vocab_size, draft vocabulary size or None) of either layout."""
    if is_speculators(d):
        layers = d.get("transformer_layer_config")
        if not isinstance(layers, dict):
            raise FormatError(f"{where}: transformer_layer_config is missing or not an object")
        fields = layer_fields({"model_type": "qwen3", **layers}, where=f"{where} transformer_layer_config")
        block, mask = d.get("block_size", 8), d.get("mask_token_id")
        if d.get("sample_from_anchor"):
            raise FormatError(f"{where}: sample_from_anchor is true (the anchor position drafts too); an eaglewire "
                              "DFlash draft predicts from the mask positions only")
        if d.get("target_hidden_size") not in (None, fields["hidden_size"]):
            raise FormatError(f"{where}: target_hidden_size {d['target_hidden_size']} differs from the draft's "
                              f"hidden size {fields['hidden_size']}; an eaglewire DFlash draft has the target's")
        vocab = d.get("draft_vocab_size")
    else:
        fields = layer_fields(d, where=where)
        nested = d.get("dflash_config") or {}
        block = nested.get("block_size", d.get("block_size"))
        mask = nested.get("mask_token_id", d.get("mask_token_id"))
        vocab = None
    if block is None:
        raise FormatError(f"{where}: no block_size (neither top level nor dflash_config)")
    if mask is None:
        raise FormatError(f"{where}: no mask_token_id; the draft's masked positions read that token's embedding")
    return {**fields, "block_size": int(block), "mask_token_id": int(mask)}, vocab


def split_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(draft tensors under eaglewire's names, the target's tensors a checkpoint may carry)."""
    own, foreign = {}, {}
    for name, tensor in state.items():
        name = name.removeprefix("model.")
        (foreign if name in FOREIGN_TENSORS or name in ("d2t", "t2d") else own)[name] = tensor
    return own, foreign


def vocab_maps_of(foreign: dict[str, torch.Tensor], draft_vocab_size: int, vocab_size: int, *,
                  where: str) -> dict[str, torch.Tensor]:
    """A pruned draft's d2t [Vd] (target id = draft id + d2t) and t2d [V] bool from its checkpoint, checked to
    describe the same ``draft_vocab_size`` target ids."""
    if "d2t" not in foreign or "t2d" not in foreign:
        raise FormatError(f"{where}: draft_vocab_size {draft_vocab_size} is below the target's {vocab_size} but the "
                          "weights hold no d2t / t2d maps")
    d2t, t2d = foreign.pop("d2t").long(), foreign.pop("t2d").bool()
    if tuple(d2t.shape) != (draft_vocab_size,) or tuple(t2d.shape) != (vocab_size,):
        raise FormatError(f"{where}: d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not match draft vocab "
                          f"{draft_vocab_size} / target vocab {vocab_size}")
    ids = target_ids(d2t)  # [Vd]
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or not bool(t2d[ids].all()) or int(t2d.sum()) != draft_vocab_size:
        raise FormatError(f"{where}: d2t (offsets: target id = draft id + d2t) and t2d name different tokens")
    return {"d2t": d2t, "t2d": t2d}


def head_rows_tensor(d2t: torch.Tensor, target, dtype: torch.dtype) -> torch.Tensor:
    """The target head's rows of a pruned vocabulary [Vd, H] (target id = draft id + ``d2t``), as speculators
    saves ``lm_head.weight`` and llama.cpp's converter writes ``output.weight``."""
    return head_rows(target, target_ids(d2t.long()))[0].to("cpu", dtype)  # [Vd, H]


def check_head_rows(lm_head: torch.Tensor | None, draft: DFlashDraft, target, *, where: str) -> None:
    """A checkpoint's ``lm_head.weight``, where it carries one, must be the target head's rows of the draft's
    vocabulary (speculators saves them frozen for a pruned vocabulary; every engine reads the target's head
    otherwise): an eaglewire DFlash draft predicts with those rows, not a trained head of its own."""
    if lm_head is None:
        return
    rows = draft.draft_to_target
    if tuple(lm_head.shape) != (len(rows), draft.config.hidden_size):
        raise FormatError(f"{where}: lm_head.weight is {tuple(lm_head.shape)}, not the {len(rows)} rows of the draft "
                          f"vocabulary x hidden {draft.config.hidden_size}")
    head = head_rows(target, rows)[0].cpu()  # [Vd, H]
    if not torch.allclose(lm_head.float(), head.to(lm_head.dtype).float(), rtol=1e-2, atol=1e-3):
        raise FormatError(f"{where}: lm_head.weight is not the target's head at the draft vocabulary's rows (a trained "
                          "head of its own); an eaglewire DFlash draft predicts with the target's head")


def build_draft(fields: dict[str, Any], tensors: dict[str, torch.Tensor], *, vocab_size: int,
                where: str) -> DFlashDraft:
    """The DFlash draft holding ``tensors``; num_aux from fc's input width. FormatError naming every
    missing, unexpected or misshapen tensor."""
    if "fc.weight" not in tensors:
        raise FormatError(f"{where}: tensor fc.weight is missing; this is not a DFlash draft checkpoint")
    H = fields["hidden_size"]
    width = tensors["fc.weight"].shape[1]
    if width % H:
        raise FormatError(f"{where}: fc.weight is {tuple(tensors['fc.weight'].shape)}, whose input width {width} "
                          f"is not a multiple of the hidden size {H}")
    try:
        draft = DFlashDraft(DFlashConfig(**fields, num_aux=width // H, vocab_size=vocab_size))
    except ValueError as e:
        raise FormatError(f"{where}: {e}") from e
    expected = {k: v.shape for k, v in draft.state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise FormatError(f"{where}: the weights do not form a DFlash draft: missing {missing}, unexpected {unexpected}")
    wrong = [f"{k} {tuple(t.shape)} (config implies {tuple(expected[k])})" for k, t in tensors.items()
             if t.shape != expected[k]]
    if wrong:
        raise FormatError(f"{where}: tensor shapes disagree with the config: {'; '.join(wrong)}")
    draft.load_state_dict(tensors)
    return draft
