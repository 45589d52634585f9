"""The hidden-state contract: which target states a draft reads, and of which target.

Canonical index: the *boundary*. A decoder with L layers has L + 1 residual-stream
boundaries; boundary b is the input of layer b (= output of layer b - 1), boundary 0 is
the embedding output and boundary L the last layer's output *before* the final norm.

Every engine numbers these differently. This module is the only place that translates:

| engine                 | id -> boundary                       | boundaries it can express |
|------------------------|--------------------------------------|---------------------------|
| vllm / speculators     | b = id                               | 0..L                      |
| specforge              | b = id + 1  (HF hidden_states[id+1]) | 1..L-1 (L would be post-norm) |
| sglang, always +1      | b = id + 1                           | 1..L-1                    |
| sglang, +1 if first==1 | b = id + 1 if ids[0] == 1 else id    | 1..L-1                    |
| llamacpp               | b = id (input of layer id)           | 0..L-1, exactly 3         |
| eagle (reference)      | hard-coded [2, L//2, L-3]            | only that layout          |
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

CONTRACT_VERSION = 1

Engine = Literal["sglang", "vllm", "speculators", "specforge", "llamacpp", "eagle"]
ENGINES: tuple[str, ...] = ("sglang", "vllm", "speculators", "specforge", "llamacpp", "eagle")

# llama.cpp (build 11434) copies the input of layer i for id i and fuses exactly three.
LLAMACPP_NUM_AUX = 3

# SGLang's two readings of eagle_aux_hidden_state_layer_ids.
SglangRule = Literal["always_plus_one", "plus_one_if_first_is_one"]
SGLANG_RULES: tuple[str, ...] = ("always_plus_one", "plus_one_if_first_is_one")
SGLANG_RULE_VERSIONS = {
    "always_plus_one": "SGLang releases before mid-2026",
    "plus_one_if_first_is_one": "SGLang releases since mid-2026",
}

# Fingerprint fields whose difference is only a warning: a draft trained on fp32 captures
# may be served in bf16 (the doctor measures the drift that causes).
SOFT_FIELDS = frozenset({"dtype"})


class ContractError(ValueError):
    """A hidden-state contract is invalid, or two contracts/targets do not match."""


class EngineConventionError(ContractError):
    """A boundary layout that an engine's convention cannot express."""


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
    """Ordered aux boundaries (concatenation order) plus the target they belong to."""

    aux_boundaries: tuple[int, ...]
    target: TargetFingerprint
    version: int = CONTRACT_VERSION

    def __post_init__(self) -> None:
        if self.version != CONTRACT_VERSION:
            raise ContractError(f"contract version {self.version} is not supported "
                                f"(this eaglewire reads version {CONTRACT_VERSION})")
        bounds = validate_boundaries(list(self.aux_boundaries), self.target.num_layers)
        object.__setattr__(self, "aux_boundaries", tuple(bounds))

    @property
    def num_aux(self) -> int:
        return len(self.aux_boundaries)

    @property
    def num_layers(self) -> int:
        return self.target.num_layers

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "aux_boundaries": list(self.aux_boundaries),
                "target": asdict(self.target)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HiddenStateContract:
        try:
            target = TargetFingerprint(**d["target"])
            return cls(aux_boundaries=tuple(d["aux_boundaries"]), target=target,
                       version=int(d.get("version", CONTRACT_VERSION)))
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
        """Raise ContractError unless ``other`` wires the same states of the same target."""
        if self.aux_boundaries != other.aux_boundaries:
            raise ContractError(
                f"{what} holds aux boundaries {list(other.aux_boundaries)} but "
                f"{list(self.aux_boundaries)} are expected; re-capture with "
                f"--aux-boundaries {','.join(map(str, self.aux_boundaries))} or train on matching data")
        return other.check_target(self.target, what=what, allow=allow)


# ---------------------------------------------------------------- engine translation

def sglang_read(ids: list[int], rule: str) -> list[int]:
    """The boundaries SGLang captures for config ``ids`` under ``rule``."""
    if rule not in SGLANG_RULES:
        raise ContractError(f"unknown SGLang rule {rule!r}; known: {', '.join(SGLANG_RULES)}")
    plus_one = rule == "always_plus_one" or (ids and ids[0] == 1)
    return [i + 1 for i in ids] if plus_one else list(ids)


def _check_sglang_expressible(boundaries: list[int], num_layers: int) -> None:
    for b in boundaries:
        if b == 0:
            raise EngineConventionError(
                "SGLang cannot capture boundary 0 (the embedding output): its id would be -1, "
                "which SGLang drops or crashes on. Retrain with a layout without boundary 0 "
                f"(e.g. {default_aux_boundaries(num_layers)}), or serve with vLLM or eaglewire")
        if b == num_layers:
            raise EngineConventionError(
                f"SGLang cannot capture boundary {num_layers} (the last layer's pre-norm output "
                f"of a {num_layers}-layer target): no layer {num_layers} exists to capture before, "
                "so SGLang silently drops it. Retrain without it, or serve with vLLM or eaglewire")


