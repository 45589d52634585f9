"""``eaglewire doctor --stored``: the wiring test from stored states, the target never run.

At a 1T-parameter target's scale the target cannot be loaded here, but its captured states can:
shards (``prepare`` or ``import-data``) holding every stored boundary. The draft is fed those
states exactly as in training; the target's signal comes from its head applied to the stored
boundary-L state (``--labels head``: only the embedding, final norm and lm_head are read, see
``target_head.py``; shards stored with top-K labels give their top-1 instead) or from the stored
next tokens (``--labels tokens``). Every ordered choice
of k stored boundaries is a candidate layout, so a draft trained on the first three of four
stored states and served the last three is named as such, with both fixes. Checks that need
the target to run (measured acceptance, capture drift against a fresh capture, which boundary
each stored state is) are skipped, and the report says why and how to run them.

``check_stored_boundaries`` (run by the full doctor on ``--data``, where the target runs) matches each
stored state against every boundary of a fresh capture of a few stored sequences (``boundary_match.py``):
shards imported one layer off (SpecForge's layer-output ids taken as boundaries) are named, with the
re-import line that fixes them.

Shapes: B batch, T tokens, H hidden, k aux boundaries, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import shlex
import logging
import time
from pathlib import Path

import torch

from eaglewire.core.configs import config_record
from eaglewire.core.contract import SOFT_FIELDS, HiddenStateContract
from eaglewire.data.prepare import batches_by_tokens
from eaglewire.data import boundary_match
from eaglewire.data.import_data import ABSENT_LAST, import_command, reimport_command, ImportDataConfig
from eaglewire.data.label_check import POST_NORM, check_labels, reimport_fix, stored_last_state
from eaglewire.data.shards import ShardDataset
from eaglewire.data.sources import pad_right
from eaglewire.doctor.checks import (LaunchSettings, Measured, check_accuracy, check_alignment, check_evidence,
                                     check_layouts, check_serving, serving_fix)
from eaglewire.doctor.doctor_config import DoctorConfig
from eaglewire.doctor.measure import Drift, EvalBatch, Sequence, block_parts, coverage, isolation_accuracy
from eaglewire.doctor.verdicts import Check, DoctorReport
from eaglewire.doctor.template_switch import check_template_switch
from eaglewire.engines.formats.foreign_draft import load_any_draft
from eaglewire.model.dflash_blocks import is_block_draft
from eaglewire.model.target import Target
from eaglewire.core.device import resolve_device
from eaglewire.model.target_head import load_target_head
from eaglewire.model.ttt import TargetSignal, signal_positions, target_signal, topk_signal

log = logging.getLogger(__name__)

LABELS = ("head", "tokens")
MAX_LAYOUTS = 720  # ordered choices measured; beyond it only the declared and serving ones


def token_signal(input_ids: torch.Tensor, needed: torch.Tensor, draft_ids: torch.Tensor,
                 t2d: torch.Tensor) -> TargetSignal:
    """The stored next token as the target's (one-hot) signal: index q judges x_{q+1}.

    input_ids / needed [B, T]; draft_ids [Vd] target id of each draft id; t2d [V] bool.
    """
    B, T = input_ids.shape
    argmax = torch.zeros_like(input_ids)
    argmax[:, :-1] = input_ids[:, 1:]  # [B, T]
    to_draft = torch.cumsum(t2d.long(), 0) - 1  # [V] draft id of a target id (where t2d)
    in_vocab = t2d[argmax] & needed  # [B, T]
    probs = torch.zeros(B, T, len(draft_ids), device=input_ids.device)  # [B, T, Vd]
    probs[in_vocab, to_draft[argmax[in_vocab]]] = 1.0
    return TargetSignal(probs=probs, argmax=argmax, in_vocab=in_vocab)


def stored_batches(ds: ShardDataset, indices: list[int], target: Target, draft, *, labels: str,
                   max_length: int, batch_tokens: int = 2048) -> list[EvalBatch]:
    """EvalBatches whose states are the stored ones: boundary b -> [B, T, H] for every stored b
    (boundary L too when the shards store the last state; top-K shards give their top-K as the
    signal of ``labels`` head)."""
    H, bounds, L = ds.contract.target.hidden_size, list(ds.contract.aux_boundaries), ds.contract.num_layers
    seqs, topk = [], {}
    for i in indices:
        item = ds[i]
        last = item["last_hidden"][:max_length] if "last_hidden" in item else None
        seqs.append(Sequence(ds.sequence_ids[i], item["input_ids"][:max_length], item["loss_mask"][:max_length],
                             item["aux_hidden"][:max_length], last))
        if "topk_ids" in item:
            topk[ds.sequence_ids[i]] = (item["topk_logprobs"][:max_length], item["topk_ids"][:max_length])
    out = []
    for batch in batches_by_tokens(seqs, batch_tokens):
        T = max(len(s.input_ids) for s in batch)

        def padded(rows: list[torch.Tensor]) -> torch.Tensor:
            return pad_right(rows, T).to(target.device)  # [B, T, ...] where the head and the draft compute

        ids, mask = padded([s.input_ids for s in batch]), padded([s.loss_mask for s in batch])  # [B, T]
        aux = padded([s.stored_aux.float() for s in batch])  # [B, T, k*H]
        states = dict(zip(bounds, aux.split(H, dim=-1)))  # boundary -> [B, T, H]
        last = None
        if batch[0].stored_last is not None:
            last = states[L] = padded([s.stored_last.float() for s in batch])  # [B, T, H]
        needed = signal_positions(mask)
        with torch.no_grad():
            emb = target.embed_tokens(ids).float()  # [B, T, H]
            if labels == "tokens":
                signal = token_signal(ids, needed, draft.draft_to_target, draft.t2d)
            elif last is None:  # the stored top-K: acc@0 against its top-1
                lp = padded([topk[s.id][0] for s in batch])  # [B, T, K]
                top = padded([topk[s.id][1] for s in batch])  # [B, T, K]
                signal = topk_signal(lp, top, draft.draft_to_target, draft.t2d, needed)
            else:
                signal = target_signal(target.head, last.to(target.dtype), draft.draft_to_target, draft.t2d, needed)
        out.append(EvalBatch(input_ids=ids, loss_mask=mask, states=states, emb=emb, signal=signal,
                             stored_aux=aux, stored_last=last, lengths=[len(s.input_ids) for s in batch],
                             **block_parts(target, draft)))
    return out


def stored_layouts(stored: list[int], k: int, declared: list[int], serving: dict[str, list[int]]
                   ) -> dict[tuple[int, ...], list[str]]:
    """Candidate layout -> why: every ordered choice of k stored boundaries (capped), the
    declared one and each serving reading whose boundaries are stored."""
    out: dict[tuple[int, ...], list[str]] = {}
    for layout in itertools.islice(itertools.permutations(stored, k), MAX_LAYOUTS):
        out[layout] = ["stored"]
    for label, layout in [("declared", declared), *serving.items()]:
        if set(layout) <= set(stored) and len(layout) == k:
            out.setdefault(tuple(layout), []).insert(0, label)
    return out


def _state(item: dict, contract, boundary: int) -> torch.Tensor:
    """One stored boundary of a sequence, [T, H] (L is the stored last state)."""
    if boundary == contract.num_layers and boundary not in contract.aux_boundaries:
        return item["last_hidden"].float()
    H, i = contract.target.hidden_size, list(contract.aux_boundaries).index(boundary)
    return item["aux_hidden"][:, i * H:(i + 1) * H].float()  # [T, H]


@torch.no_grad()
def stored_drift(a: ShardDataset, b: ShardDataset, seq_ids: list[str]) -> tuple[list[Drift], int]:
    """Per boundary both captures hold: cosine and relative error of ``b``'s states against
    ``a``'s over the sequences both hold with the same tokens; (drifts, sequences compared)."""
    L = a.contract.num_layers
    both_last = a.labels_mode == b.labels_mode == "hidden"  # top-K shards keep no last state
    common = [x for x in a.contract.aux_boundaries if x in b.contract.aux_boundaries] + ([L] if both_last else [])
    index_b = {sid: i for i, sid in enumerate(b.sequence_ids)}
    index_a = {sid: i for i, sid in enumerate(a.sequence_ids)}
    sums = {x: [0.0, 0, 0.0, 0.0] for x in common}  # cosine sum, tokens, |diff|^2, |ref|^2
    compared = 0
    for sid in seq_ids:
        if sid not in index_b:
            continue
        ia, ib = a[index_a[sid]], b[index_b[sid]]
        if not torch.equal(ia["input_ids"], ib["input_ids"]):
            continue
        compared += 1
        for x in common:
            ref, other = _state(ia, a.contract, x), _state(ib, b.contract, x)  # [T, H]
            s = sums[x]
            s[0] += float(torch.nn.functional.cosine_similarity(ref, other, dim=-1).sum())
            s[1] += ref.shape[0]
            s[2] += float((other - ref).pow(2).sum())
            s[3] += float(ref.pow(2).sum())
    drifts = [Drift(x, c / max(n, 1), (d / max(r, 1e-30)) ** 0.5) for x, (c, n, d, r) in sums.items()]
    return drifts, compared


