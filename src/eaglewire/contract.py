"""The hidden-state contract: which target states a draft reads, and of which target.

Canonical index: the *boundary*. A decoder with L layers has L + 1 residual-stream
boundaries; boundary b is the input of layer b (= output of layer b - 1), boundary 0 is
the embedding output and boundary L the last layer's output *before* the final norm.
A draft's boundaries are strictly ascending: every engine feeds the aux states in layer
order (vLLM sorts the ids, SGLang and llama.cpp capture while walking the layers).

Every engine numbers these differently, and SGLang differently per target model file.
This module is the only place that translates; each reading is a function of (engine,
engine version, target architecture), read from the engines' released code (the file and
function of every rule: docs/engines.md; tests/engines checks them against the wheels):

| engine (version)        | target model file                      | id -> boundary                   | boundaries |
|-------------------------|----------------------------------------|----------------------------------|------------|
| vllm / speculators 0.33 | llama, qwen2/qwen3, deepseek_v2, gpt_oss | b = id (ids sorted)            | 0..L       |
| vllm 0.33               | gemma3, glm4_moe_lite                  | no EAGLE-3 support               | none       |
| sglang 0.5.23           | llama (mistral), qwen2, qwen3          | b = id + 1  (id -1 -> 0)         | 0..L-1     |
| sglang 0.5.23           | gemma3_causal                          | id + 1, but captures the block's output without the residual | 0 only |
| sglang 0.5.23           | deepseek_v2 (DeepSeek-V3), glm4_moe_lite | b = id + 1 if ids[0] == 1 else id | 0..L-1, not starting at 1 |
| sglang 0.5.23           | gpt_oss                                | b = id if max(id) == L else id + 1 | 0..L     |
| specforge               | (HF hidden_states[id + 1])             | b = id + 1                       | 1..L-1     |
| llamacpp (b11434)       | any                                    | b = id, exactly 3                | 0..L-1     |
| eagle (reference)       | any                                    | hard-coded [2, L//2, L-3]        | that only  |
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

CONTRACT_VERSION = 1

Engine = Literal["sglang", "vllm", "speculators", "specforge", "llamacpp", "eagle"]
ENGINES: tuple[str, ...] = ("sglang", "vllm", "speculators", "specforge", "llamacpp", "eagle")

# The releases the readings below were taken from (tests/engines re-reads them).
SGLANG_VERSION = "0.5.23"
VLLM_VERSION = "0.33.0"

# llama.cpp (build 11434) copies the input of layer i for id i and fuses exactly three.
LLAMACPP_NUM_AUX = 3

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
    if out != sorted(out):
        raise ContractError(
            f"aux boundaries {out} are not ascending; sort them (--aux-boundaries "
            f"{','.join(map(str, sorted(out)))}): every engine feeds the aux states in layer order "
            "(vLLM sorts the ids, SGLang and llama.cpp capture while walking the layers), so a draft "
            "trained on another order would be fed its states permuted")
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


# ---------------------------------------------------------------- target architectures

# The target families eaglewire knows an engine reading for (HF model_type spelling).
TARGET_ARCHS: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "deepseek_v3",
                                 "glm4_moe_lite", "gpt_oss")
_ARCH_ALIASES = {
    "llamaforcausallm": "llama", "mistralforcausallm": "mistral", "qwen2forcausallm": "qwen2",
    "qwen3forcausallm": "qwen3", "gemma3forcausallm": "gemma3", "gemma3forconditionalgeneration": "gemma3",
    "gemma3_text": "gemma3", "deepseekv3forcausallm": "deepseek_v3", "glm4moeliteforcausallm": "glm4_moe_lite",
    "gptossforcausallm": "gpt_oss",
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


@dataclass(frozen=True, kw_only=True)
class ModelFile:
    """How one engine release's target model file turns config ids into captured boundaries."""

    engine: str
    path: str  # in the engine's wheel
    function: str  # where the id rule lives
    ids: str  # plus_one | plus_one_if_first_is_one | verbatim_if_max_is_L | verbatim
    captures_last: bool  # boundary L (after the last layer, before the norm) can be captured
    block_output: bool = False  # captures a layer's output without the residual, not the stream
    unsupported: str | None = None  # why this engine serves no EAGLE-3 draft on this target


