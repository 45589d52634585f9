"""Load chat conversations (ShareGPT JSON, OpenAI-style JSONL, parquet, ``datasets`` directories)
and tokenize them with a loss mask.

Terms:
  record        one JSON object of the file, before normalisation
  conversation  a record that survived normalisation: roles mapped through ROLE_ALIASES,
                an optional leading system message, then user/assistant turns ending
                with an assistant turn
  loss mask     1 on the tokens the draft learns to predict: each assistant reply's content
                and the end-of-turn token right after it; 0 on all template scaffolding

The format is chosen by the file's bytes, never by its extension: a directory with
``state.json`` is a ``datasets`` directory (save_to_disk), ``PAR1`` a parquet file, a directory
of parquet files one table (in name order), an Arrow stream or file its own magic (``data/tables.py`` reads them, with pyarrow alone); else the first
non-whitespace character ('[' JSON array, '{' JSONL). A JSON array is parsed record by record, so
a file cut off mid-record (the shipped ShareGPT file is) still yields every complete record
before the cut; an Arrow stream cut mid-batch yields every complete batch (a cut-off parquet file
cannot be read: its index is at the end). In a table, a row is a record: its ``messages``
(role/content, as UltraChat's parquet) or ``conversations`` (ShareGPT's from/value) column,
and ``id`` where there is one; other columns (UltraChat's ``prompt``, ``prompt_id``) are not read.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglewire.data.tables import TableError, iter_rows, table_columns, table_kind

log = logging.getLogger(__name__)

ROLE_ALIASES: dict[str, str] = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}

_CHUNK_CHARS = 1 << 20  # JSON array read size; grows while one record does not fit
MAX_SKIPPED_LISTED = 1000  # skipped records named one by one in a report; the counts cover all

# ``--template plain``: a minimal documented template for base models without a chat template.
# A system message is a paragraph, a user turn "User: ...", an assistant turn "Assistant: ..."
# ended by the EOS token (which the loss mask covers, as it does an end-of-turn token); turns
# are separated by a blank line; the generation prompt is "Assistant: ".
PLAIN_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n\n"
    "{% else %}Assistant: {{ m['content'] }}{{ eos_token }}\n\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)
_SEPARATORS = " \t\r\n,\ufeff"


@dataclass(kw_only=True)
class Conversation:
    id: str  # the record's "id", else its index among the file's records
    messages: list[dict[str, str]]  # [{"role": "system"|"user"|"assistant", "content": str}]


@dataclass(kw_only=True)
class LoadReport:
    """What reading one file kept, skipped (reason -> count) and whether the file was cut off."""

    path: str
    loaded: int = 0
    skipped: collections.Counter = field(default_factory=collections.Counter)
    truncated: bool = False  # the file ended mid-record (or could not be parsed further)
    truncated_at_byte: int | None = None  # where the last complete record ended
    dropped_bytes: int = 0  # bytes after truncated_at_byte that were not parsed
    # the first MAX_SKIPPED_LISTED skipped records: {"id", "reason"} (+ "line" in JSONL, 1-based;
    # "row" in a table, 0-based)
    skipped_records: list[dict[str, Any]] = field(default_factory=list)

    def skip(self, reason: str, **where: Any) -> None:
        self.skipped[reason] += 1
        if len(self.skipped_records) < MAX_SKIPPED_LISTED:
            self.skipped_records.append({**where, "reason": reason})

    def to_dict(self) -> dict[str, Any]:
        """What a manifest records: counts, the skipped records by id, the truncation."""
        return {"path": self.path, "loaded": self.loaded, "skipped": dict(self.skipped.most_common()),
                "skipped_records": self.skipped_records,
                "skipped_records_listed": f"the first {MAX_SKIPPED_LISTED}" if sum(self.skipped.values())
                > MAX_SKIPPED_LISTED else "all",
                "truncated": self.truncated, "truncated_at_byte": self.truncated_at_byte,
                "dropped_bytes": self.dropped_bytes}

    def summary(self) -> str:
        """One line: how many conversations were kept, what was skipped and why, truncation."""
        text = f"{self.path}: kept {self.loaded} conversation(s)"
        total = sum(self.skipped.values())
        if total:
            reasons = ", ".join(f"{reason}: {n}" for reason, n in self.skipped.most_common())
            text += f"; skipped {total} ({reasons})"
        if self.truncated:
            text += (f"; file truncated: {self.dropped_bytes} byte(s) after the last complete "
                     f"record (ends at byte {self.truncated_at_byte}) were dropped")
        return text


def load_conversations(
    path: str | Path, *, limit: int | None = None, offset: int = 0
) -> tuple[list[Conversation], LoadReport]:
    """Read up to ``limit`` conversations after skipping the first ``offset`` usable ones.

    Parsing stops as soon as ``offset + limit`` conversations are kept, so the report then covers
    only the part of the file that was read. ``report.loaded`` is the number returned. Raises
    FileNotFoundError for a missing file and ValueError for an empty file, an unknown format or
    when no conversation is left to return.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of conversations or None, got {limit}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    report = LoadReport(path=str(path))
    conversations: list[Conversation] = []
    for i, conv in enumerate(iter_conversations(path, report=report)):
        if i >= offset:
            conversations.append(conv)
        if limit is not None and len(conversations) >= limit:
            break
    report.loaded = len(conversations)
    if not conversations:
        why = f" after skipping the first {offset} usable" if offset else ""
        raise ValueError(f"{path}: no usable conversations{why}; {report.summary()}")
    return conversations, report


