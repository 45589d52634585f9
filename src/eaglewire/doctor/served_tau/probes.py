"""``doctor --engine-url``: probe prompts that separate the wirings the server's text could not tell apart.

When several candidate wirings with different fixes each reproduce the server's counters within noise
(``wiring_fit.judge``), the doctor asks the server more, on prompts chosen by replay: greedy decoding is
lossless, so the server answers a probe prompt with the target's own greedy text, which the doctor writes
itself (``greedy_replies``) and replays every remaining candidate on. A probe separates two candidates where
their predicted acceptance differs; the doctor sends the probes whose predictions set the candidates
furthest apart in units of the noise over the drafts they add (``choose``), replays every remaining candidate
on what the server actually returned, judges again on all the server's drafts together, and repeats until
one fix is left or the probe budget (new tokens asked of the server) is spent. The pool: held-out
conversations not yet sent, code (HumanEval), repetitive text, and the user's ``--traffic``.

The pure part (``separation``, ``unseparated``, ``choose``, ``combined``) takes replayed counts.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

from eaglewire.doctor.served_tau.wiring_fit import Spread, family_spread
from eaglewire.engines.serving.served_counts import AcceptanceRates, ServedCounts, add_lists

SEPARATION = 3.0  # noise widths between two candidates' predictions that a probe set must reach for each pair
PER_SOURCE = 4  # pool prompts drawn from each source
REPETITIVE = (  # text whose continuation a draft predicts from the tokens before it, not from the topic
    "Repeat the following sentence exactly ten times, one per line: The quick brown fox jumps over the lazy dog.",
    "Count from 1 to 100, separated by commas.",
    "Write the days of the week in order, one per line, and then write the same list four more times.",
    "Write the English alphabet in order with spaces between the letters, three times.",
    "Print the word 'hello' twenty times, separated by spaces.",
    "List the numbers from 10 to 60 in steps of 2, one per line.",
)


@dataclass(frozen=True)
class Probe:
    source: str  # "held-out", "code", "repetitive", "traffic"
    prompt: list[int]


@dataclass
class Counts(AcceptanceRates):
    """Drafts summed over texts (a candidate's replays, or the server's accounts of several requests)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


def combined(*parts: AcceptanceRates) -> Counts:
    out = Counts()
    for p in parts:
        out.drafts += p.drafts
        out.draft_tokens += p.draft_tokens
        out.accepted += p.accepted
        out.accepted_per_pos = add_lists(out.accepted_per_pos, p.accepted_per_pos)
    return out


def combined_served(first: ServedCounts, more: ServedCounts) -> ServedCounts:
    """The server's account of two sets of requests as one (outputs in request order)."""
    total = combined(first, more)
    return ServedCounts(first.engine, total.drafts, total.draft_tokens, total.accepted, total.accepted_per_pos,
                        outputs=list(first.outputs) + list(more.outputs),
                        source=first.source if first.source == more.source else "mixed",
                        notes=list(dict.fromkeys(first.notes + more.notes)))


def separation(a: AcceptanceRates, b: AcceptanceRates, spread: Spread = Spread()) -> float:
    """How far apart two candidates' replays of the same drafts are, in noise widths: the served-wiring fit
    (``wiring_fit.fit``) of ``b`` (a stand-in: with its family's ``spread``) as if ``a`` were the server's counters."""
    from eaglewire.doctor.served_tau.wiring_fit import Wiring, fit

    return fit(a, Wiring((), "", "", ""), b, spread).score


def apart(a: AcceptanceRates, b: AcceptanceRates, spread_a: Spread = Spread(), spread_b: Spread = Spread()) -> float:
    """Noise widths between two candidates' replays, the closer way round (each noise is its own replay's)."""
    return min(separation(a, b, spread_b), separation(b, a, spread_a))


def family_spreads(totals: dict, families: dict) -> dict:
    """key -> its family's spread over ``totals`` (key -> replay), for the keys ``families`` (key -> family label)
    names: stand-ins of one hypothesis are told apart from the others with their spread, as they are judged."""
    members: dict[str, list] = {}
    for k, label in families.items():
        if k in totals:
            members.setdefault(label, []).append(totals[k])
    spread = {label: family_spread(rs) for label, rs in members.items()}
    return {k: spread[label] for k, label in families.items() if k in totals}


def unseparated(pairs: list[tuple[str, str]], totals: dict[str, AcceptanceRates],
                families: dict | None = None) -> list[tuple[str, str]]:
    """The pairs of candidates whose summed replays are fewer than SEPARATION noise widths apart (either way)."""
    wide = family_spreads(totals, families or {})
    return [(a, b) for a, b in pairs
            if apart(totals[a], totals[b], wide.get(a, Spread()), wide.get(b, Spread())) < SEPARATION]


