"""The checks both doctors run (``doctor_command.py`` on a fresh capture, ``stored.py`` on stored states),
and ``Measured``, what they read: built once per run, after the draft has been measured at its
declared layout."""

from __future__ import annotations

import dataclasses
import filecmp
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglewire import engines
from eaglewire.core.errors import read_json_object
from eaglewire.doctor.evidence import USEFUL_ACC0, judge_sweep, predicts_nothing, wilson_bounds
from eaglewire.doctor.measure import EvalBatch, isolation_accuracy
from eaglewire.doctor.verdicts import Check, DoctorReport, LayoutRow
from eaglewire.doctor.engine_reading import (config_fix, dflash_config_fix, engine_refusal, lint_flags,
                                     read_dflash_engine_config, read_engine_config)
from eaglewire.engines import Ability
from eaglewire.model.dflash_blocks import is_block_draft
from eaglewire.model.draft import Eagle3Draft
from eaglewire.model.ttt import StepCounts


@dataclass(kw_only=True, frozen=True)
class Measured:
    """The draft measured on the batches every check reads, and the layouts it is judged by."""

    engine: str  # the serving engine (--engine)
    engine_config: str | None  # the draft config it loads: --engine-config, or what its launch flags load
    draft: Eagle3Draft  # or a DFlashDraft: ``counts`` are then per drafted position (acc@0 = the first)
    batches: list[EvalBatch]  # captured now (doctor_command.py) or built from stored states (stored.py)
    declared: list[int]  # the aux boundaries the draft's contract declares
    num_layers: int  # L, the target's last boundary
    serving: dict[str, list[int]]  # label -> the boundaries the serving engine will feed
    counts: list[StepCounts]  # the draft in isolation at ``declared``, per TTT step (--steps)

    @property
    def acc0(self) -> float:
        return self.counts[0].acc

    @property
    def n(self) -> int:
        """Judged reply tokens."""
        return self.counts[0].valid

    @property
    def cond(self) -> list[float]:
        """cond acc@1.. : each step's accuracy where every earlier step was right."""
        return [c.cond_acc for c in self.counts[1:]]


@dataclass(frozen=True)
class LaunchSettings:
    """How the serving engine is launched, as the serving checks read it (the fields are the doctor flags of the same
    name, filled by ``doctor_config``)."""

    engine: str
    engine_config: str | None  # the draft config the engine loads (llama.cpp: the draft GGUF)
    engine_flags: str | None
    target: str  # a GGUF target says which architecture it converted to


ENGINE_CONFIG_FIX = "pass --engine-config the draft's config.json file the engine loads (not its directory, not inline JSON)"


def _same_content(a: Path, b: Path) -> bool:
    """Whether two engine configs say the same: as JSON objects for config.json, byte for byte otherwise (a GGUF)."""
    if a.suffix == b.suffix == ".json":
        return read_json_object(a, ENGINE_CONFIG_FIX) == read_json_object(b, ENGINE_CONFIG_FIX)
    return filecmp.cmp(a, b, shallow=False)


def config_the_flags_load(report: DoctorReport, launch: LaunchSettings, named: str | None) -> LaunchSettings:
    """``launch`` with the engine config the launch flags load (``named``: their draft, a directory or llama.cpp's
    GGUF): read when no ``--engine-config`` is given, and judged instead of a ``--engine-config`` that differs from
    it (a FAIL says so): the engine loads what its flags name, whatever the doctor was shown. A draft that is
    not here (another machine's path, a hub name) changes nothing."""
    if not named:
        return launch
    loads = Path(named).expanduser()
    loads = loads / "config.json" if loads.is_dir() else loads
    if not loads.is_file():
        return launch
    if not launch.engine_config:
        report.add(Check("engine config", "ok", f"read {loads}: what the launch flags load"))
        return dataclasses.replace(launch, engine_config=str(loads))
    given = Path(launch.engine_config)
    if given.is_file() and given.resolve() != loads.resolve() and not _same_content(given, loads):
        report.add(Check("engine config", "fail", f"--engine-config {given} is not what the launch flags load: "
                         f"{loads} differs, and {launch.engine} reads that one (judged below)",
                         fix=f"point the launch flags at the draft of {given}, or fix {loads}"))
        return dataclasses.replace(launch, engine_config=str(loads))
    return launch


