"""The engines eaglewire speaks: one ``EngineSpec`` line each (``engines/interface.py`` declares what an
engine can do in types), and the library entry points that pick an engine by name.

Adding an engine: one package ending in ``SPEC = EngineSpec(...)`` and one line in ``ENGINES``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from eaglewire.model.checkpoint import read_draft
from eaglewire.core.contract import (FAMILIES, ContractError, EngineConventionError, default_aux_boundaries,
                                     validate_boundaries)
from eaglewire.engines.formats.eagle import SPEC as EAGLE
from eaglewire.engines.eaglewire import SPEC as EAGLEWIRE
from eaglewire.engines.llamacpp import SPEC as LLAMACPP
from eaglewire.engines.sglang import SPEC as SGLANG
from eaglewire.engines.formats.specforge import SPEC as SPECFORGE
from eaglewire.engines.vllm import SPEC as VLLM
from eaglewire.engines.export import ExportConfig, ExportReport
from eaglewire.engines.formats.importing import ImportReport, import_checkpoint, import_dflash, is_dflash_dir
from eaglewire.engines.interface import Ability, EngineSpec, IdReading, Sampling
from eaglewire.engines.formats.eagle3_layout import FormatError

Engine = EngineSpec

ENGINES: tuple[EngineSpec, ...] = (EAGLEWIRE, SGLANG, VLLM, SPECFORGE, LLAMACPP, EAGLE)
_BY_NAME = {n: e for e in ENGINES for n in (e.name, *e.aliases)}


def names(capability: Ability | None = None, *, aliases: bool = True) -> tuple[str, ...]:
    """Engine names (each followed by its aliases unless ``aliases`` is false), in registry order;
    only those with ``capability`` when given."""
    return tuple(n for e in ENGINES if capability is None or e.can(capability)
                 for n in ((e.name, *e.aliases) if aliases else (e.name,)))


def get(name: str, capability: Ability | None = None, *, param: str = "engine") -> EngineSpec:
    """The engine called ``name`` (an alias resolves to its engine); ValueError naming the valid
    names (those with ``capability``, when given)."""
    engine = _BY_NAME.get(name)
    if engine is None or (capability is not None and not engine.can(capability)):
        raise ValueError(f"{param} {name!r} is not one of {', '.join(names(capability))}")
    return engine


def file_readers(suffix: str) -> tuple[EngineSpec, ...]:
    """The engines that load draft files of their own ending in ``suffix`` (``.gguf``: llama.cpp)."""
    return tuple(e for e in ENGINES if suffix and e.draft_file_suffix == suffix and e.linter and e.linter.read_draft_file)


def file_reader(suffix: str) -> EngineSpec:
    """The engine that loads draft files ending in ``suffix`` (``.gguf``: llama.cpp); ValueError where none does."""
    found = file_readers(suffix)
    if not found:
        raise ValueError(f"no engine eaglewire knows loads a {suffix or 'suffix-less'} draft file")
    return found[0]


def sampling_of(name: str) -> Sampling:
    """How the engine called ``name`` (any name or alias) samples: its ``Sampling``, eaglewire's own where its
    rule was not read."""
    return get(name).sampling or EAGLEWIRE.sampling


def canonical(name: str) -> str:
    """``speculators`` -> ``vllm``: the engine an alias names."""
    return get(name).name


# ---------------------------------------------------------------- ids

def _engine(name: str) -> EngineSpec:
    engine = _BY_NAME.get(name)
    if engine is None:
        raise ContractError(f"unknown engine {name!r}; known: {', '.join(names())}")
    return engine


def _reading(e: EngineSpec, family: str) -> IdReading:
    """The engine's reading of ``family``'s ids: EngineConventionError where it serves none."""
    if family not in FAMILIES:
        raise ContractError(f"draft family {family!r} is not one of {', '.join(FAMILIES)}")
    reading = e.reading(family)
    if reading is None:
        raise EngineConventionError(f"{e.name} serves no {family} draft (eaglewire knows no reading of its {family} "
                                    f"ids); engines that do: {', '.join(family_engines(family))}")
    return reading


def family_engines(family: str) -> tuple[str, ...]:
    """Engines with a reading of ``family``'s ids."""
    return tuple(e.name for e in ENGINES if e.reading(family) is not None)


def to_engine(boundaries: list[int], num_layers: int, engine: str, *, target_arch: str | None = None,
              family: str = "eagle3") -> list[int]:
    """Layer ids that make ``engine`` capture exactly ``boundaries`` on a target of architecture
    ``target_arch`` (required for SGLang) for a ``family`` draft; EngineConventionError if it cannot."""
    e = _engine(engine)
    reading = _reading(e, family)
    boundaries = validate_boundaries(list(boundaries), num_layers)
    return reading.to_ids(boundaries, num_layers, target_arch if e.per_model_file else None)


