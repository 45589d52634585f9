"""Conversation loading (ShareGPT JSON array, JSONL) and the chat-template loss mask."""

from __future__ import annotations

import json
import logging

import pytest

from eaglewire.data import conversations as C
from eaglewire.data.conversations import (
    Conversation,
    LoadReport,
    iter_conversations,
    load_conversations,
    tokenize_conversation,
)


def sharegpt(rid, *turns):
    """A ShareGPT record from (from, value) pairs."""
    return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def openai(*turns, **extra):
    return {"messages": [{"role": r, "content": c} for r, c in turns], **extra}


def write_array(path, records, *, newline="\n"):
    """Write a pretty JSON array; return the text and the byte end of each record."""
    parts = [json.dumps(r, indent=2, ensure_ascii=False).replace("\n", newline) for r in records]
    text, ends = "[" + newline, []
    for i, part in enumerate(parts):
        text += ("," + newline if i else "") + part
        ends.append(len(text.encode("utf-8")))
    text += newline + "]" + newline
    path.write_bytes(text.encode("utf-8"))
    return text, ends


GOOD = [
    sharegpt("a", ("human", "Hi"), ("gpt", "Hello!")),
    sharegpt("b", ("system", "Sei knapp ✓"), ("User", "2+2?"), ("ChatGPT", "4")),
    sharegpt("c", ("human", "Grüß dich ✓"), ("bing", "Hallo ✓"), ("human", "more"), ("bard", "sure")),
]


# ---------------------------------------------------------------- ShareGPT JSON array


