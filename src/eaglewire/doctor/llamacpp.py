"""``doctor --engine llamacpp``: the draft as llama.cpp will serve it.

- the GGUF draft's metadata (``--engine-config draft.gguf``): ``extract_layers`` against the
  contract, with the exact fix;
- whether llama.cpp (build ``engines.llamacpp.BUILD``) feeds EAGLE-3 drafts for the target's
  architecture at all (its graph must expose layer inputs; others abort at load);
- llama.cpp's speculative flags (``--engine-flags``): what it would silently change or ignore;
- with ``--engine-url`` of a running llama-server: the served τ on the held-out prompts, set
  against eaglewire's engine on the same prompts. A served τ below it is a serving-side fault
  (wiring, flags, a requantized target), not a weak draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eaglewire.doctor.config import DoctorConfig
from eaglewire.doctor.report import Check, DoctorReport
from eaglewire.doctor.serving import parse_flags
from eaglewire.engines import llamacpp as engine

# flag -> what replaced it (removed at this build: llama-server exits on them)
REMOVED_FLAGS = {"--draft": "--spec-draft-n-max", "--draft-n": "--spec-draft-n-max", "--draft-max": "--spec-draft-n-max",
                 "--draft-min": "--spec-draft-n-min", "--draft-n-min": "--spec-draft-n-min"}
DRAFT_MODEL_FLAGS = ("-md", "--model-draft", "--spec-draft-model")
DEFAULT_N_MAX = 3  # llama.cpp's --spec-draft-n-max default
# Served τ this far below eaglewire's engine on the same prompts is a fault, not noise
# (the bar: ±0.05 for an f32/f16 target, ±0.1 for a Q4 one).
SERVED_TAU_TOLERANCE = 0.1


@dataclass
class LlamaFlags:
    num_steps: int | None = None  # --spec-draft-n-max as given (None: llama.cpp's default 3)
    n_min: int | None = None
    p_min: float | None = None
    problems: list[tuple[str, str, str]] = field(default_factory=list)  # (verdict, what, fix)


def lint_flags(flags: str) -> LlamaFlags:
    """llama-server launch flags that would serve the EAGLE-3 draft otherwise than meant."""
    args = parse_flags(flags)
    out = LlamaFlags()
    for old, new in REMOVED_FLAGS.items():
        if old in args:
            out.problems.append(("fail", f"{old} was removed before build {engine.BUILD}: llama-server exits on it",
                                 f"use {new}"))
    if not any(f in args for f in DRAFT_MODEL_FLAGS):
        out.problems.append(("fail", "no draft model (-md): llama-server decodes without speculation",
                             "add -md draft.gguf --spec-type draft-eagle3"))
    kind = args.get("--spec-type")
    if kind is None:
        out.problems.append(("warn", f"no --spec-type: build {engine.BUILD} infers draft-eagle3 from the GGUF's "
                             "metadata, other builds may not", "add --spec-type draft-eagle3"))
    elif "draft-eagle3" not in kind.split(","):
        out.problems.append(("fail", f"--spec-type {kind}: llama.cpp will not feed target states to the EAGLE-3 "
                             "draft", "--spec-type draft-eagle3"))
    n_max, n_min, p_min = (args.get(k) for k in ("--spec-draft-n-max", "--spec-draft-n-min", "--spec-draft-p-min"))
    out.num_steps = _number(n_max, "--spec-draft-n-max", out)
    out.n_min = _number(n_min, "--spec-draft-n-min", out)
    out.p_min = _number(p_min if p_min is not None else args.get("--draft-p-min"), "--spec-draft-p-min", out, float)
    steps = out.num_steps if out.num_steps is not None else DEFAULT_N_MAX
    if out.num_steps == 0:
        out.problems.append(("fail", "--spec-draft-n-max 0: nothing is drafted", "--spec-draft-n-max 3"))
    if out.n_min is not None and out.n_min > steps:
        out.problems.append(("fail", f"--spec-draft-n-min {out.n_min} > --spec-draft-n-max {steps}: every draft is "
                             "shorter than the minimum and dropped, silently", "--spec-draft-n-min 0"))
    if out.p_min:
        out.problems.append(("warn", f"--spec-draft-p-min {out.p_min:g}: drafting stops at the first token the draft "
                             "is less sure of, so τ falls short of the chain's prediction",
                             "--spec-draft-p-min 0 to draft the full chain (when measuring τ)"))
    if args.get("--spec-draft-sampling") == "probabilistic":
        out.problems.append(("warn", "--spec-draft-sampling probabilistic: greedy acceptance no longer applies; "
                             "τ is not comparable with greedy predictions", "--spec-draft-sampling greedy"))
    threads = {k: args.get(k) for k in ("-t", "-td")}
    if threads["-t"] and not threads["-td"]:
        out.problems.append(("warn", f"-t {threads['-t']} without -td: the draft's thread count is left to "
                             "llama.cpp", f"-td {threads['-t']} -tbd {threads['-t']}"))
    return out


def _number(value: str | None, flag: str, out: LlamaFlags, kind: type = int):
    """``value`` as ``kind`` (int or float); None, with a problem recorded, when llama-server would refuse it."""
    if value is None:
        return None
    try:
        return kind(value)
    except ValueError:
        what, fix = ("an integer", 3) if kind is int else ("a number", 0)
        out.problems.append(("fail", f"{flag} {value!r} is not {what}: llama-server refuses it", f"{flag} {fix}"))
        return None


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
    from eaglewire.formats.llamacpp import draft_layers, layout_problem, read_gguf_metadata

    steps = DEFAULT_N_MAX
    if config.target.endswith(".gguf"):
        architecture = str(read_gguf_metadata(config.target).get("general.architecture", architecture))
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
    meta = read_gguf_metadata(config.engine_config)
    layers = draft_layers(meta)
    problem = layout_problem(meta, declared, num_layers, where=config.engine_config)
    evidence = [f"general.architecture {meta.get('general.architecture')!r}, extract_layers {layers}"]
    if problem:
        report.add(Check("engine wiring", "fail", "llama.cpp will not feed the draft the boundaries it was trained on",
                         evidence, fix=problem))
    else:
        report.add(Check("engine wiring", "ok", f"llama.cpp captures {declared}, as trained", evidence))
    readings = {"llamacpp": [int(x) for x in layers]} if layers and len(layers) == 3 and \
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