def check_serving(report: DoctorReport, launch: LaunchSettings, declared: list[int], L: int, arch: str,
                  dflash_block: int | None = None, *, vocab_ids: torch.Tensor | None = None
                  ) -> tuple[dict[str, list[int]], int, LaunchSettings]:
    """Serving flags lint; (the boundaries the serving engine will capture, label -> layout;
    the tokens it drafts per round when the flags do not say, ``default_steps``; ``launch`` with the engine config
    the flags load, ``config_the_flags_load``, for the checks after it). ``dflash_block``: the draft is a DFlash
    draft trained on blocks of that size; ``vocab_ids``: the target ids of the draft's vocabulary [Vd] (None: the
    whole vocabulary). Every engine answers through its linter: a config.json beside the weights read for its ids,
    or a draft file of its own (llama.cpp's GGUF) read for its layout and d2t (``check_draft_file``); both doctors
    come here. Its readings go into ``Measured.serving``, so it runs before the draft is measured and takes its
    inputs bare."""
    spec = engines.get(launch.engine, Ability.LINT)
    lint, label = spec.linter, spec.linter.label or launch.engine
    family = "eagle3" if dflash_block is None else "dflash"
    steps = default_steps(launch.engine, dflash_block)
    shown = launch
    if lint.target_file_arch is not None:
        arch = lint.target_file_arch(launch.target) or arch  # a GGUF target says which architecture it converted to
    if lint.arch_reading is not None:
        report.add(architecture_check(launch.engine, arch))
    if launch.engine_flags:
        flags = lint_flags(launch.engine, launch.engine_flags, declared, L, arch, dflash_block=dflash_block)
        report.add(flags_check(label, flags.problems))
        steps = flags.num_steps or steps
        launch = config_the_flags_load(report, launch, flags.draft_path)
    own_file = lint.draft_file_layout is not None
    if launch.engine == "eaglewire" and not launch.engine_config:
        return {"eaglewire": list(declared)}, steps, launch
    if family == "eagle3" and (refused := engine_refusal(launch.engine, arch)):
        why, others = refused
        report.add(Check("engine architecture", "fail", f"{launch.engine} serves no EAGLE-3 draft for a {arch} target",
                         [why], fix=f"serve it with {' or '.join(others)} (doctor --engine {others[0]})"))
        return {}, steps, launch
    if not launch.engine_config:
        report.add(Check("engine config", "warn", f"no --engine-config: cannot tell which "
                         + (f"layers {label} will feed" if own_file else f"boundaries {label} will capture"),
                         fix=lint.draft_file_fix or "pass the config.json the engine will load"))
        return {}, steps, launch
    if own_file:
        # the checks after this one (engine fields, the diagnosis) read the --engine-config shown
        return check_draft_file(report, launch.engine, launch.engine_config, declared, L, family, vocab_ids), steps, shown
    cfg = read_json_object(launch.engine_config, ENGINE_CONFIG_FIX)
    if family == "dflash":
        reading = read_dflash_engine_config(launch.engine, cfg, L, declared, arch)
        fix = dflash_config_fix(launch.engine, declared, L, arch, cfg)
    else:
        reading = read_engine_config(launch.engine, cfg, L, declared, arch)
        fix = config_fix(launch.engine, declared, L, arch)
    wrong = {label: b for label, b in reading.readings.items() if b != declared}
    evidence = ([f"{label} captures boundaries {b}" for label, b in reading.readings.items()] + reading.notes
                + reading.problems)
    if wrong or reading.problems:
        report.add(Check("engine wiring", "fail",
                         f"{launch.engine} will feed the draft boundaries other than the {declared} it was trained on",
                         evidence, fix=fix))
    else:
        report.add(Check("engine wiring", "ok", f"{launch.engine} captures {declared}, as trained", evidence))
    return reading.readings, steps, launch