def _check_stored_drift(report: DoctorReport, config: DoctorConfig, m: Measured, ds: ShardDataset, picked: list[int],
                        target: Target) -> None:
    """``ds`` against a second capture of its ``picked`` sequences (``--compare-data``)."""
    draft, declared = m.draft, m.declared
    other = ShardDataset(config.compare_data, verify=False)
    drifts, compared = stored_drift(ds, other, [ds.sequence_ids[i] for i in picked])
    if not compared:
        report.add(Check("capture drift", "skip", f"{config.compare_data} holds none of the measured sequences "
                         "with the same tokens", fix="capture the same sequences in both set-ups"))
        return
    evidence = [f"boundary {d.boundary}: cosine {d.cosine:.5f}, relative error {d.relative_error:.2e}" for d in drifts]
    if set(declared) <= set(other.contract.aux_boundaries) | {other.contract.num_layers}:
        index = {sid: i for i, sid in enumerate(other.sequence_ids)}
        mine = [index[ds.sequence_ids[i]] for i in picked if ds.sequence_ids[i] in index]
        batches = stored_batches(other, mine, target, draft, labels=config.labels, max_length=config.max_length)
        acc = isolation_accuracy(draft, batches, declared, steps=1)[0].acc
        evidence.append(f"acc@0 on {config.compare_data}: {acc:.3f} ({config.data}: {m.acc0:.3f})")
    worst = min(d.cosine for d in drifts)
    what = f"{compared} sequences captured twice ({config.data} vs {config.compare_data})"
    if worst >= 0.999:
        report.add(Check("capture drift", "ok", f"the two captures agree on {what}", evidence))
    else:
        report.add(Check("capture drift", "warn" if worst >= 0.99 else "fail",
                         f"the two captures differ (lowest cosine {worst:.4f}) on {what}", evidence,
                         fix="capture in the precision, quantization and norm placement the draft was trained on, "
                             "or retrain on states captured the way they will be served"))


