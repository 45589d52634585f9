"""What a draft computes once an engine has read its config: ``ServedDraft``, each engine's reading
of every field that changes the draft's computation (built by that engine's module, e.g.
``vllm.read_served``), its comparison with what training used (``mismatches``), and the draft
rebuilt as that engine would run it (``as_served``), so the doctor can measure what it will accept.

An eaglewire draft (native, or imported: an import refuses other norm placements) computes with
``TRAINED_NORMS`` all false, its own ``DraftConfig`` (eps, RoPE, head_dim, sizes), the target's
embedding, its own ``lm_head`` over ``draft_vocab_size`` ids and ``d2t`` as offsets
(target id = draft id + d2t[draft id]).
"""

from __future__ import annotations

import copy
import json
import types
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from eaglewire.engines.formats.eagle3_layout import SAME_WEIGHTS_TOLERANCE, relative_difference
from eaglewire.model.draft import DraftConfig, Eagle3Draft, RMSNorm, Rotary

# flag -> what a true value makes the engine compute; an eaglewire draft trains with all false
TRAINED_NORMS: dict[str, str] = {
    "norm_before_residual": "the residual is hidden_norm(h) instead of h",
    "norm_before_fc": "an RMSNorm over the concatenated aux states before fc",
    "fc_norm": "an RMSNorm on each aux state before fc",
    "norm_output": "the post-norm state is fed to the next step (cond acc@1.. only)",
}


@dataclass(kw_only=True)
class ServedDraft:
    """The values one engine release computes a draft with, read from its config as that engine
    reads it (missing keys get the engine's defaults, not the writer's)."""

    engine: str  # e.g. "vLLM 0.33.0"
    norms: dict[str, bool]  # TRAINED_NORMS' flags as the engine reads them
    draft_vocab_size: int | None  # None: the engine runs the draft over the target's whole vocabulary
    target_hidden_size: int | None
    num_aux: int  # aux states fc is sized for
    hidden_size: int | None
    head_dim: int | None
    rms_norm_eps: float | None  # None: the config lacks it and the engine fails to load
    rope_theta: float
    rope_parameters: dict[str, Any]
    embedding: str  # "target" | "draft" (its own embed_tokens)
    lm_head: str  # "draft" | "target" (the target's head, full vocabulary) | "embedding" (tied)
    d2t: str = "offsets"  # how it reads d2t: target id = draft id + d2t
    t2d: str = "ignored"
    dtype: str = "the target's"
    layer: str = "llama"  # the draft layer class it builds ("qwen3": adds q_norm / k_norm)
    cited: dict[str, str] = field(default_factory=dict)  # field -> file and function read
    notes: list[str] = field(default_factory=list)
    norm_sections: dict[str, str] = field(default_factory=dict)  # norm flag -> the config section it was read from


@dataclass(frozen=True)
class Mismatch:
    """One field the engine reads otherwise than training used."""

    field: str
    served: Any
    trained: Any
    meaning: str
    fix: str  # the exact key and value to write
    measurable: bool = True  # as_served can rebuild the draft with it (else: it fails to load or differs too much)


