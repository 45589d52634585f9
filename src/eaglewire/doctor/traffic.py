"""``doctor --traffic FILE``: the draft's acceptance on the prompts users send, beside the held-out
training data, split by what differs, and which data to add where traffic accepts clearly less.

The file: JSONL (or one JSON list) of OpenAI chat requests (``{"messages": [...]}``), completion
requests (``{"prompt": "..."}``), OpenAI request logs (the request under ``body`` or ``request``,
as the Batch API and most proxies log it), JSON strings, or plain lines of prompt text. The target
writes its own greedy reply to each traffic prompt and to the held-out prompts alike
(``--traffic-tokens``), and the draft is measured on both as the doctor measures (``measure.py``:
a fresh capture, the TTT unroll, acc@0 over judged reply tokens; τ predicted from acc@0 and cond
acc), so recorded replies differing from self-written ones do not read as drift. Slices: with or without a system
prompt, prompt length, code or prose (a heuristic: fences, code-like lines or punctuation). A
slice accepts clearly less when its acc@0 is below the held-out one by more than the binomial
noise of two independent proportions (``evidence.Z`` standard errors, at least ``MIN_LEAD``).
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglewire.doctor.evidence import MIN_LEAD, Z
from eaglewire.doctor.measure import Sequence, capture_batches, isolation_accuracy
from eaglewire.doctor.verdicts import Check, DoctorReport
from eaglewire.doctor.engine_reading import predicted_tau

log = logging.getLogger(__name__)

LENGTH_BUCKETS = (128, 512, 2048)  # prompt tokens: <=128, 129-512, 513-2048, longer
REQUEST_KEYS = ("body", "request")  # where request logs keep the request
_CODE_LINE = re.compile(r"^\s*(def |class |import |from \S+ import |#include|function |public |private |return\b|"
                        r"for \(|if \(|while \(|const |let |var |SELECT |[{}]\s*$|\w+\(.*\);\s*$)")
CODE_PUNCTUATION = 0.06  # share of {}()[];=<> characters above which text reads as code


@dataclass
class TrafficPrompt:
    messages: list[dict[str, str]] | None  # a chat request
    text: str | None  # a plain prompt
    template_kwargs: dict[str, Any] | None = None  # the chat request's own chat_template_kwargs, where it sends them

    @property
    def has_system(self) -> bool:
        return any(m.get("role") in ("system", "developer") for m in self.messages or [])

    @property
    def content(self) -> str:
        return self.text if self.text is not None else "\n".join(m.get("content", "") for m in self.messages or [])


def _content(value: Any) -> str:
    """A message's content: text, or OpenAI's text parts joined."""
    if isinstance(value, list):
        return "".join(p.get("text", "") for p in value if isinstance(p, dict))
    return "" if value is None else str(value)


def parse_prompt(item: Any, where: str) -> TrafficPrompt | None:
    """One record -> a prompt (None: a record with nothing to send, e.g. a log line of a response)."""
    if isinstance(item, str):
        return TrafficPrompt(None, item) if item.strip() else None
    if not isinstance(item, dict):
        raise ValueError(f"{where}: a traffic record must be a JSON object, string or text line, got "
                         f"{type(item).__name__}")
    for key in REQUEST_KEYS:
        if isinstance(item.get(key), dict):
            return parse_prompt(item[key], where)
    if isinstance(item.get("messages"), list):
        messages = [{"role": "system" if m.get("role") == "developer" else str(m.get("role", "user")),
                     "content": _content(m.get("content"))} for m in item["messages"] if isinstance(m, dict)]
        while messages and messages[-1]["role"] == "assistant":  # a logged conversation: prompt its last turn
            messages.pop()
        kwargs = item.get("chat_template_kwargs")
        return TrafficPrompt(messages, None, kwargs if isinstance(kwargs, dict) else None) if messages else None
    prompt = item.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and isinstance(prompt[0], str) else None
    if isinstance(prompt, str):
        return TrafficPrompt(None, prompt)
    return None


def traffic_records(path: str | Path) -> list[tuple[Any, str]]:
    """Every record of a traffic file, (parsed JSON or a plain prompt line, where it is): a JSON array, else
    JSONL, a line that is not JSON being a prompt."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--traffic {path} does not exist; pass a JSONL file of requests or prompts")
    text = path.read_text(errors="replace")
    records: list[tuple[Any, str]] = []
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            records = [(x, f"{path} item {i}") for i, x in enumerate(json.loads(stripped))]
        except json.JSONDecodeError:
            records = []
    if not records:
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append((json.loads(line), f"{path}:{n}"))
            except json.JSONDecodeError:
                records.append((line, f"{path}:{n}"))  # a plain prompt line
    return records


