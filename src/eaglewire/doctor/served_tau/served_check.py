"""``doctor --engine-url``: the τ a running server achieves, set against what the draft earns there.

The doctor sends its held-out prompts to the server (greedy), reads what the engine itself says
it accepted (each engine module's ``measure_served``: per-request figures where the engine gives
them, else its Prometheus counters before and after), and replays the same greedy chain on the
training-time unroll of the server's own output text (``acceptance/replay.py``): greedy decoding
is lossless, so a server wired as trained accepts exactly what the replay accepts on its text. A
served acceptance below the replay beyond binomial noise is a serving-side fault, not a weak
draft; the fix names the causes the other checks did not rule out, and the served-wiring check
(``diagnosis.py``) replays every wiring eaglewire knows on that text to name the one the server feeds.

Shapes: S draft steps, T tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglewire import engines
from eaglewire.engines import Ability
from eaglewire.doctor.evidence import wilson_bounds
from eaglewire.doctor.measure import Sequence, capture_batches, step_rightness
from eaglewire.doctor.verdicts import Check, DoctorReport
from eaglewire.doctor.served_tau.served_replay import SERVED_TAU_TOLERANCE, Replayed, replay_chain  # noqa: F401 (re-exported)
from eaglewire.engines.serving.served_counts import ServedCounts, ServedError, server_failed

log = logging.getLogger(__name__)

# The served text is the target's own greedy text at fewer positions than this: the server runs
# another target (precision, quantization, weights) or does not decode greedily.
MIN_TEXT_AGREEMENT = 0.98


@dataclass(frozen=True)
class ServedSettings:
    """What the served check and its diagnosis read: the server and how much to ask of it
    (the fields are the doctor flags of the same name, filled by ``doctor_config``)."""

    engine: str
    engine_url: str | None
    engine_config: str | None  # the draft config the server loads: --engine-config, or what its flags load
    target_arch: str | None
    engine_prompts: int
    engine_tokens: int
    probe_tokens: int
    traffic: str | None  # the users' prompts: probe prompts are drawn from them too


def replay_served(target, draft, layout: list[int], prompts: list[list[int]], outputs: list[list[int]],
                  num_steps: int) -> Replayed:
    """The replay on every (prompt, server output) pair, fed the declared ``layout``."""
    total = Replayed(accepted_per_pos=[0] * num_steps)
    for prompt, output in zip(prompts, outputs):
        if not output:
            continue
        text = torch.tensor(list(prompt) + list(output))  # [T]
        own = Sequence("served output", text, torch.arange(len(text)) >= len(prompt))
        batch = capture_batches(target, draft, [own], layout)[0]
        right = step_rightness(draft, batch, layout, steps=num_steps)[0]  # [S, T]
        one = replay_chain(right, len(prompt))
        argmax = batch.signal.argmax[0, len(prompt) - 1:len(text) - 1].cpu()  # [T - P]: predicts text[P:]
        one.judged, one.agreeing = len(output), int((argmax == text[len(prompt):]).sum())
        total.add(one)
    return total


def chain_length(counts: ServedCounts, default: int) -> int:
    """The server's chain: its per-position counters' length (vLLM, llama.cpp, eaglewire), or
    drafted tokens per verify step (SGLang's histogram grows only as far as it accepted)."""
    per_step = round(counts.draft_tokens / counts.drafts) if counts.drafts else 0
    return max(len(counts.accepted_per_pos), per_step) or default


# What can make a server accept less than the draft earns on its own text, and the check that
# rules each out when it passed.
CAUSES = (
    ("engine wiring", "the layers the engine feeds the draft (the ids in its config, read as that engine reads "
                      "them)"),
    ("serving flags", "launch flags (temperature, chain length, draft probability cut-offs such as "
                      "--spec-draft-p-min)"),
    (None, "a draft config field the engine reads otherwise than trained (norm_before_residual, d2t as offsets "
           "or absolute ids, draft_vocab_size)"),
    (None, "the engine's decoding path (positions, the KV cache after acceptance, tree masks, the states fed "
           "back after a rejection)"),
)


def candidate_causes(report: DoctorReport, replayed: Replayed) -> list[str]:
    """The causes of a serving-side fault that no passing check ruled out."""
    passed = {c.name for c in report.checks if c.verdict == "ok"}
    causes = [what for check, what in CAUSES if check is None or check not in passed]
    if replayed.text_agreement < MIN_TEXT_AGREEMENT:
        causes.insert(0, f"the server's target is not the one measured here: its greedy text is this target's "
                         f"own at {replayed.text_agreement:.1%} of positions (another precision, a requantized "
                         "GGUF, other weights, or sampling instead of greedy)")
    return causes


def traffic_in_figures(counts: ServedCounts) -> str | None:
    """Why the served figures read the server's load as well as its wiring, when other clients used it meanwhile:
    counters that count their rounds too, or an engine whose acceptance moves with the requests beside a sequence;
    None when the figures are the doctor's requests' own and load does not move them."""
    others = counts.others
    if others is None or not others.busy:
        return None
    if counts.source != "per-request":
        return f"the {counts.engine} server's counters count the other clients' verify steps too"
    return others.load_changes_acceptance


def busy_verdict(check: Check, counts: ServedCounts, replayed: Replayed) -> Check:
    """A fault or an excess read on a busy server, where the figures read the load: inconclusive, with what to do."""
    why = traffic_in_figures(counts)
    if why is None:
        return check
    return Check(check.name, "inconclusive", f"measured on a busy server ({counts.others.describe()}): {why}, so "
                 f"τ {counts.tau:.2f} served against {replayed.tau:.2f} replayed reads the load as well as the wiring",
                 check.evidence, fix="re-run the doctor while no other client uses the server, or against a second instance of it "
                     "launched the same way")


def served_check(counts: ServedCounts, replayed: Replayed, report: DoctorReport) -> Check:
    """Served acceptance against the replay on the server's own text. The replay is the
    expectation on that text, not a second sample: the served rate per drafted token is judged
    against the binomial (Wilson) interval of the replay's rate over the served drafted tokens, and
    a fault must also cost more than SERVED_TAU_TOLERANCE of τ. A fault or an excess read where other clients'
    traffic enters the figures is inconclusive (``busy_verdict``)."""
    name = "served acceptance"
    n = max(counts.draft_tokens, 1)
    low, high = wilson_bounds(replayed.acceptance_rate, n)
    per_pos = ", ".join(f"{s:.2f}/{r:.2f}" for s, r in zip(counts.per_position, replayed.per_position))
    evidence = [f"{counts.engine} ({counts.source}): {counts.accepted} of {counts.draft_tokens} drafted tokens "
                f"accepted over {counts.drafts} verify steps: served τ {counts.tau:.2f}",
                f"replayed on the server's own {replayed.judged} output tokens: {replayed.accepted} of "
                f"{replayed.draft_tokens} over {replayed.drafts} rounds: τ {replayed.tau:.2f}",
                f"acceptance per drafted token {counts.acceptance_rate:.3f} served vs {replayed.acceptance_rate:.3f} "
                f"replayed (binomial noise over {n:,} drafted tokens: {low:.3f}..{high:.3f})"]
    if per_pos:
        evidence.append(f"per position, served/replayed: {per_pos}")
    evidence += counts.notes
    if counts.others is not None:
        evidence.append(f"while measured, the server had {counts.others.describe()} (its counter of generated tokens "
                        "and gauge of running requests, read before and after the doctor's requests)")
    if counts.drafts == 0 or counts.draft_tokens == 0:
        return Check(name, "fail", f"the {counts.engine} server drafted nothing for the doctor's prompts", evidence,
                     fix="start the server with the draft and speculative decoding on")
    if replayed.judged == 0:
        return Check(name, "inconclusive", f"served τ {counts.tau:.2f}; the server returned no output ids to "
                     "replay on", evidence, fix="use a server build that returns the generated token ids")
    gap = replayed.tau - counts.tau
    if counts.acceptance_rate < low and gap > SERVED_TAU_TOLERANCE:
        causes = candidate_causes(report, replayed)
        return busy_verdict(Check(
            name, "fail", f"a serving-side fault: the {counts.engine} server accepts less than the draft earns on the "
            f"same text (τ {counts.tau:.2f} served vs {replayed.tau:.2f} replayed, beyond noise)", evidence,
            fix="the draft is not the problem; check, in turn: " + "; ".join(causes)), counts, replayed)
    if counts.acceptance_rate > high and -gap > SERVED_TAU_TOLERANCE:
        return busy_verdict(Check(
            name, "warn", f"the {counts.engine} server reports more accepted than the replay allows "
            f"(τ {counts.tau:.2f} vs {replayed.tau:.2f})", evidence,
            fix="other clients' traffic in its counters, or a server not decoding greedily: measure on an idle "
                "server with per-request metrics"), counts, replayed)
    return Check(name, "ok", f"served τ {counts.tau:.2f}, as the replay predicts ({replayed.tau:.2f}, within "
                 "noise)", evidence)


def unanswered_fix(error: ServedError, served: ServedSettings) -> str:
    """What to do when the server did not answer the doctor's requests: a server that failed on them (HTTP 5xx)
    runs a copy it cannot compute with; otherwise the URL is not this draft's server."""
    if not server_failed(error):
        return f"check that --engine-url {served.engine_url} is the {served.engine} server serving this draft"
    load = (f"restart it on {Path(served.engine_config).parent} (your --engine-config's copy)" if served.engine_config
            else "re-export the draft with `eaglewire export` and restart it on that")
    return (f"the {served.engine} server failed on a request: its log says why. A served draft copy with tensors "
            "the engine cannot compute with fails so at the first draft (a d2t written as absolute target ids where "
            f"the engine reads offsets indexes past the vocabulary): {load}")


def check_served(report: DoctorReport, served: ServedSettings, target, draft, layout: list[int],
                 sequences: list[Sequence], default_steps: int) -> Check:
    """Measure the server at ``served.engine_url`` on the held-out prompts and judge it."""
    prompts = [s.prompt_ids for s in sequences[:max(served.engine_prompts, 1)]]
    spec = engines.get(served.engine, Ability.MEASURE, param="--engine")
    try:
        with report.timed("served: the server's answers"):
            counts = spec.measure(served.engine_url, prompts, max_new_tokens=served.engine_tokens)
    except ServedError as e:
        return report.add(Check("served acceptance", "fail", f"could not read the served acceptance: {e}",
                                fix=unanswered_fix(e, served)))
    steps = chain_length(counts, default_steps)
    with report.timed("served: replay"):
        replayed = replay_served(target, draft, layout, prompts, counts.outputs, steps)
    check = report.add(served_check(counts, replayed, report))
    report.served = {"engine": counts.engine, "source": counts.source, "tau": counts.tau,
                     "drafts": counts.drafts, "accepted": counts.accepted, "replayed_drafts": replayed.drafts,
                     "replayed_accepted": replayed.accepted, "per_position": counts.per_position, "replayed_tau": replayed.tau,
                     "replayed_per_position": replayed.per_position, "chain": steps,
                     "others": None if counts.others is None else {"generated": counts.others.generated,
                                                                   "running": counts.others.running}}
    if check.verdict == "fail" and counts.draft_tokens and replayed.judged:  # a serving-side fault: which wiring?
        from eaglewire.doctor.served_tau.diagnosis import diagnose

        from eaglewire.doctor.served_tau.probes import Prober, probe_pool

        prober = Prober(lambda ps: spec.measure(served.engine_url, ps, max_new_tokens=served.engine_tokens),
                        probe_pool(target, [s.prompt_ids for s in sequences[len(prompts):]], served.traffic),
                        budget=served.probe_tokens, tokens=served.engine_tokens)
        with report.timed("served: diagnosis"):
            report.add(diagnose(report, served, target, draft, layout, prompts, counts, replayed, steps,
                                candidate_causes(report, replayed), prober))
    return check