def mismatches(served: ServedDraft, cfg: DraftConfig, *, config_key: str = "") -> list[Mismatch]:
    """Every field ``served`` computes otherwise than a draft of ``cfg`` was trained with.
    ``config_key``: where the engine reads the layer fields (``transformer_layer_config.`` for vLLM's
    speculators format), for the fixes."""
    out = []
    for flag, meaning in TRAINED_NORMS.items():
        if served.norms.get(flag, False):
            section = served.norm_sections.get(flag)
            where = (f'inside "{section}" of config.json ({served.engine} reads it there before the top level)'
                     if section else "at the top level of config.json")
            out.append(Mismatch(flag, True, False, f"{served.engine} reads {flag} as true: {meaning}; "
                                "the draft was trained without it", f'write "{flag}": false {where}',
                                measurable=flag != "norm_output"))
    sizes = (("draft_vocab_size", served.draft_vocab_size, cfg.draft_vocab_size, ""),
             ("target_hidden_size", served.target_hidden_size, cfg.target_hidden_size, ""),
             ("hidden_size", served.hidden_size, cfg.hidden_size, config_key),
             ("head_dim", served.head_dim, cfg.head_dim, config_key))
    for name, got, want, key in sizes:
        if got != want and not (name == "draft_vocab_size" and got is None and want == cfg.vocab_size):
            shown = "missing: the target's whole vocabulary and the target's lm_head" if got is None else got
            out.append(Mismatch(name, shown, want, f"{served.engine} sizes the draft with {name} {shown}; "
                                f"trained with {want}", f'write "{key}{name}": {want}', measurable=False))
    if served.num_aux != cfg.num_aux:
        out.append(Mismatch("num_aux_hidden_states", served.num_aux, cfg.num_aux,
                            f"{served.engine} sizes fc for {served.num_aux} aux states; the draft fuses {cfg.num_aux}",
                            f'write "{config_key}num_aux_hidden_states": {cfg.num_aux}', measurable=False))
    if served.rms_norm_eps is None:
        out.append(Mismatch("rms_norm_eps", "missing", cfg.rms_norm_eps, f"{served.engine} has no default for "
                            "rms_norm_eps: loading fails", f'write "{config_key}rms_norm_eps": {cfg.rms_norm_eps}',
                            measurable=False))
    elif not _close(served.rms_norm_eps, cfg.rms_norm_eps):
        out.append(Mismatch("rms_norm_eps", served.rms_norm_eps, cfg.rms_norm_eps,
                            f"{served.engine} normalises with eps {served.rms_norm_eps}",
                            f'write "{config_key}rms_norm_eps": {cfg.rms_norm_eps}'))
    if not _close(served.rope_theta, cfg.rope_theta):
        out.append(Mismatch("rope_theta", served.rope_theta, cfg.rope_theta,
                            f"{served.engine} rotates positions with theta {served.rope_theta}",
                            f'write "{config_key}rope_theta": {cfg.rope_theta}'))
    if _rope(served.rope_parameters) != _rope(cfg.rope_parameters):
        out.append(Mismatch("rope_scaling", served.rope_parameters or None, cfg.rope_parameters or None,
                            f"{served.engine} scales RoPE with {served.rope_parameters or 'nothing'}",
                            f'write "{config_key}rope_scaling": {json.dumps(cfg.rope_parameters or None)}'))
    if served.lm_head != "draft":
        out.append(Mismatch("lm_head", served.lm_head, "draft", f"{served.engine} uses the {served.lm_head}'s "
                            "weights as the draft's head, not the trained lm_head",
                            'write "tie_word_embeddings": false and "draft_vocab_size"' f": {cfg.draft_vocab_size}",
                            measurable=False))
    if served.layer != "llama":
        out.append(Mismatch("model_type", served.layer, "llama", f"{served.engine} builds a {served.layer} "
                            "draft layer (q_norm/k_norm the draft does not have)",
                            f'write "{config_key}model_type": "llama"', measurable=False))
    return out


def _close(a: float, b: float) -> bool:
    return abs(float(a) - float(b)) <= 1e-9 * max(abs(float(a)), abs(float(b)), 1e-30)


def _rope(params: dict[str, Any] | None) -> dict[str, Any]:
    p = {k: v for k, v in (params or {}).items() if k not in ("rope_theta",)}
    return {} if p.get("rope_type", "default") == "default" and len(p) <= 1 else p


def as_served(draft: Eagle3Draft, found: list[Mismatch], *, d2t: torch.Tensor | None = None,
              norm_weights: dict[str, torch.Tensor] | None = None, lm_head: torch.Tensor | None = None) -> Eagle3Draft:
    """A copy of ``draft`` computing as the engine will (the measurable ``found``; ``d2t``: the
    offsets it will map draft ids with, when its directory holds other ones). The trained weights
    are kept; a norm the checkpoint has no weights for gets ones, as an engine initialises it, or the
    weight the served file holds (``norm_weights``: norm flag -> weight, e.g. a GGUF's norm before fc);
    ``lm_head`` [Vd, H]: the head rows the served file holds where they are not the trained ones."""
    served = copy.deepcopy(draft)
    by = {m.field: m for m in found if m.measurable}
    cfg = served.config
    if "rms_norm_eps" in by or "rope_theta" in by or "rope_scaling" in by:
        cfg = replace(cfg, rms_norm_eps=float(by["rms_norm_eps"].served) if "rms_norm_eps" in by else cfg.rms_norm_eps,
                      rope_theta=float(by["rope_theta"].served) if "rope_theta" in by else cfg.rope_theta,
                      rope_parameters=dict(by["rope_scaling"].served or {}) if "rope_scaling" in by
                      else cfg.rope_parameters)
        for module in served.modules():
            if isinstance(module, RMSNorm):
                module.eps = cfg.rms_norm_eps
        served.config = cfg
        served.rotary = Rotary(cfg).to(draft.fc.weight.device)
    if "norm_before_residual" in by:
        served.midlayer.finish = types.MethodType(_finish_normed_residual, served.midlayer)
    pre = []
    if "norm_before_fc" in by:  # one norm over the k*Ht concatenation (vLLM's input_norm)
        pre.append(RMSNorm(cfg.num_aux * cfg.target_hidden_size, cfg.rms_norm_eps))
        if (weight := (norm_weights or {}).get("norm_before_fc")) is not None:
            pre[-1].weight.data.copy_(weight.reshape(pre[-1].weight.shape))  # [k*Ht]
    if "fc_norm" in by:
        pre.append(_ChunkNorm(cfg.num_aux, cfg.target_hidden_size, cfg.rms_norm_eps))
    if pre:
        served.pre_fc = torch.nn.Sequential(*pre).to(draft.fc.weight.device, draft.fc.weight.dtype)
        served.fuse = types.MethodType(lambda self, aux: self.fc(self.pre_fc(aux)), served)
    if d2t is not None:
        served.d2t.copy_(d2t.to(served.d2t))
    if lm_head is not None:
        served.lm_head.weight.data.copy_(lm_head.to(served.lm_head.weight))  # [Vd, H]
    return served