def flags_check(engine: str, problems: list[tuple[str, str, str]]) -> Check:
    """The "serving flags" check of a lint's (verdict, what, fix) problems."""
    worst = "fail" if any(v == "fail" for v, _, _ in problems) else ("warn" if problems else "ok")
    return Check("serving flags", worst, f"{engine} flags: " + ("nothing silently changed" if not problems
                                                                else f"{len(problems)} problem(s)"),
                 [what for _, what, _ in problems], fix="; ".join(f for _, _, f in problems) or None)


def default_steps(engine: str, dflash_block: int | None = None) -> int:
    """Tokens ``engine`` drafts a round when its flags do not say: its own default (a DFlash block's at most), else
    SGLang's default chain of 5 or a DFlash block's ``dflash_block - 1``."""
    n_max = engines.get(engine, Ability.LINT).linter.default_n_max
    if dflash_block is None:
        return 5 if n_max is None else n_max
    return dflash_block - 1 if n_max is None else min(n_max, dflash_block - 1)


def architecture_check(engine: str, architecture: str) -> Check:
    """Does ``engine``'s build feed an EAGLE-3 draft for a target of ``architecture`` (transformers class or the
    engine's own name, a GGUF's)? Its linter's ``arch_reading`` says."""
    lint = engines.get(engine, Ability.LINT).linter
    label, reading = lint.label or engine, lint.arch_reading(architecture)
    name = f"{label} architecture"
    if reading.arch is None:
        return Check(name, "warn", f"cannot tell which {label} architecture {architecture!r} converts to",
                     fix=reading.fix)
    if reading.serves:
        return Check(name, "ok", f"{label} build {reading.build} feeds EAGLE-3 drafts for {reading.arch} targets "
                                 f"({architecture})")
    return Check(name, "fail", f"{label} build {reading.build} cannot serve an EAGLE-3 draft for a {reading.arch} "
                               f"target ({architecture}): {reading.why_not}",
                 [f"architectures it serves EAGLE-3 for: {', '.join(sorted(reading.served))}"], fix=reading.fix)


def check_draft_file(report: DoctorReport, engine: str, path: str, declared: list[int], L: int, family: str,
                     vocab_ids: torch.Tensor | None) -> dict[str, list[int]]:
    """The engine wiring and vocabulary checks of a draft file of ``engine``'s own (llama.cpp's GGUF) at ``path``;
    {engine: the boundaries it feeds from it} ({} where it would load none)."""
    spec = engines.get(engine, Ability.LINT)
    label = spec.linter.label or engine
    layout = spec.linter.draft_file_layout(path, declared, L, family)
    if layout.problem:
        report.add(Check("engine wiring", "fail", f"{label} will not feed the draft the boundaries it was trained on",
                         [layout.recorded], fix=layout.problem))
    else:
        report.add(Check("engine wiring", "ok", f"{label} captures {declared}, as trained", [layout.recorded]))
    report.add(vocab_check(engine, path, vocab_ids))
    return {spec.name: layout.feeds} if layout.feeds else {}


def vocab_check(engine: str, path: str, vocab_ids: torch.Tensor | None) -> Check:
    """Does the d2t of ``engine``'s draft file at ``path`` map the draft's rows to the target ids it was trained over
    (``vocab_ids`` [Vd]; None: the whole vocabulary, no d2t)?"""
    lint = engines.get(engine, Ability.LINT).linter
    problem = lint.draft_file_vocab(path, vocab_ids)
    if problem:
        return Check("engine vocabulary", "fail", f"{lint.label or engine} will read the draft's predictions as "
                     "other tokens", [problem], fix=lint.vocab_fix)
    what = ("the target's whole vocabulary, as trained (no d2t)" if vocab_ids is None else
            f"d2t maps the draft's {len(vocab_ids)} rows to the target ids it was trained over")
    return Check("engine vocabulary", "ok", what)


def serving_fix(report: DoctorReport, m: Measured, arch: str | None = None) -> str:
    """The config change that makes the serving engine feed the declared layout: the engine wiring check's fix
    (the key its engine reads for this draft family, on this target's model file; llama.cpp's re-export), else
    the engine's EAGLE-3 config fix."""
    wiring = next((c.fix for c in report.checks if c.name == "engine wiring" and c.fix), None)
    return wiring or config_fix(m.engine, m.declared, m.num_layers, arch)


