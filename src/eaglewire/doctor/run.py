"""``eaglewire doctor``: the standalone wiring test. Loads the draft, the target and held-out
sequences, captures them once at every candidate boundary, and runs the checks."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch

from eaglewire.checkpoint import load_draft
from eaglewire.contract import SOFT_FIELDS, HiddenStateContract
from eaglewire.doctor.config import DoctorConfig
from eaglewire.doctor.evidence import USEFUL_ACC0, judge_sweep, predicts_nothing, wilson_bounds
from eaglewire.doctor.layouts import candidate_layouts
from eaglewire.doctor.measure import (Sequence, capture_batches, capture_drift, coverage, isolation_accuracy,
                                      engine_agreement, stored_accuracy)
from eaglewire.doctor.replay import RoundAgreement
from eaglewire.doctor.report import Check, DoctorReport, LayoutRow
from eaglewire.doctor.serving import config_fix, lint_flags, predicted_tau, read_engine_config
from eaglewire.foreign_draft import detect_draft_format, load_any_draft
from eaglewire.presets import resolve_draft
from eaglewire.target import Target, load_target

log = logging.getLogger(__name__)


def run_doctor(config: DoctorConfig, *, target: Target | None = None) -> DoctorReport:
    if config.stored:  # the target is never run: doctor/stored.py
        from eaglewire.doctor.stored import run_stored_doctor

        return run_stored_doctor(config)
    start = time.perf_counter()
    target = target or load_target(config.target)
    report = DoctorReport(draft=config.draft, target=config.target)
    if detect_draft_format(resolve_draft(config.draft)) == "native":
        draft, contract, draft_cfg = load_draft(config.draft)  # checked below, as a verdict, not an exception
    else:  # a foreign draft records no target: it is converted for this one, its reading stated
        draft, contract, draft_cfg, notes = load_any_draft(config.draft, target=target)
        report.add(Check("draft format", "warn" if len(notes) > 1 else "ok", notes[0], notes[1:]))
    draft = draft.to(target.device)
    summary = draft_cfg.get("training") or {}
    declared = list(contract.aux_boundaries)
    L = target.num_layers

    identity_ok = _check_identity(report, contract, target)
    arch = config.target_arch or contract.target.architecture
    if config.engine == "llamacpp":
        from eaglewire.doctor import llamacpp

        serving, serving_steps = llamacpp.serving(report, config, declared, L, arch)
    else:
        serving, serving_steps = _serving(report, config, declared, L, arch)
    sequences, source = _load_sequences(config, target, contract, summary, report)
    if not sequences:
        report.add(Check("data", "fail", "no held-out sequence with reply tokens to measure on",
                         fix="pass --data SHARDS or --conversations FILE with assistant replies"))
        return report
    if not identity_ok:
        return report  # the wrong target: every measurement below would be noise
    layouts = candidate_layouts(declared, L, serving)
    needed = sorted({b for layout in layouts for b in layout})
    batches = capture_batches(target, draft, sequences, needed)

    inside, counted = coverage(batches)
    share = inside / max(counted, 1)
    report.add(Check("vocab coverage", "ok" if share >= 0.85 else "warn",
                     f"{share:.1%} of the target's next tokens on replies are in the draft vocabulary "
                     f"({draft.config.draft_vocab_size:,} of {draft.config.vocab_size:,})",
                     fix=None if share >= 0.85 else "retrain with a larger --draft-vocab-size"))

    counts = isolation_accuracy(draft, batches, declared, steps=config.steps)
    acc0, cond = counts[0].acc, [c.cond_acc for c in counts[1:]]
    report.accuracy = {"acc@0": acc0} | {f"cond acc@{j}": c for j, c in enumerate(cond, 1)}
    _check_evidence(report, counts[0].valid, len(sequences), config, summary)
    _check_accuracy(report, counts, summary, source)
    _check_layouts(report, draft, batches, layouts, declared, serving, acc0, counts[0].valid, config, L)
    _check_drift(report, draft, batches, declared, L, config.steps, acc0)
    _check_alignment(report, draft, batches, declared, acc0, counts[0].valid)
    rounds = _check_acceptance(report, config, target, draft, contract, sequences, acc0, cond, serving_steps)
    if config.engine_url:
        from eaglewire.doctor import llamacpp

        served = llamacpp.measure_served(config.engine_url, [s.prompt_ids for s in sequences[:max(config.engine_prompts, 1)]],
                                         max_new_tokens=config.engine_tokens, num_steps=serving_steps)
        report.add(llamacpp.served_check(served, rounds.measured_tau if rounds and rounds.rounds else None,
                                         predicted_tau(acc0, cond, serving_steps), serving_steps))

    report.facts = {"held-out sequences": len(sequences), "judged tokens": counts[0].valid,
                    "source": source, "seconds": round(time.perf_counter() - start, 1)}
    if config.json:
        Path(config.json).parent.mkdir(parents=True, exist_ok=True)
        Path(config.json).write_text(json.dumps(report.to_dict(), indent=1))
    return report


# ------------------------------------------------------------------ checks

def _check_identity(report: DoctorReport, contract: HiddenStateContract, target: Target) -> bool:
    diff = contract.target.differences(target.fingerprint)
    hard = {k: v for k, v in diff.items() if k not in SOFT_FIELDS}
    fp = target.fingerprint
    facts = (f"{fp.architecture}, {fp.num_layers} layers, hidden {fp.hidden_size}, vocab {fp.vocab_size:,}; "
             "tokenizer, chat template and weights by hash")
    if hard:
        report.add(Check("identity", "fail", "the draft was trained for another target",
                         [f"{k}: draft {a!r}, target {b!r}" for k, (a, b) in hard.items()],
                         fix="serve the draft with the target it was trained on, or retrain it on this target"))
        return False
    soft = [f"{k}: draft {a!r}, target {b!r} (the drift check measures what this costs)" for k, (a, b) in diff.items()]
    report.add(Check("identity", "warn" if soft else "ok", "the draft's contract matches the target" +
                     (" except its precision" if soft else ""), soft or [facts]))
    return True


def _serving(report: DoctorReport, config: DoctorConfig, declared: list[int], L: int, arch: str
             ) -> tuple[dict[str, list[int]], int]:
    """Serving flags lint; (the boundaries the serving engine will capture, label -> layout;
    the chain length it drafts, SGLang's default 5 when the flags do not say)."""
    steps = 5
    if config.engine_flags:
        flags = lint_flags(config.engine, config.engine_flags, declared, L, arch)
        worst = "fail" if any(v == "fail" for v, _, _ in flags.problems) else (
            "warn" if flags.problems else "ok")
        report.add(Check("serving flags", worst,
                         f"{config.engine} flags: " + ("nothing silently changed" if not flags.problems
                                                        else f"{len(flags.problems)} problem(s)"),
                         [what for _, what, _ in flags.problems], fix="; ".join(f for _, _, f in flags.problems) or None))
        steps = flags.num_steps or steps
    if config.engine == "eaglewire" and not config.engine_config:
        return {"eaglewire": list(declared)}, steps
    if not config.engine_config:
        report.add(Check("engine config", "warn", f"no --engine-config: cannot tell which boundaries "
                         f"{config.engine} will capture", fix="pass the config.json the engine will load"))
        return {}, steps
    cfg = json.loads(Path(config.engine_config).read_text())
    reading = read_engine_config(config.engine, cfg, L, declared, arch)
    wrong = {label: b for label, b in reading.readings.items() if b != declared}
    evidence = ([f"{label} captures boundaries {b}" for label, b in reading.readings.items()] + reading.notes
                + reading.problems)
    if wrong or reading.problems:
        report.add(Check("engine wiring", "fail",
                         f"{config.engine} will feed the draft boundaries other than the {declared} it was trained on",
                         evidence, fix=config_fix(config.engine, declared, L, arch)))
    else:
        report.add(Check("engine wiring", "ok", f"{config.engine} captures {declared}, as trained", evidence))
    return reading.readings, steps


def _check_evidence(report: DoctorReport, n: int, sequences: int, config: DoctorConfig, summary: dict) -> None:
    """Judged tokens against the minimum; below it nothing can pass, and the fix says where more come from."""
    what = f"{n:,} judged reply tokens on {sequences} held-out sequence(s) (minimum {config.min_tokens:,})"
    if n >= config.min_tokens:
        report.add(Check("evidence", "ok", what))
        return
    per = max(n / max(sequences, 1), 1.0)
    need = math.ceil(config.min_tokens / per)
    if sequences < config.num_sequences:  # the source ran out, not the flag
        recorded = len(summary.get("heldout_sequence_ids") or [])
        fix = (f"only {sequences} held-out sequence(s) were found" +
               (f" (the draft recorded {recorded} held out)" if recorded and not config.include_training else "") +
               f"; about {need} are needed: pass --conversations FILE with conversations training did not see "
               "(--offset skips the first ones) or --data SHARDS not used in training; or --include-training "
               "to also measure on training sequences (it reads optimistic)")
    else:
        fix = f"raise --num-sequences from {config.num_sequences} to about {need}, or --max-length (now {config.max_length})"
    report.add(Check("evidence", "inconclusive", f"too little evidence to pass: {what}",
                     [f"~{per:.0f} judged tokens per sequence; with {n:,} tokens an accuracy is known to about "
                      f"±{2 * math.sqrt(0.25 / max(n, 1)):.3f}"], fix=fix))


def _check_accuracy(report: DoctorReport, counts, summary: dict, source: str) -> None:
    acc0, n = counts[0].acc, counts[0].valid
    evidence = [f"acc@0 {acc0:.3f}" + "".join(f", cond acc@{j} {c.cond_acc:.3f}" for j, c in enumerate(counts[1:], 1))
                + f" over {n:,} judged reply tokens"]
    if predicts_nothing(acc0, n):
        high = wilson_bounds(acc0, n)[1]
        report.add(Check("accuracy in isolation", "fail", f"the draft predicts nothing: acc@0 {acc0:.3f} "
                         f"({source})", evidence + [f"at most {high:.3f} at ~95% confidence, under the "
                                                   f"{USEFUL_ACC0} a draft needs to accept anything"],
                         fix="a draft this weak cannot speed decoding, nor can its wiring be checked: train it "
                         "longer or on more data, and check it was trained on this target's states"))
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


def _check_layouts(report, draft, batches, layouts, declared, serving, acc0, n, config, L) -> None:
    rows = []
    for layout, labels in layouts.items():
        acc = acc0 if list(layout) == declared else isolation_accuracy(draft, batches, list(layout), steps=1)[0].acc
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
                         judged.evidence + lines, fix=config_fix(config.engine, declared, L)))
        return
    report.add(Check("layout sweep", "ok", judged.summary, judged.evidence))


