"""``doctor --engine llamacpp``: the draft as llama.cpp will serve it.

- the GGUF draft's metadata (``--engine-config draft.gguf``): ``extract_layers`` against the
  contract, with the exact fix; its ``d2t`` against the draft's vocabulary; every other field llama.cpp
  computes with (its own ``token_embd``, ``norm_before_fc`` and its tensor, eps, RoPE, sizes) is the
  engine-fields check's (``checks.check_engine_fields`` through ``engines/llamacpp/served.py``), measured;
- whether llama.cpp (build ``engines.llamacpp.BUILD``) feeds EAGLE-3 drafts for the target's
  architecture at all (its graph must expose layer inputs; others abort at load);
- llama.cpp's speculative flags (``--engine-flags``): what it would silently change or ignore;
- with ``--engine-url`` of a running llama-server: the served τ on the held-out prompts is
  ``served.py``'s, as for every engine (``engines.llamacpp.measure_served`` reads it).
"""

from __future__ import annotations

from pathlib import Path

import torch

from eaglewire.core.verdicts import Check, Findings, flags_check
from eaglewire.engines.interface import ServingInputs
from eaglewire.engines.llamacpp.gguf import draft_layers, layout_problem, read_gguf_metadata, vocab_problem
from eaglewire.engines.llamacpp.installation import BUILD
from eaglewire.engines.llamacpp.lint import DEFAULT_N_MAX, lint_dflash_flags, lint_flags
from eaglewire.engines.llamacpp.readings import EAGLE3_TARGET_ARCHS, GGUF_ARCH, NAME as LLAMACPP, llamacpp_arch


def architecture_check(architecture: str) -> Check:
    """Can llama.cpp feed an EAGLE-3 draft for a target of ``architecture`` (transformers class
    or GGUF architecture name)?"""
    arch = llamacpp_arch(architecture)
    if arch is None:
        return Check("llama.cpp architecture", "warn",
                     f"cannot tell which llama.cpp architecture {architecture!r} converts to",
                     fix="check that the target's model file in llama.cpp sets t_layer_inp (src/models/)")
    if arch in EAGLE3_TARGET_ARCHS:
        return Check("llama.cpp architecture", "ok",
                     f"llama.cpp build {BUILD} feeds EAGLE-3 drafts for {arch} targets ({architecture})")
    return Check("llama.cpp architecture", "fail",
                 f"llama.cpp build {BUILD} cannot serve an EAGLE-3 draft for a {arch} target ({architecture}): "
                 "its graph does not expose layer inputs, and llama-server aborts at load "
                 "(GGML_ASSERT(t_layer_inp[il] != nullptr))",
                 [f"architectures it serves EAGLE-3 for: {', '.join(sorted(EAGLE3_TARGET_ARCHS))}"],
                 fix="serve this draft with vLLM, SGLang or eaglewire, or use a llama.cpp build whose "
                     f"src/models/ file for {arch} records t_layer_inp")


def vocab_check(gguf_path: str, vocab_ids: torch.Tensor | None) -> Check:
    """Does the GGUF's d2t map the draft's rows to the target ids it was trained over (``vocab_ids`` [Vd]; None:
    the whole vocabulary, no d2t)?"""
    problem = vocab_problem(Path(gguf_path), vocab_ids, where=gguf_path)
    if problem:
        return Check("engine vocabulary", "fail", "llama.cpp will read the draft's predictions as other tokens",
                     [problem], fix="re-export the draft with `eaglewire export --to llamacpp` (llama.cpp's converter "
                                    "adds draft id to an offset d2t; a checkpoint with absolute ids must be converted "
                                    "to offsets first)")
    what = ("the target's whole vocabulary, as trained (no d2t)" if vocab_ids is None else
            f"d2t maps the draft's {len(vocab_ids)} rows to the target ids it was trained over")
    return Check("engine vocabulary", "ok", what)