def from_engine(ids: list[int] | None, num_layers: int, engine: str, *, target_arch: str | None = None,
                family: str = "eagle3") -> list[int]:
    """Boundaries that ``engine`` captures for config ``ids`` (None: the engine's default; a DFlash
    default depends on the draft, so None is refused there) on a target of architecture ``target_arch``
    (required for SGLang), in the order it feeds them."""
    e = _engine(engine)
    reading = _reading(e, family)
    if ids is None:
        if family != "eagle3":
            raise ContractError(f"{e.name}: a {family} config without ids means a default that depends on the draft's "
                                "layer count; read it with the engine module's read_dflash_ids")
        # Every engine falls back to [2, L//2, L-3] when the config carries no ids.
        return default_aux_boundaries(num_layers)
    bounds = reading.to_boundaries([int(i) for i in ids], num_layers, target_arch if e.per_model_file else None)
    return validate_boundaries(bounds, num_layers)


def refusal(engine: str, arch: str | None) -> str | None:
    """Why ``engine`` serves no EAGLE-3 draft on this target at all, and which engines do (None: it serves one)."""
    e = _engine(engine)
    why = e.linter.refusal(arch) if e.per_model_file and e.linter and e.linter.refusal else None  # (llama.cpp's
    # is the doctor's architecture check)
    return f"{why}; {served_elsewhere(arch, but=e.name)}" if why else None


@dataclass(frozen=True)
class Elsewhere:
    """The engines that serve an EAGLE-3 draft for one target, and why each other one does not."""

    serve: tuple[str, ...]
    refuse: tuple[tuple[str, str], ...]  # (engine, its reason)

    def __str__(self) -> str:
        return (f"engines that serve it: {', '.join(self.serve)}" +
                "".join(f"; {name} does not either ({why})" for name, why in self.refuse))


def served_elsewhere(arch: str | None, *, but: str) -> Elsewhere:
    """Which engines other than ``but`` serve an EAGLE-3 draft for a target of ``arch``, and why each other one
    does not: each engine's own reading (its model file; llama.cpp's graph), never a guess."""
    serve, refuse = [], []
    for e in ENGINES:
        if e.name == but or not e.can(Ability.LINT):
            continue
        try:
            why = _why_not(e, arch)
        except ContractError:  # a target family it has no reading of: nothing to say
            continue
        if why:
            refuse.append((e.name, why))
        else:
            serve.append(e.name)
    return Elsewhere(tuple(serve), tuple(refuse))


def _refuses(engine: EngineSpec, arch: str | None) -> bool:
    try:
        return bool(_why_not(engine, arch))
    except ContractError:
        return False


def _why_not(engine: EngineSpec, arch: str | None) -> str | None:
    """Why ``engine`` serves no EAGLE-3 draft for ``arch`` (None: it does, or it cannot be told); ContractError
    for a target family it has no reading of."""
    refusal_of = engine.linter.refusal if engine.linter else None
    if refusal_of is None:
        return None  # eaglewire captures any layer of any model it loads
    if engine.per_model_file and arch is None:
        return None
    return refusal_of(arch)


def read_ids(engine: str, config: dict[str, Any], *, family: str = "eagle3"
             ) -> tuple[dict[str, list[int] | None], list[str]]:
    """Where ``engine`` finds its aux ids in ``config`` for a ``family`` draft: (label -> ids, None for
    its default; notes). The one reader of each engine's keys: import and the doctor both use it."""
    reads = lambda e: e.reading(family) is not None and e.reading(family).read_ids is not None  # noqa: E731
    e = _BY_NAME.get(engine)
    if e is None or not reads(e):
        raise ValueError(f"engine {engine!r} is not one of {', '.join(n for n in names() if reads(_BY_NAME[n]))}")
    return e.reading(family).read_ids(config)