def _pick(ds: ShardDataset, summary: dict, config: DoctorConfig) -> tuple[list[int], str | None]:
    """Held-out sequences when the draft recorded them and the data hold them, else the last ones."""
    index = {sid: i for i, sid in enumerate(ds.sequence_ids)}
    heldout = [] if config.include_training else list(summary.get("heldout_sequence_ids") or [])
    picked = [index[s] for s in heldout if s in index][:config.num_sequences]
    if picked:
        return picked, None
    n = min(config.num_sequences, len(ds))
    return list(range(len(ds) - n, len(ds))), (
        None if config.include_training else "the draft records no held-out sequence of these shards: measuring "
        "on the last ones, which training may have seen")


def run_stored_doctor(config: DoctorConfig) -> DoctorReport:
    """The doctor on stored states (``config.data``) with the target's head only."""
    start = time.perf_counter()
    if config.labels not in LABELS:
        raise ValueError(f"--labels {config.labels!r} is not one of {', '.join(LABELS)}")
    if not config.data:
        raise ValueError("--stored measures on stored states: pass --data SHARDS (from `eaglewire prepare` or "
                         "`eaglewire import-data`, holding every stored boundary)")
    report = DoctorReport(draft=config.draft, target=config.target, resolved_config=config_record(config))
    target = load_target_head(config.target, device=resolve_device(config.device))
    ds = ShardDataset(config.data, verify=False)
    if config.labels == "head" and ds.manifest["source"].get("last_hidden") == ABSENT_LAST:
        raise ValueError(f"--data {config.data} holds no boundary-L state (imported with --no-last): the head has "
                         "nothing to read; pass --labels tokens")
    allow = set(config.allow_target_mismatch or ())
    draft, contract, draft_cfg, notes = load_any_draft(config.draft, target=target, check_native=False, allow=allow)
    draft = draft.to(target.device)  # beside the head that makes its signal
    if notes:
        report.add(Check("draft format", "warn" if len(notes) > 1 else "ok", notes[0], notes[1:]))
    summary = draft_cfg.get("training") or {}
    declared, stored, L = list(contract.aux_boundaries), list(ds.contract.aux_boundaries), ds.contract.num_layers
    if not _identity(report, contract, ds, target, allow):
        return report
    _check_labels(report, config, ds, target, summary)
    arch = config.target_arch or contract.target.architecture
    rows = draft.draft_to_target
    serving, _, launch = check_serving(report, config.settings(LaunchSettings), declared, L, arch,
                                       draft.config.block_size if is_block_draft(draft) else None,
                                       vocab_ids=rows.cpu() if len(rows) < target.vocab_size else None)
    check_template_switch(report, contract, getattr(target, "tokenizer", None), engine=config.engine,
                          engine_flags=config.engine_flags, chat_template_kwargs=config.chat_template_kwargs)
    picked, warning = _pick(ds, summary, config)
    if warning:
        report.add(Check("data", "warn", warning))
    batches = stored_batches(ds, picked, target, draft, labels=config.labels, max_length=config.max_length)
    inside, counted = coverage(batches)
    if config.labels == "tokens":
        report.add(Check("labels", "ok", "judged against the stored next tokens (no lm_head used)"))
    elif ds.labels_mode == "topk":
        report.add(Check("labels", "ok", f"judged against the top-1 of the stored target labels ({ds.storage.labels}; "
                         "no lm_head used)"))
    if missing := [b for b in declared if b not in stored + ([L] if ds.labels_mode == "hidden" else [])]:
        report.add(Check("accuracy in isolation", "fail", f"the draft reads boundaries {declared}; {missing} "
                         f"are not among the stored {stored}", fix=_missing_fix(config, ds, declared)))
        return report
    m = Measured(engine=launch.engine, engine_config=launch.engine_config, draft=draft, batches=batches,
                 declared=declared, num_layers=L, serving=serving,
                 counts=isolation_accuracy(draft, batches, declared, steps=config.steps))
    report.accuracy = {"acc@0": m.acc0} | {f"cond acc@{j}": c for j, c in enumerate(m.cond, 1)}
    check_evidence(report, m.n, len(picked), summary, min_tokens=config.min_tokens,
                   num_sequences=config.num_sequences, max_length=config.max_length,
                   include_training=config.include_training)
    check_accuracy(report, m, summary, f"stored states in {config.data}")
    check_layouts(report, m, stored_layouts(stored + [b for b in declared if b == L], len(declared), declared, serving))
    _check_served(report, m, stored, arch)
    check_alignment(report, m)
    if config.compare_data:
        _check_stored_drift(report, config, m, ds, picked, target)
    report.add(Check("stored boundaries", "skip", "which boundary each stored state is: needs the target to run "
                     "(--stored never runs it)", fix=f"`{_full_doctor(config)}` (not --stored) matches each stored "
                     "state against every boundary of the target run on a few stored sequences"))
    skipped = "measured acceptance" + ("" if config.compare_data else " and capture drift (or pass --compare-data)")
    report.add(Check("skipped", "skip", f"{skipped}: needs the target to run; this run never ran it (--stored)"))
    report.facts = {"held-out sequences": len(picked), "judged tokens": m.n, "source": config.data,
                    "draft vocab coverage": round(inside / max(counted, 1), 4),
                    "seconds": round(time.perf_counter() - start, 1)}
    if config.json:
        Path(config.json).parent.mkdir(parents=True, exist_ok=True)
        Path(config.json).write_text(json.dumps(report.to_dict(), indent=1))
    return report


