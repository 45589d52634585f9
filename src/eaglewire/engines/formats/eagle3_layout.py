"""What every engine's EAGLE-3 draft format shares: the draft layer as a Llama config, tensor-name
normalisation, vocabulary maps (d2t / t2d) and ``FormatError``. All functions are pure (no I/O).

The layout is the EAGLE-3 reference one (SafeAILab/EAGLE), which SGLang and SpecForge inherited:
``config.json`` is a Llama config of the one draft layer (``LlamaForCausalLMEagle3``,
``num_hidden_layers: 1``, ``draft_vocab_size``, optional ``target_hidden_size``, and SGLang's nested
``eagle_config.eagle_aux_hidden_state_layer_ids``, which SpecForge writes too: ``parse_eagle3_config``
reads it for both, each naming itself as the reader); the tensors are
``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` (in ``pytorch_model.bin`` or
``model.safetensors``, sometimes under a ``model.`` prefix).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from eaglewire.model.draft import DraftConfig, Eagle3Draft

ARCHITECTURE = "LlamaForCausalLMEagle3"

# transformers' LlamaConfig defaults: a diff-dict config (speculators writes one) omits them.
LLAMA_DEFAULTS: dict[str, Any] = {
    "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
    "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False, "num_hidden_layers": 32,
}

# Tensors a checkpoint may carry that the draft does not own (eaglewire uses the target's embedding).
FOREIGN_TENSORS = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")


class FormatError(ValueError):
    """A checkpoint or config that a format cannot hold, or that cannot be read as that format."""


# ---------------------------------------------------------------- Llama layer config

def rope_fields(cfg: DraftConfig) -> dict[str, Any]:
    """RoPE as both transformers generations read it.

    ``rope_theta`` + ``rope_scaling`` for transformers 4.x readers (SGLang, vLLM), and
    ``rope_parameters`` for transformers 5.x (which prefers it when both are present).
    """
    scaling = dict(cfg.rope_parameters) or None
    params = {"rope_type": "default", **cfg.rope_parameters, "rope_theta": cfg.rope_theta}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rope_parameters": params}


def parse_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope_theta, non-default RoPE parameters without theta) from any generation's fields."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if "full_attention" in params:  # per-layer-type RoPE: the draft uses the global one
        params = params["full_attention"]
    params = dict(params)
    theta = float(params.pop("rope_theta", d.get("rope_theta", LLAMA_DEFAULTS["rope_theta"])))
    if "type" in params and "rope_type" not in params:  # transformers < 4.45 spelling
        params["rope_type"] = params.pop("type")
    if params.get("rope_type", "default") == "default":
        params = {}
    return theta, params


def llama_layer_config(cfg: DraftConfig) -> dict[str, Any]:
    """The draft's one decoder layer as a Llama config dict (vocab_size = the target's)."""
    return {
        "model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        **rope_fields(cfg),
    }


def parse_llama_layer(d: dict[str, Any], *, where: str) -> dict[str, Any]:
    """DraftConfig fields of a Llama draft layer (all but num_aux, target_hidden_size,
    draft_vocab_size). ``where`` names the config in error messages."""
    model_type = d.get("model_type", "llama")
    if model_type != "llama":
        raise FormatError(f"{where}: the draft layer is model_type {model_type!r}; eaglewire drafts are "
                          "Llama layers (a qwen3 layer adds q_norm/k_norm, which they do not have)")
    c = {**LLAMA_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    if int(c["num_hidden_layers"]) != 1:
        raise FormatError(f"{where}: num_hidden_layers is {c['num_hidden_layers']}; eaglewire drafts "
                          "have exactly one decoder layer (as EAGLE-3, SGLang and vLLM do)")
    if c["hidden_act"] != "silu":
        raise FormatError(f"{where}: hidden_act {c['hidden_act']!r} is not supported; eaglewire drafts use silu")
    for flag in ("attention_bias", "mlp_bias"):
        if c[flag]:
            raise FormatError(f"{where}: {flag} is true; eaglewire drafts have no biases")
    if "vocab_size" not in d:
        raise FormatError(f"{where}: vocab_size (the target's vocabulary size) is missing")
    heads = int(c["num_attention_heads"])
    theta, rope = parse_rope(d)
    return {
        "hidden_size": int(c["hidden_size"]), "intermediate_size": int(c["intermediate_size"]),
        "num_attention_heads": heads, "num_key_value_heads": int(c.get("num_key_value_heads", heads)),
        "head_dim": int(c.get("head_dim") or int(c["hidden_size"]) // heads),
        "vocab_size": int(d["vocab_size"]), "rms_norm_eps": float(c["rms_norm_eps"]),
        "rope_theta": theta, "rope_parameters": rope,
        "max_position_embeddings": int(c["max_position_embeddings"]), "hidden_act": "silu",
    }


# ---------------------------------------------------------------- config.json (SGLang's, which SpecForge writes)

def eagle_config_ids(d: dict[str, Any], *, reader: str) -> tuple[list[int] | None, list[str]]:
    """(ids from the nested ``eagle_config.eagle_aux_hidden_state_layer_ids``, notes); None when absent (the
    engine then uses its default). ``reader``: the tool whose reading the notes describe (SGLang, or SpecForge,
    which reads the same keys)."""
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


def parse_eagle3_config(d: dict[str, Any], *, where: str, reader: str
                        ) -> tuple[dict[str, Any], list[int] | None, list[str]]:
    """(layer fields + draft_vocab_size/target_hidden_size, ids or None, notes); ``reader``
    names the tool whose reading the notes describe."""
    archs = d.get("architectures") or []
    notes = []
    if archs and ARCHITECTURE not in archs:
        notes.append(f"architectures is {archs}, not [{ARCHITECTURE!r}]; read as an EAGLE-3 draft anyway")
    layer = parse_llama_layer(d, where=where)
    ids, id_notes = eagle_config_ids(d, reader=reader)
    extra = {"draft_vocab_size": d.get("draft_vocab_size"), "target_hidden_size": d.get("target_hidden_size")}
    return {**layer, **extra}, ids, notes + id_notes


def draft_config(layer: dict[str, Any], state: dict[str, torch.Tensor], *, where: str,
                 target_hidden_size: int | None = None, draft_vocab_size: int | None = None) -> DraftConfig:
    """A DraftConfig from parsed layer fields and the (native-named) tensors' shapes.

    num_aux = fc input width / target_hidden_size; target_hidden_size defaults to the
    draft's hidden size and draft_vocab_size to lm_head's rows.
    """
    for name in ("fc.weight", "lm_head.weight"):
        if name not in state:
            raise FormatError(f"{where}: tensor {name} is missing; this is not an EAGLE-3 draft checkpoint")
    ht = int(target_hidden_size or layer["hidden_size"])
    fc_in = state["fc.weight"].shape[1]
    if fc_in % ht:
        raise FormatError(f"{where}: fc.weight is {tuple(state['fc.weight'].shape)}, whose input width "
                          f"{fc_in} is not a multiple of target_hidden_size {ht}")
    vd = int(draft_vocab_size or state["lm_head.weight"].shape[0])
    try:
        return DraftConfig(**layer, target_hidden_size=ht, num_aux=fc_in // ht, draft_vocab_size=vd)
    except ValueError as e:
        raise FormatError(f"{where}: {e}") from e


# ---------------------------------------------------------------- tensors

def build_draft(cfg: DraftConfig, tensors: dict[str, torch.Tensor], d2t: torch.Tensor, t2d: torch.Tensor, *,
                where: str) -> Eagle3Draft:
    """The draft holding ``tensors`` (native names, without d2t/t2d); FormatError naming
    every missing, unexpected or misshapen tensor."""
    draft = Eagle3Draft(cfg)
    expected = {k: v.shape for k, v in draft.state_dict().items() if k not in ("d2t", "t2d")}
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise FormatError(f"{where}: the weights do not form an EAGLE-3 draft: missing {missing}, "
                          f"unexpected {unexpected}")
    wrong = [f"{k} {tuple(t.shape)} (config implies {tuple(expected[k])})"
             for k, t in tensors.items() if t.shape != expected[k]]
    if wrong:
        raise FormatError(f"{where}: tensor shapes disagree with the config: {'; '.join(wrong)}")
    draft.load_state_dict({**tensors, "d2t": d2t, "t2d": t2d})
    return draft


def split_state(state: dict[str, torch.Tensor], *, where: str
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(draft tensors under native names, foreign tensors such as embed_tokens.weight).

    Strips a ``model.`` prefix and maps ``layers.0.`` to ``midlayer.``; a second decoder
    layer is an error.
    """
    draft, foreign = {}, {}
    for name, tensor in state.items():
        name = name.removeprefix("model.")
        if name.startswith("layers."):
            index, _, rest = name.removeprefix("layers.").partition(".")
            if index != "0":
                raise FormatError(f"{where}: tensor layers.{index}.{rest} belongs to a second decoder "
                                  "layer; eaglewire drafts have exactly one")
            name = "midlayer." + rest
        (foreign if name in FOREIGN_TENSORS else draft)[name] = tensor
    return draft, foreign


