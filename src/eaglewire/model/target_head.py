"""A target of which only the head is in memory: embedding, final norm and lm_head.

Offline training, import and the stored-state doctor never run the target's layers; they
apply its head to stored states and embed token ids. For a 1T-parameter target that is a
few GB, read from the safetensors files with ``safe_open`` (headers, then only the named
tensors). The model is built on the meta device from its config, so its layers exist as
shapes only; the fingerprint hashes the very tensors a full load would hash (read by name),
so a head-only target and a full load of the same directory have equal fingerprints.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from eaglewire.core.contract import TargetFingerprint
from eaglewire.model.target import (Target, auto_model_class, chat_template_sha256, check_text_model,
                                    fingerprint_target, resolve_target_path, tokenizer_sha256)

log = logging.getLogger(__name__)


class HeadOnlyError(ValueError):
    """The directory cannot provide a head-only target (no weights, a tensor missing)."""


def tensor_locations(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (from the index, else every file's header)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {name: model_dir / file for name, file in weight_map.items()}
    out: dict[str, Path] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({name: path for name in f.keys()})
    return out


_WRAPPER_PREFIX = re.compile(r"^(?:model\.|language_model\.)+")


def _stored_names(names: list[str], locations: dict[str, Path]) -> dict[str, str]:
    """Parameter name -> its name in the files. A wrapper (``LlavaForConditionalGeneration``) names its
    text model ``model.language_model.norm.weight`` in memory and may store it as
    ``language_model.model.norm.weight`` (its lm_head as ``language_model.lm_head.weight``): a name
    absent verbatim is matched with the ``model.`` / ``language_model.`` prefixes stripped, when unique."""
    by_short: dict[str, list[str]] = {}
    for stored in locations:
        by_short.setdefault(_WRAPPER_PREFIX.sub("", stored), []).append(stored)
    out = {}
    for n in names:
        candidates = by_short.get(_WRAPPER_PREFIX.sub("", n), [])
        out[n] = n if n in locations else candidates[0] if len(candidates) == 1 else n
    return out


def read_tensors(names: list[str], locations: dict[str, Path], *, where: Path) -> dict[str, torch.Tensor]:
    """Only ``names``, each opened in its own file; raise naming the first absent one."""
    stored = _stored_names(names, locations)
    missing = [n for n in names if stored[n] not in locations]
    if missing:
        raise HeadOnlyError(f"target {where}: tensor(s) {missing} are not in its safetensors files "
                            f"({len(locations)} tensors found); pass a transformers model directory "
                            "saved with save_pretrained")
    out: dict[str, torch.Tensor] = {}
    for name in names:
        with safe_open(str(locations[stored[name]]), "pt") as f:
            out[name] = f.get_tensor(stored[name])
    return out


def load_target_head(spec: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Target:
    """A Target whose embedding, final norm and lm_head are real and whose layers are meta.

    ``head``, ``embed_tokens``, ``fingerprint`` and the size properties work; running the
    model does not (its layers hold no data). ``spec`` is a model directory or preset.
    """
    from transformers import AutoConfig, AutoTokenizer

    path = resolve_target_path(spec)
    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = auto_model_class(config, where=f"target {spec}").from_config(config, dtype=dtype)
    check_text_model(model, where=f"target {spec}")
    model.eval().requires_grad_(False)
    names = [n for n, _ in model.named_parameters()]  # tied parameters listed once, as a full load does
    embed = model.get_input_embeddings()
    by_id = {id(p): n for n, p in model.named_parameters()}
    wanted = {by_id[id(embed.weight)], by_id[id(model.get_decoder().norm.weight)],
              names[0], names[len(names) // 2], names[-1]}
    head_weight = model.get_output_embeddings().weight
    if id(head_weight) in by_id:
        wanted.add(by_id[id(head_weight)])
    locations = tensor_locations(path)
    if not locations:
        raise HeadOnlyError(f"target {path} holds no *.safetensors weights; the head-only target reads "
                            "the embedding, final norm and lm_head from them")
    tensors = read_tensors(sorted(wanted), locations, where=path)
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False, assign=True)
    if model.get_output_embeddings().weight.is_meta:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight  # tied
    for module in (model.get_input_embeddings(), model.get_decoder().norm, model.get_output_embeddings()):
        module.to(device)  # the layers stay on meta
    log.info("target %s: head only (%d of %d tensors read)", path, len(tensors), len(locations))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    target = Target(model=model, tokenizer=tokenizer, spec=spec)
    target._fingerprint = fingerprint_target(model, tokenizer)
    return target


def unnorm_weight(target: Target) -> torch.Tensor:
    """The final norm applied to a vector of ones: its effective per-channel scale, [H].

    Dividing a post-norm state y by it gives u with norm(u) == y (an RMS norm is idempotent on
    unit-RMS vectors), so a post-norm capture can be stored where a pre-norm one is expected.
    """
    norm = target.decoder.norm
    if getattr(norm, "bias", None) is not None:
        raise HeadOnlyError(f"the final norm of target {target.spec} has a bias ({type(norm).__name__}); "
                            "a post-norm state cannot be mapped back through it")
    ones = torch.ones(target.hidden_size, dtype=target.dtype, device=target.device)
    return norm(ones).float()  # [H]


def config_fingerprint(spec: str) -> tuple[TargetFingerprint, list[str]]:
    """The fingerprint of a target known only by its config (and tokenizer, when present), plus
    the fields it could not know. Unknown fields are recorded as ``"unknown"``."""
    from transformers import AutoConfig, AutoTokenizer

    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise HeadOnlyError(f"--target {spec} has no config.json; pass the target's model directory "
                            "(its config.json is enough to import; its weights add the head)")
    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = auto_model_class(config, where=f"--target {spec}").from_config(config)
    check_text_model(model, where=f"--target {spec}")
    unknown = ["weights_sha256"]
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError):
        tokenizer, unknown = None, unknown + ["tokenizer_sha256", "chat_template_sha256"]
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    fingerprint = TargetFingerprint(
        architecture=str((config.architectures or [type(model).__name__])[0]),
        num_layers=len(model.get_decoder().layers), hidden_size=int(cfg.hidden_size),
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        tokenizer_sha256=tokenizer_sha256(tokenizer) if tokenizer is not None else "unknown",
        chat_template_sha256=chat_template_sha256(tokenizer) if tokenizer is not None else "unknown",
        weights_sha256="unknown", dtype="float32")
    return fingerprint, unknown