def _identity(report: DoctorReport, contract: HiddenStateContract, ds: ShardDataset, target: Target,
              allow: set[str] = frozenset()) -> bool:
    """The draft, the stored data and the head must belong to one target (``allow``: fields that may differ)."""
    hard, allowed = [], []
    for what, fp in (("stored data", ds.contract.target), ("--target", target.fingerprint)):
        diff = contract.target.differences(fp)
        hard += [f"{k}: draft {a!r}, {what} {b!r}" for k, (a, b) in diff.items() if k not in SOFT_FIELDS | allow]
        allowed += [f"{k}: draft {a!r}, {what} {b!r} (allowed by --allow-target-mismatch)"
                    for k, (a, b) in diff.items() if k in allow]
    if hard:
        fields = sorted({line.split(":")[0] for line in hard})
        report.add(Check("identity", "fail", "the draft, the stored states and the target are not of one target",
                         hard, fix="pass the target and the data the draft was trained for (if the difference is "
                                   f"deliberate: --allow-target-mismatch {','.join(fields)})"))
        return False
    report.add(Check("identity", "warn" if allowed else "ok",
                     "the draft, the stored states and the head belong to one target" +
                     (" except the allowed fields" if allowed else ""), allowed))
    return True


def _check_served(report: DoctorReport, m: Measured, stored: list[int], arch: str) -> None:
    """Name what the engine feeds against what the draft was trained on, with both fixes
    (``stored``: the boundaries the data hold; ``arch``: the target's architecture as served)."""
    declared = m.declared
    for label, served in m.serving.items():
        if served == declared:
            continue
        measured = (f": acc@0 {isolation_accuracy(m.draft, m.batches, served, steps=1)[0].acc:.3f} there vs "
                    f"{m.acc0:.3f} as trained" if set(served) <= set(m.batches[0].states) else "")
        retrain = (f"retrain on the layout the engine feeds: `eaglewire import-data ... --aux-boundaries "
                   f"{','.join(map(str, served))}`, then `eaglewire train`" if set(served) <= set(stored)
                   else f"retrain on boundaries {served} (capture them)")
        report.add(Check("trained vs served", "fail", f"trained on {declared}, {label} will feed {served}{measured}",
                         [f"stored boundaries: {stored}"],
                         fix=f"either {serving_fix(report, m, arch)}, or {retrain}"))


