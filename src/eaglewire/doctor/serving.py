"""The serving side as the engine will see it: which boundaries an engine captures for a
config, and the launch flags it would silently change. Pure functions over dicts/strings;
where each engine keeps its ids is read by ``formats.read_ids`` (the one reader, shared with
import), what the ids mean on the target's model file by contract.py.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from eaglewire.contract import (SGLANG_VERSION, ContractError, EngineConventionError, default_aux_boundaries,
                                engine_refusal, from_engine, model_file, sglang_families, sglang_readings, target_arch,
                                to_engine)
from eaglewire.formats import read_ids, sglang, speculators

SERVING_ENGINES: tuple[str, ...] = ("eaglewire", "sglang", "vllm", "speculators")


@dataclass
class EngineReading:
    """What an engine captures for a config: one reading per model file or runner where
    the config alone is ambiguous, and what stops the engine from serving it as trained."""

    engine: str
    ids: list[int] | None  # as found in the config (None: absent -> engine default)
    readings: dict[str, list[int]]  # label -> boundaries captured, in the order fed
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # the engine fails or feeds other states


def _known_arch(arch: str | None, notes: list[str]) -> str | None:
    if arch is None:
        return None
    try:
        return target_arch(arch)
    except ContractError as e:
        notes.append(f"{e}; showing every reading")
        return None


def read_engine_config(engine: str, config: dict[str, Any], num_layers: int, declared: list[int],
                       arch: str | None = None) -> EngineReading:
    """Boundaries ``engine`` will capture for ``config`` on a target of architecture ``arch``
    (None: every SGLang model file's reading). The engine's own keys only: the contract
    eaglewire records beside them is exactly what engines ignore."""
    if engine == "eaglewire":
        return EngineReading(engine, None, {"eaglewire": list(declared)})
    if engine not in SERVING_ENGINES:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(SERVING_ENGINES)}")
    found, notes = read_ids(engine, config)
    out = EngineReading(engine, next(iter(found.values())), {}, notes)
    arch = _known_arch(arch, out.notes)
    refusal = engine_refusal(engine, arch)
    if refusal:
        out.problems.append(refusal)
    for label, ids in found.items():
        if ids is None:
            default = default_aux_boundaries(num_layers)
            out.notes.append(f"{label}: no ids where it looks, so it silently falls back to its default layers "
                             f"(boundaries {default})")
            out.readings[f"{label}, its default layers"] = default
        elif engine == "sglang" and arch is None:
            for family, got in sglang_readings(ids, num_layers).items():
                if isinstance(got, list):
                    out.readings[family] = got
                else:
                    out.notes.append(f"{family}: {got}")
        else:
            where = model_file(engine, arch)
            label = f"sglang {SGLANG_VERSION} ({where.path})" if engine == "sglang" else label
            try:
                out.readings[label] = from_engine(ids, num_layers, engine, target_arch=arch)
            except EngineConventionError as e:
                out.problems.append(f"{label}: {e}")
            cannot = _cannot(declared, num_layers, engine, arch) if where.block_output else ""
            if cannot and any(b > 0 for b in out.readings.get(label, [])):
                out.problems.append(cannot)
    fc = (sglang.num_aux if engine == "sglang" else speculators.num_aux)(config)
    if fc != len(declared):
        fix = ("set num_aux_hidden_states" if engine == "sglang" else "set transformer_layer_config."
               "num_aux_hidden_states") + f" to {len(declared)} (or list {len(declared)} ids)"
        out.problems.append(f"{engine} sizes the draft's fc for {fc} aux states but the draft fuses "
                            f"{len(declared)}: loading fails; {fix}")
    return out


def _cannot(declared: list[int], num_layers: int, engine: str, arch: str | None) -> str:
    """Why ``engine`` cannot capture ``declared`` on this target ('' if it can)."""
    try:
        to_engine(declared, num_layers, engine, target_arch=arch)
    except EngineConventionError as e:
        return str(e)
    return ""


def config_fix(engine: str, declared: list[int], num_layers: int, arch: str | None = None) -> str:
    """The exact config change that makes ``engine`` capture ``declared`` on this target."""
    arch = _known_arch(arch, [])
    try:
        if engine == "sglang":
            if arch is not None:
                ids = to_engine(declared, num_layers, "sglang", target_arch=arch)
                return (f'set "eagle_config": {{"eagle_aux_hidden_state_layer_ids": {json.dumps(ids)}}} (the rule '
                        f"of {model_file('sglang', arch).path}), or re-export with `eaglewire export --to sglang`")
            options = []
            for family, archs in sglang_families().items():
                try:
                    options.append(f"{json.dumps(to_engine(declared, num_layers, 'sglang', target_arch=archs[0]))} "
                                   f"on {family} targets")
                except EngineConventionError:
                    options.append(f"none on {family} targets")
            return ("set eagle_config.eagle_aux_hidden_state_layer_ids to " + "; ".join(options)
                    + " (or re-export with `eaglewire export --to sglang`, which reads the target's architecture)")
        if engine in ("vllm", "speculators"):
            to_engine(declared, num_layers, engine, target_arch=arch)
            return (f'set the top-level "eagle_aux_hidden_state_layer_ids": {json.dumps(declared)} and '
                    f"transformer_layer_config.num_aux_hidden_states: {len(declared)} (or re-export with "
                    "`eaglewire export --to vllm`)")
    except EngineConventionError as e:
        return str(e)
    return f"serve with boundaries {declared}"


@dataclass
class Flags:
    num_steps: int | None = None
    topk: int | None = None
    num_draft_tokens: int | None = None
    problems: list[tuple[str, str, str]] = field(default_factory=list)  # (verdict, what, fix)


def lint_flags(engine: str, flags: str, declared: list[int], num_layers: int, arch: str | None = None) -> Flags:
    """Launch flags the engine would silently change or cannot honour (``arch``: the target's
    architecture, for what its model file can capture)."""
    args = parse_flags(flags)
    out = Flags()
    arch = _known_arch(arch, [])
    if engine in ("sglang", "vllm") and arch is not None:
        cannot = _cannot(declared, num_layers, engine, arch)
        if cannot:
            out.problems.append(("fail", f"{engine} cannot feed this draft {declared} on this target", cannot))
    if engine == "vllm":
        raw = args.get("--speculative-config")
        if raw is None:
            out.problems.append(("fail", "no --speculative-config: vLLM runs without speculation",
                                 '--speculative-config \'{"method": "eagle3", "model": DRAFT, '
                                 '"num_speculative_tokens": 5}\''))
            return out
        try:
            spec = json.loads(raw)
        except json.JSONDecodeError as e:
            out.problems.append(("fail", f"--speculative-config is not JSON ({e})", "quote the JSON object"))
            return out
        if spec.get("method") != "eagle3":
            out.problems.append(("fail", f'method is {spec.get("method")!r}: vLLM will not read the aux '
                                 "states of an EAGLE-3 draft", 'set "method": "eagle3"'))
        out.num_steps = _int(spec.get("num_speculative_tokens"))
        out.topk = 1
        out.num_draft_tokens = out.num_steps + 1 if out.num_steps else None
        return out
    out.num_steps = _int(args.get("--speculative-num-steps"))
    out.topk = _int(args.get("--speculative-eagle-topk"))
    out.num_draft_tokens = _int(args.get("--speculative-num-draft-tokens"))
    if engine == "sglang":
        algo = args.get("--speculative-algorithm")
        if algo is not None and algo.upper() != "EAGLE3":
            out.problems.append(("fail", f"--speculative-algorithm {algo}: SGLang will not feed aux states "
                                 "to an EAGLE-3 draft", "--speculative-algorithm EAGLE3"))
    steps, topk, tokens = out.num_steps, out.topk, out.num_draft_tokens
    if topk == 1 and steps is not None and tokens is not None and tokens != steps + 1:
        silently = "SGLang overrides it with only a log warning" if engine == "sglang" else "eaglewire refuses it"
        out.problems.append(("warn" if engine == "sglang" else "fail",
                             f"--speculative-eagle-topk 1 with --speculative-num-draft-tokens {tokens} != "
                             f"--speculative-num-steps {steps} + 1: {silently}",
                             f"--speculative-num-draft-tokens {steps + 1}"))
    return out


def _is_flag(token: str) -> bool:
    if not token.startswith("-"):
        return False
    try:
        float(token)  # "-1" is a value
        return False
    except ValueError:
        return True


def parse_flags(flags: str) -> dict[str, str]:
    """Launch flags as a shell would split them -> {flag as written: value}: ``--x v``, ``--x=v``
    and ``-x v``; a flag without a value maps to ""."""
    tokens, out, i = shlex.split(flags), {}, 0
    while i < len(tokens):
        tok = tokens[i]
        if _is_flag(tok):
            name, eq, value = tok.partition("=")
            if not eq and i + 1 < len(tokens) and not _is_flag(tokens[i + 1]):
                value, i = tokens[i + 1], i + 1
            out[name] = value
        i += 1
    return out


def _int(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def predicted_tau(acc0: float, cond: list[float], num_steps: int) -> float:
    """τ of a greedy chain of ``num_steps``: 1 + Σ_i Π_{j<=i} c_j with c_0 = acc@0 and
    c_j = cond acc@j (the last measured value stands in for deeper steps)."""
    rates = [acc0] + list(cond)
    tau, alive = 1.0, 1.0
    for i in range(num_steps):
        alive *= rates[min(i, len(rates) - 1)]
        tau += alive
    return tau
