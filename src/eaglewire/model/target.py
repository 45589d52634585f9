"""Load a target LLM (named preset, HF model directory or .gguf file) and fingerprint it.

A GGUF file is dequantized once with transformers' GGUF loader and cached as a
safetensors model directory in the user cache, so later loads take seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from eaglewire.core.contract import TargetFingerprint
from eaglewire.core.device import resolve_device
from eaglewire.core.errors import reading
from eaglewire.core.fileio import atomic_dir, atomic_write_text
from eaglewire.core.locks import file_lock
from eaglewire.core.presets import TARGET_PRESETS, cache_dir, fetch_asset

log = logging.getLogger(__name__)


def resolve_dtype(dtype: str | torch.dtype = "auto", device: torch.device | None = None) -> torch.dtype:
    """``auto``: bf16 on CUDA, fp32 on CPU (this CPU has no native bf16 units)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device is not None and device.type == "cuda" else torch.float32
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(table)}")
    return table[dtype]


@dataclass(eq=False)
class Target:
    """A decoder-only causal LM, its tokenizer, and the parts eaglewire reaches into."""

    model: nn.Module  # a transformers *ForCausalLM
    tokenizer: object | None
    spec: str = "custom"
    _fingerprint: TargetFingerprint | None = field(default=None, repr=False)

    @property
    def config(self):
        return self.model.config

    @property
    def text_config(self):
        cfg = self.model.config
        return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg

    @property
    def decoder(self) -> nn.Module:
        return self.model.get_decoder()

    @property
    def layers(self) -> nn.ModuleList:
        return self.decoder.layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def in_dtype(self, dtype: torch.dtype) -> Target:
        """This target with its weights in ``dtype`` (itself where they are): a copy, so one process can capture in
        one precision and decode in another without loading the model file twice."""
        if dtype == self.dtype:
            return self
        import copy

        return Target(model=copy.deepcopy(self.model).to(dtype), tokenizer=self.tokenizer, spec=self.spec)

    def head(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Target logits from boundary L (pre-norm): final norm + lm_head (+ softcap).

        last_hidden: [..., H] -> logits [..., V]
        """
        return softcap(self.model.get_output_embeddings()(self.decoder.norm(last_hidden)), self.logit_softcap)

    @property
    def logit_softcap(self) -> float | None:
        """The config's final-logit soft cap (Gemma's ``final_logit_softcapping``); None: none."""
        return getattr(self.text_config, "final_logit_softcapping", None) or None

    @property
    def fingerprint(self) -> TargetFingerprint:
        if self._fingerprint is None:
            self._fingerprint = fingerprint_target(self.model, self.tokenizer)
        return self._fingerprint


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` in ``logits``' dtype; ``logits`` themselves where ``cap`` is None."""
    return torch.tanh(logits / cap) * cap if cap else logits


# ------------------------------------------------------------------ model classes

WRAPPERS = "Llava, Mistral 3, Gemma 3, Qwen2-VL, Qwen2.5-VL"  # *ForConditionalGeneration wrappers run here


class TargetModelError(ValueError):
    """A target whose config transformers builds no decoder-only text model for."""


def auto_model_class(config, *, where: str = "target"):
    """transformers' auto class for a target's config: a causal LM, else a ``*ForConditionalGeneration``
    wrapper (image-text-to-text: Llava, Mistral 3, Qwen2-VL, ...), which eaglewire runs on its text
    model: ``get_decoder()`` is the language model, the lm_head its head, text-only input its forward.
    Anything else is refused here, in eaglewire's words (not transformers' list of every class)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING)

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return AutoModelForCausalLM
    if type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING and hasattr(config, "get_text_config"):
        return AutoModelForImageTextToText
    archs = ", ".join(getattr(config, "architectures", None) or []) or "none recorded"
    raise TargetModelError(
        f"{where}: model_type {config.model_type!r} (architectures: {archs}) is not a decoder-only text model "
        f"eaglewire can run: transformers has neither a causal-LM class nor a *ForConditionalGeneration wrapper "
        f"for it. eaglewire runs causal LMs and the wrappers of one ({WRAPPERS}) on their text model; pass "
        "the text model's directory (or a causal-LM checkpoint of it)")


def check_text_model(model, *, where: str = "target") -> None:
    """The parts eaglewire reaches into: ``get_decoder().layers``, its final ``norm``, an lm_head."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    missing = [what for what, ok in (("get_decoder()", decoder is not None),
                                     ("get_decoder().layers", hasattr(decoder, "layers")),
                                     ("get_decoder().norm", hasattr(decoder, "norm")),
                                     ("get_output_embeddings()", model.get_output_embeddings() is not None)) if not ok]
    if missing:
        raise TargetModelError(f"{where}: {type(model).__name__} has no {', '.join(missing)}: eaglewire captures the "
                               "decoder layers' inputs and applies the final norm + lm_head; pass a decoder-only "
                               f"text model or a wrapper of one ({WRAPPERS})")


# ------------------------------------------------------------------ fingerprint

def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tokenizer_sha256(tokenizer) -> str:
    """Hash of the vocabulary and special tokens (stable across save/load)."""
    if tokenizer is None:
        return "none"
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    return _sha256(json.dumps([vocab, special], ensure_ascii=False).encode())


