"""``eaglewire doctor``: the standalone wiring test. Loads the draft, the target and held-out
sequences, captures them once at every candidate boundary, and runs the checks: those the
stored-states doctor shares from ``checks.py``, those that need the target to run here."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglewire.core.configs import config_record
from eaglewire.core.contract import SOFT_FIELDS, HiddenStateContract
from eaglewire.doctor.checks import (LaunchSettings, Measured, check_accuracy, check_alignment, check_engine_version,
                                     check_evidence, check_layouts, check_serving, name_the_judged_release)
from eaglewire.doctor.cache import Cached, cache_key, load, now, store
from eaglewire.doctor.doctor_config import DoctorConfig
from eaglewire.doctor.layouts import candidate_layouts
from eaglewire.doctor.served_tau.served_check import ServedSettings, check_served
from eaglewire.doctor.stored import check_stored_boundaries, trained_on
from eaglewire.doctor.temperature import SamplingSettings, check_sampling
from eaglewire.doctor.template_switch import check_template_switch
from eaglewire.doctor.traffic import check_traffic, load_traffic
from eaglewire.doctor.measure import (Sequence, capture_batches, capture_drift, coverage, isolation_accuracy,
                                      engine_agreement, stored_accuracy)
from eaglewire.acceptance.replay import RoundAgreement
from eaglewire.doctor.verdicts import Check, DoctorReport
from eaglewire import engines
from eaglewire.doctor.engine_reading import predicted_tau
from eaglewire.engines.formats.foreign_draft import load_any_draft
from eaglewire.core.presets import resolve_draft
from eaglewire.model.dflash_blocks import is_block_draft
from eaglewire.model.target import Target, load_target

log = logging.getLogger(__name__)


def run_doctor(config: DoctorConfig, *, target: Target | None = None) -> DoctorReport:
    if config.stored:  # the target is never run: doctor/stored.py
        from eaglewire.doctor.stored import run_stored_doctor

        return run_stored_doctor(config)
    report = _examine(config, target)
    name_the_judged_release(report, config.engine)  # a running server's release, in every line
    if config.json:
        Path(config.json).parent.mkdir(parents=True, exist_ok=True)
        Path(config.json).write_text(json.dumps(report.to_dict(), indent=1))
    return report


def _examine(config: DoctorConfig, target: Target | None) -> DoctorReport:
    """The fresh doctor's checks, in the order the report shows them."""
    start = time.perf_counter()
    report = DoctorReport(draft=config.draft, target=config.target, resolved_config=config_record(config))
    with report.timed("load target"):
        target = target or load_target(config.target, device=config.device)
    # a native draft's contract is checked below, as a verdict; a foreign one records no target, so it is
    # converted for this one and its reading stated
    allow = set(config.allow_target_mismatch or ())
    with report.timed("load draft"):
        draft, contract, draft_cfg, notes = load_any_draft(config.draft, target=target, check_native=False,
                                                           allow=allow)
    if notes:
        report.add(Check("draft format", "warn" if len(notes) > 1 else "ok", notes[0], notes[1:]))
    draft = draft.to(target.device)
    summary = draft_cfg.get("training") or {}
    declared = list(contract.aux_boundaries)
    L = target.num_layers

    identity_ok = _check_identity(report, contract, target, allow)
    if config.engine_url:
        check_engine_version(report, config.engine, config.engine_url)  # which release's reading judges the server
        config = _flags_from_server(report, config)
    arch = config.target_arch or contract.target.architecture
    dflash_block = draft.config.block_size if is_block_draft(draft) else None
    rows = draft.draft_to_target
    vocab_ids = rows if len(rows) < target.vocab_size else None
    serving, serving_steps, launch = check_serving(report, config.settings(LaunchSettings), declared, L, arch,
                                                   dflash_block, vocab_ids=vocab_ids)
    if launch.engine_config != config.engine_config:  # the checks after it judge what the launch flags load
        config = dataclasses.replace(config, engine_config=launch.engine_config)
    check_template_switch(report, contract, target.tokenizer,
                          load_traffic(config.traffic, config.traffic_prompts) if config.traffic else None,
                          engine=config.engine, engine_flags=config.engine_flags,
                          chat_template_kwargs=config.chat_template_kwargs)
    with report.timed("held-out sequences"):
        sequences, source = _load_sequences(config, target, contract, summary, report)
    if not sequences:
        report.add(Check("data", "fail", "no held-out sequence with reply tokens to measure on",
                         fix="pass --data SHARDS or --conversations FILE with assistant replies"))
        return report
    if not identity_ok:
        return report  # the wrong target: every measurement below would be noise
    key = None
    if config.cache:  # what an earlier run computed from the same draft, target, data and settings
        with report.timed("cache key"):
            key = cache_key(config_record(config), resolve_draft(config.draft), target, sequences,
                            report.engine_version)
    cached = load(key) if key else None
    held_out = _HeldOut(config, target, draft, contract, summary, source, sequences, declared, serving, serving_steps)
    first = len(report.checks)
    if cached:
        cached.restore_before(report)
        judged = cached.facts["judged tokens"]
    else:
        judged = _held_out_checks(report, held_out)
    before = report.checks[first:]
    if config.engine_url:  # the running server against the replay on its own text (doctor/served_tau/served_check.py)
        check_served(report, config.settings(ServedSettings), target, draft, declared, sequences,
                     serving_steps)  # times its own stages
    first = len(report.checks)
    if cached:
        cached.restore_after(report)
    else:
        _later_checks(report, held_out)
    report.facts = {"held-out sequences": len(sequences), "judged tokens": judged,
                    "source": source, "seconds": round(time.perf_counter() - start, 1)}
    if cached:
        report.facts["reused"] = (f"{len(cached.before) + len(cached.after)} checks computed at {cached.created} "
                                  f"in {cached.saved_seconds} s (same draft, target, data and settings; "
                                  "--no-cache recomputes)")
    elif key:
        computed = {k: v for k, v in report.stage_seconds.items() if k in CACHED_STAGES}
        store(key, Cached(
            before=before, after=report.checks[first:], layouts=report.layouts, accuracy=dict(report.accuracy),
            facts={"judged tokens": judged},
            extras={"sampling": report.sampling, "traffic": report.traffic, "concurrency": report.concurrency},
            stage_seconds=computed, created=now()))
    return report