def _check_labels(report: DoctorReport, config: DoctorConfig, ds: ShardDataset, target: Target, summary: dict
                  ) -> None:
    """The label check (``data/label_check.py``): does the stored last state give the target's predictions?
    A draft trained on these shards learned the head's reading of that state as its labels (``summary``: its
    training record, which says whether it was)."""
    if ds.manifest["source"].get("last_hidden") == ABSENT_LAST:
        report.add(Check("label check", "skip", "the data hold no boundary-L state (imported with --no-last)"))
        return
    if config.skip_label_check:
        report.add(Check("label check", "skip", "not run (--skip-label-check)"))
        return
    check = check_labels(ds, target)
    if check.verdict == "fail":
        source = ds.manifest["source"]
        stored = source.get("stored_boundaries")
        boundaries = f" (imported with --boundaries {','.join(map(str, stored))})" if stored else ""
        side = f", as the {stored_last_state(source)} state" if check.norm_side_wrong else ""
        fix = reimport_fix(check.diagnosis, ds.contract.num_layers)
        report.add(Check("label check", "fail", f"the stored last state{boundaries}{side} does not give the target's "
                         "own predictions: a draft trained on it learned wrong labels", [check.message],
                         fix=f"re-import (eaglewire import-data) {fix}"
                         + after_reimport(summary, config.data, "retrain the draft on the new shards")))
    else:
        report.add(Check("label check", check.verdict, check.message))


