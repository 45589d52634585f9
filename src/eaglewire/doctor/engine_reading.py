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
from eaglewire.engines import Ability
from eaglewire.core.contract import ContractError, EngineConventionError, default_aux_boundaries, target_arch
from eaglewire.engines.serving.launch_flags import Flags
from eaglewire.engines.serving.served_draft import FieldReading, embedding_differs, own_embedding_mismatch


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
    from eaglewire.engines.formats.model_file import wrapper_key

    if wrapper_key(arch):  # a wrapped target: each engine reads it through its wrapper's own model file
        return str(arch)
    try:
        return target_arch(arch)
    except ContractError as e:
        notes.append(f"{e}; showing every reading")
        return None


def _config_readers() -> tuple[str, ...]:
    """Engines whose draft config the doctor reads (their model file decides the ids)."""
    return tuple(n for n in engines.names(Ability.LINT) if engines.get(n).per_model_file)


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
    lint = e.linter
    for label, ids in found.items():
        if ids is None:
            default = default_aux_boundaries(num_layers)
            out.notes.append(f"{label}: no ids where it looks, so it silently falls back to its default layers "
                             f"(boundaries {default})")
            out.readings[f"{label}, its default layers"] = default
        elif e.needs_target_arch and arch is None:
            for family, got in lint.readings(ids, num_layers).items():
                if isinstance(got, list):
                    out.readings[family] = got
                else:
                    out.notes.append(f"{family}: {got}")
        else:
            where = lint.file_for(arch)
            label = f"{e.name} {e.version} ({where.path})" if e.needs_target_arch else label
            try:
                out.readings[label] = engines.from_engine(ids, num_layers, engine, target_arch=arch)
            except EngineConventionError as err:
                out.problems.append(f"{label}: {err}")
            cannot = lint.cannot_feed(declared, num_layers, arch) if where.block_output else ""
            if cannot and any(b > 0 for b in out.readings.get(label, [])):
                out.problems.append(cannot)
    fc = lint.num_aux(config)
    if fc != len(declared):
        fix = ("set num_aux_hidden_states" if e.needs_target_arch else "set transformer_layer_config."
               "num_aux_hidden_states") + f" to {len(declared)} (or list {len(declared)} ids)"
        out.problems.append(f"{engine} sizes the draft's fc for {fc} aux states but the draft fuses "
                            f"{len(declared)}: loading fails; {fix}")
    return out


def engine_refusal(engine: str, arch: str | None) -> tuple[str, tuple[str, ...]] | None:
    """(why ``engine`` serves no EAGLE-3 draft on a target of ``arch`` at all, naming the engines that do; those
    engines), None where it serves one or cannot be told."""
    if engine not in _config_readers():
        return None
    try:
        arch = _known_arch(arch, [])
        why = engines.refusal(engine, arch)
    except ContractError:
        return None
    return (why, engines.served_elsewhere(arch, but=engine).serve) if why else None


def config_fix(engine: str, declared: list[int], num_layers: int, arch: str | None = None) -> str:
    """The exact config change that makes ``engine`` capture ``declared`` on this target."""
    arch = _known_arch(arch, [])
    lint = engines.get(engine).linter if engine in engines.names() else None
    if lint is not None and lint.config_fix is not None:
        return lint.config_fix(declared, num_layers, arch)
    return f"serve with boundaries {declared}"


def lint_flags(engine: str, flags: str, declared: list[int], num_layers: int, arch: str | None = None, *,
               dflash_block: int | None = None) -> Flags:
    """Launch flags ``engine`` would silently change or cannot honour (``arch``: the target's
    architecture, for what its model file can capture); ``dflash_block``: the draft is a DFlash draft
    trained on blocks of that size (None: an EAGLE-3 draft)."""
    lint = engines.get(engine, Ability.LINT).linter
    arch = _known_arch(arch, [])
    if dflash_block is None:
        return lint.lint_flags(flags, declared, num_layers, arch)
    if lint.lint_dflash_flags is None:
        raise ValueError(f"eaglewire has not read {engine}'s DFlash launch flags")
    return lint.lint_dflash_flags(flags, declared, num_layers, arch, dflash_block)


def predicted_tau(acc0: float, cond: list[float], num_steps: int) -> float:
    """τ of a greedy chain of ``num_steps``: 1 + Σ_i Π_{j<=i} c_j with c_0 = acc@0 and
    c_j = cond acc@j (the last measured value stands in for deeper steps)."""
    rates = [acc0] + list(cond)
    tau, alive = 1.0, 1.0
    for i in range(num_steps):
        alive *= rates[min(i, len(rates) - 1)]
        tau += alive
    return tau


# ---------------------------------------------------------------- every field, as the engine reads it

def read_file_fields(path, draft, *, emb_rows=None) -> FieldReading:
    """``read_fields`` for a draft file whose suffix says which engine loads it (a ``.gguf``: llama.cpp's
    loader): every field that engine reads from it that changes what ``draft`` computes, against training."""
    from pathlib import Path

    return engines.file_reader(Path(path).suffix).linter.read_draft_file(path, draft, emb_rows=emb_rows)


def field_readers() -> tuple[str, ...]:
    """Engines whose every computing field the doctor reads from their config."""
    return tuple(n for n in _config_readers() if engines.get(n).linter.read_served is not None)