# The stages whose checks read only the draft, the target, the held-out data and the settings (cached).
CACHED_STAGES = {"capture", "isolation accuracy", "layout sweep", "stored states", "acceptance (eaglewire's engine)",
                 "sampling", "traffic", "tune"}


@dataclass(frozen=True)
class _HeldOut:
    """What the server-independent checks read."""

    config: DoctorConfig
    target: Target
    draft: Any
    contract: HiddenStateContract
    summary: dict
    source: str
    sequences: list[Sequence]
    declared: list[int]
    serving: Any
    serving_steps: int


def _held_out_checks(report: DoctorReport, h: _HeldOut) -> int:
    """The checks on held-out data before the served one: capture at every candidate boundary, coverage,
    accuracy, the layout sweep, stored states, eaglewire's engine, sampling. Returns the judged tokens."""
    config, target, draft, declared = h.config, h.target, h.draft, h.declared
    L = target.num_layers
    layouts = candidate_layouts(declared, L, h.serving)
    needed = sorted({b for layout in layouts for b in layout})
    with report.timed("capture"):
        batches = capture_batches(target, draft, h.sequences, needed)

    inside, counted = coverage(batches)
    share = inside / max(counted, 1)
    report.add(Check("vocab coverage", "ok" if share >= 0.85 else "warn",
                     f"{share:.1%} of the target's next tokens on replies are in the draft vocabulary "
                     f"({draft.config.draft_vocab_size:,} of {draft.config.vocab_size:,})",
                     fix=None if share >= 0.85 else "retrain with a larger --draft-vocab-size"))

    with report.timed("isolation accuracy"):
        m = Measured(engine=config.engine, engine_config=config.engine_config, draft=draft, batches=batches,
                     declared=declared, num_layers=L, serving=h.serving,
                     counts=isolation_accuracy(draft, batches, declared, steps=config.steps))
    report.accuracy = {"acc@0": m.acc0} | {f"cond acc@{j}": c for j, c in enumerate(m.cond, 1)}
    check_evidence(report, m.n, len(h.sequences), h.summary, min_tokens=config.min_tokens,
                   num_sequences=config.num_sequences, max_length=config.max_length,
                   include_training=config.include_training)
    check_accuracy(report, m, h.summary, h.source)
    with report.timed("layout sweep"):
        check_layouts(report, m, layouts)
    with report.timed("stored states"):
        check_stored_boundaries(report, config.data, target, h.summary)  # which boundary each stored state is
        _check_drift(report, m)
    check_alignment(report, m)
    with report.timed("acceptance (eaglewire's engine)"):
        _check_acceptance(report, m, target, h.contract, h.sequences, h.serving_steps,
                          engine_prompts=config.engine_prompts, engine_tokens=config.engine_tokens)
    with report.timed("sampling"):  # doctor/temperature.py
        check_sampling(report, config.settings(SamplingSettings), target, draft, declared, h.sequences,
                       h.serving_steps)
    return m.n


