"""What llama.cpp (build ``BUILD``) computes an EAGLE-3 draft with, read from the draft GGUF the way
its loader and ``src/models/eagle3.cpp`` read it: ``read_served`` gives the ``ServedDraft`` every engine's
reading is compared through (``engines/serving/served_draft.py``), and the tensors that change the computation
without a flag saying so.

Read at build 11434:
- ``llama_model_eagle3::load_arch_hparams``: ``<arch>.target_layers`` (exactly 3), ``target_hidden_size``,
  ``norm_before_residual`` and ``norm_before_fc`` (both optional, default false);
- ``load_arch_tensors``: ``enc.output_norm.weight`` (required when ``norm_before_fc``: the RMSNorm over the
  concatenated target states before ``fc``, with that weight); ``token_embd.weight`` when present is the
  draft's own embedding ("Llama 3.3 70B EAGLE3 has its own"), else the target's; ``output.weight`` optional,
  else the target's head; ``d2t`` (I64) makes the draft vocabulary ``d2t``'s length;
- ``graph<false>``: the token rows come from ``tok_embd`` (own, else the target's), logits are scattered to
  the target ids ``d2t`` holds (absolute ids, ``ggml_set_rows``);
- ``llama_model::load_hparams`` (src/llama-model.cpp): ``embedding_length``, ``attention.head_count``,
  ``attention.key_length``, ``attention.layer_norm_rms_epsilon``, ``rope.freq_base``, ``rope.scaling.*``;
  a ``rope_freqs`` tensor carries llama3-style scaling.

GGUF stores eps and theta as float32: they are read back at float32's shortest decimal (1e-05, not
9.9999997e-06), so a value written from the draft's config compares equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglewire.engines.llamacpp.gguf import read_gguf_metadata, reader_tensor
from eaglewire.engines.llamacpp.installation import BUILD
from eaglewire.engines.serving.served_draft import ServedDraft

EAGLE3_CPP = "src/models/eagle3.cpp"
NORM_BEFORE_FC_TENSOR = "enc.output_norm.weight"  # LLM_TENSOR_ENC_OUTPUT_NORM
OWN_EMBEDDING_TENSOR = "token_embd.weight"
OWN_HEAD_TENSOR = "output.weight"
LLAMA3_ROPE_TENSOR = "rope_freqs.weight"

CITED = {
    "target_layers / target_hidden_size / norm flags": f"{EAGLE3_CPP} llama_model_eagle3::load_arch_hparams",
    "token_embd / output / enc.output_norm / d2t": f"{EAGLE3_CPP} load_arch_tensors, graph<false>",
    "eps / rope / sizes": "src/llama-model.cpp llama_model::load_hparams",
}


@dataclass
class GgufDraft:
    """A draft GGUF as llama.cpp computes with it."""

    served: ServedDraft
    own_embedding: torch.Tensor | None  # [V, H] its token_embd, which llama.cpp uses instead of the target's
    own_head: torch.Tensor | None = None  # [Vd, H] its output (lm_head) rows (None: it takes the target's head)
    norm_weights: dict[str, torch.Tensor] = field(default_factory=dict)  # norm flag -> the weight applied
    missing: list[str] = field(default_factory=list)  # tensors its flags require and it lacks: it fails to load


def _float32(value: Any) -> float:
    """A float32 GGUF value at its shortest round-trip decimal (1e-05 rather than 9.99999974738e-06)."""
    return float(str(np.float32(value)))


def _tensor(path: Path, name: str) -> torch.Tensor | None:
    """One GGUF tensor in float32, dequantized, in PyTorch's layout ([rows, cols]); None when absent."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    t = reader_tensor(path, name)
    if t is None:
        return None
    data = np.asarray(t.data)
    if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        data = dequantize(data, t.tensor_type)
    rows = [int(n) for n in reversed(t.shape.tolist())]  # GGUF lists ne0 (the row length) first
    return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(rows)  # [rows, cols] or [n]