def _check_llamacpp_expressible(boundaries: list[int], num_layers: int) -> None:
    if len(boundaries) != LLAMACPP_NUM_AUX:
        raise EngineConventionError(
            f"llama.cpp fuses exactly {LLAMACPP_NUM_AUX} target states (extract_layers); this layout has "
            f"{len(boundaries)} ({list(boundaries)}). Retrain on 3 boundaries (e.g. "
            f"{default_aux_boundaries(num_layers)}), or serve with vLLM, SGLang or eaglewire")
    if num_layers in boundaries:
        raise EngineConventionError(
            f"llama.cpp cannot capture boundary {num_layers} (the last layer's pre-norm output of a "
            f"{num_layers}-layer target): it copies the input of layer i for id i, and there is no layer "
            f"{num_layers}. Retrain without it, or serve with vLLM or eaglewire")


def to_engine(boundaries: list[int], num_layers: int, engine: str, *,
              sglang_rule: str = "always_plus_one") -> list[int]:
    """Layer ids that make ``engine`` capture exactly ``boundaries``; error if it cannot."""
    boundaries = validate_boundaries(list(boundaries), num_layers)
    if engine in ("vllm", "speculators"):
        return boundaries
    if engine == "specforge":
        for b in boundaries:
            if b in (0, num_layers):
                raise EngineConventionError(
                    f"SpecForge cannot express boundary {b}: its id would be {b - 1}, and SpecForge "
                    + ("rejects negative ids" if b == 0 else
                       "reads HF hidden_states[L], which is post-norm, not the pre-norm state"))
        return [b - 1 for b in boundaries]
    if engine == "sglang":
        _check_sglang_expressible(boundaries, num_layers)
        if sglang_rule == "always_plus_one":
            return [b - 1 for b in boundaries]
        if sglang_rule != "plus_one_if_first_is_one":
            raise ContractError(f"unknown SGLang rule {sglang_rule!r}; known: {', '.join(SGLANG_RULES)}")
        if boundaries[0] == 2:
            return [b - 1 for b in boundaries]  # first id 1 -> +1 applied
        if boundaries[0] == 1:
            raise EngineConventionError(
                "SGLang (since mid-2026) cannot express a layout starting at boundary 1: id 0 is "
                "taken verbatim (boundary 0) and id 1 gets +1 (boundary 2). Export for older SGLang "
                "(--sglang-rule always_plus_one) or serve with vLLM or eaglewire")
        return list(boundaries)  # taken verbatim
    if engine == "llamacpp":
        _check_llamacpp_expressible(boundaries, num_layers)
        return boundaries
    if engine == "eagle":
        default = default_aux_boundaries(num_layers)
        if boundaries != default:
            raise EngineConventionError(
                f"the EAGLE reference code hard-codes boundaries {default} for a {num_layers}-layer "
                f"target; a draft on {boundaries} cannot run there. Serve it with vLLM, SGLang or eaglewire")
        return boundaries
    raise ContractError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")


def from_engine(ids: list[int] | None, num_layers: int, engine: str, *,
                sglang_rule: str = "always_plus_one") -> list[int]:
    """Boundaries that ``engine`` captures for config ``ids`` (None: the engine's default)."""
    if engine == "eagle" or ids is None:
        # Every engine falls back to [2, L//2, L-3] when the config carries no ids.
        if engine not in ENGINES:
            raise ContractError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
        return default_aux_boundaries(num_layers)
    ids = [int(i) for i in ids]
    if engine in ("vllm", "speculators"):
        bounds = ids
    elif engine == "specforge":
        if any(i < 0 for i in ids):
            raise EngineConventionError(f"SpecForge ids {ids} contain a negative id; SpecForge rejects them")
        bounds = [i + 1 for i in ids]
    elif engine == "sglang":
        bounds = sglang_read(ids, sglang_rule)
    elif engine == "llamacpp":
        _check_llamacpp_expressible(ids, num_layers)
        bounds = ids
    else:
        raise ContractError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    return validate_boundaries(bounds, num_layers)


def sglang_readings(ids: list[int]) -> dict[str, list[int]]:
    """How each SGLang rule reads ``ids``: rule -> boundaries captured."""
    return {rule: sglang_read(list(ids), rule) for rule in SGLANG_RULES}


def sglang_ambiguity(boundaries: list[int], ids: list[int]) -> str | None:
    """A sentence naming the SGLang versions that miswire ``ids``, or None if all agree."""
    readings = sglang_readings(ids)
    wrong = [r for r, b in readings.items() if b != list(boundaries)]
    if not wrong:
        return None
    right = [r for r in SGLANG_RULES if r not in wrong]
    parts = [f"{SGLANG_RULE_VERSIONS[r]} capture boundaries {readings[r]}" for r in wrong]
    ok = (" and ".join(SGLANG_RULE_VERSIONS[r] for r in right) + f" wire it right ({list(boundaries)})"
          if right else "no SGLang version wires it right")
    return f"ids {list(ids)}: " + "; ".join(parts) + f"; {ok}"