def _sglang(path: str, cls: str, ids: str = "plus_one", *, last: bool = False, block_output: bool = False) -> ModelFile:
    return ModelFile(engine="sglang", path=f"sglang/srt/models/{path}", ids=ids, captures_last=last,
                     function=f"{cls}.set_eagle3_layers_to_capture", block_output=block_output)


def _vllm(path: str, model: str, *, unsupported: str | None = None) -> ModelFile:
    return ModelFile(engine="vllm", path=f"vllm/model_executor/models/{path}", ids="verbatim",
                     captures_last=unsupported is None, unsupported=unsupported,
                     function=f"{model}.forward + EagleModelMixin._set_aux_hidden_state_layers (sorted)")


_NO_VLLM_EAGLE3 = ("vLLM {v}'s {cls} does not implement SupportsEagle3, so vLLM refuses an EAGLE-3 draft "
                   "for this target; serve it with SGLang or eaglewire")
SGLANG_FILES: dict[str, ModelFile] = {
    "llama": _sglang("llama.py", "LlamaForCausalLM"),
    "mistral": _sglang("llama.py", "LlamaForCausalLM"),  # models/mistral.py subclasses it
    "qwen2": _sglang("qwen2.py", "Qwen2ForCausalLM"),
    "qwen3": _sglang("qwen3.py", "Qwen3ForCausalLM"),
    "gemma3": _sglang("gemma3_causal.py", "Gemma3ForCausalLM", last=True, block_output=True),
    "deepseek_v3": _sglang("deepseek_v2.py", "DeepseekV2ForCausalLM", "plus_one_if_first_is_one"),
    "glm4_moe_lite": _sglang("glm4_moe_lite.py", "Glm4MoeLiteForCausalLM", "plus_one_if_first_is_one"),
    "gpt_oss": _sglang("gpt_oss.py", "GptOssForCausalLM", "verbatim_if_max_is_L", last=True),
}
VLLM_FILES: dict[str, ModelFile] = {
    "llama": _vllm("llama.py", "LlamaModel"),
    "mistral": _vllm("llama.py", "LlamaModel"),  # models/mistral.py subclasses LlamaForCausalLM
    "qwen2": _vllm("qwen2.py", "Qwen2Model"),
    "qwen3": _vllm("qwen2.py", "Qwen2Model"),  # Qwen3Model subclasses Qwen2Model
    "gemma3": _vllm("gemma3.py", "Gemma3Model", unsupported=_NO_VLLM_EAGLE3.format(
        v=VLLM_VERSION, cls="Gemma3ForCausalLM (models/gemma3.py)")),
    "deepseek_v3": _vllm("deepseek_v2.py", "DeepseekV2Model"),
    "glm4_moe_lite": _vllm("glm4_moe_lite.py", "Glm4MoeLiteModel", unsupported=_NO_VLLM_EAGLE3.format(
        v=VLLM_VERSION, cls="Glm4MoeLiteForCausalLM (models/glm4_moe_lite.py)")),
    "gpt_oss": _vllm("gpt_oss.py", "GptOssModel"),
}
_VLLM_GENERIC = _vllm("llama.py", "LlamaModel")


def model_file(engine: str, arch: str | None) -> ModelFile:
    """The model file whose rule ``engine`` applies to a target of architecture ``arch``."""
    if engine in ("vllm", "speculators"):
        return _VLLM_GENERIC if arch is None else VLLM_FILES[target_arch(arch)]
    if engine == "sglang":
        if arch is None:
            raise ContractError(
                f"SGLang {SGLANG_VERSION} reads the ids differently per target model file; give the "
                f"target's architecture (target_arch / --target-arch: {', '.join(TARGET_ARCHS)})")
        return SGLANG_FILES[target_arch(arch)]
    raise ContractError(f"engine {engine!r} has no per-model-file reading; known: sglang, vllm, speculators")