def pairs_to_separate(fixes: dict[str, str | None]) -> list[tuple[str, str]]:
    """The pairs of candidates (label -> fix) that ask for different fixes: those the doctor must tell apart."""
    return [(a, b) for a, b in itertools.combinations(fixes, 2) if fixes[a] != fixes[b]]


def choose(pairs: list[tuple[str, str]], prior: dict[str, AcceptanceRates],
           predicted: list[dict[str, AcceptanceRates]], cost: list[int], budget: int,
           families: dict | None = None) -> list[int]:
    """The probes (indexes into ``predicted``: candidate label -> its replay on that probe's text) to send, at most
    ``budget`` in ``cost``: added one at a time, each the one that leaves the fewest ``pairs`` less than SEPARATION
    apart on the prior drafts plus those chosen (ties: the largest summed separation, capped, per token), until
    every pair is apart or no probe brings one closer to it. ``families``: key -> family label of the stand-ins
    (``Wiring.stand_in``), told apart with their family's spread."""
    chosen: list[int] = []
    totals = dict(prior)
    spent = 0

    def score(with_probe: dict[str, AcceptanceRates]) -> tuple[int, float]:
        wide = family_spreads(with_probe, families or {})
        seps = [apart(with_probe[a], with_probe[b], wide.get(a, Spread()), wide.get(b, Spread())) for a, b in pairs]
        return sum(s >= SEPARATION for s in seps), sum(min(s, SEPARATION) for s in seps)

    current = score(totals)
    while current[0] < len(pairs):
        best = None
        for i, replays in enumerate(predicted):
            if i in chosen or spent + cost[i] > budget or not replays:
                continue
            trial = {k: combined(totals[k], replays[k]) for k in totals}
            got = score(trial)
            gain = (got[0] - current[0], (got[1] - current[1]) / max(cost[i], 1))
            if gain > (0, 0.0) and (best is None or gain > best[0]):
                best = (gain, i, trial, got)
        if best is None:
            break
        _, i, totals, current = best
        chosen.append(i)
        spent += cost[i]
    return chosen


# ---------------------------------------------------------------- the pool and the server


def probe_pool(target, held_out: list[list[int]], traffic: str | None, *, per_source: int = PER_SOURCE,
               room: int | None = None) -> list[Probe]:
    """Prompts the doctor may probe the server with: held-out prompts not yet sent, code, repetitive text and
    the user's ``--traffic``, ``per_source`` of each (those that fit ``room`` tokens)."""
    from eaglewire.core.prompts import load_prompts
    from eaglewire.decode.text import encode_prompt

    tok = target.tokenizer
    pool = [Probe("held-out", list(p)) for p in held_out[:per_source] if p]
    pool += [Probe("code", encode_prompt(tok, p.text, chat=False)) for p in load_prompts("humaneval", per_source)]
    pool += [Probe("repetitive", encode_prompt(tok, text, chat=True)) for text in REPETITIVE[:per_source]]
    if traffic:
        from eaglewire.doctor.traffic import load_traffic

        for p in load_traffic(traffic, per_source):
            ids = encode_prompt(tok, p.messages if p.messages is not None else p.text, chat=p.messages is not None)
            pool.append(Probe("traffic", ids))
    return [p for p in pool if room is None or len(p.prompt) <= room]


@dataclass
class Prober:
    """What probing needs beside the candidates: the server and the pool."""

    measure: Callable[[list[list[int]]], ServedCounts]  # prompts -> the server's account of its greedy replies
    pool: list[Probe]
    budget: int  # new tokens the probes may ask of the server in all
    tokens: int  # new tokens per probe


@dataclass
class Probed:
    """What probing did: the rounds' probes by source, the tokens the server wrote for them, why it stopped."""

    sent: list[Probe] = field(default_factory=list)
    indexes: list[int] = field(default_factory=list)  # the sent probes' places in the pool
    tokens: int = 0
    rounds: int = 0
    stopped: str = ""

    def said(self) -> str:
        by = {}
        for p in self.sent:
            by[p.source] = by.get(p.source, 0) + 1
        sources = ", ".join(f"{n} {s}" for s, n in by.items()) or "none"
        return (f"{len(self.sent)} probe prompts ({sources}) in {self.rounds} round(s), {self.tokens:,} probe "
                f"tokens: {self.stopped}")


