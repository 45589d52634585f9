"""Regenerate the assistant replies of a conversation data set with the target itself.

Terms:
  turn         one assistant reply, regenerated from the history before it
  history      system + user turns + the *regenerated* replies before a turn
  stop tokens  EOS and the chat template's end-of-turn token; a reply ends at the first one,
               which is not stored
  truncated    a reply that reached max_new_tokens without a stop token; it is kept
  cut          a conversation that ended early because the next prompt exceeded
               max_prompt_tokens or a reply came out empty: the turns before are kept, the rest
               dropped; a conversation cut before its first turn is *dropped* (not written, so a
               resumed run tries it again)

Generation: a turn of a batch is one batched generation. Llama-family targets (model types in
``runner.LEAN_MODEL_TYPES``) use the batched lean decoder (``decode.batched.BatchedDecoder``,
weights prepared once per ``regenerate`` call); other architectures use HF ``generate``. Both
stop a reply at the first stop token and strip it (``split_reply``). Greedy replies agree
between the two (up to fp32 near-ties); sampled replies are reproducible from the seed on either
path but differ between them (each draws its random numbers its own way).

Shapes: B conversations in flight, T prompt tokens (left padded), N new tokens.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from eaglewire.data.conversations import Conversation
from eaglewire.decode.sampling import MAX_NEW_TOKENS
from eaglewire.core.tokens import END_OF_TURN_TOKENS, stop_token_ids

log = logging.getLogger(__name__)

_ROLES = ("system", "user", "assistant")


@dataclass(kw_only=True)
class RegenerateConfig:
    max_new_tokens: int = field(default=MAX_NEW_TOKENS, metadata={"help": "reply length limit in tokens"})
    temperature: float = field(default=0.0, metadata={"help": "sampling temperature (0 = greedy)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling threshold (1 = off)"})
    batch_size: int = field(default=8, metadata={
        "help": "in-process: conversations regenerated together (rows of one batched generation)"})
    # in-process, batch i samples with seed + i (i counts batches of the input, resumed or not);
    # through a server, conversation i of the input with seed + i
    seed: int = field(default=0, metadata={"help": "sampling seed"})
    max_turns: int | None = field(default=None, metadata={
        "help": "regenerate at most this many replies per conversation; it ends there (default: all)"})
    max_prompt_tokens: int = field(default=2048, metadata={
        "help": "a longer history cuts the conversation at that turn (its earlier turns are kept)"})

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, 1)
        _check_int("batch_size", self.batch_size, 1)
        _check_int("seed", self.seed, 0)
        _check_int("max_prompt_tokens", self.max_prompt_tokens, 1)
        if self.max_turns is not None:
            _check_int("max_turns", self.max_turns, 1, none=True)
        if not isinstance(self.temperature, (int, float)) or not (
                math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), "
                             f"got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def context(self) -> int:
        """Tokens of context a server needs per conversation in flight: the longest prompt and its reply."""
        return self.max_prompt_tokens + self.max_new_tokens


def _check_int(name: str, value: Any, low: int, *, none: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}{' or None' * none}, got {value!r}")


@dataclass(kw_only=True)
class RegenerateReport:
    conversations_done: int = 0  # written to the output
    conversations_skipped_resumed: int = 0  # already in the output file
    conversations_skipped_duplicate: int = 0  # an id seen earlier in the same input
    conversations_cut: int = 0  # written, but ended early (see "cut")
    conversations_dropped: int = 0  # cut before the first turn: not written
    turns_regenerated: int = 0  # replies written
    turns_truncated: int = 0  # replies written that hit max_new_tokens
    new_tokens: int = 0  # tokens generated, stop tokens included
    seconds: float = 0.0
    tokens_per_second: float = 0.0

    @property
    def conversations_run(self) -> int:
        """Conversations this run regenerated, written or dropped (the ones its seconds were spent on)."""
        return self.conversations_done + self.conversations_dropped

    def summary(self) -> str:
        """One line for the log or the terminal."""
        return (f"regenerated {self.turns_regenerated} turn(s) of {self.conversations_done} "
                f"conversation(s) ({self.turns_truncated} truncated, {self.conversations_cut} cut, "
                f"{self.conversations_dropped} dropped; "
                f"skipped {self.conversations_skipped_resumed} resumed, "
                f"{self.conversations_skipped_duplicate} duplicate); "
                f"{self.new_tokens} new tokens in {self.seconds:.1f} s "
                f"({self.tokens_per_second:.1f} tokens/s)")


# Called after each batch with the input conversations gone through so far (resumed and skipped ones included) and
# the report; returns how many of the input's conversations to go through in all (fewer: the run stops there).
Pace = Callable[[int, RegenerateReport], int]


@dataclass
class PendingConversation:
    """A conversation in flight; ``history`` always ends with a regenerated reply, or is empty."""

    conv: Conversation
    history: list[dict[str, str]] = field(default_factory=list)
    next_index: int = 0  # first message of conv.messages not in history yet
    prompt_end: int = 0  # index of the assistant turn being regenerated
    turns: int = 0
    truncated: int = 0
    cut: bool = False
    done: bool = False

    def next_prompt(self, max_turns: int | None) -> list[dict[str, str]] | None:
        """History + the messages up to the next assistant turn; None when nothing is left."""
        if max_turns is not None and self.turns >= max_turns:
            return None
        messages = self.conv.messages
        end = next((i for i in range(self.next_index, len(messages))
                    if messages[i]["role"] == "assistant"), None)
        if end is None:
            return None  # trailing user turns are dropped
        self.prompt_end = end
        return self.history + [dict(m) for m in messages[self.next_index:end]]

    def add_reply(self, prompt: list[dict[str, str]], text: str, truncated: bool) -> None:
        self.history = prompt + [{"role": "assistant", "content": text}]
        self.next_index = self.prompt_end + 1
        self.turns += 1
        self.truncated += truncated

    def record(self) -> dict[str, Any]:
        return {"id": self.conv.id, "messages": self.history, "regenerated": True,
                "num_regenerated_turns": self.turns, "truncated_turns": self.truncated}


def split_reply(tokens: list[int], stop_ids: Iterable[int]) -> tuple[list[int], bool]:
    """(reply tokens before the first stop token, whether a stop token was found)."""
    stops = set(stop_ids)
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[:i], True
    return tokens, False


def read_done_ids(path: str | Path) -> set[str]:
    """Ids already written to ``path``. A partial last line (a crash mid-write) is cut off the
    file with a warning; a complete line that is not a JSON object with an "id" raises
    ValueError."""
    path = Path(path)
    if not path.exists():
        return set()
    ids: set[str] = set()
    end = 0  # byte after the last complete line
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                break
            end += len(line)
            if line.strip():
                ids.add(_record_id(line, path, number))
    size = path.stat().st_size
    if end < size:
        log.warning("%s ends with a partial line (crash mid-write?): dropping its last %d "
                    "byte(s)", path, size - end)
        with open(path, "rb+") as f:
            f.truncate(end)
            os.fsync(f.fileno())
    return ids


def _record_id(line: bytes, path: Path, number: int) -> str:
    try:
        record = json.loads(line)
    except ValueError as err:
        raise ValueError(f"{path}: line {number} is not JSON ({err}); cannot resume from it: "
                         "move the file away or remove that line") from err
    if not isinstance(record, dict) or "id" not in record:
        raise ValueError(f"{path}: line {number} has no \"id\"; cannot resume from a file that "
                         "regenerate did not write")
    return str(record["id"])


def regenerate(target: Any, conversations: Iterable[Conversation], out_path: str | Path, *,
               config: RegenerateConfig, progress: bool = False,
               template_kwargs: dict[str, Any] | None = None, pace: Pace | None = None) -> RegenerateReport:
    """Replace every assistant reply of ``conversations`` by the target's own, turn by turn.

    Appends one JSONL line per finished conversation to ``out_path`` ({"id", "messages",
    "regenerated", "num_regenerated_turns", "truncated_turns"}), fsynced after each batch. Ids
    already in ``out_path`` are skipped, so an interrupted run resumes where it stopped; greedy
    (and, with the same batch_size, seeded sampling) resumes to the same output. With max_turns,
    messages after the last regenerated reply are dropped. Raises ValueError for a target without
    tokenizer or chat template and for a message with an unknown role or non-string content.
    ``template_kwargs``: the chat template's switches the prompts are rendered with (e.g.
    ``{"enable_thinking": False}``; None: the template's defaults). ``pace`` (see ``Pace``) may end the run before
    the input does: the batch that reaches its limit is cut there.
    """
    tokenizer = _check_tokenizer(target)
    out_path = Path(out_path)
    resumed, started = read_done_ids(out_path), set()
    if resumed:
        log.info("%s already holds %d conversation(s); skipping them", out_path, len(resumed))
    stop_ids = stop_token_ids(tokenizer, target.model)
    if not stop_ids:
        raise ValueError(f"the tokenizer has no eos_token_id and none of {END_OF_TURN_TOKENS}; "
                         "regenerate cannot tell where a reply ends")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    gen_config = _generation_config(config, stop_ids, pad_id)
    decoder = _lean_decoder(target)
    report = RegenerateReport()
    start = time.perf_counter()
    total = len(conversations) if hasattr(conversations, "__len__") else None
    seen, limit = 0, None  # input conversations gone through; pace's limit on them
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "a", encoding="utf-8") as out, \
            tqdm(total=total, desc="regenerate", unit="conv", disable=not progress) as bar:
        for index, batch in enumerate(_batches(conversations, config.batch_size)):
            if limit is not None and not (batch := batch[:max(limit - seen, 0)]):
                break
            pending = _admit(batch, resumed, started, report)
            if pending:
                with _seeded(config.seed + index, target.device):
                    _run_batch(target, pending, config, gen_config, stop_ids, report, decoder, template_kwargs)
                _write(out, pending, report)
            bar.update(len(batch))
            seen += len(batch)
            report.seconds = time.perf_counter() - start
            bar.set_postfix(tok_s=f"{report.new_tokens / max(report.seconds, 1e-9):.1f}")
            if pace is not None:
                limit = pace(seen, report)
                bar.total = limit if total is None else min(total, limit)
    report.seconds = time.perf_counter() - start
    report.tokens_per_second = report.new_tokens / report.seconds if report.seconds > 0 else 0.0
    log.info("%s", report.summary())
    return report


def _lean_decoder(target: Any) -> Any:
    """The batched lean decoder where the target's architecture has a lean forward, else None."""
    from eaglewire.decode.batched import BatchedDecoder
    from eaglewire.decode.runner import has_lean_forward

    return BatchedDecoder(target) if has_lean_forward(target) else None