def infer_boundaries(fmt: str, ids: list[int] | None, num_layers: int, *,
                     target_arch: str | None = None) -> tuple[list[int], list[str]]:
    """(boundaries a ``fmt`` checkpoint with config ``ids`` was made for, notes).

    Missing ids, and every EAGLE reference checkpoint, mean the default [2, L//2, L-3]
    that every tool falls back to; the notes say so. sglang ids are read with the rule of
    the target's model file (``target_arch``, required); a note names the target families
    on which SGLang reads them differently.
    """
    e = get(fmt, Ability.IMPORT, param="format")
    default_only = e.importer.default_only
    if ids is None or default_only:
        bounds = default_aux_boundaries(num_layers)
        why = default_only or "the config carries no aux layer ids"
        return bounds, [f"{why}: assuming the default boundaries {bounds} ([2, L//2, L-3]) that every "
                        "tool falls back to; a draft trained on other layers would be fed the wrong states"]
    arch = target_arch if e.per_model_file else None
    try:
        bounds = from_engine(ids, num_layers, e.name, target_arch=arch)
    except EngineConventionError as err:
        raise type(err)(f"config ids {ids} ({fmt} convention) do not fit this {num_layers}-layer target: {err}. "
                        "Was the draft made for another target?") from err
    notes = e.eagle3.read_notes(ids, bounds, num_layers, arch) if e.eagle3.read_notes else []
    return bounds, notes


# ---------------------------------------------------------------- export / import

def other_readings(engine: str, *, boundaries: list[int], ids: list[int], num_layers: int,
                   target_arch: str | None) -> list[str]:
    """SERVING.md lines: how every other engine reads the directory ``engine``'s export wrote."""
    return [line for e in ENGINES if e.name != engine and e.reads_export is not None
            for line in e.reads_export(engine, boundaries=boundaries, ids=ids, num_layers=num_layers,
                                              target_arch=target_arch)]


def export_draft(draft_dir: str | Path, to: str, out_dir: str | Path, *, target=None,
                 allow: frozenset[str] | set[str] = frozenset(), config: ExportConfig | None = None,
                 **settings: Any) -> ExportReport:
    """Write the native draft in ``draft_dir`` in the format of engine ``to`` to ``out_dir``.

    ``config`` (default ``ExportConfig()``) with any of its fields overridden by ``settings``
    (``target_arch``, ``verifier_name``, ``num_steps``, ``outtype``, ...). The engine's reading is
    the one of the target's model file: ``target_arch`` (default: the architecture the draft's
    contract records). vllm/speculators (and llamacpp, converted from it) need the target's
    embedding: ``target``, else loaded from the spec the draft records; checked against the
    contract, ``allow`` as in ``HiddenStateContract.check_target``.
    """
    engine = get(to, Ability.EXPORT, param="export format")
    config = replace(config or ExportConfig(), **settings)
    draft, out = read_draft(draft_dir), Path(out_dir)
    if out.resolve() == draft.path.resolve():
        raise ValueError(f"the output directory {out} is the draft being exported; choose another")
    if draft.family == "dflash":
        fn = engine.exporter.export_dflash
        if fn is None:
            raise FormatError(f"{engine.name} has no DFlash export; DFlash drafts export to "
                              f"{', '.join(n for n in names(Ability.EXPORT) if get(n).exporter.export_dflash)}")
        if draft.draft_config.pruned and not engine.can(Ability.EXPORT_PRUNED_DFLASH):
            raise FormatError(f"{draft.path} is a DFlash draft over {draft.draft_config.draft_vocab_size} of the target's "
                              f"{draft.draft_config.vocab_size} tokens (trained with --draft-vocab-size); {engine.name}'s export "
                              f"carries no d2t yet: export it --to {' or --to '.join(names(Ability.EXPORT_PRUNED_DFLASH, aliases=False))}, or "
                              "train with the whole vocabulary (no --draft-vocab-size)")
        return fn(draft, to, out, config, target=target, allow=allow, others=other_readings)
    try:
        return engine.exporter.export(draft, to, out, config, target=target, allow=allow, others=other_readings)
    except EngineConventionError as e:
        arch = config.target_arch or draft.contract.target.architecture
        if engine.per_model_file and _refuses(engine, arch):  # this engine serves no draft on this target
            raise EngineConventionError(f"{e}; {served_elsewhere(arch, but=engine.name)}") from e
        raise


def import_draft(src_dir: str | Path, from_: str, target, out_dir: str | Path, *,
                 target_arch: str | None = None, allow: frozenset[str] | set[str] = frozenset()) -> ImportReport:
    """Convert a ``from_`` checkpoint directory into a native draft for ``target`` in ``out_dir``
    (``engines.importing.import_checkpoint``)."""
    engine = get(from_, Ability.IMPORT, param="import format")
    if is_dflash_dir(src_dir):
        return import_dflash(src_dir, from_, engine, target, out_dir, target_arch=target_arch, allow=allow,
                             from_engine=from_engine)
    return import_checkpoint(src_dir, from_, engine, target, out_dir, target_arch=target_arch, allow=allow,
                             infer=infer_boundaries)