def chat_template_sha256(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    return _sha256(template.encode()) if isinstance(template, str) else "none"


def weights_sha256(model: nn.Module, values_per_tensor: int = 4096) -> str:
    """Hash of a few tensors (first, middle, last, embedding), rounded to bf16.

    Rounding to bf16 makes an fp32 and a bf16 load of the same checkpoint agree;
    a requantized or fine-tuned target differs.
    """
    params = [p for _, p in model.named_parameters()]
    picks = [model.get_input_embeddings().weight, params[0], params[len(params) // 2], params[-1]]
    h = hashlib.sha256()
    for p in picks:
        chunk = p.detach().flatten()[:values_per_tensor].to("cpu", torch.bfloat16)
        h.update(chunk.view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def fingerprint_target(model: nn.Module, tokenizer) -> TargetFingerprint:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    archs = getattr(model.config, "architectures", None) or [type(model).__name__]
    return TargetFingerprint(
        architecture=str(archs[0]),
        num_layers=len(model.get_decoder().layers),
        hidden_size=int(cfg.hidden_size),
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        tokenizer_sha256=tokenizer_sha256(tokenizer),
        chat_template_sha256=chat_template_sha256(tokenizer),
        weights_sha256=weights_sha256(model),
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
    )


# ------------------------------------------------------------------ loading

def _gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = _sha256(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode())[:16]
    return cache_dir() / "targets" / f"{gguf.stem}-{key}"


GGUF_FIX = "download or convert it again (a .gguf is read whole: a cut copy fails here)"


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF file once into a cached safetensors model directory."""
    out = _gguf_cache_dir(gguf)
    if (out / "DONE").is_file():
        _record_architecture(out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(out.with_name(out.name + ".lock"), wait=True):  # another process may be converting it
        if not (out / "DONE").is_file():
            with reading(gguf, GGUF_FIX):
                _convert_gguf_unlocked(gguf, out)
    return out


def _convert_gguf_unlocked(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantizing %s once into %s (later loads reuse it)", gguf.name, out)
    with atomic_dir(out) as tmp:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # dequantized: plain weights from here on
        config.architectures = [type(model).__name__]  # what model.save_pretrained records; SGLang needs it
        config.save_pretrained(tmp)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied to the embedding; safetensors keeps one copy
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        (tmp / "DONE").write_text(json.dumps({"source": str(gguf)}))


def _record_architecture(out: Path) -> None:
    """A directory dequantized before its config recorded ``architectures`` gets it (SGLang's model config reads
    ``architectures[0]``; transformers and vLLM infer it from model_type)."""
    path = out / "config.json"
    config = json.loads(path.read_text())
    if config.get("architectures"):
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type", ""))
    if name:
        atomic_write_text(path, json.dumps({**config, "architectures": [name]}, indent=2, sort_keys=True) + "\n")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_target_path(spec: str) -> Path:
    """A preset name, .gguf file or HF directory -> a local HF model directory."""
    if spec in TARGET_PRESETS:
        return convert_gguf(fetch_asset(TARGET_PRESETS[spec].asset))
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"target {spec!r} is neither a preset ({', '.join(sorted(TARGET_PRESETS))}) "
            "nor an existing path; pass a preset name, a .gguf file or a model directory")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"target file {path} is not a .gguf file; pass a .gguf file or a "
                             "model directory holding config.json")
        return convert_gguf(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"target directory {path} is not a model: it has no config.json "
                         "(expected a transformers model directory)")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"target directory {path} has no tokenizer ({', '.join(TOKENIZER_FILES)}); "
                         "save the tokenizer beside the model (tokenizer.save_pretrained)")
    return path


def load_tokenizer(spec: str):
    """Tokenizer of a target given as preset name, HF directory or .gguf file.

    A .gguf file not yet converted is read for its tokenizer alone (seconds), so checks on the
    tokenizer (e.g. that it has a chat template) come before the expensive dequantization.
    """
    from transformers import AutoTokenizer

    gguf = fetch_asset(TARGET_PRESETS[spec].asset) if spec in TARGET_PRESETS else Path(spec).expanduser()
    if gguf.suffix == ".gguf" and gguf.is_file() and not (_gguf_cache_dir(gguf) / "DONE").is_file():
        with reading(gguf, GGUF_FIX):
            return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return AutoTokenizer.from_pretrained(str(resolve_target_path(spec)))


def load_target(spec: str, *, device: str | torch.device = "auto",
                dtype: str | torch.dtype = "auto") -> Target:
    """Load a target from a preset name, a local HF model directory, or a .gguf file."""
    from transformers import AutoConfig, AutoTokenizer

    path = resolve_target_path(spec)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    cls = auto_model_class(AutoConfig.from_pretrained(str(path)), where=f"target {spec}")
    model = cls.from_pretrained(str(path), dtype=dt).to(dev).eval()
    check_text_model(model, where=f"target {spec}")
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return Target(model=model, tokenizer=tokenizer, spec=spec)


def target_from_config(config, *, seed: int = 0, tokenizer=None, dtype=torch.float32) -> Target:
    """A randomly initialised target from a transformers config (tests, benchmarks)."""
    torch.manual_seed(seed)
    model = auto_model_class(config).from_config(config, dtype=dtype).eval()
    check_text_model(model)
    model.requires_grad_(False)
    return Target(model=model, tokenizer=tokenizer, spec=f"random:{config.model_type}")