def check_evidence(report: DoctorReport, n: int, sequences: int, summary: dict, *, min_tokens: int,
                   num_sequences: int, max_length: int, include_training: bool) -> None:
    """Judged tokens against ``min_tokens``; below it nothing can pass, and the fix says where more come from
    (``num_sequences``, ``max_length``, ``include_training``: the flags that chose the ``sequences``)."""
    what = f"{n:,} judged reply tokens on {sequences} held-out sequence(s) (minimum {min_tokens:,})"
    if n >= min_tokens:
        report.add(Check("evidence", "ok", what))
        return
    per = max(n / max(sequences, 1), 1.0)
    need = math.ceil(min_tokens / per)
    if sequences < num_sequences:  # the source ran out, not the flag
        recorded = len(summary.get("heldout_sequence_ids") or [])
        fix = (f"only {sequences} held-out sequence(s) were found" +
               (f" (the draft recorded {recorded} held out)" if recorded and not include_training else "") +
               f"; about {need} are needed: pass --conversations FILE with conversations training did not see "
               "(--offset skips the first ones) or --data SHARDS not used in training; or --include-training "
               "to also measure on training sequences (it reads optimistic)")
    else:
        fix = f"raise --num-sequences from {num_sequences} to about {need}, or --max-length (now {max_length})"
    report.add(Check("evidence", "inconclusive", f"too little evidence to pass: {what}",
                     [f"~{per:.0f} judged tokens per sequence; with {n:,} tokens an accuracy is known to about "
                      f"±{2 * math.sqrt(0.25 / max(n, 1)):.3f}"], fix=fix))


def check_accuracy(report: DoctorReport, m: Measured, summary: dict, source: str) -> None:
    """acc@0 at the declared layout (``source``: what it was measured on) against what training recorded;
    then the draft as the serving engine builds it from its config (``check_engine_fields``)."""
    _check_accuracy(report, m, summary, source)
    check_engine_fields(report, m)


def _check_accuracy(report: DoctorReport, m: Measured, summary: dict, source: str) -> None:
    acc0, n = m.acc0, m.n
    evidence = [f"acc@0 {acc0:.3f}" + "".join(f", cond acc@{j} {c:.3f}" for j, c in enumerate(m.cond, 1))
                + f" over {n:,} judged reply tokens"]
    if predicts_nothing(acc0, n):
        high = wilson_bounds(acc0, n)[1]
        report.add(Check("accuracy in isolation", "fail", f"the draft predicts nothing: acc@0 {acc0:.3f} "
                         f"({source})", evidence + [f"at most {high:.3f} at ~95% confidence, under the "
                                                   f"{USEFUL_ACC0} a draft needs to accept anything"],
                         fix=vocab_map_fault(m) or "a draft this weak cannot speed decoding, nor can its wiring be "
                         "checked: train it longer or on more data, and check it was trained on this target's states"))
        return
    recorded = (summary.get("final_eval") or {}).get("val_acc_0")
    verdict = "ok"
    if recorded is not None:
        evidence.append(f"recorded at training time: acc@0 {recorded:.3f} on its own held-out split")
        if acc0 < recorded - 0.1:
            verdict = "warn"
    report.add(Check("accuracy in isolation", verdict,
                     f"acc@0 {acc0:.3f} fed exactly as in training ({source})", evidence,
                     fix=None if verdict == "ok" else
                     "the data differ from the training data, or the draft regressed; compare on the training "
                     "shards (--data) to tell which"))


def _tolerance(acc: float, n: int) -> float:
    """Differences below this are noise: two binomial standard errors, at least 0.02."""
    return max(0.02, 2 * math.sqrt(max(acc * (1 - acc), 1e-4) / max(n, 1)))