def test_sharegpt_roles_are_mapped_and_ids_kept(tmp_path):
    path = tmp_path / "data.json"
    write_array(path, GOOD + [{"conversations": GOOD[0]["conversations"]}])
    convs, report = load_conversations(path)
    assert [c.id for c in convs] == ["a", "b", "c", "3"]  # no "id": index in the file
    assert convs[1].messages == [
        {"role": "system", "content": "Sei knapp ✓"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    assert [m["role"] for m in convs[2].messages] == ["user", "assistant", "user", "assistant"]
    assert convs[2].messages[0]["content"] == "Grüß dich ✓"
    assert report.loaded == 4 and not report.skipped
    assert not report.truncated and report.truncated_at_byte is None


def test_array_of_role_content_records(tmp_path):
    path = tmp_path / "data.json"
    write_array(path, [openai(("user", "Q"), ("assistant", "A"), id=7)])
    convs, _ = load_conversations(path)
    assert convs == [Conversation(id="7", messages=[{"role": "user", "content": "Q"},
                                                    {"role": "assistant", "content": "A"}])]


def test_same_role_turns_merge_and_trailing_user_turns_drop(tmp_path):
    path = tmp_path / "data.json"
    write_array(path, [sharegpt("m", ("human", "one"), ("human", "two"), ("gpt", "x"),
                                ("gpt", "y"), ("human", "unanswered"))])
    (conv,), report = load_conversations(path)
    assert conv.messages == [{"role": "user", "content": "one\n\ntwo"},
                             {"role": "assistant", "content": "x\n\ny"}]
    assert not report.skipped


def test_bad_conversations_are_skipped_and_counted(tmp_path):
    path = tmp_path / "data.json"
    bad = [
        sharegpt("e"),
        sharegpt("u", ("human", "only a question")),
        sharegpt("s", ("gpt", "I speak first"), ("human", "ok")),
        sharegpt("s2", ("system", "sys"), ("gpt", "I speak first"), ("human", "ok"), ("gpt", "y")),
        sharegpt("r", ("human", "hi"), ("xyz", "??"), ("gpt", "yo")),
        sharegpt("m1", ("human", "   "), ("gpt", "yo")),
        {"id": "n", "conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "a"}]},
        {"id": "x", "text": "no turns"},
        "not an object",
        sharegpt("late", ("human", "hi"), ("gpt", "yo"), ("system", "late"), ("human", "?"), ("gpt", "!")),
    ]
    write_array(path, [GOOD[0]] + bad)
    convs, report = load_conversations(path)
    assert [c.id for c in convs] == ["a"]
    assert report.skipped == {
        "empty": 1, "no assistant turn": 1, "starts with assistant": 2, "unknown role 'xyz'": 1,
        "empty message": 1, "non-string content": 1, "malformed record": 2,
        "system message after the first turn": 1,
    }
    summary = report.summary()
    assert "kept 1 conversation" in summary and "skipped 10" in summary
    assert "starts with assistant: 2" in summary and "unknown role 'xyz': 1" in summary


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_truncated_array_recovers_complete_records(tmp_path, monkeypatch, caplog, chunk, newline):
    monkeypatch.setattr(C, "_CHUNK_CHARS", chunk)  # small chunks: records span reads
    path = tmp_path / "cut.json"
    text, ends = write_array(path, GOOD, newline=newline)
    data = text.encode("utf-8")
    cut = ends[1] + (ends[2] - ends[1]) // 2  # in the middle of the third record
    path.write_bytes(data[:cut])
    with caplog.at_level(logging.WARNING, logger=C.__name__):
        convs, report = load_conversations(path)
    assert [c.id for c in convs] == ["a", "b"]
    assert report.truncated and report.truncated_at_byte == ends[1]
    assert report.dropped_bytes == cut - ends[1]
    assert "file ends mid-record" in caplog.text and f"past byte {ends[1]}" in caplog.text
    assert f"dropped the {cut - ends[1]} byte(s)" in caplog.text
    assert "truncated" in report.summary() and str(ends[1]) in report.summary()


@pytest.mark.parametrize("tail", ["", ",\n  ", ",\n  {\"id\": \"z\", \"conv"])
def test_array_without_closing_bracket_is_truncated(tmp_path, tail):
    path = tmp_path / "cut.json"
    text, ends = write_array(path, GOOD[:2])
    path.write_bytes(text.encode()[:ends[1]] + tail.encode())
    convs, report = load_conversations(path)
    assert len(convs) == 2 and report.truncated
    assert report.truncated_at_byte == ends[1] and report.dropped_bytes == len(tail)


def test_syntax_error_in_a_complete_array_keeps_the_records_before_it(tmp_path, caplog):
    path = tmp_path / "bad.json"
    text, ends = write_array(path, GOOD)
    path.write_bytes(text.encode()[: ends[1]] + b", {oops} " + text.encode()[ends[1]:])
    with caplog.at_level(logging.WARNING, logger=C.__name__):
        convs, report = load_conversations(path)
    assert [c.id for c in convs] == ["a", "b"]
    assert report.truncated and report.truncated_at_byte == ends[1]
    assert "invalid JSON" in caplog.text


def test_limit_stops_before_a_later_cut(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(C, "_CHUNK_CHARS", 16)
    path = tmp_path / "cut.json"
    text, ends = write_array(path, GOOD)
    path.write_bytes(text.encode()[: ends[2] - 5])
    with caplog.at_level(logging.WARNING):
        convs, report = load_conversations(path, limit=2)
    assert [c.id for c in convs] == ["a", "b"]
    assert not report.truncated and caplog.text == ""  # the cut was never read


def test_offset_and_limit(tmp_path):
    path = tmp_path / "data.json"
    write_array(path, GOOD)
    assert [c.id for c in load_conversations(path, offset=1)[0]] == ["b", "c"]
    convs, report = load_conversations(path, offset=1, limit=1)
    assert [c.id for c in convs] == ["b"] and report.loaded == 1
    with pytest.raises(ValueError, match="no usable conversations after skipping the first 3"):
        load_conversations(path, offset=3)
    with pytest.raises(ValueError, match="limit must be a positive number.*got 0"):
        load_conversations(path, limit=0)
    with pytest.raises(ValueError, match="offset must be >= 0, got -1"):
        load_conversations(path, offset=-1)


# ---------------------------------------------------------------- JSONL


def test_jsonl_skips_malformed_lines_and_flags_a_cut_last_line(tmp_path):
    lines = [
        json.dumps(openai(("system", "s"), ("user", "q1"), ("assistant", "a1"), id="first")),
        "",
        "{not json",
        json.dumps(GOOD[0]),  # ShareGPT-style record on a line
        json.dumps(openai(("assistant", "first"), ("user", "q"))),
        json.dumps(openai(("user", "q2"), ("assistant", "a2")))[:-9],  # cut, no newline
    ]
    path = tmp_path / "data.jsonl"
    text = "\n".join(lines)
    path.write_text(text)
    convs, report = load_conversations(path)
    assert [c.id for c in convs] == ["first", "a"]
    assert convs[0].messages[0] == {"role": "system", "content": "s"}
    assert report.skipped == {"malformed record": 2, "starts with assistant": 1}
    last_line_start = len(text) - len(lines[-1])
    assert report.truncated and report.truncated_at_byte == last_line_start


def test_jsonl_malformed_line_mid_file_is_not_truncation(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(GOOD[0]) + "\n{bad\n" + json.dumps(GOOD[1]) + "\n")
    convs, report = load_conversations(path)
    assert [c.id for c in convs] == ["a", "b"]
    assert report.skipped == {"malformed record": 1} and not report.truncated
    assert "malformed record: 1" in report.summary()


def test_format_follows_content_not_extension(tmp_path):
    as_array, as_lines = tmp_path / "array.jsonl", tmp_path / "lines.json"
    write_array(as_array, GOOD)
    as_lines.write_text("\n".join(json.dumps(r) for r in GOOD) + "\n")
    assert load_conversations(as_array)[0] == load_conversations(as_lines)[0]


# ---------------------------------------------------------------- errors


def test_missing_file_says_what_to_pass(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; pass a ShareGPT JSON array"):
        load_conversations(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match="data_path"):
        iter_conversations(tmp_path / "nope.json", report=LoadReport(path="x"))  # eager check


@pytest.mark.parametrize("content", ["", "  \n\t"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "empty.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"{path} is empty"):
        load_conversations(path)


def test_unknown_format(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("id,text\n")
    with pytest.raises(ValueError, match=r"expected a JSON array \('\['\) or JSON Lines.*'i'"):
        load_conversations(path)


def test_no_usable_conversations_names_path_and_reasons(tmp_path):
    path = tmp_path / "bad.json"
    write_array(path, [sharegpt("s", ("gpt", "hi"), ("human", "x"), ("gpt", "y")),
                       sharegpt("r", ("robot", "beep"))])
    with pytest.raises(ValueError) as err:
        load_conversations(path)
    msg = str(err.value)
    assert str(path) in msg and "no usable conversations" in msg
    assert "starts with assistant: 1" in msg and "unknown role 'robot': 1" in msg


def test_empty_array(tmp_path):
    path = tmp_path / "data.json"
    path.write_text("[ ]")
    with pytest.raises(ValueError, match="no usable conversations"):
        load_conversations(path)


def test_iter_streams_and_fills_the_report(tmp_path):
    path = tmp_path / "data.json"
    write_array(path, [GOOD[0], sharegpt("s", ("gpt", "x"))] + GOOD[1:])
    report = LoadReport(path=str(path))
    stream = iter_conversations(path, report=report)
    assert next(stream).id == "a" and report.loaded == 1
    assert next(stream).id == "b" and report.skipped == {"starts with assistant": 1}


# ---------------------------------------------------------------- the shipped ShareGPT file


@pytest.mark.real
def test_real_sharegpt_file():
    from eaglewire.core.presets import data_path

    path = data_path("sharegpt")
    convs, report = load_conversations(path)
    raw = path.read_bytes()
    assert report.truncated and 0 < report.dropped_bytes == len(raw) - report.truncated_at_byte
    records = json.loads(raw[: report.truncated_at_byte] + b"]")  # independent parse of the head
    assert len(records) == 17_671
    assert report.loaded + sum(report.skipped.values()) == 17_671
    assert report.loaded == len(convs) > 10_000
    roles = {t["from"] for r in records for t in r["conversations"]}
    assert roles == {"human", "gpt", "system", "chatgpt", "bing", "bard", "user"}
    assert report.skipped["starts with assistant"] > 0
    assert convs[0].id == records[0]["id"] == "QWJhYvA_0"
    for conv in convs:
        roles = [m["role"] for m in conv.messages if m["role"] != "system"]
        assert roles[0] == "user" and roles[-1] == "assistant"
        assert all(a != b for a, b in zip(roles, roles[1:]))  # alternating


# ---------------------------------------------------------------- tokenization and loss mask


TWO_TURNS = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Say OK."},
    {"role": "assistant", "content": "OK"},
]


def runs(ids, mask):
    """Contiguous runs of masked token ids."""
    out, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            out, cur = out + [cur], []
    return out + [cur] if cur else out


def check_mask(tok, conv, tc, *, template=None, end="<|im_end|>", strip=False):
    """Masked runs decode to reply + end-of-turn; the rest decodes to the scaffolding."""
    text = tok.apply_chat_template(conv.messages, tokenize=False, chat_template=template)
    assert tc.input_ids == tok(text, add_special_tokens=False)["input_ids"]  # no extra BOS
    assert len(tc.loss_mask) == len(tc.input_ids)
    replies = [m["content"].strip() if strip else m["content"]
               for m in conv.messages if m["role"] == "assistant"]
    assert [tok.decode(r) for r in runs(tc.input_ids, tc.loss_mask)] == [r + end for r in replies]
    marked = [dict(m, content="\x00") if m["role"] == "assistant" else m for m in conv.messages]
    scaffolding = tok.apply_chat_template(marked, tokenize=False, chat_template=template)
    scaffolding = scaffolding.replace("\x00" + end, "")
    assert "\x00" not in scaffolding
    unmasked = [i for i, m in zip(tc.input_ids, tc.loss_mask) if not m]
    assert tok.decode(unmasked) == scaffolding
    assert tc.num_assistant_turns == len(replies)
    return scaffolding


def test_chatml_mask_without_system(smollm2_tokenizer):
    tok = smollm2_tokenizer
    conv = Conversation(id="t", messages=TWO_TURNS)
    tc = tokenize_conversation(conv, tok)
    scaffolding = check_mask(tok, conv, tc)
    assert "You are a helpful AI assistant named SmolLM" in scaffolding  # default system prompt
    assert scaffolding.count("<|im_start|>assistant\n") == 2
    assert tc.input_ids[0] == 1 and tc.input_ids[-1] == 198  # <|im_start|> ... "\n"
    assert tc.loss_mask[-1] == 0 and tc.loss_mask[-2] == 1 and tc.input_ids[-2] == 2
    assert tc.id == "t" and not tc.truncated


def test_chatml_mask_with_system(smollm2_tokenizer):
    tok = smollm2_tokenizer
    conv = Conversation(id="s", messages=[{"role": "system", "content": "Answer briefly."}]
                        + TWO_TURNS)
    tc = tokenize_conversation(conv, tok)
    scaffolding = check_mask(tok, conv, tc)
    assert "Answer briefly." in scaffolding and "SmolLM" not in scaffolding


def test_reply_text_also_in_a_user_turn(smollm2_tokenizer):
    tok = smollm2_tokenizer
    conv = Conversation(id="d", messages=[{"role": "user", "content": "OK"},
                                          {"role": "assistant", "content": "OK"}])
    tc = tokenize_conversation(conv, tok)
    check_mask(tok, conv, tc)
    assert sum(tc.loss_mask) == 2  # "OK" + <|im_end|>, not the user's "OK"


LLAMA3_LIKE = (  # Llama-3 layout with other special tokens standing in, content trimmed
    "{{ '<|endoftext|>' }}{% for m in messages %}"
    "{{ '<jupyter_start>' + m['role'] + '<jupyter_text>\n\n' + m['content'] | trim + '<file_sep>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<jupyter_start>assistant<jupyter_text>\n\n' }}"
    "{% endif %}"
)
PLAIN_TEXT = (  # no special tokens at all: nothing but the content is learned
    "{% for m in messages %}{{ '### ' + m['role'] + ':\n' + m['content'] + '\n\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant:\n' }}{% endif %}"
)


def test_generic_llama3_like_template(smollm2_tokenizer):
    tok = smollm2_tokenizer
    messages = [{"role": "system", "content": "sys"}, *TWO_TURNS[:1],
                {"role": "assistant", "content": "  Padded reply.\n"}, *TWO_TURNS[2:]]
    conv = Conversation(id="l", messages=messages)
    tc = tokenize_conversation(conv, tok, chat_template=LLAMA3_LIKE)
    scaffolding = check_mask(tok, conv, tc, template=LLAMA3_LIKE, end="<file_sep>", strip=True)
    assert "<|im_end|>" not in scaffolding and scaffolding.startswith("<|endoftext|>")
    assert tok.chat_template != LLAMA3_LIKE  # the tokenizer itself is untouched


def test_generic_plain_text_template(smollm2_tokenizer):
    tok = smollm2_tokenizer
    conv = Conversation(id="p", messages=TWO_TURNS)
    tc = tokenize_conversation(conv, tok, chat_template=PLAIN_TEXT)
    check_mask(tok, conv, tc, template=PLAIN_TEXT, end="")


def test_template_that_drops_replies_is_an_error(smollm2_tokenizer):
    drops = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match="conversation t: the chat template does not reproduce"):
        tokenize_conversation(Conversation(id="t", messages=TWO_TURNS), smollm2_tokenizer,
                              chat_template=drops)


def test_max_length(smollm2_tokenizer):
    tok = smollm2_tokenizer
    conv = Conversation(id="t", messages=TWO_TURNS)
    full = tokenize_conversation(conv, tok)
    cut = tokenize_conversation(conv, tok, max_length=10)
    assert cut.input_ids == full.input_ids[:10] and cut.loss_mask == full.loss_mask[:10]
    assert cut.truncated and cut.num_tokens_before_truncation == len(full.input_ids)
    assert sum(cut.loss_mask) == 0  # cut inside the default system prompt: nothing to learn
    same = tokenize_conversation(conv, tok, max_length=len(full.input_ids))
    assert not same.truncated and same.input_ids == full.input_ids
    with pytest.raises(ValueError, match="max_length must be a positive number of tokens.*got 0"):
        tokenize_conversation(conv, tok, max_length=0)


def test_bos_is_prepended_when_the_template_leaves_it_out(smollm2_tokenizer, monkeypatch):
    tok = smollm2_tokenizer
    conv = Conversation(id="t", messages=TWO_TURNS)
    monkeypatch.setattr(C, "_adds_bos", lambda tokenizer: True)
    tc = tokenize_conversation(conv, tok, chat_template=PLAIN_TEXT)  # starts with "###"
    assert tc.input_ids[0] == tok.bos_token_id and tc.loss_mask[0] == 0
    monkeypatch.undo()
    plain = tokenize_conversation(conv, tok, chat_template=PLAIN_TEXT)
    assert tc.input_ids[1:] == plain.input_ids and tc.loss_mask[1:] == plain.loss_mask


# ---------------------------------------------------------------- parquet and datasets directories

def ultrachat_table(records):
    """UltraChat's parquet shape: prompt, prompt_id, messages (list of {content, role})."""
    import pyarrow as pa

    return pa.table({"prompt": [r["messages"][0]["content"] for r in records],
                     "prompt_id": [f"p{i:04d}" for i in range(len(records))],
                     "messages": [r["messages"] for r in records]})


CHATS = [openai(("user", "Hi"), ("assistant", "Hello!")),
         openai(("system", "be brief"), ("user", "2+2?"), ("assistant", "4"), ("user", "and 3+3?")),
         openai(("assistant", "I speak first"), ("user", "ok")),
         openai(("user", "Grüß dich ✓"), ("assistant", "Hallo ✓"))]


def test_parquet_messages_like_ultrachat(tmp_path):
    import pyarrow.parquet as pq

    path = tmp_path / "train_sft-00000-of-00001"  # no extension: the bytes say parquet
    pq.write_table(ultrachat_table(CHATS), path)
    convs, report = load_conversations(path)
    want, _ = load_conversations(write_jsonl(tmp_path / "same.jsonl", CHATS))
    assert [(c.id, c.messages) for c in convs] == [(c.id, c.messages) for c in want]  # ids: the row index
    assert report.skipped == {"starts with assistant": 1}
    assert report.skipped_records == [{"id": "2", "row": 2, "reason": "starts with assistant"}]
    assert "skipped 1 (starts with assistant: 1)" in report.summary() and not report.truncated


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def save_dataset(records, path, **kw):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(records).save_to_disk(str(path), **kw)
    return path


def test_datasets_directory_of_sharegpt_conversations_reads_as_the_json(tmp_path):
    records = GOOD + [sharegpt("u", ("human", "only a question")), sharegpt("r", ("human", "hi"), ("xyz", "?"))]
    write_array(tmp_path / "data.json", records)
    want, want_report = load_conversations(tmp_path / "data.json")
    convs, report = load_conversations(save_dataset(records, tmp_path / "ds"))
    assert [(c.id, c.messages) for c in convs] == [(c.id, c.messages) for c in want]
    assert report.skipped == want_report.skipped == {"no assistant turn": 1, "unknown role 'xyz'": 1}
    assert [r["id"] for r in report.skipped_records] == ["u", "r"]


def test_a_cut_arrow_stream_keeps_its_complete_batches(tmp_path, caplog):
    records = [openai(("user", f"question {i}"), ("assistant", f"answer {i}")) for i in range(2500)]
    ds = save_dataset(records, tmp_path / "ds")
    arrow = next(ds.glob("*.arrow"))
    data = arrow.read_bytes()
    arrow.write_bytes(data[:-500])  # the last batch (datasets writes 1,000 rows a batch) is cut
    with caplog.at_level(logging.WARNING):
        convs, report = load_conversations(ds)
    assert len(convs) == 2000 and convs[-1].messages[0]["content"] == "question 1999"
    assert report.truncated and report.dropped_bytes == len(data) - 500 - report.truncated_at_byte > 0
    assert "file truncated" in report.summary() and "cannot read past byte" in caplog.text


def test_unreadable_or_wrong_tables_say_what_to_do(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    cut = tmp_path / "cut.parquet"
    pq.write_table(ultrachat_table(CHATS), cut)
    cut.write_bytes(cut.read_bytes()[:-20])
    with pytest.raises(ValueError, match="cut-off parquet file is unreadable .* fetch it again"):
        load_conversations(cut)
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "text.parquet")
    with pytest.raises(ValueError, match=r"no messages or conversations column \(its columns: text\)"):
        load_conversations(tmp_path / "text.parquet")
    datasets = pytest.importorskip("datasets")
    split = datasets.Dataset.from_list(CHATS)
    datasets.DatasetDict({"train_sft": split, "test_sft": split}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ValueError, match=r"is a DatasetDict \(splits: train_sft, test_sft\); pass one split"):
        load_conversations(tmp_path / "dict")
    convs, _ = load_conversations(tmp_path / "dict" / "train_sft")
    assert len(convs) == 3
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not a datasets directory"):
        load_conversations(tmp_path / "plain")


def test_prepare_reads_a_datasets_directory(tmp_path, chat_tiny_target):
    from eaglewire.data.prepare import PrepareConfig, prepare
    from eaglewire.data.shards import ShardDataset

    records = [openai(("user", f"Question {i}?"), ("assistant", f"Answer {i}.")) for i in range(3)]
    ds = save_dataset(records + [openai(("assistant", "first"), ("user", "?"))], tmp_path / "ds")
    summary = prepare(PrepareConfig(out=str(tmp_path / "shards"), data=str(ds), max_length=64, batch_tokens=256,
                                    shard_tokens=64), target=chat_tiny_target, progress=False)
    assert summary.sequences == 3
    assert len(ShardDataset(tmp_path / "shards")) == 3
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert set(manifest["source"]["file"]["files"]) == {p.name for p in ds.iterdir()}
    assert manifest["status"]["load_report"]["skipped"] == {"starts with assistant": 1}
    assert manifest["status"]["load_report"]["skipped_records"] == [{"id": "3", "row": 3,
                                                                     "reason": "starts with assistant"}]


def test_a_directory_of_parquet_files_reads_as_one_table_in_name_order(tmp_path):
    """The hub's data/train-0000k-of-00003.parquet: rows in file-name order (not the order written),
    row indices running on across files (ids and the skip report), other files left out."""
    import pyarrow.parquet as pq

    records = CHATS + [openai(("user", f"question {i}"), ("assistant", f"answer {i}")) for i in range(5)]
    parts = tmp_path / "data"
    parts.mkdir()
    for k in (2, 0, 1):  # written out of order
        pq.write_table(ultrachat_table(records[3 * k:3 * k + 3]), parts / f"train-{k:05d}-of-00003.parquet")
    (parts / "README.md").write_text("# not a table\n")
    (parts / ".cache").write_bytes(b"PAR1 hidden")
    convs, report = load_conversations(parts)
    want, want_report = load_conversations(write_jsonl(tmp_path / "same.jsonl", records))
    assert [(c.id, c.messages) for c in convs] == [(c.id, c.messages) for c in want]
    assert report.skipped_records == [{"id": "2", "row": 2, "reason": "starts with assistant"}]
    assert report.skipped == want_report.skipped and not report.truncated
    assert [c.id for c in load_conversations(parts, offset=4, limit=2)[0]] == ["5", "6"]  # across a file boundary


def test_a_parquet_directory_of_several_splits_or_with_a_cut_file_says_what_to_do(tmp_path):
    import pyarrow.parquet as pq

    parts = tmp_path / "data"
    parts.mkdir()
    pq.write_table(ultrachat_table(CHATS), parts / "train_sft-00000-of-00001-5a1b.parquet")
    pq.write_table(ultrachat_table(CHATS), parts / "test_sft-00000-of-00001-9c0d.parquet")
    with pytest.raises(ValueError, match=r"several splits \(test_sft, train_sft\); pass one split's files"):
        load_conversations(parts)
    (parts / "test_sft-00000-of-00001-9c0d.parquet").unlink()
    second = parts / "train_sft-00001-of-00002-5a1b.parquet"
    pq.write_table(ultrachat_table(CHATS), second)
    second.write_bytes(second.read_bytes()[:-20])
    with pytest.raises(ValueError, match=r"train_sft-00001-of-00002-5a1b.parquet cannot be read as parquet"):
        load_conversations(parts)
    with pytest.raises(ValueError, match="not a datasets directory .* holds no parquet files"):
        load_conversations(tmp_path / "empty" if (tmp_path / "empty").mkdir() is None else None)