def load_traffic(path: str | Path, limit: int) -> list[TrafficPrompt]:
    """The first ``limit`` prompts of a traffic file."""
    out = []
    for item, where in traffic_records(path):
        prompt = parse_prompt(item, where)
        if prompt is not None:
            out.append(prompt)
        if len(out) >= limit:
            break
    if not out:
        raise ValueError(f"--traffic {path} holds no prompt (chat requests, completion requests, request logs "
                         "or prompt lines)")
    return out


def looks_like_code(text: str) -> bool:
    """Fenced code, two or more code-like lines, or code's share of punctuation."""
    if "```" in text:
        return True
    if sum(bool(_CODE_LINE.match(line)) for line in text.splitlines()) >= 2:
        return True
    return sum(c in "{}()[];=<>" for c in text) / max(len(text), 1) > CODE_PUNCTUATION


def length_bucket(n: int) -> str:
    low = 0
    for high in LENGTH_BUCKETS:
        if n <= high:
            return f"prompts of {low + 1}-{high} tokens" if low else f"prompts of at most {high} tokens"
        low = high
    return f"prompts over {LENGTH_BUCKETS[-1]} tokens"


def slices_of(prompt: TrafficPrompt, prompt_len: int) -> list[str]:
    """The slices a prompt belongs to (one per kind of difference)."""
    return ["with a system prompt" if prompt.has_system else "without a system prompt",
            length_bucket(prompt_len), "code" if looks_like_code(prompt.content) else "prose"]


def _advice(name: str) -> str:
    if name == "with a system prompt":
        return "add conversations with system prompts (like your traffic's) to the training data"
    if name == "without a system prompt":
        return "add conversations without a system prompt to the training data"
    if name.startswith("prompts"):
        return f"add conversations with {name} to the training data (and a --max-length that holds them)"
    if name == "code":
        return "add code conversations to the training data"
    if name == "prose":
        return "add prose conversations to the training data"
    return ("add conversations like your traffic to the training data (e.g. these prompts, their replies "
            "regenerated by the target: prepare --regenerate)")


def difference_noise(a: float, n_a: int, b: float, n_b: int) -> float:
    """Z standard errors of the difference of two independent binomial proportions, at least MIN_LEAD."""
    return max(MIN_LEAD, Z * math.sqrt(a * (1 - a) / max(n_a, 1) + b * (1 - b) / max(n_b, 1)))


@dataclass
class SliceAccuracy:
    name: str
    prompts: int
    judged: int
    acc0: float
    tau: float


class Replier:
    """The target's own greedy replies: prompt ids -> a Sequence whose reply tokens are judged."""

    def __init__(self, target, reply_tokens: int) -> None:
        from eaglewire.core.tokens import stop_token_ids
        from eaglewire.decode.spec_decoder import SpecDecoder

        self.plain, self.reply_tokens = SpecDecoder(target), reply_tokens
        self.stop = set(stop_token_ids(target.tokenizer, target.model))
        self.room = int(target.text_config.max_position_embeddings) - reply_tokens  # longest prompt that fits

    def __call__(self, ids: list[int], name: str) -> Sequence:
        reply, _ = self.plain.generate(ids, max_new_tokens=self.reply_tokens, stop_token_ids=self.stop)
        text = torch.tensor(ids + reply)  # [T]
        return Sequence(name, text, torch.arange(len(text)) >= len(ids))


def measure_slices(target, draft, layout: list[int], groups: dict[str, list[Sequence]], *, steps: int,
                   tau_steps: int) -> list[SliceAccuracy]:
    """The draft on each group's sequences, fed ``layout`` as in training (a fresh capture)."""
    out = []
    for name, seqs in groups.items():
        if not seqs:
            continue
        counts = isolation_accuracy(draft, capture_batches(target, draft, seqs, layout), layout, steps=steps)
        acc0, cond = counts[0].acc, [c.cond_acc for c in counts[1:]]
        out.append(SliceAccuracy(name, len(seqs), counts[0].valid, acc0, predicted_tau(acc0, cond, tau_steps)))
    return out