def check_layouts(report: DoctorReport, m: Measured, layouts: dict[tuple[int, ...], list[str]]) -> None:
    """Every candidate layout measured (``layouts``: layout -> why it is a candidate): the declared
    one must be the best beyond noise, and the serving engine must feed it."""
    declared, serving, acc0, n = m.declared, m.serving, m.acc0, m.n
    rows = []
    for layout, labels in layouts.items():
        acc = (acc0 if list(layout) == declared
               else isolation_accuracy(m.draft, m.batches, list(layout), steps=1)[0].acc)
        rows.append(LayoutRow(list(layout), labels, round(acc, 4), n))
    report.layouts = rows
    judged = judge_sweep({tuple(r.layout): r.acc0 for r in rows}, declared, n)
    if judged.verdict == "fail":
        report.add(Check("layout sweep", "fail", judged.summary, judged.evidence,
                         fix="the contract (or the data it was trained on) is mislabeled: re-capture with "
                         f"--aux-boundaries {','.join(map(str, judged.best))} and retrain, or fix the recorded contract"))
        return
    if judged.verdict == "inconclusive":
        report.add(Check("layout sweep", "inconclusive", judged.summary, judged.evidence,
                         fix="nothing can be told apart until the draft predicts something: train it further"))
        return
    bad = {label: b for label, b in serving.items() if b != declared}
    if bad:
        by_layout = {tuple(r.layout): r.acc0 for r in rows}
        lines = [f"{label} feeds {b}: acc@0 {by_layout.get(tuple(b), float('nan')):.3f} instead of {acc0:.3f}"
                 for label, b in bad.items()]
        report.add(Check("layout sweep", "fail", f"the serving side feeds another layout than the declared {declared}",
                         judged.evidence + lines, fix=serving_fix(report, m)))
        return
    report.add(Check("layout sweep", "ok", judged.summary, judged.evidence))


# The state of position t+1 was computed from the token the draft is asked to predict after it,
# so a correctly trained draft also reads somewhat better from it (measured on the reference
# draft: 0.380 vs 0.310). A draft trained on that state reads several times better from it.
LOOKAHEAD_GAIN = 1.5


def misaligned_shift(acc0: float, shifted: dict[int, float], n: int) -> int | None:
    """The position shift the draft was evidently trained with, or None when it lines up.

    acc0: acc@0 aligned; shifted: acc@0 with the states of t + s fed at t, for s = -1, +1.
    An earlier state beating the aligned one beyond noise is a shift; a later one must also
    beat it by LOOKAHEAD_GAIN, because it carries the answer's context and helps any draft.
    """
    tol = _tolerance(acc0, n)
    better = {s: a for s, a in shifted.items()
              if a > acc0 + tol and (s < 0 or a >= LOOKAHEAD_GAIN * acc0)}
    return max(better, key=better.get) if better else None


def check_alignment(report: DoctorReport, m: Measured) -> None:
    """The declared layout fed one position early and late: a draft trained off by one reads better so."""
    acc0, n = m.acc0, m.n
    shifted = {s: isolation_accuracy(m.draft, m.batches, m.declared, steps=1, shift=s)[0].acc for s in (-1, 1)}
    evidence = [f"states of position t{s:+d} at t: acc@0 {a:.3f} (aligned: {acc0:.3f})" for s, a in shifted.items()]
    evidence.append(f"t+1 reads ahead (its state saw the next token), so it may score higher for any draft; "
                    f"only {LOOKAHEAD_GAIN:g}x the aligned accuracy counts as a shift")
    shift = misaligned_shift(acc0, shifted, n)
    if shift is None and predicts_nothing(max([acc0, *shifted.values()]), n):
        report.add(Check("alignment", "inconclusive", "the draft predicts nothing in any alignment: nothing to "
                         "compare", evidence))
    elif shift is not None:
        report.add(Check("alignment", "fail", f"the draft predicts better with states shifted by {shift:+d} token",
                         evidence, fix="the training data paired tokens with the states of their neighbours; "
                         "re-capture with `eaglewire prepare` and retrain"))
    else:
        report.add(Check("alignment", "ok", "tokens and states line up (no off-by-one position shift)", evidence))


