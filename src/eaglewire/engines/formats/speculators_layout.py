"""The speculators EAGLE-3 layout (speculators 0.9), and a directory written in it. Not an engine: vLLM loads
it (its export, engines/vllm/readings.py, writes it with vLLM's ids and launch command) and llama.cpp's
converter reads it (its GGUF export, engines/llamacpp/gguf.py, converts such a directory), so it lives below
both.

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
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from eaglewire.engines.export import (ExportConfig, load_export_target, record, serving_dtype, stored_dtype, verifier,
                                      write_export)
from eaglewire.engines.formats.eagle3_layout import FormatError, llama_layer_config
from eaglewire.model.checkpoint import DraftFiles
from eaglewire.model.draft import DraftConfig

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


def write(draft: DraftFiles, out: Path, config: ExportConfig, *, engine: str, arch: str | None,
          serving: Callable[[str | None], str], target=None,
          allow: frozenset[str] | set[str] = frozenset()) -> tuple[list[str], list[str]]:
    """Write ``draft`` in this layout into ``out`` (its boundaries are the ids): (files written, notes). Needs
    the target's embedding (``target``, else loaded from the spec the draft records; checked against the
    contract, ``allow`` as in ``HiddenStateContract.check_target``); ``torch_dtype`` is the target's stored
    dtype. ``engine`` and ``arch`` go into the export record; ``serving(verifier name)`` is SERVING.md."""
    contract, cfg = draft.contract, draft.draft_config
    name = verifier(config, draft)
    target = target if target is not None else load_export_target(draft)
    notes = contract.check_target(target.fingerprint, what=f"draft {draft.path}", allow=allow)
    notes += verifier_notes(name, is_local_path=bool(name) and Path(name).expanduser().exists())
    dtype = stored_dtype(target.spec) or serving_dtype(draft.target_spec, str(target.dtype).removeprefix("torch."),
                                                       notes)
    engine_config = {**build_config(cfg, list(contract.aux_boundaries), verifier_name=name,
                                    num_steps=config.num_steps, dtype=dtype,
                                    verifier_architecture=contract.target.architecture),
                     **record(draft, arch, engine)}
    state = draft.state()
    keep_maps = check_vocab_maps(cfg, state["d2t"])
    tensors = to_speculators_names({k: v for k, v in state.items() if keep_maps or k not in ("d2t", "t2d")})
    # the target's stored values: vLLM shares the target's embedding only when exactly equal
    tensors["embed_tokens.weight"] = target.embed_tokens.weight.detach().to("cpu", getattr(torch, dtype))
    return write_export(out, engine_config, tensors, serving(name)), notes