# ------------------------------------------------------------------ which boundary each stored state is

def _full_doctor(config: DoctorConfig) -> str:
    """The doctor line that runs the target on these data (the checks --stored skips)."""
    return shlex.join(["eaglewire", "doctor", "--draft", config.draft, "--target", config.target, "--data",
                       str(config.data)])


def _reimported(data: str) -> str:
    path = Path(data)
    return str(path.with_name(path.name + "-reimported"))


def trained_on(summary: dict, data: str) -> bool | None:
    """Whether the draft was trained on the shards at ``data``, by its training record (``summary``, the
    ``training`` section of its config.json): its ``data`` is the directory ``train --data`` read, the one record
    of its training data (no content hash of the shards is kept). None where it records none (a foreign draft)."""
    recorded = summary.get("data")
    return None if not recorded else Path(recorded).resolve() == Path(data).resolve()


def after_reimport(summary: dict, data: str, retrain: str) -> str:
    """What follows a re-import of the misread shards at ``data`` in its fix: ``retrain`` (how to retrain the draft
    on the re-imported shards) only where the draft was trained on these (``trained_on``); a draft trained on other
    data (the shipped reference) learned nothing from them, so re-importing is the whole fix."""
    trained = trained_on(summary, data)
    if trained:
        return f", then {retrain}: it was trained on these shards (its training record names {data})"
    if trained is None:
        return f"; if the draft was trained on these shards (it records no training data), {retrain}"
    return (f"; that is the whole fix: the draft was trained on {summary['data']}, not on these shards, so it needs "
            "no retraining")


def _missing_fix(config: DoctorConfig, ds: ShardDataset, declared: list[int]) -> str:
    """The fix when the draft reads boundaries the data do not hold: a re-import that stores them, where the
    import stored them; where every stored one is one layer off the draft's, the identification that tells."""
    source, stored = ds.manifest["source"], list(ds.contract.aux_boundaries)
    record = source.get("import_config")
    if record and set(declared) <= set(source.get("stored_boundaries") or []):
        known = {f.name for f in dataclasses.fields(ImportDataConfig)}
        imported = ImportDataConfig(**{k: v for k, v in record.items() if k in known})
        line = import_command(imported, out=_reimported(config.data), identify_boundaries="auto",
                              aux_boundaries=[b for b in declared if b != ds.contract.num_layers])
        return f"the import stored them: import the draft's boundaries too: `{line}`"
    shift = {b - a for a, b in zip(stored, declared)} if len(stored) == len(declared) else set()
    if len(shift) == 1 and abs(next(iter(shift))) == 1:
        d = next(iter(shift))
        line = reimport_command(source, {a: a + d for a in stored}, _reimported(config.data))
        guess = (f"; if they are, the import that stores them as {declared} is `{line}`" if line else "")
        return (f"every stored boundary is one layer {'below' if d > 0 else 'above'} the draft's: the states may be "
                f"boundaries {declared} recorded one off (a capture's layer-output ids taken as boundaries, or the "
                f"reverse). Which boundary each stored state is needs the target to run: `{_full_doctor(config)}` "
                f"(not --stored) names them, with the re-import line that fixes it{guess}")
    return (f"measure on data holding boundaries {declared} (the data the draft was trained on), or capture them "
            "(`eaglewire prepare --aux-boundaries`, `eaglewire import-data --boundaries`)")