def _later_checks(report: DoctorReport, h: _HeldOut) -> None:
    """The checks after the served one: the users' traffic, and what to serve for speed."""
    config = h.config
    if config.traffic:  # the users' prompts beside the held-out data (doctor/traffic.py)
        with report.timed("traffic"):
            check_traffic(report, config.traffic, h.target, h.draft, h.declared, h.sequences, h.serving_steps,
                          prompts=config.traffic_prompts, reply_tokens=config.traffic_tokens, steps=config.steps)
    if config.tune:
        with report.timed("tune"):
            _check_speed(report, config, h.target, h.draft, h.contract, h.sequences, h.serving_steps)


# ------------------------------------------------------------------ checks

def _check_identity(report: DoctorReport, contract: HiddenStateContract, target: Target,
                    allow: set[str] = frozenset()) -> bool:
    diff = contract.target.differences(target.fingerprint)
    hard = {k: v for k, v in diff.items() if k not in SOFT_FIELDS and k not in allow}
    fp = target.fingerprint
    facts = (f"{fp.architecture}, {fp.num_layers} layers, hidden {fp.hidden_size}, vocab {fp.vocab_size:,}; "
             "tokenizer, chat template and weights by hash")
    if hard:
        report.add(Check("identity", "fail", "the draft was trained for another target",
                         [f"{k}: draft {a!r}, target {b!r}" for k, (a, b) in hard.items()],
                         fix="serve the draft with the target it was trained on, or retrain it on this target (if the "
                             f"difference is deliberate, e.g. a requantized target: --allow-target-mismatch "
                             f"{','.join(hard)})"))
        return False
    soft = [f"{k}: draft {a!r}, target {b!r} (" + ("allowed by --allow-target-mismatch; " if k in allow else "") +
            "the drift check measures what this costs)" for k, (a, b) in diff.items()]
    report.add(Check("identity", "warn" if soft else "ok", "the draft's contract matches the target" +
                     ((" except its precision" if set(diff) <= SOFT_FIELDS else " except " + ", ".join(diff))
                      if soft else ""), soft or [facts]))
    return True


def _check_drift(report: DoctorReport, m: Measured) -> None:
    """The states stored at training time (shards) against those captured now."""
    drift = capture_drift(m.batches, m.declared, m.num_layers)
    if not drift:
        report.add(Check("capture drift", "skip", "needs the shards the draft was trained on (--data)"))
        return
    worst = min(d.cosine for d in drift)
    evidence = [f"boundary {d.boundary}: cosine {d.cosine:.5f}, relative error {d.relative_error:.2e}" for d in drift]
    stored = stored_accuracy(m.draft, m.batches, steps=1)[0].acc
    evidence.append(f"acc@0 on the stored states {stored:.3f}, on states captured now {m.acc0:.3f}")
    if worst >= 0.999:
        report.add(Check("capture drift", "ok", "states captured now match those stored at training time", evidence))
    else:
        verdict = "warn" if worst >= 0.99 else "fail"
        misread = next((c for c in report.checks if c.name == "stored boundaries" and c.verdict == "fail"), None)
        report.add(Check("capture drift", verdict, f"states captured now differ from training time "
                         f"(lowest cosine {worst:.4f})", evidence,
                         fix=f"the stored states are other boundaries than recorded (stored boundaries): {misread.fix}"
                         if misread else "serve the target in the precision and quantization the data was captured "
                         "with, with the same norm placement (pre-norm states), or re-capture and retrain"))


# Rounds may disagree where the engine's batched verify and the doctor's capture round a
# near-tie differently (a top-2 logit gap of ~1e-5 in fp32); a wiring fault disagrees far more.
MIN_ROUND_AGREEMENT = 0.9


