"""The hidden-state contract: which target states a draft reads, and of which target.

Canonical index: the *boundary*. A decoder with L layers has L + 1 residual-stream
boundaries; boundary b is the input of layer b (= output of layer b - 1), boundary 0 is
the embedding output and boundary L the last layer's output *before* the final norm.
A draft's boundaries are strictly ascending: every engine feeds the aux states in layer
order (vLLM sorts the ids, SGLang and llama.cpp capture while walking the layers).

Every engine numbers these differently, and SGLang differently per target model file; each
engine's module in ``eaglewire.engines`` translates (``engines.to_engine`` / ``from_engine``),
this base module never does. It holds the boundary notion only: validation, the default
layout, the target fingerprint, the contract, its errors, and the target-architecture keys the
engines' readings are indexed by.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

CONTRACT_VERSION = 1

# Fingerprint fields whose difference is only a warning: a draft trained on fp32 captures
# may be served in bf16 (the doctor measures the drift that causes).
SOFT_FIELDS = frozenset({"dtype"})


class ContractError(ValueError):
    """A hidden-state contract is invalid, or two contracts/targets do not match."""


class EngineConventionError(ContractError):
    """A boundary layout that an engine's convention cannot express."""


# Draft families: how a draft reads the fused states (and how each engine numbers its ids).
# EAGLE-3 drafts one token per pass from the fused state; DFlash drafts a block per pass.
FAMILIES: tuple[str, ...] = ("eagle3", "dflash")


def default_aux_boundaries(num_layers: int) -> list[int]:
    """``[2, L//2, L-3]``: what every engine falls back to when a config has no ids."""
    if num_layers < 7:
        raise ContractError(
            f"the default aux boundaries [2, L//2, L-3] are not distinct for a {num_layers}-layer "
            "target; pass the boundaries explicitly (--aux-boundaries)")
    return [2, num_layers // 2, num_layers - 3]


def validate_boundaries(boundaries: list[int], num_layers: int) -> list[int]:
    """Check an aux layout against a target with ``num_layers`` layers; return it as ints."""
    if not boundaries:
        raise ContractError("aux_boundaries is empty; give at least one boundary, e.g. "
                            f"{default_aux_boundaries(num_layers)}")
    out = []
    for b in boundaries:
        if isinstance(b, bool) or not isinstance(b, int):
            raise ContractError(f"aux boundary {b!r} is not an integer")
        if not 0 <= b <= num_layers:
            raise ContractError(
                f"aux boundary {b} is outside [0, {num_layers}] for a {num_layers}-layer target "
                f"(0 = embedding output, {num_layers} = last layer before the final norm)")
        out.append(int(b))
    dup = sorted({b for b in out if out.count(b) > 1})
    if dup:
        raise ContractError(f"aux boundaries {out} repeat {dup}; each boundary may appear once")
    if out != sorted(out):
        raise ContractError(
            f"aux boundaries {out} are not ascending; sort them (--aux-boundaries "
            f"{','.join(map(str, sorted(out)))}): every engine feeds the aux states in layer order "
            "(vLLM sorts the ids, SGLang and llama.cpp capture while walking the layers), so a draft "
            "trained on another order would be fed its states permuted")
    return out


def validate_aux_boundaries(boundaries: list[int], num_layers: int) -> list[int]:
    """``validate_boundaries`` for a draft's aux states, which must lie below L: boundary L is the
    target's own signal (the head reads it), stored apart as the last state, never an aux input."""
    out = validate_boundaries(boundaries, num_layers)
    if num_layers in out:
        below = [b for b in out if b != num_layers]
        raise ContractError(
            f"aux boundaries {out} include {num_layers} = L, the last layer's output of this {num_layers}-layer "
            "target, which is the target's signal (final norm + lm_head read it), stored as the last state, "
            f"not an aux input; the aux states must be below L. Pass --aux-boundaries with values in "
            f"[0, {num_layers - 1}]" + (f", e.g. {','.join(map(str, below))}" if below else ""))
    return out


@dataclass(frozen=True, kw_only=True)
class TargetFingerprint:
    """What identifies the target whose states a draft reads."""

    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    tokenizer_sha256: str
    chat_template_sha256: str
    weights_sha256: str
    dtype: str

    def differences(self, other: TargetFingerprint) -> dict[str, tuple[Any, Any]]:
        """Fields that differ: name -> (self's value, other's value)."""
        return {f.name: (getattr(self, f.name), getattr(other, f.name))
                for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)}