def _rope(meta: dict[str, Any], arch: str, tensors: set[str]) -> dict[str, Any]:
    """The RoPE scaling llama.cpp applies, as transformers' rope_parameters name it ({}: none)."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return {"rope_type": "llama3"} if LLAMA3_ROPE_TENSOR in tensors else {}
    out: dict[str, Any] = {"rope_type": str(kind)}
    if (factor := meta.get(f"{arch}.rope.scaling.factor")) is not None:
        out["factor"] = _float32(factor)
    if (ctx := meta.get(f"{arch}.rope.scaling.original_context_length")) is not None:
        out["original_max_position_embeddings"] = int(ctx)
    return out


def read_served(path: str | Path) -> GgufDraft:
    """What llama.cpp computes the EAGLE-3 draft in the GGUF at ``path`` with (module docstring)."""
    path = Path(path)
    meta = read_gguf_metadata(path)
    arch = str(meta.get("general.architecture"))
    tensors = set(meta["tensor_names"])
    key = lambda name, default=None: meta.get(f"{arch}.{name}", default)  # noqa: E731
    norms = {"norm_before_residual": bool(key("norm_before_residual", False)),
             "norm_before_fc": bool(key("norm_before_fc", False)), "fc_norm": False, "norm_output": False}
    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length") or (int(hidden) // int(heads) if hidden and heads else None)
    eps = key("attention.layer_norm_rms_epsilon")
    d2t = reader_tensor(path, "d2t")
    layers, target_hidden = key("target_layers"), key("target_hidden_size")
    served = ServedDraft(
        engine=f"llama.cpp build {BUILD}", norms=norms,
        draft_vocab_size=int(d2t.shape[0]) if d2t is not None else None,
        target_hidden_size=int(target_hidden) if target_hidden is not None else None,
        num_aux=len(layers) if layers is not None else 0,
        hidden_size=int(hidden) if hidden else None, head_dim=int(head_dim) if head_dim else None,
        rms_norm_eps=_float32(eps) if eps is not None else None,
        rope_theta=_float32(key("rope.freq_base", 10000.0)), rope_parameters=_rope(meta, arch, tensors),
        embedding="draft" if OWN_EMBEDDING_TENSOR in tensors else "target",
        lm_head="draft" if OWN_HEAD_TENSOR in tensors else "target",
        d2t="absolute target ids", cited=dict(CITED))
    out = GgufDraft(served, own_embedding=_tensor(path, OWN_EMBEDDING_TENSOR), own_head=_tensor(path, OWN_HEAD_TENSOR))
    if norms["norm_before_fc"]:
        weight = _tensor(path, NORM_BEFORE_FC_TENSOR)
        if weight is None:
            out.missing.append(NORM_BEFORE_FC_TENSOR)
        else:
            out.norm_weights["norm_before_fc"] = weight  # [k*Ht]
    return out


# The fix for any GGUF field read otherwise than trained: the GGUF is the converter's output, and the loader
# refuses tensors it does not create, so an edited key alone does not do; a re-export writes every field as trained.
REEXPORT_FIX = ("re-export the draft with `eaglewire export --draft DRAFT --to llamacpp --out DIR` and serve DIR's "
                "GGUF (llama.cpp's converter writes every field, and the target's embedding, from the draft as trained)")


def same_float32(a: float, b: float) -> bool:
    """Whether two values are one float32 value (GGUF stores eps and theta in float32)."""
    return bool(np.float32(a) == np.float32(b))


def read_fields(path, draft, *, emb_rows=None):
    """The doctor's field reading of a llama.cpp draft GGUF (``FieldReading``): every field llama.cpp reads from it that changes what ``draft``
    computes (``engines/llamacpp/served.py``), against training; the draft's vocabulary map (``d2t``) is the
    llama.cpp vocabulary check's."""
    from dataclasses import replace

    from eaglewire.engines.serving.served_draft import (FieldReading, Mismatch, embedding_comparable, embedding_differs,
                                                mismatches, own_embedding_mismatch, same_rope_type)
    from eaglewire.engines.formats.eagle3_layout import SAME_WEIGHTS_TOLERANCE, relative_difference

    gguf = read_served(path)
    served = gguf.served
    found, notes = [], []
    for m in mismatches(served, draft.config):
        if m.field == "rope_scaling" and same_rope_type(m.served, m.trained):
            notes.append(f"RoPE scaling {m.trained.get('rope_type')}: llama.cpp's GGUF names its type; compared by "
                         "type only")
            continue
        if m.field in ("rms_norm_eps", "rope_theta") and same_float32(m.served, m.trained):
            continue  # the converter wrote the trained value in float32
        if m.field == "norm_before_fc" and gguf.missing:
            m = replace(m, meaning=f"{m.meaning}; the GGUF lacks {', '.join(gguf.missing)}, so llama.cpp refuses to "
                                   "load it", measurable=False)
        found.append(replace(m, fix=REEXPORT_FIX))
    differs, more = embedding_differs(gguf.own_embedding, emb_rows, "the GGUF's token_embd.weight")
    notes += more
    out = FieldReading(served, found, notes=notes, norm_weights=gguf.norm_weights)
    if differs:
        measurable = embedding_comparable(gguf.own_embedding, emb_rows)
        out.found.append(own_embedding_mismatch(served.engine, REEXPORT_FIX, measurable=measurable))
        out.embedding = gguf.own_embedding if measurable else None
    elif gguf.own_embedding is not None:
        served.embedding = "target"  # its own token_embd holds the target's rows
    trained = draft.lm_head.weight.detach().float().cpu()  # [Vd, H]
    if gguf.own_head is not None and relative_difference(gguf.own_head, trained) > SAME_WEIGHTS_TOLERANCE:
        same_shape = tuple(gguf.own_head.shape) == tuple(trained.shape)
        out.found.append(Mismatch("lm_head", "the GGUF's own output rows", "the trained lm_head",
                                  f"{served.engine} scores the draft's tokens with the GGUF's output.weight "
                                  f"{list(gguf.own_head.shape)}, which is not the trained lm_head "
                                  f"{list(trained.shape)}", REEXPORT_FIX, measurable=same_shape))
        out.lm_head = gguf.own_head if same_shape else None
    return out