def _check_drift(report, draft, batches, declared, L, steps, acc0) -> None:
    drift = capture_drift(batches, declared, L)
    if not drift:
        report.add(Check("capture drift", "skip", "needs the shards the draft was trained on (--data)"))
        return
    worst = min(d.cosine for d in drift)
    evidence = [f"boundary {d.boundary}: cosine {d.cosine:.5f}, relative error {d.relative_error:.2e}" for d in drift]
    stored = stored_accuracy(draft, batches, steps=1)[0].acc
    evidence.append(f"acc@0 on the stored states {stored:.3f}, on states captured now {acc0:.3f}")
    if worst >= 0.999:
        report.add(Check("capture drift", "ok", "states captured now match those stored at training time", evidence))
    else:
        verdict = "warn" if worst >= 0.99 else "fail"
        report.add(Check("capture drift", verdict, f"states captured now differ from training time "
                         f"(lowest cosine {worst:.4f})", evidence,
                         fix="serve the target in the precision and quantization the data was captured with, "
                         "with the same norm placement (pre-norm states), or re-capture and retrain"))


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


def _check_alignment(report, draft, batches, declared, acc0, n) -> None:
    shifted = {s: isolation_accuracy(draft, batches, declared, steps=1, shift=s)[0].acc for s in (-1, 1)}
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