def traffic_groups(target, replier: Replier, prompts: list[TrafficPrompt]) -> tuple[dict[str, list[Sequence]], int]:
    """Each prompt with the target's reply, in "all traffic" and its slices; also how many were
    left out (longer than the target's context)."""
    from eaglewire.decode.text import encode_prompt

    groups: dict[str, list[Sequence]] = {"all traffic": []}
    skipped = 0
    for i, prompt in enumerate(prompts):
        ids = encode_prompt(target.tokenizer, prompt.messages if prompt.messages is not None else prompt.text,
                            chat=prompt.messages is not None)
        if len(ids) > replier.room:
            skipped += 1
            continue
        seq = replier(ids, f"traffic {i}")
        for name in ["all traffic", *slices_of(prompt, len(ids))]:
            groups.setdefault(name, []).append(seq)
    return groups, skipped


def traffic_check(slices: list[SliceAccuracy], heldout_acc0: float, heldout_n: int, skipped: int) -> Check:
    """Each slice against the held-out data; the slices that accept clearly less, with what to add."""
    lines, low = [], []
    for s in slices:
        noise = difference_noise(s.acc0, s.judged, heldout_acc0, heldout_n)
        clearly_less = s.judged > 0 and s.acc0 < heldout_acc0 - noise
        lines.append(f"{s.name}: acc@0 {s.acc0:.3f} over {s.judged:,} judged tokens ({s.prompts} prompts), "
                     f"predicted τ {s.tau:.2f}; held-out {heldout_acc0:.3f} (noise ±{noise:.3f})"
                     + (": clearly less" if clearly_less else ""))
        if clearly_less:
            low.append(s)
    if skipped:
        lines.append(f"{skipped} prompt(s) longer than the target's context left out")
    name = "traffic drift"
    if not slices or slices[0].judged == 0:
        return Check(name, "inconclusive", "no judged reply token on the traffic (replies outside the draft "
                     "vocabulary, or none written)", lines, fix="raise --traffic-tokens or --traffic-prompts")
    if not low:
        return Check(name, "ok", f"traffic accepts as the held-out data does (acc@0 {slices[0].acc0:.3f} vs "
                     f"{heldout_acc0:.3f}, within noise)", lines)
    # name the slices that differ; the whole traffic only when no slice stands out
    named = [s for s in low if s.name != "all traffic"] or low
    worst = min(named, key=lambda s: s.acc0)
    summary = (f"traffic {worst.name} accepts {worst.acc0:.2f} vs {heldout_acc0:.2f} held-out"
               if worst.name != "all traffic" else
               f"your traffic accepts {worst.acc0:.2f} vs {heldout_acc0:.2f} held-out")
    fixes = list(dict.fromkeys(_advice(s.name) for s in sorted(named, key=lambda s: s.acc0)))
    return Check(name, "warn", summary + f": {fixes[0]}", lines, fix="; ".join(fixes))


def check_traffic(report: DoctorReport, path: str, target, draft, layout: list[int], heldout: list[Sequence],
                  tau_steps: int, *, prompts: int, reply_tokens: int, steps: int) -> Check:
    """The slices of the traffic at ``path`` (its first ``prompts``) against as many held-out prompts, both answered
    by the target's own greedy replies of ``reply_tokens`` and measured alike over ``steps`` draft steps (recorded
    replies would differ from self-written ones by themselves)."""
    requests = load_traffic(path, prompts)
    replier = Replier(target, reply_tokens)
    groups, skipped = traffic_groups(target, replier, requests)
    base = [replier(s.prompt_ids, s.id) for s in heldout[:prompts] if 0 < len(s.prompt_ids) <= replier.room]
    [reference] = measure_slices(target, draft, layout, {"held-out prompts": base}, steps=steps,
                                 tau_steps=tau_steps) or [SliceAccuracy("held-out prompts", 0, 0, 0.0, 1.0)]
    slices = measure_slices(target, draft, layout, groups, steps=steps, tau_steps=tau_steps)
    check = report.add(traffic_check(slices, reference.acc0, reference.judged, skipped))
    check.evidence.insert(0, f"held-out prompts, the target's own replies: acc@0 {reference.acc0:.3f} over "
                             f"{reference.judged:,} judged tokens ({reference.prompts} prompts), predicted τ "
                             f"{reference.tau:.2f}")
    report.traffic = {"held-out": reference.__dict__, "skipped": skipped, "slices": [s.__dict__ for s in slices]}
    return check