def vocab_map_fault(m: Measured) -> str | None:
    """The fix when the draft's own d2t is evidently absolute target ids read as offsets: read as
    ids, it covers clearly more of the target's next tokens on the judged replies (None otherwise)."""
    import torch

    from eaglewire.engines.formats.eagle3_layout import looks_absolute

    if is_block_draft(m.draft):  # a DFlash draft predicts over the target's own head: no d2t
        return None
    d2t = m.draft.d2t.cpu().long()
    V = m.draft.config.vocab_size
    if not looks_absolute(d2t) or int(d2t.max()) >= V or int(d2t.min()) < 0:
        return None
    now, alt = torch.zeros(V, dtype=torch.bool), torch.zeros(V, dtype=torch.bool)
    now[m.draft.draft_to_target.cpu().clamp(max=V - 1)] = True
    alt[d2t] = True
    hits_now = hits_alt = total = 0
    for b in m.batches:
        nxt = b.signal.argmax[:, :-1].cpu()[b.loss_mask[:, 1:].cpu()]  # [N] the target's next tokens on replies
        hits_now, hits_alt, total = hits_now + int(now[nxt].sum()), hits_alt + int(alt[nxt].sum()), total + nxt.numel()
    if total == 0 or hits_alt <= max(2 * hits_now, 0.2 * total):
        return None
    return (f"the draft's d2t holds absolute target ids (d2t[0..3] = {d2t[:3].tolist()}, climbing strictly) read as "
            f"offsets: read as ids it covers {hits_alt / total:.1%} of the target's next tokens, as offsets "
            f"{hits_now / total:.1%}. Re-import the checkpoint (`eaglewire import` now reads such a d2t as ids), "
            "or rewrite d2t as d2t - arange(draft_vocab_size)")


def served_embedding(batch: EvalBatch, embedding) -> EvalBatch:
    """``batch`` with its token embeddings taken from ``embedding`` [V, H] (an engine's own rows) instead of the
    target's: what the draft reads for the same tokens in that engine."""
    emb = embedding.to(batch.emb.device, batch.emb.dtype)[batch.input_ids.to(batch.emb.device)]  # [B, T, H]
    return dataclasses.replace(batch, emb=emb)


def check_engine_version(report: DoctorReport, engine: str, engine_url: str) -> None:
    """Ask the ``engine`` server at ``engine_url`` (``--engine-url``) which version it is and say which release's
    reading judges it (every other line then names that release: ``name_the_judged_release``)."""
    from eaglewire import engines

    spec = engines.get(engine)
    if spec.served_version is None or spec.judged is None:
        return
    served = spec.served_version(engine_url)
    report.engine_version = (served or "").strip() or None
    report.engine_release, line = spec.judged(served)
    exact = served is not None and line.startswith(f"judged with {report.engine_release}'s reading (the server says")
    report.add(Check("engine version", "ok" if exact else "warn", line,
                     fix=None if exact else f"compare the server's version with the releases eaglewire read "
                                            f"({report.engine_release} is the nearest)"))


def name_the_judged_release(report: DoctorReport, engine: str) -> None:
    """Every line of ``report`` that names the release eaglewire read ``engine``'s code from ("vllm 0.33.0",
    "vLLM 0.33.0": the readings' labels, the fields' meanings) names the release whose reading judged the server at
    --engine-url instead (``report.engine_release``, "vLLM 0.32.0"), as the engine version check says: a report
    names one version. The checks, the layout sweep's labels and the served JSON; nothing where no server was asked
    or the two are one release."""
    say = judged_release(engine, report.engine_release)
    if say is None:
        return
    report.checks = [dataclasses.replace(c, summary=say(c.summary), evidence=[say(e) for e in c.evidence],
                                         fix=c.fix and say(c.fix)) for c in report.checks]
    report.layouts = [dataclasses.replace(r, labels=[say(label) for label in r.labels]) for r in report.layouts]
    report.served = _said(report.served, say)