def _finish_normed_residual(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """MidLayer.finish with the residual taken from hidden_norm(hidden) (norm_before_residual)."""
    h = self.hidden_norm(hidden) + attn_out
    return h + self.mlp(self.post_attention_layernorm(h))


class _ChunkNorm(torch.nn.Module):
    """An RMSNorm on each of k aux states: [.., k*Ht] -> [.., k*Ht] (fc_norm)."""

    def __init__(self, k: int, size: int, eps: float) -> None:
        super().__init__()
        self.k = k
        self.norms = torch.nn.ModuleList(RMSNorm(size, eps) for _ in range(k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([n(c) for n, c in zip(self.norms, x.chunk(self.k, dim=-1))], dim=-1)  # [.., k*Ht]


# ---------------------------------------------------------------- what the doctor reads an engine's files into

@dataclass
class FieldReading:
    """What ``engine`` computes the draft with from its config directory, against training."""

    served: Any  # engines.served_draft.ServedDraft
    found: list  # engines.served_draft.Mismatch: each field read otherwise than trained
    d2t: Any = None  # [Vd] long offsets the engine maps draft ids with, where they differ from the draft's
    notes: list[str] = field(default_factory=list)
    embedding: Any = None  # [V, H] the token embedding the engine drafts with, where it is not the target's
    norm_weights: dict[str, Any] = field(default_factory=dict)  # norm flag -> the weight the served file applies
    lm_head: Any = None  # [Vd, H] the head rows the served file holds, where they are not the trained ones


def embedding_comparable(embed, emb_rows) -> bool:
    """Whether the target's rows ``emb_rows`` = (token ids [N], rows [N, H]) can be looked up in ``embed`` [V, H]."""
    if embed is None or emb_rows is None:
        return False
    ids, rows = emb_rows
    return int(ids.max()) < embed.shape[0] and embed.shape[-1] == rows.shape[-1]


def embedding_differs(embed, emb_rows, what: str) -> tuple[bool, list[str]]:
    """(whether ``embed`` [V, H] is not the target's at ``emb_rows`` = (token ids [N], the target's rows [N, H]),
    the note saying by how much)."""
    if embed is None or emb_rows is None:
        return False, []
    ids, rows = emb_rows
    if not embedding_comparable(embed, emb_rows):
        return True, [f"{what} is {list(embed.shape)}: not this target's embedding ({list(rows.shape)[-1]} wide, "
                      f"ids up to {int(ids.max())})"]
    rel = relative_difference(embed.float()[ids], rows)  # [N, H] against [N, H]
    return rel > SAME_WEIGHTS_TOLERANCE, [f"{what} differs from the target's by {rel:.2e} (relative)"]


def own_embedding_mismatch(engine: str, fix: str, *, measurable: bool):
    """The field reading of an engine that drafts with the checkpoint's own token embedding, not the target's."""
    return Mismatch("embed_tokens", "the checkpoint's own", "the target's",
                    f"{engine} uses the checkpoint's own embedding rows, which are not this target's", fix,
                    measurable=measurable)


def same_rope_type(served: Any, trained: Any) -> bool:
    return isinstance(served, dict) and isinstance(trained, dict) and \
        served.get("rope_type") == trained.get("rope_type") is not None


