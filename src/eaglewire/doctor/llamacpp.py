"""``doctor --engine llamacpp``: the draft as llama.cpp will serve it.

- the GGUF draft's metadata (``--engine-config draft.gguf``): ``extract_layers`` against the
  contract, with the exact fix;
- whether llama.cpp (build ``engines.llamacpp.BUILD``) feeds EAGLE-3 drafts for the target's
  architecture at all (its graph must expose layer inputs; others abort at load);
- llama.cpp's speculative flags (``--engine-flags``): what it would silently change or ignore;
- with ``--engine-url`` of a running llama-server: the served τ on the held-out prompts, judged
  by ``served.py`` for every engine (``ServedTau`` / ``served_check`` below are the older
  llama.cpp-only reading, kept for their callers; ``run.py`` no longer uses them).
"""

from __future__ import annotations

from dataclasses import dataclass

from eaglewire.doctor.config import DoctorConfig
from eaglewire.doctor.report import Check, DoctorReport
from eaglewire.engines import llamacpp as engine
from eaglewire.engines.llamacpp.lint import DEFAULT_N_MAX, lint_flags
from eaglewire.engines.llamacpp.readings import NAME as LLAMACPP

# Served τ this far below eaglewire's engine on the same prompts is a fault, not noise
# (the bar: ±0.05 for an f32/f16 target, ±0.1 for a Q4 one).
SERVED_TAU_TOLERANCE = 0.1


def architecture_check(architecture: str) -> Check:
    """Can llama.cpp feed an EAGLE-3 draft for a target of ``architecture`` (transformers class
    or GGUF architecture name)?"""
    arch = engine.llamacpp_arch(architecture)
    if arch is None:
        return Check("llama.cpp architecture", "warn",
                     f"cannot tell which llama.cpp architecture {architecture!r} converts to",
                     fix="check that the target's model file in llama.cpp sets t_layer_inp (src/models/)")
    if arch in engine.EAGLE3_TARGET_ARCHS:
        return Check("llama.cpp architecture", "ok",
                     f"llama.cpp build {engine.BUILD} feeds EAGLE-3 drafts for {arch} targets ({architecture})")
    return Check("llama.cpp architecture", "fail",
                 f"llama.cpp build {engine.BUILD} cannot serve an EAGLE-3 draft for a {arch} target ({architecture}): "
                 "its graph does not expose layer inputs, and llama-server aborts at load "
                 "(GGML_ASSERT(t_layer_inp[il] != nullptr))",
                 [f"architectures it serves EAGLE-3 for: {', '.join(sorted(engine.EAGLE3_TARGET_ARCHS))}"],
                 fix="serve this draft with vLLM, SGLang or eaglewire, or use a llama.cpp build whose "
                     f"src/models/ file for {arch} records t_layer_inp")


def serving(report: DoctorReport, config: DoctorConfig, declared: list[int], num_layers: int, architecture: str
            ) -> tuple[dict[str, list[int]], int]:
    """The llama.cpp part of the serving checks: (label -> boundaries llama.cpp captures, chain length)."""
    steps = DEFAULT_N_MAX
    if config.target.endswith(".gguf"):
        architecture = str(engine.read_gguf_metadata(config.target).get("general.architecture", architecture))
    report.add(architecture_check(architecture))
    if config.engine_flags:
        flags = lint_flags(config.engine_flags)
        worst = ("fail" if any(v == "fail" for v, _, _ in flags.problems) else "warn" if flags.problems else "ok")
        report.add(Check("serving flags", worst, "llama.cpp flags: " + (
            "nothing silently changed" if not flags.problems else f"{len(flags.problems)} problem(s)"),
            [what for _, what, _ in flags.problems], fix="; ".join(f for _, _, f in flags.problems) or None))
        steps = flags.num_steps or steps
    if not config.engine_config:
        report.add(Check("engine config", "warn", "no --engine-config: cannot tell which layers llama.cpp will feed",
                         fix="pass the GGUF draft llama-server will load (--engine-config draft.gguf)"))
        return {}, steps
    meta = engine.read_gguf_metadata(config.engine_config)
    layers = engine.draft_layers(meta)
    problem = engine.layout_problem(meta, declared, num_layers, where=config.engine_config)
    evidence = [f"general.architecture {meta.get('general.architecture')!r}, extract_layers {layers}"]
    if problem:
        report.add(Check("engine wiring", "fail", "llama.cpp will not feed the draft the boundaries it was trained on",
                         evidence, fix=problem))
    else:
        report.add(Check("engine wiring", "ok", f"llama.cpp captures {declared}, as trained", evidence))
    readings = {LLAMACPP: [int(x) for x in layers]} if layers and len(layers) == 3 and \
        all(0 <= x <= num_layers for x in layers) and len(set(layers)) == 3 else {}
    return readings, steps