def judged_release(engine: str, release: str | None):
    """A line with ``engine``'s name and the release eaglewire read it from ("vllm 0.33.0") -> the line with the
    version of ``release`` instead ("vllm 0.32.0"); None where ``release`` is none or that same release."""
    spec = engines.get(engine)
    judged = release.split()[-1] if release else None
    if not spec.version or not judged or judged == spec.version:
        return None
    said = {spec.name, spec.linter.label, spec.runtime.label if spec.runtime else None} - {None}  # "vllm", "vLLM"
    names = "|".join(map(re.escape, said))
    read = re.compile(rf"\b({names}) {re.escape(spec.version)}(?![\w+]|\.\d)", re.IGNORECASE)  # not 0.33.0.1
    return lambda line: read.sub(lambda m: f"{m[1]} {judged}", line)


def _said(value, say):
    """``value`` (JSON: dicts, lists, strings) with ``say`` applied to every string in it."""
    if isinstance(value, str):
        return say(value)
    if isinstance(value, dict):
        return {say(k) if isinstance(k, str) else k: _said(v, say) for k, v in value.items()}
    if isinstance(value, list):
        return [_said(v, say) for v in value]
    return value


def check_engine_fields(report: DoctorReport, m: Measured) -> None:
    """Every field the serving engine reads from ``--engine-config`` that changes what the draft
    computes, against training; a field read otherwise is a FAIL with the key to write, and the draft
    rebuilt as the engine builds it is measured on the same tokens (acc@0 as served)."""
    from eaglewire import engines
    from eaglewire.doctor.engine_reading import field_readers, read_fields, read_file_fields
    from eaglewire.engines import canonical
    from eaglewire.engines.serving.served_draft import as_served

    if not m.engine_config or is_block_draft(m.draft):
        return  # the engines' field readings are EAGLE-3's (a DFlash draft's wiring: the engine wiring check)
    path = Path(m.engine_config)
    b = m.batches[0]
    real = b.loss_mask.new_ones(b.input_ids.shape, dtype=bool)  # [B, T]
    rows = (b.input_ids[real].cpu(), b.emb[real].cpu())  # [N], [N, H]
    if engines.file_readers(path.suffix):  # the file says what reads it (a .gguf: llama.cpp's loader)
        reading = read_file_fields(path, m.draft, emb_rows=rows)
    elif m.engine in field_readers():
        reading = read_fields(canonical(m.engine), read_json_object(path, ENGINE_CONFIG_FIX), path.parent,
                              m.draft, emb_rows=rows)
    else:
        return
    served = reading.served
    evidence = [f"{k}: {v}" for k, v in served.cited.items()] + reading.notes
    if not reading.found:
        report.add(Check("engine fields", "ok", f"{served.engine} computes the draft as trained: norm flags "
                         f"{', '.join(f'{k} {v}' for k, v in served.norms.items())}; eps {served.rms_norm_eps}; "
                         f"rope_theta {served.rope_theta:g}; {served.draft_vocab_size} draft ids mapped by d2t "
                         f"({served.d2t}); the {served.embedding}'s embedding, the {served.lm_head}'s lm_head", evidence))
        return
    lines = [f"{f.field}: {served.engine} reads {f.served!r}, trained {f.trained!r}: {f.meaning}" for f in reading.found]
    measurable = [f for f in reading.found if f.measurable]
    if measurable and len(measurable) == len(reading.found):
        built = as_served(m.draft, measurable, d2t=reading.d2t, norm_weights=reading.norm_weights,
                          lm_head=reading.lm_head)
        batches = m.batches if reading.embedding is None else [served_embedding(x, reading.embedding) for x in m.batches]
        acc = isolation_accuracy(built, batches, m.declared, steps=1)[0].acc
        report.accuracy["acc@0 as served"] = acc
        lines.append(f"the draft as {served.engine} builds it from this config: acc@0 {acc:.3f} on the same "
                     f"{m.n:,} tokens (as trained: {m.acc0:.3f})")
    else:
        lines.append(f"not measured: {', '.join(f.field for f in reading.found if not f.measurable)} "
                     f"make {served.engine} load another draft (or none)")
    report.add(Check("engine fields", "fail", f"{served.engine} reads {', '.join(f.field for f in reading.found)} "
                     "otherwise than the draft was trained", lines + evidence,
                     fix="; ".join(dict.fromkeys(f.fix for f in reading.found))))