@dataclass(frozen=True, kw_only=True)
class HiddenStateContract:
    """Ordered aux boundaries (concatenation order) plus the target they belong to, and, for a
    draft, its family (``None`` for data: the same shards train either family).

    ``chat_template_kwargs``: the chat-template switches the data was rendered with (e.g.
    ``{"enable_thinking": False}``; ``{}`` = the template's own defaults), which a draft inherits
    from its data; ``None`` = not recorded (older manifests and checkpoints, imported captures)."""

    aux_boundaries: tuple[int, ...]
    target: TargetFingerprint
    version: int = CONTRACT_VERSION
    family: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.version != CONTRACT_VERSION:
            raise ContractError(f"contract version {self.version} is not supported "
                                f"(this eaglewire reads version {CONTRACT_VERSION})")
        bounds = validate_aux_boundaries(list(self.aux_boundaries), self.target.num_layers)
        object.__setattr__(self, "aux_boundaries", tuple(bounds))
        if self.family is not None and self.family not in FAMILIES:
            raise ContractError(f"draft family {self.family!r} is not one eaglewire knows ({', '.join(FAMILIES)})")
        if self.chat_template_kwargs is not None:
            object.__setattr__(self, "chat_template_kwargs", template_kwargs(self.chat_template_kwargs))

    def for_family(self, family: str) -> HiddenStateContract:
        """This contract as a draft of ``family`` records it."""
        from dataclasses import replace

        return replace(self, family=family)

    @property
    def num_aux(self) -> int:
        return len(self.aux_boundaries)

    @property
    def num_layers(self) -> int:
        return self.target.num_layers

    def to_dict(self) -> dict[str, Any]:
        out = {"version": self.version, "aux_boundaries": list(self.aux_boundaries),
               "target": asdict(self.target)}
        if self.family is not None:
            out["family"] = self.family
        if self.chat_template_kwargs is not None:
            out["chat_template_kwargs"] = dict(self.chat_template_kwargs)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HiddenStateContract:
        try:
            target = TargetFingerprint(**d["target"])
            return cls(aux_boundaries=tuple(d["aux_boundaries"]), target=target,
                       version=int(d.get("version", CONTRACT_VERSION)), family=d.get("family"),
                       chat_template_kwargs=d.get("chat_template_kwargs"))
        except (KeyError, TypeError) as e:
            raise ContractError(f"malformed hidden-state contract {json.dumps(d)[:200]}: {e}") from e

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> HiddenStateContract:
        return cls.from_dict(json.loads(text))

    def check_target(self, target: TargetFingerprint, *, what: str = "this draft",
                     allow: frozenset[str] | set[str] = frozenset()) -> list[str]:
        """Raise ContractError when ``target`` is not the target of this contract.

        Differences in ``allow`` (and the soft fields, e.g. dtype) are returned as
        warnings instead. The error names every differing field.
        """
        diffs = self.target.differences(target)
        hard = {k: v for k, v in diffs.items() if k not in allow and k not in SOFT_FIELDS}
        warnings = [f"{k}: recorded {a!r}, now {b!r}" for k, (a, b) in diffs.items() if k not in hard]
        if hard:
            lines = "; ".join(f"{k} recorded {a!r} but the target has {b!r}" for k, (a, b) in hard.items())
            raise ContractError(
                f"{what} was made for another target: {lines}. Use the target it was made for, "
                f"or, if the difference is deliberate (e.g. a requantized target), allow it "
                f"explicitly with --allow-target-mismatch {','.join(hard)}")
        return warnings

    def check_same(self, other: HiddenStateContract, *, what: str = "data",
                   allow: frozenset[str] | set[str] = frozenset()) -> list[str]:
        """Raise ContractError unless ``other`` wires the same states of the same target (and, when
        both are drafts, is of the same family)."""
        if self.family and other.family and self.family != other.family:
            raise ContractError(f"{what} is a {other.family} draft but a {self.family} one is expected; "
                                f"pass a {self.family} draft (or train with --family {other.family})")
        if self.aux_boundaries != other.aux_boundaries:
            raise ContractError(
                f"{what} holds aux boundaries {list(other.aux_boundaries)} but "
                f"{list(self.aux_boundaries)} are expected; re-capture with "
                f"--aux-boundaries {','.join(map(str, self.aux_boundaries))} or train on matching data")
        warnings = self._check_template_kwargs(other, what=what, allow=allow)
        return warnings + other.check_target(self.target, what=what, allow=allow)

    def _check_template_kwargs(self, other: HiddenStateContract, *, what: str,
                               allow: frozenset[str] | set[str]) -> list[str]:
        """Both recorded and different: an error (``allow`` holding ``chat_template_kwargs``: a
        warning); either unrecorded: nothing to compare."""
        mine, theirs = self.chat_template_kwargs, other.chat_template_kwargs
        if mine is None or theirs is None or mine == theirs:
            return []
        line = (f"chat_template_kwargs: {what} was rendered with {describe_template_kwargs(theirs)}, "
                f"{describe_template_kwargs(mine)} expected")
        if "chat_template_kwargs" in allow:
            return [line]
        raise ContractError(
            f"{line}: a draft learns the text its data's template switch renders (e.g. a <think> block or "
            f"none), so the two do not match. Render both alike (prepare with {template_kwargs_flags(mine)} to "
            f"match what is expected, with {template_kwargs_flags(theirs)} to match {what}), or, if the "
            "difference is deliberate, allow it with --allow-target-mismatch chat_template_kwargs")