def _directory_tensors(directory) -> dict[str, Any]:
    """The tensors beside an engine config that change what the draft computes (d2t, t2d,
    embed_tokens.weight, lm_head presence): name -> tensor (lm_head: its name only, None)."""
    from pathlib import Path

    from safetensors import safe_open

    out: dict[str, Any] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                short = name.removeprefix("model.")
                if short in ("d2t", "t2d", "embed_tokens.weight"):
                    out[short] = f.get_tensor(name)
                elif "lm_head" in short or "embed_tokens" in short:
                    out.setdefault(short, None)
    return out


def read_fields(engine: str, config: dict[str, Any], directory, draft, *, emb_rows=None) -> FieldReading:
    """Every field ``engine`` reads from ``config`` (and the tensors in ``directory``) that changes
    what ``draft`` computes, against what it was trained with. ``emb_rows``: (token ids [N],
    the target's embedding rows [N, H]) to tell whether the checkpoint's own embed_tokens is the
    target's (vLLM uses its own when they differ)."""
    import torch

    from eaglewire.engines.serving.served_draft import Mismatch, mismatches
    from eaglewire.engines.formats.eagle3_layout import looks_absolute

    lint = engines.get(engine).linter
    tensors = _directory_tensors(directory) if directory is not None else {}
    embed = tensors.get("embed_tokens.weight")
    differs, notes = embedding_differs(embed, emb_rows, "the checkpoint's embed_tokens.weight")
    served = lint.read_served(config, set(tensors) if tensors else None, own_embedding_differs=differs)
    out = FieldReading(served, mismatches(served, draft.config, config_key=lint.served_config_key(config)), notes=notes)
    if served.embedding == "draft":
        out.found.append(own_embedding_mismatch(served.engine, "write the target's embedding as embed_tokens.weight in "
                                                "the target's stored dtype, or remove it (re-export with `eaglewire "
                                                "export`)", measurable=embed is not None))
        out.embedding = embed.float() if embed is not None else None
    vd, trained = draft.config.draft_vocab_size, draft.draft_to_target.cpu()
    if vd == draft.config.vocab_size and "d2t" not in tensors:
        return out
    d2t = tensors.get("d2t")
    if d2t is None:
        mapped = torch.arange(vd)  # vLLM: draft_id_to_target_id stays zeros; SGLang: no hot-token map
        what = "the checkpoint has no d2t: it maps draft id i to target id i"
        fix = "write the draft's d2t (offsets: target id - draft id) beside the weights"
    else:
        d2t = d2t.long().flatten()
        mapped = torch.arange(d2t.numel()) + d2t if d2t.numel() == vd else None
        absolute = d2t.numel() == vd and torch.equal(d2t, trained)
        what = (f"d2t is written as absolute target ids (d2t[0..3] = {d2t[:3].tolist()}, "
                f"{'climbing strictly, ' if looks_absolute(d2t) else ''}equal to the draft's target ids) where "
                f"{served.engine} reads offsets ({served.cited.get('d2t / t2d', '')})" if absolute else
                "its d2t maps draft ids to other target ids than training used")
        fix = ("rewrite d2t as d2t - arange(draft_vocab_size) (offsets), or re-export with `eaglewire export`"
               if absolute else "write the draft's own d2t (offsets), or re-export with `eaglewire export`")
    if mapped is not None and torch.equal(mapped, trained):
        return out
    measurable = mapped is not None and int(mapped.min()) >= 0 and int(mapped.max()) < draft.config.vocab_size
    out.found.append(Mismatch("d2t", "absolute ids" if "absolute" in what else "other offsets", "offsets",
                              what, fix, measurable=measurable))
    out.d2t = (mapped - torch.arange(vd)) if measurable else None
    return out


def read_dflash_engine_config(engine: str, config: dict[str, Any], num_layers: int, declared: list[int],
                              arch: str | None = None) -> EngineReading:
    """``read_engine_config`` for a DFlash draft: the boundaries ``engine`` captures for its DFlash ids
    (``engines.read_ids(..., family="dflash")``), each reading's problem naming the key, the value written
    and the value to write (the engine module's ``dflash_config_fix``)."""
    if engine == "eaglewire":
        return EngineReading(engine, None, {"eaglewire": list(declared)})
    e = engines.get(engine)
    found, notes = engines.read_ids(engine, config, family="dflash")
    out = EngineReading(engine, next(iter(found.values())), {}, notes)
    arch = _known_arch(arch, out.notes)
    for label, ids in found.items():
        if ids is None:
            out.problems.append(f"{label}: no ids where {engine} looks, so it falls back to a default of its own: "
                                + e.linter.dflash_config_fix(declared, num_layers, arch, config))
            continue
        try:
            out.readings[label] = engines.from_engine(ids, num_layers, engine, target_arch=arch, family="dflash")
        except (EngineConventionError, ContractError) as err:
            out.problems.append(f"{label}: {err}")
    return out


def dflash_config_fix(engine: str, declared: list[int], num_layers: int, arch: str | None,
                      config: dict[str, Any]) -> str:
    lint = engines.get(engine).linter
    if lint is None or lint.dflash_config_fix is None:
        return f"serve with boundaries {declared}"
    return lint.dflash_config_fix(declared, num_layers, _known_arch(arch, []), config)