# ---------------------------------------------------------------- vocabulary maps

def identity_vocab_maps(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t, t2d of a draft whose vocabulary is the target's."""
    return torch.zeros(vocab_size, dtype=torch.long), torch.ones(vocab_size, dtype=torch.bool)


def complete_vocab_maps(d2t: torch.Tensor | None, t2d: torch.Tensor | None, *, vocab_size: int,
                        draft_vocab_size: int, where: str) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(d2t [Vd] long, t2d [V] bool, notes): fill in what the checkpoint left out.

    target id = draft id + d2t[draft id]; t2d[target id] = in the draft vocabulary.
    Both missing is only allowed for a full-vocabulary draft (identity maps).
    """
    notes: list[str] = []
    if d2t is None and t2d is None:
        if draft_vocab_size != vocab_size:
            raise FormatError(f"{where}: no d2t/t2d tensors, but the draft vocabulary ({draft_vocab_size}) "
                              f"is smaller than the target's ({vocab_size}); the token mapping is lost")
        return (*identity_vocab_maps(vocab_size), notes)
    if d2t is not None and d2t.shape != (draft_vocab_size,):
        raise FormatError(f"{where}: d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab_size},)")
    if t2d is not None and t2d.shape != (vocab_size,):
        raise FormatError(f"{where}: t2d has shape {tuple(t2d.shape)}, expected ({vocab_size},) "
                          "(the target vocabulary)")
    if d2t is None:
        kept = t2d.bool().nonzero().flatten()
        if kept.numel() != draft_vocab_size:
            raise FormatError(f"{where}: t2d marks {kept.numel()} tokens but the draft vocabulary has "
                              f"{draft_vocab_size}")
        return kept - torch.arange(draft_vocab_size), t2d.bool(), notes
    reading = read_d2t(d2t, t2d, vocab_size=vocab_size, where=where)
    if reading.kind == "absolute":
        notes.append(reading.message)
    targets = reading.targets
    derived = torch.zeros(vocab_size, dtype=torch.bool)
    derived[targets] = True
    return targets - torch.arange(draft_vocab_size), derived, notes


# A frequency-built draft vocabulary always holds some neighbouring target ids (the byte tokens,
# the first ids of a BPE merge table), so offsets (target - draft id) repeat; absolute ids
# written as d2t climb strictly instead. Below this many draft ids the pattern says nothing.
MIN_IDS_TO_TELL = 16


@dataclass(frozen=True)
class D2tReading:
    """How a checkpoint's d2t reads: ``offsets`` (target = draft id + d2t, what SGLang, vLLM and
    speculators compute) or ``absolute`` (d2t holds the target ids themselves, as llama.cpp's GGUF
    stores them); ``targets`` [Vd] long: the target id of each draft id under that reading."""

    kind: str
    targets: torch.Tensor
    message: str = ""


def _valid_targets(targets: torch.Tensor, vocab_size: int) -> bool:
    return (int(targets.min()) >= 0 and int(targets.max()) < vocab_size
            and torch.unique(targets).numel() == targets.numel())


def looks_absolute(d2t: torch.Tensor) -> bool:
    """d2t climbs strictly from a first value >= 0 over at least MIN_IDS_TO_TELL ids: target ids
    written where offsets belong (offsets of an ascending frequency vocabulary repeat)."""
    d2t = d2t.long()
    return (d2t.numel() >= MIN_IDS_TO_TELL and int(d2t[0]) >= 0
            and bool((d2t[1:] > d2t[:-1]).all()))


def read_d2t(d2t: torch.Tensor, t2d: torch.Tensor | None, *, vocab_size: int, where: str) -> D2tReading:
    """Which reading of ``d2t`` the checkpoint means, checked against ``t2d`` when present; never
    one map rebuilt from the other: FormatError naming what was found when they disagree.

    With t2d, the reading t2d agrees with wins (neither: refused). Without it, the offsets reading
    unless it maps outside the vocabulary or repeats a token while the absolute one does not, or
    d2t climbs strictly (``looks_absolute``)."""
    d2t = d2t.long()
    Vd = d2t.numel()
    as_offsets, as_absolute = torch.arange(Vd) + d2t, d2t.clone()
    ok = {"offsets": _valid_targets(as_offsets, vocab_size), "absolute": _valid_targets(as_absolute, vocab_size)}
    absolute = D2tReading("absolute", as_absolute, (
        f"{where}: d2t holds absolute target ids (d2t[0..3] = {d2t[:3].tolist()}, climbing strictly), not the "
        "offsets SGLang, vLLM and speculators read (target = draft id + d2t): an engine serving this checkpoint "
        "maps every draft id to the wrong token. Read as absolute ids and converted to offsets; to serve the "
        "original, rewrite d2t as d2t - arange(draft_vocab_size)"))
    if t2d is not None:
        marked = t2d.bool().nonzero().flatten()
        agree = {k: ok[k] and torch.equal(torch.sort(t)[0], marked)
                 for k, t in (("offsets", as_offsets), ("absolute", as_absolute))}
        if agree["offsets"]:
            return D2tReading("offsets", as_offsets)
        if agree["absolute"]:
            return replace(absolute, message=absolute.message.replace("climbing strictly", "t2d agrees with that "
                                                                      "reading, not with offsets"))
        raise FormatError(f"{where}: t2d disagrees with d2t read either way: t2d marks {marked.numel()} tokens "
                          f"(first {marked[:3].tolist()}); d2t read as offsets maps to "
                          f"{as_offsets[:3].tolist()}..., read as absolute ids to {as_absolute[:3].tolist()}... "
                          "One of them is from another vocabulary: rebuild both from the token counts (or drop "
                          "the wrong one, if you know which)")
    if not ok["offsets"] and not ok["absolute"]:
        raise FormatError(f"{where}: d2t maps draft ids outside the target vocabulary [0, {vocab_size}) or to the "
                          "same target token twice, read as offsets or as absolute ids")
    if not ok["offsets"] or looks_absolute(d2t):
        return absolute
    return D2tReading("offsets", as_offsets)


SAME_WEIGHTS_TOLERANCE = 1e-2  # relative difference above which a served copy is not the target's / trained weights


def relative_difference(a, b) -> float:
    """Relative Frobenius difference of ``a`` from ``b`` (same shapes; inf for other shapes). A requantized copy
    (Q8_0, bf16) differs by far less than ``SAME_WEIGHTS_TOLERANCE``; another model's rows (or the same rows
    permuted) by ~1."""
    if tuple(a.shape) != tuple(b.shape):
        return float("inf")
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))