def _check_acceptance(report: DoctorReport, m: Measured, target: Target, contract: HiddenStateContract,
                      sequences: list[Sequence], steps: int, *, engine_prompts: int, engine_tokens: int
                      ) -> RoundAgreement | None:
    """The engine's greedy chain of ``steps`` on the first ``engine_prompts`` held-out prompts (``engine_tokens``
    new tokens each), round by round against the replay of the training-time unroll on the text it produced
    (``replay.py``): they must accept the same."""
    from eaglewire.core.tokens import stop_token_ids
    from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder

    draft = m.draft
    if is_block_draft(draft):
        steps = min(steps, draft.config.block_size - 1)  # a chain of n from one block
    predicted = predicted_tau(m.acc0, m.cond, steps)
    if engine_prompts < 1:
        report.add(Check("acceptance", "skip", f"predicted τ {predicted:.2f} for a chain of {steps}; "
                         "measurement skipped (--engine-prompts 0)"))
        return None
    decoder = SpecDecoder(target, draft, contract, SpecConfig.chain(steps))
    stop = set(stop_token_ids(target.tokenizer, target.model))
    rounds, prompts = RoundAgreement(), sequences[:engine_prompts]
    for seq in prompts:
        rounds.add(engine_agreement(decoder, draft, list(contract.aux_boundaries), seq.prompt_ids,
                                    max_new_tokens=engine_tokens, stop_token_ids=stop))
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


def _check_speed(report: DoctorReport, config: DoctorConfig, target: Target, draft, contract,
                 sequences: list[Sequence], launch_steps: int | None = None) -> None:
    """What ``eaglewire tune`` recommends for the serving engine (its speed ranking), on the held-out prompts;
    with ``--concurrency``, up to how many concurrent requests that pays (``doctor/load_check.py``)."""
    from eaglewire.acceptance.speed import SpeedQuery, rank_speed
    from eaglewire.doctor.load_check import LoadSettings, check_load_elsewhere, check_speed_under_load, load_levels

    spec = engines.get(config.engine)
    under_load = load_levels(config.concurrency)  # --concurrency beyond one request (doctor/load_check.py)
    if not spec.stated_costs and not spec.in_process:
        report.add(Check("speed", "skip", f"{spec.runtime.label}'s round costs are measured on its own files, in "
                                          "servers tune launches",
                         fix=f"eaglewire tune --engine {spec.name} --draft {config.draft}"))
        if under_load:
            check_load_elsewhere(report, under_load, config.draft, spec)
        return
    prompts = [s.prompt_ids for s in sequences[:max(config.engine_prompts, 2)]]
    in_process = next(e for e in engines.ENGINES if e.in_process).name
    engine = spec.name if spec.stated_costs else in_process
    query = SpeedQuery(engine=engine, stated=spec.stated_costs, max_new_tokens=max(config.engine_tokens, 16),
                       max_steps=4)
    result = rank_speed(query, target, draft, contract, prompts)
    choice = result.recommendation.choice
    evidence = [f"{p.shape.label(result.rule)}: τ {p.tau:.2f}, {p.speedup:.2f}x plain "
                f"(break-even τ {p.break_even_tau:.2f})" for p in result.ranked[:3]]
    evidence.append(f"costs {result.costs.source} for {engine}; `eaglewire tune` ranks every shape with more prompts")
    if under_load and spec.in_process:
        report.add(check_speed_under_load(report, config.settings(LoadSettings), target, draft, contract, prompts,
                                          result, evidence))
        return
    report.add(Check("speed", "warn" if choice.shape.plain else "ok", result.recommendation.reason, evidence))
    if config.engine_flags and launch_steps is not None:
        cap = launch_cap(result, launch_steps)
        if cap is not None:
            report.add(cap)
    if under_load:  # a stated cost model prices one request: a server's load is measured in the server
        check_load_elsewhere(report, under_load, config.draft, spec)