def _check_tokenizer(target: Any) -> Any:
    tokenizer = target.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("regenerate needs a target whose tokenizer has a chat template; "
                         f"target {getattr(target, 'spec', '?')!r} has none")
    return tokenizer


def _generation_config(config: RegenerateConfig, stop_ids: list[int], pad_id: int):
    """Sampling fully set here, so the target's generation_config.json cannot change it."""
    from transformers import GenerationConfig

    common = dict(max_new_tokens=config.max_new_tokens, eos_token_id=stop_ids, pad_token_id=pad_id,
                  num_beams=1, min_length=0, repetition_penalty=1.0, no_repeat_ngram_size=0)
    if config.temperature == 0:
        return GenerationConfig(do_sample=False, **common)
    return GenerationConfig(do_sample=True, temperature=config.temperature, top_p=config.top_p,
                            top_k=0, **common)


def _batches(items: Iterable[Conversation], size: int) -> Iterator[list[Conversation]]:
    it = iter(items)
    while batch := list(itertools.islice(it, size)):
        yield batch


def admit(conversations: Iterable[Conversation], resumed: set[str], started: set[str],
          report: RegenerateReport) -> Iterator[tuple[int, Conversation]]:
    """(index, conversation) of those still to do, validated; their ids join ``started``. A repeated id
    and one already written (``resumed``) are counted in ``report`` and skipped."""
    for index, conv in enumerate(conversations):
        if conv.id in started:
            log.warning("conversation id %r appears again in the input; skipping the repeat",
                        conv.id)
            report.conversations_skipped_duplicate += 1
        elif conv.id in resumed:
            report.conversations_skipped_resumed += 1
        else:
            _check_messages(conv)
            started.add(conv.id)
            yield index, conv