def serving(report: Findings, served: ServingInputs, declared: list[int], num_layers: int, architecture: str,
            dflash_block: int | None = None, vocab_ids: torch.Tensor | None = None) -> tuple[dict[str, list[int]], int]:
    """The llama.cpp part of the serving checks: (label -> boundaries llama.cpp captures, tokens drafted per
    round); ``dflash_block``: a DFlash draft trained on blocks of that size (None: EAGLE-3); ``vocab_ids``: the
    target ids of the draft's vocabulary [Vd] (None: the whole vocabulary)."""
    family = "eagle3" if dflash_block is None else "dflash"
    steps = DEFAULT_N_MAX if dflash_block is None else min(DEFAULT_N_MAX, dflash_block - 1)
    if served.target.endswith(".gguf"):
        architecture = str(read_gguf_metadata(served.target).get("general.architecture", architecture))
    report.add(architecture_check(architecture))
    engine_config = served.engine_config
    if served.engine_flags:
        flags = (lint_flags(served.engine_flags) if dflash_block is None else
                 lint_dflash_flags(served.engine_flags, declared, num_layers, architecture, dflash_block))
        report.add(flags_check("llama.cpp", flags.problems))
        steps = flags.num_steps or steps
        engine_config = served.flags_load(flags.draft_path)
    if not engine_config:
        report.add(Check("engine config", "warn", "no --engine-config: cannot tell which layers llama.cpp will feed",
                         fix="pass the GGUF draft llama-server will load (--engine-config draft.gguf)"))
        return {}, steps
    meta = read_gguf_metadata(engine_config)
    layers = draft_layers(meta)
    problem = layout_problem(meta, declared, num_layers, where=engine_config, family=family)
    evidence = [f"general.architecture {meta.get('general.architecture')!r}, extract_layers {layers}"]
    if problem:
        report.add(Check("engine wiring", "fail", "llama.cpp will not feed the draft the boundaries it was trained on",
                         evidence, fix=problem))
    else:
        report.add(Check("engine wiring", "ok", f"llama.cpp captures {declared}, as trained", evidence))
    report.add(vocab_check(engine_config, vocab_ids))
    if family == "dflash":
        return ({LLAMACPP: [int(x) for x in layers]} if layers and all(0 <= x <= num_layers for x in layers) else {},
                steps)
    readings = {LLAMACPP: [int(x) for x in layers]} if layers and len(layers) == 3 and \
        all(0 <= x <= num_layers for x in layers) and len(set(layers)) == 3 else {}
    return readings, steps


def draft_file_layers(path) -> list[int] | None:
    """The boundaries a draft GGUF makes llama.cpp feed (its ``extract_layers`` / DFlash ``target_layers``)."""
    layers = draft_layers(read_gguf_metadata(path))
    return [int(x) for x in layers] if layers else None


def layout_fix(engine_config: str | None, declared: list[int], num_layers: int, served_layout: list[int] | None,
               dflash: bool) -> str:
    """The fix that makes llama-server feed ``declared``: ``layout_problem`` on the GGUF given, or on a GGUF holding
    ``served_layout`` where the one given is wired as trained (the server loads another one)."""
    meta, where = None, "the GGUF llama-server loads"
    if engine_config and str(engine_config).endswith(".gguf"):
        try:
            meta, where = read_gguf_metadata(engine_config), engine_config
        except Exception:  # noqa: BLE001 - the engine checks report an unreadable GGUF
            meta = None
    shown = list(served_layout or [])
    if (meta is None or draft_layers(meta) == list(declared)) and shown and min(shown) >= 0:
        meta, where = {"general.architecture": GGUF_ARCH, f"{GGUF_ARCH}.target_layers": shown}, \
            "the GGUF llama-server loads"
    problem = (layout_problem(meta, declared, num_layers, where=where, family="dflash" if dflash else "eagle3")
               if meta is not None else None)
    return problem or (f"re-export with `eaglewire export --to llamacpp --draft DRAFT --out DIR`: its GGUF's "
                       f"extract_layers are {declared}, which llama.cpp feeds as the boundaries trained")