def launch_cap(result, launch_steps: int) -> Check | None:
    """The launch's chain against the speed ranking's choice: a WARN where the flags draft fewer tokens a round
    than the recommended chain and the ranking predicts the launch's chain slower by more than its margin (the
    seeds' --speculative-num-steps 1 under --speculative-num-draft-tokens 16); None otherwise."""
    from eaglewire.acceptance.recommend import MARGIN

    best = result.recommendation.choice
    launched = next((p for p in result.ranked if p.shape.n_max == launch_steps and not p.shape.p_min), None)
    if best.shape.plain or launched is None or best.shape.n_max <= launch_steps:
        return None
    if best.speedup < launched.speedup * (1 + MARGIN):
        return None
    label = best.shape.label(result.rule)
    return Check("launch shape", "warn",
                 f"the launch flags cap the draft at {launch_steps} drafted token{'s' if launch_steps != 1 else ''} a "
                 f"round (τ {launched.tau:.2f}, {launched.speedup:.2f}x plain predicted); {label} is predicted "
                 f"{best.speedup:.2f}x (τ {best.tau:.2f})",
                 [f"{p.shape.label(result.rule)}: τ {p.tau:.2f}, {p.speedup:.2f}x" for p in result.ranked[:4]],
                 fix=f"launch with {label}")


# ------------------------------------------------------------------ data

def _flags_from_server(report: DoctorReport, config: DoctorConfig) -> DoctorConfig:
    """Without --engine-flags, the launch flags the running server says it runs with (an engine that reports
    them, SGLang's /get_server_info), so its flags and the draft config they load are checked as served."""
    spec = engines.get(config.engine)
    if config.engine_flags or spec.served_flags is None:
        return config
    flags = spec.served_flags(config.engine_url)
    if not flags:
        return config
    report.add(Check("launch flags", "ok", f"read from the running server at {config.engine_url}: {flags}"))
    return dataclasses.replace(config, engine_flags=flags)


def _load_sequences(config: DoctorConfig, target: Target, contract: HiddenStateContract, summary: dict,
                    report: DoctorReport) -> tuple[list[Sequence], str]:
    heldout = [] if config.include_training else list(summary.get("heldout_sequence_ids") or [])
    data, conversations = config.data, config.conversations
    if not data and not conversations:
        from eaglewire.core.presets import recorded_data

        recorded = recorded_data(summary)  # the preset it was prepared from when the path is not here
        if recorded and (Path(recorded) / "manifest.json").exists():
            data = recorded
        else:
            conversations = recorded if recorded and not Path(recorded).is_dir() else "sharegpt"
    if data:
        unseen = trained_on(summary, data) is False
        return _from_shards(data, contract, heldout, config, report, unseen), f"shards {data}"
    return (_from_conversations(conversations, target, heldout, config,
                                contract.chat_template_kwargs if contract is not None else None),
            f"conversations {conversations}")


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
    # shards training never read are held out whole (their ids may repeat the training data's)
    picked = [] if unseen else [index[s] for s in heldout if s in index][:config.num_sequences]
    if not picked:
        picked = list(range(max(0, len(ds) - config.num_sequences), len(ds)))
        if not (config.include_training or unseen):
            report.add(Check("data", "warn", "the draft records no held-out sequences from these shards: "
                             "measuring on the last ones, which training may have seen"))
    out = []
    for i in picked:
        item = ds[i]
        n, last = config.max_length, item.get("last_hidden")  # no last state in shards with top-K labels
        out.append(Sequence(ds.sequence_ids[i], item["input_ids"][:n].long(), item["loss_mask"][:n].bool(),
                            item["aux_hidden"][:n] if same else None, last[:n] if same and last is not None else None))
    return [s for s in out if bool(s.loss_mask[2:].any())]


def _from_conversations(name: str, target: Target, heldout: list[str], config: DoctorConfig,
                        template_kwargs: dict | None = None) -> list[Sequence]:
    """Held-out conversations rendered as the draft's data was (``template_kwargs``: its switches)."""
    from eaglewire.data.conversations import load_conversations, tokenize_conversation
    from eaglewire.data.prepare import resolve_data

    convs, _ = load_conversations(resolve_data(name))
    wanted = set(heldout)
    chosen = [c for c in convs if c.id in wanted] or convs[config.offset:]
    out = []
    for conv in chosen:
        seq = tokenize_conversation(conv, target.tokenizer, max_length=config.max_length,
                                    template_kwargs=template_kwargs or None)
        if sum(seq.loss_mask[2:]):
            out.append(Sequence(seq.id, torch.tensor(seq.input_ids), torch.tensor(seq.loss_mask, dtype=torch.bool)))
        if len(out) >= config.num_sequences:
            break
    return out