# ------------------------------------------------------------------ served τ

@dataclass
class ServedTau:
    tau: float
    drafted: int
    accepted: int
    verify_steps: int
    counted_exactly: bool  # verify steps from /metrics; else estimated as drafted / chain length
    outputs: list[list[int]]


def served_tau(timings: list[dict], verify_steps: int | None, num_steps: int) -> tuple[float, int, bool]:
    """τ from llama.cpp's counters: 1 + accepted / verify steps (llama.cpp's own "mean len").
    Without the steps count (no --metrics) every round is taken to draft the full chain."""
    drafted = sum(int(t.get("draft_n", 0)) for t in timings)
    accepted = sum(int(t.get("draft_n_accepted", 0)) for t in timings)
    if verify_steps:
        return 1.0 + accepted / verify_steps, verify_steps, True
    steps = -(-drafted // max(num_steps, 1))
    return (1.0 + accepted / steps if steps else 1.0), steps, False


def measure_served(url: str, prompts: list[list[int]], *, max_new_tokens: int, num_steps: int) -> ServedTau:
    """Greedy completions of ``prompts`` from the llama-server at ``url``; τ from its counters."""
    before = engine.metrics(url)
    answers = [engine.complete(url, p, n_predict=max_new_tokens) for p in prompts]
    after = engine.metrics(url)
    key = "spec_decode_num_drafts_total"
    steps = int(after[key] - before[key]) if before and after and key in after and key in before else None
    timings = [a.get("timings") or {} for a in answers]
    tau, steps_used, exact = served_tau(timings, steps, num_steps)
    return ServedTau(tau=tau, drafted=sum(int(t.get("draft_n", 0)) for t in timings),
                     accepted=sum(int(t.get("draft_n_accepted", 0)) for t in timings), verify_steps=steps_used,
                     counted_exactly=exact, outputs=[list(a.get("tokens") or []) for a in answers])


def served_check(served: ServedTau, eaglewire_tau: float | None, predicted: float, num_steps: int) -> Check:
    """Served τ against eaglewire's engine on the same prompts (else the replay prediction)."""
    reference, what = (eaglewire_tau, "eaglewire's engine on the same prompts") if eaglewire_tau is not None \
        else (predicted, "the prediction from acc@0 and cond acc")
    evidence = [f"llama-server: {served.accepted} of {served.drafted} drafted tokens accepted over "
                f"{served.verify_steps} verify steps" + ("" if served.counted_exactly else
                                                        " (estimated: the server runs without --metrics)"),
                f"served τ {served.tau:.2f} vs {reference:.2f} from {what} (chain of {num_steps})"]
    if served.drafted == 0:
        return Check("served acceptance", "fail", "llama-server drafted nothing", evidence,
                     fix="start llama-server with -md draft.gguf --spec-type draft-eagle3")
    if served.tau < reference - SERVED_TAU_TOLERANCE:
        return Check("served acceptance", "fail", f"llama-server accepts less than the draft earns: τ {served.tau:.2f} "
                     f"< {reference:.2f}", evidence,
                     fix="a serving-side fault, not a weak draft: check the engine wiring above, the flags "
                         "(--spec-draft-p-min 0, the same --spec-draft-n-max), and serve the target eaglewire "
                         "measured (an f32/f16 GGUF of the same weights, not a requantized one)")
    return Check("served acceptance", "ok", f"served τ {served.tau:.2f}, as eaglewire's engine predicts "
                 f"({reference:.2f})", evidence)