def engine_refusal(engine: str, arch: str | None) -> str | None:
    """Why ``engine`` serves no EAGLE-3 draft on this target at all (None: it does)."""
    if engine not in ("sglang", "vllm", "speculators") or arch is None:
        return None
    return model_file(engine, arch).unsupported


# ---------------------------------------------------------------- engine readings

def sglang_layers_to_capture(ids: list[int], rule: str, num_layers: int) -> list[int]:
    """The ``layers_to_capture`` SGLang's ``set_eagle3_layers_to_capture`` sets for ``ids`` under ``rule``."""
    ids = list(ids)
    if rule == "plus_one":
        return [i + 1 for i in ids]
    if rule == "plus_one_if_first_is_one":
        return [i + 1 for i in ids] if ids and ids[0] == 1 else ids
    if rule == "verbatim_if_max_is_L":
        return ids if ids and max(ids) == num_layers else [i + 1 for i in ids]
    raise ContractError(f"unknown SGLang id rule {rule!r}")


def captured_boundaries(layers: list[int], num_layers: int, captures_last: bool) -> list[int]:
    """Boundaries a forward captures for ``layers_to_capture``: the input of each layer ``i in
    layers`` (in layer order) and, where the file does, the stream after the last layer."""
    got = sorted({i for i in layers if 0 <= i < num_layers})
    return got + [num_layers] if captures_last and num_layers in layers else got


def _engine_read(ids: list[int], num_layers: int, f: ModelFile) -> list[int]:
    layers = ids if f.ids == "verbatim" else sglang_layers_to_capture(ids, f.ids, num_layers)
    return captured_boundaries(layers, num_layers, f.captures_last)


def _sglang_ids(boundaries: list[int], num_layers: int, f: ModelFile) -> list[int]:
    where = f"SGLang {SGLANG_VERSION}'s {f.path} ({f.function})"
    instead = "Retrain on another layout (e.g. [2, L//2, L-3]), or serve with vLLM or eaglewire"
    if f.block_output and any(b > 0 for b in boundaries):
        raise EngineConventionError(
            f"{where} captures, for every layer after the first, the previous block's output without the "
            "residual (the layer returns them apart and only hidden_states is kept), not the residual-stream "
            "boundary the draft was trained on: SGLang would feed this Gemma 3 target's draft other states. "
            "Serve it with eaglewire")
    if num_layers in boundaries and not f.captures_last:
        raise EngineConventionError(
            f"{where} cannot capture boundary {num_layers} (the last layer's pre-norm output of a "
            f"{num_layers}-layer target): its id would ask for the input of layer {num_layers}, which does "
            f"not exist, so the draft would get fewer states than its fc takes. {instead}")
    if f.ids == "plus_one":
        ids = [b - 1 for b in boundaries]
    elif f.ids == "plus_one_if_first_is_one":
        if boundaries[0] == 1:
            raise EngineConventionError(
                f"{where} adds 1 to the ids only when the first id is 1: a first id 0 means boundary 0 and a "
                f"first id 1 means boundary 2, so no id list starts at boundary 1. {instead}")
        ids = [b - 1 for b in boundaries] if boundaries[0] == 2 else list(boundaries)
    elif f.ids == "verbatim_if_max_is_L":
        ids = list(boundaries) if boundaries[-1] == num_layers else [b - 1 for b in boundaries]
    else:
        raise ContractError(f"unknown SGLang id rule {f.ids!r}")
    assert _engine_read(ids, num_layers, f) == boundaries, (ids, boundaries, f)
    return ids


def to_engine(boundaries: list[int], num_layers: int, engine: str, *, target_arch: str | None = None) -> list[int]:
    """Layer ids that make ``engine`` capture exactly ``boundaries`` on a target of architecture
    ``target_arch`` (required for SGLang); EngineConventionError if it cannot."""
    boundaries = validate_boundaries(list(boundaries), num_layers)
    if engine in ("vllm", "speculators"):
        why = engine_refusal(engine, target_arch)
        if why:
            raise EngineConventionError(why)
        return boundaries
    if engine == "sglang":
        return _sglang_ids(boundaries, num_layers, model_file("sglang", target_arch))
    if engine == "specforge":
        for b in boundaries:
            if b in (0, num_layers):
                raise EngineConventionError(
                    f"SpecForge cannot express boundary {b}: its id would be {b - 1}, and SpecForge "
                    + ("rejects negative ids" if b == 0 else
                       "reads HF hidden_states[L], which is post-norm, not the pre-norm state"))
        return [b - 1 for b in boundaries]
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