def replay_texts(target, draft, built: dict, prompts: list[list[int]], outputs: list[list[int]],
                 steps: int) -> list[dict]:
    """Per (prompt, output) text: each built wiring's (key -> (layout, the draft as it runs it, its batch
    transform): ``wiring_fit.built``) replay of the greedy chain there ({} for an empty output). The texts are
    captured together, once, for ``draft`` (the trained one)."""
    from eaglewire.doctor.served_tau.wiring_fit import capture_texts, replay_rows

    out: list[dict] = [{} for _ in prompts]
    texts = capture_texts(target, draft, prompts, outputs, {b for layout, _, _ in built.values() for b in layout})
    for k, (layout, served, transform) in built.items():
        for name, one in replay_rows(layout, served, transform, texts, steps):
            out[int(name.removeprefix("text "))][k] = one
    return out


def build_all(wirings: dict, draft) -> dict:
    """key -> Wiring  =>  key -> (its layout, the draft as it runs it, its batch transform), each built once."""
    from eaglewire.doctor.served_tau.wiring_fit import built

    return {k: (w.layout, *built(w, draft)) for k, w in wirings.items()}


def greedy_replies(target, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """The target's own greedy reply to each prompt (what a server answers, greedy decoding being lossless):
    batched where the target has a lean forward, else one at a time."""
    from eaglewire.core.tokens import stop_token_ids
    from eaglewire.decode.batched import generate_batch

    stop = stop_token_ids(target.tokenizer, target.model)
    try:
        return [reply for reply, _ in generate_batch(target, prompts, max_new_tokens=tokens, stop_token_ids=stop)]
    except ValueError:  # no lean forward for this model type
        from eaglewire.doctor.traffic import Replier

        replier = Replier(target, tokens)
        return [replier(p, "probe").input_ids[len(p):].tolist() for p in prompts]


def separate(prober: Prober, target, draft, candidates: dict, counts: ServedCounts, replays: dict, steps: int,
             *, shown: dict | None = None) -> tuple[ServedCounts, dict, Probed]:
    """Probe the server until the ``candidates`` (key -> Wiring, each within noise of ``counts``) that ask for
    different fixes are down to one fix, or the budget is spent. ``replays``: key -> its replay on the server's
    text so far, for the candidates and ``shown`` (key -> Wiring replayed alongside on every probe, not judged:
    the trained wiring). Returns (the server's account of every request, each one's replay on all of it, what
    probing did)."""
    from eaglewire.doctor.served_tau.wiring_fit import judge, still_fitting
    from eaglewire.engines.serving.served_counts import ServedError

    probed = Probed()
    everyone = build_all(dict(candidates) | dict(shown or {}), draft)
    judged = {k: everyone[k] for k in candidates}
    live = dict(candidates)
    room = int(target.text_config.max_position_embeddings) - prober.tokens
    pool = [p for p in prober.pool if len(p.prompt) <= room]
    # the server's greedy reply is the target's own: the doctor writes it and replays each candidate there
    replies = greedy_replies(target, [p.prompt for p in pool], prober.tokens) if pool else []
    predicted = replay_texts(target, draft, judged, [p.prompt for p in pool], replies, steps) if pool else []
    while True:
        pairs = pairs_to_separate({k: w.fix for k, w in live.items()})
        if not pairs:
            probed.stopped = "one fix left" if live else "no candidate fits the server's acceptance on the probes"
            break
        left = prober.budget - probed.tokens
        unsent = [i for i in range(len(pool)) if i not in probed.indexes]
        order = choose(pairs, {k: replays[k] for k in live},
                       [{k: predicted[i][k] for k in live} if predicted[i] else {} for i in unsent],
                       [prober.tokens] * len(unsent), left, {k: w.label for k, w in live.items() if w.stand_in})
        if not order:
            probed.stopped = ("the probe budget is spent" if left < prober.tokens else
                              "no probe left in the pool separates them further")
            break
        picked = [unsent[j] for j in order]
        try:
            more = prober.measure([pool[i].prompt for i in picked])
        except ServedError as e:
            probed.stopped = f"the server did not answer the probes: {e}"
            break
        probed.rounds += 1
        probed.indexes += picked
        probed.sent += [pool[i] for i in picked]
        probed.tokens += sum(len(o) for o in more.outputs)
        counts = combined_served(counts, more)
        for got in replay_texts(target, draft, everyone, [pool[i].prompt for i in picked], list(more.outputs),
                                steps):
            replays = {k: combined(replays[k], got[k]) if k in got else replays[k] for k in replays}
        _, ranked = judge(counts, [(w, replays[k]) for k, w in candidates.items()])
        kept = {id(f.wiring) for f in still_fitting(ranked)}
        live = {k: w for k, w in candidates.items() if id(w) in kept}
    return counts, replays, probed
