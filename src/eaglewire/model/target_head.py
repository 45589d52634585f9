"""A target of which only the head is in memory: embedding, final norm and lm_head.

Offline training, import and the stored-state doctor never run the target's layers; they
apply its head to stored states and embed token ids. For a 1T-parameter target that is a
few GB, read from the safetensors files with ``safe_open`` (headers, then only the named
tensors). The model is built on the meta device from its config, so its layers exist as
shapes only; the fingerprint hashes the very tensors a full load would hash (read by name),
so a head-only target and a full load of the same directory have equal fingerprints.

``layers=`` also reads whole decoder layers by index, and ``through_layer`` runs one of them on stored
states: a capture through an engine (``prepare --capture vllm --head-only``) checks the engine's last state
as the last layer applied to its boundary L-1, with one layer in memory instead of all of them.
"""

from __future__ import annotations

import json
import logging
import re
from contextlib import contextmanager
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


def load_target_head(spec: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                     layers: tuple[int, ...] = ()) -> Target:
    """A Target whose embedding, final norm and lm_head are real and whose layers are meta, but for the
    decoder layers ``layers`` (0-based; negative counts from the end), read whole.

    ``head``, ``embed_tokens``, ``fingerprint``, the size properties and ``through_layer`` on the layers read
    work; running the model does not. ``spec`` is a model directory or preset.
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
    decoder_layers = model.get_decoder().layers
    read_layers = sorted({i % len(decoder_layers) for i in layers})
    for i in read_layers:
        wanted |= {by_id[id(p)] for p in decoder_layers[i].parameters()}
    locations = tensor_locations(path)
    if not locations:
        raise HeadOnlyError(f"target {path} holds no *.safetensors weights; the head-only target reads "
                            "the embedding, final norm and lm_head from them")
    tensors = read_tensors(sorted(wanted), locations, where=path)
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False, assign=True)
    if model.get_output_embeddings().weight.is_meta:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight  # tied
    for module in (model.get_input_embeddings(), model.get_decoder().norm, model.get_output_embeddings(),
                   *(decoder_layers[i] for i in read_layers)):
        module.to(device)  # the other layers stay on meta
    if read_layers:  # its buffers (inv_freq) were made on meta and are not in the files
        rotary = model.get_decoder().rotary_emb
        with torch.device(device):
            model.get_decoder().rotary_emb = type(rotary)(config=rotary.config)
    log.info("target %s: head only%s (%d of %d tensors read)", path,
             f" and layers {read_layers}" if read_layers else "", len(tensors), len(locations))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    target = Target(model=model, tokenizer=tokenizer, spec=spec)
    target._fingerprint = fingerprint_target(model, tokenizer)
    return target


class _Skipped(torch.nn.Module):
    """A decoder layer left out of a forward: hands its input on (and keeps it in ``seen``, when given)."""

    def __init__(self, seen: list[torch.Tensor] | None = None):
        super().__init__()
        self.seen = seen

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.seen is not None:
            self.seen.append(hidden_states)
        return hidden_states


@contextmanager
def _only_layer(target: Target, layer: int | None, seen: list[torch.Tensor]):
    """The decoder with every layer but ``layer`` skipped (all, for None); ``seen`` gets layer ``layer``'s output,
    or (for None) layer 0's input. The decoder's own forward then builds the masks (causal, sliding window by layer
    type), rotary positions and input scaling that a full forward uses."""
    decoder = target.decoder
    kept = decoder.layers
    hook = None
    if layer is not None:
        hook = kept[layer].register_forward_hook(lambda module, args, output: seen.append(
            output[0] if isinstance(output, tuple) else output))
    decoder.layers = torch.nn.ModuleList([
        m if i == layer else _Skipped(seen if layer is None and i == 0 else None) for i, m in enumerate(kept)])
    try:
        with torch.no_grad():
            yield decoder
    finally:
        decoder.layers = kept
        if hook is not None:
            hook.remove()


def through_layer(target: Target, layer: int, before: torch.Tensor) -> torch.Tensor:
    """Decoder layer ``layer`` (0-based) applied to one sequence's states ``before`` [T, H] (boundary ``layer``,
    positions 0..T-1): boundary ``layer + 1``, [T, H], before any final norm. Needs only that layer's weights.
    ``before`` is handed to the layer itself (a pre-hook), so a decoder that scales its input embeddings (Gemma)
    does not scale it."""
    seen: list[torch.Tensor] = []
    state = before.to(target.dtype).unsqueeze(0)  # [T, H] -> [1, T, H]

    def feed(module, args, kwargs):
        if args:
            return (state, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": state}

    handle = target.decoder.layers[layer].register_forward_pre_hook(feed, with_kwargs=True)
    try:
        with _only_layer(target, layer, seen) as decoder:
            decoder(inputs_embeds=state, use_cache=False)
    finally:
        handle.remove()
    return seen[0][0]  # [1, T, H] -> [T, H]


def boundary_zero(target: Target, token_ids: list[int]) -> torch.Tensor:
    """Boundary 0 of ``token_ids``, [T, H]: what the decoder hands its first layer (the embedding, scaled where
    the model scales it). Needs only the embedding."""
    seen: list[torch.Tensor] = []
    with _only_layer(target, None, seen) as decoder:
        decoder(input_ids=torch.tensor([token_ids], device=target.device), use_cache=False)
    return seen[0][0]  # [1, T, H] -> [T, H]


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