def iter_conversations(path: str | Path, *, report: LoadReport) -> Iterator[Conversation]:
    """Stream the usable conversations of ``path``, counting kept and skipped ones in ``report``.

    The file is checked at once (FileNotFoundError, ValueError for empty/unknown format); records
    are parsed lazily, so stopping early stops reading.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"conversation file {path} does not exist; pass a ShareGPT JSON array (.json), "
            "OpenAI-style JSONL of {\"messages\": [...]} records, a parquet file or a datasets directory "
            "(save_to_disk) with a messages or conversations column, or "
            "eaglewire.core.presets.data_path('sharegpt')"
        )
    if table_kind(path) is not None:
        return _normalised(_iter_table(path, report), report)
    if path.is_dir():
        raise ValueError(f"{path} is a directory but not a datasets directory (no state.json), and it holds no "
                         "parquet files; pass a conversation file, a parquet file or a directory of them, or a "
                         "directory written by Dataset.save_to_disk")
    first = _first_char(path)
    if first is None:
        raise ValueError(f"{path} is empty; expected a ShareGPT JSON array or JSONL conversations")
    if first == "[":
        records = _iter_json_array(path, report)
    elif first == "{":
        records = _iter_jsonl(path, report)
    else:
        raise ValueError(f"{path}: expected a JSON array ('[') or JSON Lines ('{{'), "
                         f"found {first!r} as the first character")
    return _normalised(records, report)


def _normalised(records: Iterator[tuple[int, Any, dict]], report: LoadReport) -> Iterator[Conversation]:
    for index, record, where in records:
        rid = record.get("id") if isinstance(record, dict) else None
        cid = str(index if rid is None else rid)
        messages = normalise_record(record)
        if isinstance(messages, str):
            report.skip(messages, id=cid, **where)
            continue
        report.loaded += 1
        yield Conversation(id=cid, messages=messages)


def _first_char(path: Path) -> str | None:
    with open(path, encoding="utf-8", errors="replace") as f:
        while chunk := f.read(4096):
            stripped = chunk.lstrip(" \t\r\n\ufeff")
            if stripped:
                return stripped[0]
    return None


def _iter_json_array(path: Path, report: LoadReport) -> Iterator[tuple[int, Any, dict]]:
    """Yield (index, record, {}) of a JSON array one record at a time; a cut-off tail is reported."""
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False
    byte = 0  # byte offset of buf[pos] in the file
    last_end: int | None = None  # byte after '[' or after the last complete record
    index = 0
    with open(path, encoding="utf-8", newline="") as f:  # newline="": keep byte counts exact
        while True:
            start = pos
            while pos < len(buf) and buf[pos] in _SEPARATORS:
                pos += 1
            byte += len(buf[start:pos].encode("utf-8"))
            if pos == len(buf) or (last_end is not None and buf[pos] != "]"):
                try:
                    if pos == len(buf):
                        raise json.JSONDecodeError("no closing ']'", buf, pos)
                    record, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError as err:
                    if eof:  # a complete array with a syntax error still ends with ']'
                        kind = "invalid JSON" if buf.rstrip().endswith("]") else "file ends mid-record"
                        _report_cut(report, path, last_end or 0, f"{kind}: {err.msg}")
                        return
                    more = f.read(max(_CHUNK_CHARS, len(buf) - pos))  # doubling: no quadratic retry
                    buf, pos, eof = buf[pos:] + more, 0, not more
                    continue
                byte += len(buf[pos:end].encode("utf-8"))
                pos, last_end = end, byte
                yield index, record, {}
                index += 1
            elif last_end is None:  # the opening '[' (the format check saw it first)
                pos, byte = pos + 1, byte + 1
                last_end = byte
            else:
                return  # closing ']'


TABLE_COLUMNS = ("id", "conversations", "messages")


def _iter_table(path: Path, report: LoadReport) -> Iterator[tuple[int, Any, dict]]:
    """(index, record, {"row": index}) per row of a parquet/Arrow file or datasets directory; the
    columns are checked at once, the rows read lazily."""
    try:
        names = table_columns(path)
    except TableError as e:
        raise ValueError(str(e)) from e
    if not {"conversations", "messages"} & set(names):
        raise ValueError(f"{path} has no messages or conversations column (its columns: "
                         f"{', '.join(names) or 'none'}); eaglewire reads chat turns from messages "
                         "(role/content) or conversations (ShareGPT's from/value)")
    return _table_records(path, report)


def _table_records(path: Path, report: LoadReport) -> Iterator[tuple[int, Any, dict]]:
    cuts: list = []
    index = -1
    try:
        for index, row in enumerate(iter_rows(path, columns=list(TABLE_COLUMNS), cuts=cuts)):
            yield index, {k: v for k, v in row.items() if v is not None}, {"row": index}
    except TableError as e:
        raise ValueError(str(e)) from e
    for cut in cuts:  # rows of a cut-off Arrow stream end at its last complete batch
        report.truncated = True
        report.truncated_at_byte = cut.at_byte
        report.dropped_bytes += cut.dropped_bytes
        log.warning("%s: %s ends mid-batch after row %d; the rows before the cut are kept", path, cut.path.name,
                    index)


def _report_cut(report: LoadReport, path: Path, last_end: int, why: str) -> None:
    report.truncated = True
    report.truncated_at_byte = last_end
    report.dropped_bytes = path.stat().st_size - last_end
    log.warning("%s: cannot parse past byte %d (%s); dropped the %d byte(s) after the last "
                "complete record", path, last_end, why, report.dropped_bytes)


def _iter_jsonl(path: Path, report: LoadReport) -> Iterator[tuple[int, Any, dict]]:
    """Yield (index, record, {"line": n}) per non-blank line; a line that is not JSON is
    counted, listed in the report and skipped with a warning that names its line."""
    index, byte = 0, 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            start, byte = byte, byte + len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
                report.skip("malformed record", id=str(index), line=number)
                if not line.endswith(b"\n") and byte == path.stat().st_size:
                    _report_cut(report, path, start, f"last line {number} cut off: {err}")
                else:
                    log.warning("%s: line %d is not JSON (%s); skipping it", path, number, err)
                index += 1
                continue
            yield index, record, {"line": number}
            index += 1


def normalise_record(record: Any) -> list[dict[str, str]] | str:
    """Messages of one record, normalised; or the reason (a string) the record is skipped.

    Accepts ``conversations`` (ShareGPT ``from``/``value``) or ``messages`` (``role``/``content``).
    Consecutive same-role turns are merged with a blank line; trailing user turns are dropped.
    """
    if not isinstance(record, dict):
        return "malformed record"
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list):
        return "malformed record"
    if not turns:
        return "empty"
    messages: list[dict[str, str]] = []
    for turn in turns:
        if not isinstance(turn, dict):
            return "malformed record"
        raw_role = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        role = ROLE_ALIASES.get(raw_role.lower()) if isinstance(raw_role, str) else None
        if role is None:
            return f"unknown role {raw_role!r}"
        if not isinstance(content, str):
            return "non-string content"
        if not content.strip():
            return "empty message"
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n\n" + content
        else:
            messages.append({"role": role, "content": content})
    return _check_turn_order(messages)


def _check_turn_order(messages: list[dict[str, str]]) -> list[dict[str, str]] | str:
    body = messages[1:] if messages[0]["role"] == "system" else messages
    if not any(m["role"] == "assistant" for m in body):
        return "no assistant turn"
    if body[0]["role"] != "user":
        return "starts with assistant"
    if any(m["role"] == "system" for m in body):
        return "system message after the first turn"
    while messages[-1]["role"] == "user":
        messages.pop()
    return messages


@dataclass(kw_only=True)
class TokenizedConversation:
    id: str
    input_ids: list[int]
    loss_mask: list[int]  # same length as input_ids; 1 on tokens the draft learns to predict
    num_assistant_turns: int
    num_tokens_before_truncation: int

    @property
    def truncated(self) -> bool:
        return self.num_tokens_before_truncation > len(self.input_ids)


def tokenize_conversation(
    conv: Conversation, tokenizer: Any, *, max_length: int | None = None,
    chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None,
) -> TokenizedConversation:
    """Render ``conv`` with the chat template once, tokenize it and mark the assistant replies.

    The mask is 1 on every token overlapping an assistant reply's content and on the token right
    after it when that is a special/added token (the end-of-turn token, e.g. ``<|im_end|>``,
    ``<|eot_id|>``); template scaffolding is 0. Replies are located by rendering each prefix with
    ``add_generation_prompt=True``, so no template is hard-coded. ``chat_template`` overrides the
    tokenizer's; ``template_kwargs`` are the template's switches (e.g. ``enable_thinking``). Longer results are cut to ``max_length`` tokens; ``sum(loss_mask) == 0`` then
    means nothing is left to learn.
    """
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be a positive number of tokens or None, got {max_length}")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"tokenize_conversation needs a fast tokenizer (offset mapping); "
                         f"got {type(tokenizer).__name__}")
    render = _renderer(tokenizer, chat_template, template_kwargs)
    text = render(conv.messages, False)
    spans = _assistant_spans(conv, text, render)
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    input_ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    loss_mask = _mask_from_spans(input_ids, offsets, spans, _special_ids(tokenizer))
    bos = tokenizer.bos_token_id
    if bos is not None and _adds_bos(tokenizer) and (not input_ids or input_ids[0] != bos):
        input_ids, loss_mask = [bos] + input_ids, [0] + loss_mask  # template left BOS out
    num_tokens = len(input_ids)
    if max_length is not None:
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    return TokenizedConversation(
        id=conv.id, input_ids=input_ids, loss_mask=loss_mask,
        num_assistant_turns=len(spans), num_tokens_before_truncation=num_tokens,
    )


def _renderer(tokenizer: Any, chat_template: str | None, template_kwargs: dict[str, Any] | None = None):
    def render(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=chat_template, **(template_kwargs or {}),
        )
    return render


def _assistant_spans(conv: Conversation, text: str, render) -> list[tuple[int, int]]:
    """Character span in ``text`` of each assistant reply's content, in order."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(conv.messages):
        if message["role"] != "assistant":
            continue
        prefix = render(conv.messages[:i], True)
        start = max(cursor, len(prefix)) if text.startswith(prefix) else cursor
        content = message["content"]
        pos = text.find(content, start)
        if pos < 0:  # templates that trim the content
            content = content.strip()
            pos = text.find(content, start)
        if pos < 0:
            raise ValueError(f"conversation {conv.id}: the chat template does not reproduce the "
                             f"content of message {i} (assistant); cannot build the loss mask")
        spans.append((pos, pos + len(content)))
        cursor = pos + len(content)
    return spans


def _mask_from_spans(
    input_ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]],
    special_ids: set[int],
) -> list[int]:
    mask = [0] * len(input_ids)
    t = 0
    for start, end in spans:
        while t < len(offsets) and offsets[t][1] <= start:
            t += 1
        while t < len(offsets) and offsets[t][0] < end:
            mask[t] = 1  # overlaps the reply
            t += 1
        if t < len(offsets) and input_ids[t] in special_ids:
            mask[t] = 1  # end-of-turn token right after the reply
            t += 1
    return mask


def _special_ids(tokenizer: Any) -> set[int]:
    return set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())


def _adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer itself would put BOS in front (the rendered text must carry it)."""
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id