def _admit(batch: list[Conversation], resumed: set[str], started: set[str],
           report: RegenerateReport) -> list[PendingConversation]:
    """The conversations of ``batch`` still to do, validated; their ids join ``started``."""
    return [PendingConversation(conv) for _, conv in admit(batch, resumed, started, report)]


def _check_messages(conv: Conversation) -> None:
    for i, message in enumerate(conv.messages):
        role, content = message.get("role"), message.get("content")
        if role not in _ROLES or not isinstance(content, str):
            raise ValueError(f"conversation {conv.id!r}, message {i}: expected role in {_ROLES} "
                             f"and string content, got role {role!r} and "
                             f"{type(content).__name__} content")


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seed torch's RNG inside the block only; the caller's RNG state is restored after."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def _run_batch(target: Any, pending: list[PendingConversation], config: RegenerateConfig, gen_config: Any,
               stop_ids: list[int], report: RegenerateReport, decoder: Any = None,
               template_kwargs: dict[str, Any] | None = None) -> None:
    """Advance all conversations of one batch turn by turn until each is done."""
    while active := _next_prompts(target.tokenizer, pending, config, template_kwargs):
        replies = _generate(target, [ids for _, _, ids in active], gen_config, stop_ids, decoder)
        for (p, prompt, _), (tokens, stopped) in zip(active, replies):
            report.new_tokens += len(tokens) + stopped
            text = target.tokenizer.decode(tokens, skip_special_tokens=True)
            if not text.strip():  # the loader rejects empty messages
                p.cut = p.done = True
            else:
                p.add_reply(prompt, text, truncated=not stopped)