# ---------------------------------------------------------------- chat-template switches

_JSON_SCALARS = (bool, int, float, str, type(None))


def template_kwargs(value: Any) -> dict[str, Any]:
    """``value`` checked as chat-template switches: a JSON object of scalars, keys sorted (a copy)."""
    if not isinstance(value, dict):
        raise ContractError(f"chat_template_kwargs {value!r} is not a JSON object; give e.g. "
                            '{"enable_thinking": false}')
    for key, v in value.items():
        if not isinstance(key, str) or not isinstance(v, _JSON_SCALARS):
            raise ContractError(f"chat_template_kwargs {json.dumps(value, default=str)[:200]}: {key!r} must be a "
                                "string key with a scalar value (true/false, a number, a string or null)")
    return dict(sorted(value.items()))


def describe_template_kwargs(kwargs: dict[str, Any] | None) -> str:
    """``{"enable_thinking": false}`` -> ``chat_template_kwargs {"enable_thinking": false}``; ``{}``:
    the template's defaults; ``None``: not recorded."""
    if kwargs is None:
        return "no recorded chat_template_kwargs"
    return f"chat_template_kwargs {json.dumps(kwargs, sort_keys=True)}" if kwargs else \
        "the chat template's defaults (no chat_template_kwargs)"


def template_kwargs_flags(kwargs: dict[str, Any]) -> str:
    """The ``prepare`` / ``regenerate`` flags that render with ``kwargs`` (the thinking switch)."""
    rest = {k: v for k, v in kwargs.items() if k != "enable_thinking"}
    thinking = kwargs.get("enable_thinking")
    flag = ("--enable-thinking" if thinking else "--no-enable-thinking") if isinstance(thinking, bool) else \
        "neither --enable-thinking nor --no-enable-thinking"
    return flag + (f" (and a template rendered with {json.dumps(rest, sort_keys=True)})" if rest else "")


# ---------------------------------------------------------------- target architectures

# The target families eaglewire knows an engine reading for (HF model_type spelling).
TARGET_ARCHS: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "deepseek_v3",
                                 "glm4_moe_lite", "gpt_oss")
_ARCH_ALIASES = {
    "llamaforcausallm": "llama", "mistralforcausallm": "mistral", "qwen2forcausallm": "qwen2",
    "qwen3forcausallm": "qwen3", "gemma3forcausallm": "gemma3", "gemma3forconditionalgeneration": "gemma3",
    "gemma3_text": "gemma3", "deepseekv3forcausallm": "deepseek_v3", "glm4moeliteforcausallm": "glm4_moe_lite",
    "gptossforcausallm": "gpt_oss",
    # wrapped multimodal targets: the family of the text model they run on (engines/formats/model_file.py's
    # WRAPPERS names the wrapper's own file each engine serves them from)
    "llavaforconditionalgeneration": "llama", "mistral3forconditionalgeneration": "mistral",
    "qwen2vlforconditionalgeneration": "qwen2", "qwen2_5_vlforconditionalgeneration": "qwen2",
}


def target_arch(name: str) -> str:
    """A target's HF architecture (``LlamaForCausalLM``) or model_type (``llama``) -> a TARGET_ARCHS key."""
    key = str(name).strip().lower()
    arch = key if key in TARGET_ARCHS else _ARCH_ALIASES.get(key)
    if arch is None:
        raise ContractError(
            f"target architecture {name!r} has no engine reading in eaglewire (SGLang's depends on the "
            f"target's model file); known: {', '.join(TARGET_ARCHS)} (or their HF class names). If the "
            "target is a variant of one of these, pass that one (--target-arch)")
    return arch