# Rounds may disagree where the engine's batched verify and the doctor's capture round a
# near-tie differently (a top-2 logit gap of ~1e-5 in fp32); a wiring fault disagrees far more.
MIN_ROUND_AGREEMENT = 0.9


def _check_acceptance(report, config, target, draft, contract, sequences, acc0, cond, steps: int) -> RoundAgreement | None:
    """The engine's greedy chain on held-out prompts, round by round against the replay of the
    training-time unroll on the text it produced (``replay.py``): they must accept the same."""
    from eaglewire.tokens import stop_token_ids
    from eaglewire.decode.engine import SpecConfig, SpecDecoder

    predicted = predicted_tau(acc0, cond, steps)
    if config.engine_prompts < 1:
        report.add(Check("acceptance", "skip", f"predicted τ {predicted:.2f} for a chain of {steps}; "
                         "measurement skipped (--engine-prompts 0)"))
        return None
    decoder = SpecDecoder(target, draft, contract, SpecConfig.chain(steps))
    stop = set(stop_token_ids(target.tokenizer, target.model))
    rounds, prompts = RoundAgreement(), sequences[:config.engine_prompts]
    for seq in prompts:
        rounds.add(engine_agreement(decoder, draft, list(contract.aux_boundaries), seq.prompt_ids,
                                    max_new_tokens=config.engine_tokens, stop_token_ids=stop))
    measured = rounds.measured_tau
    evidence = [f"measured by eaglewire's engine on {len(prompts)} held-out prompts ({rounds.rounds} rounds, "
                f"{rounds.measured_tokens} tokens): τ {measured:.2f} (chain of {steps})",
                f"replayed from the training-time unroll on the engine's own text: τ {rounds.replayed_tau:.2f}; "
                f"{rounds.agree} of {rounds.rounds} rounds accept the same tokens",
                f"from acc@0 and cond acc averaged over all positions: τ {predicted:.2f} (rounds start after "
                "a rejected token, where drafts are weaker, so this reads high)"]
    if rounds.rounds == 0:
        report.add(Check("acceptance", "skip", "no round to compare (raise --engine-tokens)", evidence))
    elif rounds.measured_tokens == rounds.replayed_tokens == rounds.rounds:
        report.add(Check("acceptance", "inconclusive", f"no draft token was accepted in {rounds.rounds} rounds, nor "
                         "would training accept one: their agreement says nothing", evidence,
                         fix="a draft that accepts nothing cannot show a decoding fault: train it further"))
    elif rounds.share < MIN_ROUND_AGREEMENT:
        report.add(Check("acceptance", "fail", f"the engine accepts other tokens than training predicts in "
                         f"{rounds.rounds - rounds.agree} of {rounds.rounds} rounds", evidence,
                         fix="the draft is fine in isolation: look at the decoding path (positions, KV cache, "
                         "tree masks, the states fed back after acceptance)"))
    else:
        report.add(Check("acceptance", "ok", f"measured τ {measured:.2f}; the engine accepts what training "
                     f"predicts in {rounds.agree} of {rounds.rounds} rounds", evidence))
    return rounds