def stored_samples(ds: ShardDataset, sequences: int = boundary_match.SEQUENCES,
                   max_tokens: int = boundary_match.MAX_TOKENS) -> tuple[list[tuple[list[int], torch.Tensor]],
                                                                          list[int]]:
    """(the first sequences' (token ids, stored states [T, n, H]), the boundary each slot is recorded as): the aux
    states in the contract's order, then the boundary-L state where the shards keep it pre-norm."""
    contract, source = ds.contract, ds.manifest["source"]
    L, H, said = contract.num_layers, contract.target.hidden_size, list(contract.aux_boundaries)
    last = (ds.labels_mode == "hidden" and source.get("last_hidden") != ABSENT_LAST and L not in said
            and stored_last_state(source) != POST_NORM)  # a post-norm one is no boundary: the label check judges it
    out = []
    for i in range(min(sequences, len(ds))):
        item = ds[i]
        T = min(len(item["input_ids"]), max_tokens)
        states = item["aux_hidden"][:T].float().reshape(T, len(said), H)  # [T, k*H] -> [T, k, H]
        if last:
            states = torch.cat([states, item["last_hidden"][:T].float()[:, None]], dim=1)  # [T, k+1, H]
        out.append((item["input_ids"][:T].tolist(), states))
    return out, said + ([L] if last else [])


def check_stored_boundaries(report: DoctorReport, data: str | None, target: Target, summary: dict) -> None:
    """The stored states at ``data`` (``--data``) against every boundary of ``target`` run on a few of their
    sequences: a state that is another boundary than the shards record FAILs, naming it, with the re-import line
    that fixes it (and retraining where the draft was trained on them: ``summary``, its training record, says)."""
    if not data:
        return
    ds = ShardDataset(data, verify=False)
    samples, said = stored_samples(ds)
    if not samples:
        return
    found = boundary_match.identify(target, samples, said)
    where = f"{data} against every boundary of the target run on {found.what()}"
    if found.ok:
        if found.unmatched():
            report.add(Check("stored boundaries", "warn", "some stored states are no boundary of the target run here "
                             "(another precision or quantization, or another target)", found.lines("recorded as"),
                             fix="the capture drift check says what this costs"))
        else:
            report.add(Check("stored boundaries", "ok", f"each stored state is the boundary the shards record "
                             f"({said}), matched in {where}"))
        return
    corrected = found.corrected()
    fixed = boundary_match.fix_boundaries(said, corrected)
    source = ds.manifest["source"]
    out = _reimported(data)
    line = reimport_command(source, corrected, out)
    evidence = found.lines("recorded as") + ([found.cause()] if found.cause() else [])
    if line:
        fix = f"re-import them as the boundaries they are: `{line}`" + after_reimport(
            summary, data, f"retrain the draft on {out} (`eaglewire train --data {out}`)")
    elif source.get("imported_from"):
        fix = "two stored states are one boundary: no --boundaries describes this capture; check which layers it holds"
    else:
        fix = ("these shards were captured, not imported: re-capture them (`eaglewire prepare`), and report it: the "
               "capture recorded other boundaries than it stored")
    report.add(Check("stored boundaries", "fail", f"the stored states are other boundaries than the shards record: "
                     f"{said} are {fixed or [corrected.get(b, b) for b in said]}, matched in {where}", evidence,
                     fix=fix))