def from_engine(ids: list[int] | None, num_layers: int, engine: str, *, target_arch: str | None = None) -> list[int]:
    """Boundaries that ``engine`` captures for config ``ids`` (None: the engine's default) on a
    target of architecture ``target_arch`` (required for SGLang), in the order it feeds them."""
    if engine not in ENGINES:
        raise ContractError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    if engine == "eagle" or ids is None:
        # Every engine falls back to [2, L//2, L-3] when the config carries no ids.
        return default_aux_boundaries(num_layers)
    ids = [int(i) for i in ids]
    if engine in ("vllm", "speculators", "sglang"):
        f = model_file(engine, target_arch)
        bounds = _engine_read(ids, num_layers, f)
        if len(bounds) != len(ids):
            name = "SGLang " + SGLANG_VERSION if engine == "sglang" else "vLLM " + VLLM_VERSION
            raise EngineConventionError(
                f"{name}'s {f.path} captures only boundaries {bounds} for ids {ids} on a {num_layers}-layer "
                f"target: {len(ids) - len(bounds)} of them name no layer it captures (or repeat one), so the "
                f"draft would get {len(bounds)} states for an fc that takes {len(ids)}")
    elif engine == "specforge":
        if any(i < 0 for i in ids):
            raise EngineConventionError(f"SpecForge ids {ids} contain a negative id; SpecForge rejects them")
        bounds = [i + 1 for i in ids]
    else:  # llamacpp
        _check_llamacpp_expressible(ids, num_layers)
        bounds = ids
    return validate_boundaries(bounds, num_layers)


def sglang_families() -> dict[str, list[str]]:
    """Target families whose SGLang model files read ids alike: ``"llama/mistral/..."`` -> archs."""
    groups: dict[tuple[str, bool, bool], list[str]] = {}
    for arch, f in SGLANG_FILES.items():
        groups.setdefault((f.ids, f.captures_last, f.block_output), []).append(arch)
    return {"/".join(archs): archs for archs in groups.values()}


def sglang_readings(ids: list[int], num_layers: int) -> dict[str, list[int] | str]:
    """How SGLang reads ``ids`` on each target family: label -> boundaries captured, or why
    it cannot (families whose model files agree share one label)."""
    out: dict[str, list[int] | str] = {}
    for family, archs in sglang_families().items():
        label = f"sglang {SGLANG_VERSION} on {family} targets"
        try:
            out[label] = from_engine(ids, num_layers, "sglang", target_arch=archs[0])
        except ContractError as e:
            out[label] = str(e)
        got = out[label]
        if SGLANG_FILES[archs[0]].block_output and isinstance(got, list) and max(got) > 0:
            out[label] = (f"the inputs of layers {got}, but as the previous block's output without the "
                          f"residual, not the residual-stream boundaries ({SGLANG_FILES[archs[0]].path})")
    return out


def sglang_ambiguity(boundaries: list[int], ids: list[int], num_layers: int) -> str | None:
    """A sentence naming the target families on which SGLang reads ``ids`` as other than
    ``boundaries`` (None if all read them alike; Gemma 3, wrong for any ids, is left out)."""
    readings = {k: v for k, v in sglang_readings(ids, num_layers).items() if "gemma3" not in k}
    wrong = {k: v for k, v in readings.items() if v != list(boundaries)}
    if not wrong:
        return None
    return (f"On other targets SGLang reads ids {list(ids)} differently: "
            + "; ".join(f"{k}: {v if isinstance(v, str) else f'boundaries {v}'}" for k, v in wrong.items()) + ".")


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
