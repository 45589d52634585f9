"""The serving side as the doctor judges it: which boundaries an engine will capture for a config,
and what its launch flags would silently change. The facts are the engines' (``engines.read_ids``:
where each engine keeps its ids, the one reader shared with import; ``engines.from_engine``: what
they mean on the target's model file; each engine module's ``lint_flags``); this module puts them
together for the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eaglewire import engines
from eaglewire.core.contract import ContractError, EngineConventionError, default_aux_boundaries, target_arch
from eaglewire.engines.flags import Flags


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


def _config_readers() -> tuple[str, ...]:
    """Engines whose draft config the doctor reads (their model file decides the ids)."""
    return tuple(n for n in engines.names("lint") if engines.get(n).per_model_file)


def read_engine_config(engine: str, config: dict[str, Any], num_layers: int, declared: list[int],
                       arch: str | None = None) -> EngineReading:
    """Boundaries ``engine`` will capture for ``config`` on a target of architecture ``arch``
    (None: every SGLang model file's reading). The engine's own keys only: the contract
    eaglewire records beside them is exactly what engines ignore."""
    if engine == "eaglewire":
        return EngineReading(engine, None, {"eaglewire": list(declared)})  # it reads the contract itself
    if engine not in _config_readers():
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(('eaglewire', *_config_readers()))}")
    e = engines.get(engine)
    found, notes = engines.read_ids(engine, config)
    out = EngineReading(engine, next(iter(found.values())), {}, notes)
    arch = _known_arch(arch, out.notes)
    refusal = engines.refusal(engine, arch)
    if refusal:
        out.problems.append(refusal)
    module = e.module
    for label, ids in found.items():
        if ids is None:
            default = default_aux_boundaries(num_layers)
            out.notes.append(f"{label}: no ids where it looks, so it silently falls back to its default layers "
                             f"(boundaries {default})")
            out.readings[f"{label}, its default layers"] = default
        elif e.needs_target_arch and arch is None:
            for family, got in module.readings(ids, num_layers).items():
                if isinstance(got, list):
                    out.readings[family] = got
                else:
                    out.notes.append(f"{family}: {got}")
        else:
            where = module.file_for(arch)
            label = f"{e.name} {module.VERSION} ({where.path})" if e.needs_target_arch else label
            try:
                out.readings[label] = engines.from_engine(ids, num_layers, engine, target_arch=arch)
            except EngineConventionError as err:
                out.problems.append(f"{label}: {err}")
            cannot = module.cannot_feed(declared, num_layers, arch) if where.block_output else ""
            if cannot and any(b > 0 for b in out.readings.get(label, [])):
                out.problems.append(cannot)
    fc = module.num_aux(config)
    if fc != len(declared):
        fix = ("set num_aux_hidden_states" if e.needs_target_arch else "set transformer_layer_config."
               "num_aux_hidden_states") + f" to {len(declared)} (or list {len(declared)} ids)"
        out.problems.append(f"{engine} sizes the draft's fc for {fc} aux states but the draft fuses "
                            f"{len(declared)}: loading fails; {fix}")
    return out


def config_fix(engine: str, declared: list[int], num_layers: int, arch: str | None = None) -> str:
    """The exact config change that makes ``engine`` capture ``declared`` on this target."""
    arch = _known_arch(arch, [])
    module = engines.get(engine).module if engine in engines.names() else None
    if hasattr(module, "config_fix"):
        return module.config_fix(declared, num_layers, arch)
    return f"serve with boundaries {declared}"


def lint_flags(engine: str, flags: str, declared: list[int], num_layers: int, arch: str | None = None) -> Flags:
    """Launch flags ``engine`` would silently change or cannot honour (``arch``: the target's
    architecture, for what its model file can capture)."""
    return engines.get(engine, "lint").module.lint_flags(flags, declared, num_layers, _known_arch(arch, []))


def predicted_tau(acc0: float, cond: list[float], num_steps: int) -> float:
    """τ of a greedy chain of ``num_steps``: 1 + Σ_i Π_{j<=i} c_j with c_0 = acc@0 and
    c_j = cond acc@j (the last measured value stands in for deeper steps)."""
    rates = [acc0] + list(cond)
    tau, alive = 1.0, 1.0
    for i in range(num_steps):
        alive *= rates[min(i, len(rates) - 1)]
        tau += alive
    return tau