def _next_prompts(tokenizer: Any, pending: list[PendingConversation], config: RegenerateConfig,
                  template_kwargs: dict[str, Any] | None = None
                  ) -> list[tuple[PendingConversation, list[dict[str, str]], list[int]]]:
    """(conversation, prompt messages, prompt ids) of every conversation with a turn to go."""
    active = []
    for p in pending:
        prompt = None if p.done else p.next_prompt(config.max_turns)
        if prompt is None:
            p.done = True
            continue
        ids = prompt_ids(tokenizer, prompt, template_kwargs)
        if len(ids) > config.max_prompt_tokens:
            log.debug("conversation %r: turn %d prompt has %d > max_prompt_tokens %d tokens; "
                      "cut there", p.conv.id, p.turns, len(ids), config.max_prompt_tokens)
            p.cut = p.done = True
            continue
        active.append((p, prompt, ids))
    return active


def prompt_text(tokenizer: Any, messages: list[dict[str, str]], template_kwargs: dict[str, Any] | None = None) -> str:
    """The chat template with the assistant's generation prompt (``template_kwargs``: e.g. enable_thinking)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **(template_kwargs or {}))


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]], template_kwargs: dict[str, Any] | None = None
               ) -> list[int]:
    """Prompt token ids as the target renders them: the chat template with the generation prompt."""
    return list(tokenizer(prompt_text(tokenizer, messages, template_kwargs), add_special_tokens=False)["input_ids"])


def _generate(target: Any, prompt_ids: list[list[int]], gen_config: Any, stop_ids: list[int],
              decoder: Any = None) -> list[tuple[list[int], bool]]:
    """One batched generation; per prompt (reply tokens without the stop token, stopped).

    With ``decoder`` (a ``BatchedDecoder``) the lean batched decoder runs, seeded from torch's
    RNG (seeded per batch by the caller); without, HF ``generate``.
    """
    if decoder is not None:
        return _generate_lean(decoder, prompt_ids, gen_config, stop_ids)
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), gen_config.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)  # [B, T]
    for row, ids in enumerate(prompt_ids):  # left padding: every prompt ends at column T - 1
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids):] = 1
    with torch.inference_mode():
        out = target.model.generate(input_ids=input_ids.to(target.device),
                                    attention_mask=attention_mask.to(target.device),
                                    generation_config=gen_config)
    new = out[:, width:].tolist()  # [B, N]; rows that stopped early are padded after the stop
    return [split_reply(tokens, stop_ids) for tokens in new]


def _generate_lean(decoder: Any, prompt_ids: list[list[int]], gen_config: Any,
                   stop_ids: list[int]) -> list[tuple[list[int], bool]]:
    """``_generate`` with the batched lean decoder and the same sampling settings as gen_config."""
    from eaglewire.decode.sampling import SamplingParams

    sampling, seed = SamplingParams(), 0
    if gen_config.do_sample:
        sampling = SamplingParams(temperature=gen_config.temperature, top_p=gen_config.top_p)
        seed = int(torch.randint(0, 2**62, ()))  # from the batch's seeded RNG: reproducible
    return decoder.generate(prompt_ids, max_new_tokens=gen_config.max_new_tokens,
                            stop_token_ids=stop_ids, sampling=sampling, seed=seed)


def _write(out: Any, pending: list[PendingConversation], report: RegenerateReport) -> None:
    """Append the finished conversations of a batch in input order, then flush + fsync."""
    for p in pending:
        if p.turns == 0:
            report.conversations_dropped += 1
            log.debug("conversation %r: no turn regenerated; not written", p.conv.id)
            continue
        out.write(json.dumps(p.record(), ensure_ascii=False) + "\n")
        report.conversations_done += 1
        report.conversations_cut += p.cut
        report.turns_regenerated += p.turns
        report.turns_truncated += p.truncated
    out.flush()
    os.fsync(out.fileno())
