"""The serving side as the engine will see it: which boundaries an engine captures for a
config, and the launch flags it would silently change. Pure functions over dicts/strings.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from eaglewire.contract import (SGLANG_RULE_VERSIONS, SGLANG_RULES, EngineConventionError, default_aux_boundaries,
                                from_engine, sglang_read, to_engine)

SERVING_ENGINES: tuple[str, ...] = ("eaglewire", "sglang", "vllm", "speculators")


@dataclass
class EngineReading:
    """What an engine captures for a config: one reading per rule (SGLang has two)."""

    engine: str
    ids: list[int] | None  # as found in the config (None: absent -> engine default)
    readings: dict[str, list[int]]  # label -> boundaries captured
    notes: list[str] = field(default_factory=list)


def read_engine_config(engine: str, config: dict[str, Any], num_layers: int, declared: list[int],
                       sglang_rule: str | None = None) -> EngineReading:
    """Boundaries ``engine`` will capture for ``config`` (the engine's own keys only: the
    contract eaglewire records beside them is exactly what engines ignore)."""
    if engine == "eaglewire":
        return EngineReading(engine, None, {"eaglewire": list(declared)})
    if engine == "sglang":
        nested = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
        ids = nested.get("eagle_aux_hidden_state_layer_ids")
        notes = []
        if ids is None:
            top = config.get("eagle_aux_hidden_state_layer_ids")
            where = (f"ids {top} sit at the top level, where SGLang never looks" if top is not None
                     else "the config has no eagle_config.eagle_aux_hidden_state_layer_ids")
            default = default_aux_boundaries(num_layers)
            notes.append(f"{where}: SGLang silently falls back to its default layers (boundaries {default})")
            return EngineReading(engine, None, {"sglang (default)": default}, notes)
        rules = [sglang_rule] if sglang_rule else list(SGLANG_RULES)
        return EngineReading(engine, list(ids), {f"sglang ({SGLANG_RULE_VERSIONS[r]})": sglang_read(list(ids), r)
                                                 for r in rules})
    if engine in ("vllm", "speculators"):
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        notes = []
        if ids is None:
            notes.append("the config has no top-level eagle_aux_hidden_state_layer_ids: vLLM silently "
                         f"falls back to its default layers (boundaries {default_aux_boundaries(num_layers)})")
        return EngineReading(engine, ids, {engine: from_engine(ids, num_layers, "vllm")}, notes)
    raise ValueError(f"unknown engine {engine!r}; known: {', '.join(SERVING_ENGINES)}")


def config_fix(engine: str, declared: list[int], num_layers: int) -> str:
    """The exact config change that makes ``engine`` capture ``declared``."""
    try:
        if engine == "sglang":
            old = to_engine(declared, num_layers, "sglang", sglang_rule="always_plus_one")
            new = to_engine(declared, num_layers, "sglang", sglang_rule="plus_one_if_first_is_one")
            if old == new:
                return f'set "eagle_config": {{"eagle_aux_hidden_state_layer_ids": {json.dumps(old)}}}'
            return (f'set eagle_config.eagle_aux_hidden_state_layer_ids to {json.dumps(new)} for '
                    f'{SGLANG_RULE_VERSIONS["plus_one_if_first_is_one"]} or {json.dumps(old)} for '
                    f'{SGLANG_RULE_VERSIONS["always_plus_one"]} (or re-export with `eaglewire export --to sglang '
                    '--sglang-rule ...`)')
        if engine in ("vllm", "speculators"):
            return f'set the top-level "eagle_aux_hidden_state_layer_ids": {json.dumps(declared)}'
    except EngineConventionError as e:
        return str(e)
    return f"serve with boundaries {declared}"


@dataclass
class Flags:
    num_steps: int | None = None
    topk: int | None = None
    num_draft_tokens: int | None = None
    problems: list[tuple[str, str, str]] = field(default_factory=list)  # (verdict, what, fix)


def lint_flags(engine: str, flags: str, declared: list[int], num_layers: int) -> Flags:
    """Launch flags the engine would silently change or cannot honour."""
    args = _parse_flags(shlex.split(flags))
    out = Flags()
    if engine == "vllm":
        raw = args.get("speculative-config")
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
    out.num_steps = _int(args.get("speculative-num-steps"))
    out.topk = _int(args.get("speculative-eagle-topk"))
    out.num_draft_tokens = _int(args.get("speculative-num-draft-tokens"))
    if engine == "sglang":
        algo = args.get("speculative-algorithm")
        if algo is not None and algo.upper() != "EAGLE3":
            out.problems.append(("fail", f"--speculative-algorithm {algo}: SGLang will not feed aux states "
                                 "to an EAGLE-3 draft", "--speculative-algorithm EAGLE3"))
        if 0 in declared:
            out.problems.append(("fail", "the draft reads boundary 0 (the embedding output), which SGLang "
                                 "cannot capture (id -1 is dropped or crashes)",
                                 "retrain without boundary 0, or serve with vLLM or eaglewire"))
        if num_layers in declared:
            out.problems.append(("fail", f"the draft reads boundary {num_layers} (the last layer's pre-norm "
                                 "output), which SGLang cannot capture", "retrain without it, or serve with "
                                 "vLLM or eaglewire"))
    steps, topk, tokens = out.num_steps, out.topk, out.num_draft_tokens
    if topk == 1 and steps is not None and tokens is not None and tokens != steps + 1:
        silently = "SGLang overrides it with only a log warning" if engine == "sglang" else "eaglewire refuses it"
        out.problems.append(("warn" if engine == "sglang" else "fail",
                             f"--speculative-eagle-topk 1 with --speculative-num-draft-tokens {tokens} != "
                             f"--speculative-num-steps {steps} + 1: {silently}",
                             f"--speculative-num-draft-tokens {steps + 1}"))
    return out


def _parse_flags(tokens: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.startswith("--"):
            name, eq, value = tok[2:].partition("=")
            if not eq and i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
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