# ------------------------------------------------------------------ data

def _load_sequences(config: DoctorConfig, target: Target, contract: HiddenStateContract, summary: dict,
                    report: DoctorReport) -> tuple[list[Sequence], str]:
    heldout = [] if config.include_training else list(summary.get("heldout_sequence_ids") or [])
    data, conversations = config.data, config.conversations
    if not data and not conversations:
        trained_on = summary.get("data")
        if trained_on and (Path(trained_on) / "manifest.json").exists():
            data = trained_on
        else:
            conversations = trained_on if trained_on and not Path(trained_on).is_dir() else "sharegpt"
    if data:
        trained_on = summary.get("data")
        unseen = bool(trained_on) and Path(trained_on).resolve() != Path(data).resolve()
        return _from_shards(data, contract, heldout, config, report, unseen), f"shards {data}"
    return _from_conversations(conversations, target, heldout, config), f"conversations {conversations}"


def _from_shards(data: str, contract: HiddenStateContract, heldout: list[str], config: DoctorConfig,
                 report: DoctorReport, unseen: bool) -> list[Sequence]:
    """Held-out sequences: those the draft recorded as held out, or every sequence of shards
    other than the training data (``unseen``)."""
    from eaglewire.data.shards import ShardDataset

    ds = ShardDataset(data)
    same = list(ds.contract.aux_boundaries) == list(contract.aux_boundaries)
    if not same:
        report.add(Check("data", "warn", f"the shards hold boundaries {list(ds.contract.aux_boundaries)}, the draft "
                         f"declares {list(contract.aux_boundaries)}", fix="measure on the shards the draft was "
                         "trained on to enable the capture drift check"))
    index = {sid: i for i, sid in enumerate(ds.sequence_ids)}
    picked = [index[s] for s in heldout if s in index][:config.num_sequences]
    if not picked:
        picked = list(range(max(0, len(ds) - config.num_sequences), len(ds)))
        if not (config.include_training or unseen):
            report.add(Check("data", "warn", "the draft records no held-out sequences from these shards: "
                             "measuring on the last ones, which training may have seen"))
    out = []
    for i in picked:
        item = ds[i]
        n = config.max_length
        out.append(Sequence(ds.sequence_ids[i], item["input_ids"][:n].long(), item["loss_mask"][:n].bool(),
                            item["aux_hidden"][:n] if same else None, item["last_hidden"][:n] if same else None))
    return [s for s in out if bool(s.loss_mask[2:].any())]


def _from_conversations(name: str, target: Target, heldout: list[str], config: DoctorConfig) -> list[Sequence]:
    from eaglewire.data.conversations import load_conversations, tokenize_conversation
    from eaglewire.data.prepare import resolve_data

    convs, _ = load_conversations(resolve_data(name))
    wanted = set(heldout)
    chosen = [c for c in convs if c.id in wanted] or convs[config.offset:]
    out = []
    for conv in chosen:
        seq = tokenize_conversation(conv, target.tokenizer, max_length=config.max_length)
        if sum(seq.loss_mask[2:]):
            out.append(Sequence(seq.id, torch.tensor(seq.input_ids), torch.tensor(seq.loss_mask, dtype=torch.bool)))
        if len(out) >= config.num_sequences:
            break
    return out
