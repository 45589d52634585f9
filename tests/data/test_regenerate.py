"""Regeneration: batched greedy == unbatched greedy == a plain argmax loop, resume, seeding.

The tiny target's 0.02-std random weights send every prompt to the same reply (" Poverty
Poverty ..."), which would make "batched == unbatched" pass vacuously; ``lively_target`` scales
the same weights by 10 so replies depend on the prompt. A scripted stub model covers what a
random model never does: stop tokens, empty replies.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from eaglewire.data.conversations import Conversation, load_conversations
from eaglewire.data.regenerate import RegenerateConfig, regenerate
from eaglewire.model.target import Target

NEW = 8  # max_new_tokens: every reply of the random target is truncated at NEW tokens


def _conv(cid: str, *turns: str, system: str | None = None) -> Conversation:
    """Alternating user/assistant messages from ``turns`` (a trailing user turn is allowed)."""
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]
    return Conversation(id=cid, messages=messages)


CONVERSATIONS = [  # 1-3 turns, prompts of different lengths: batches shrink turn by turn
    _conv("a", "Hi!", "Hello."),
    _conv("b", "Explain why the sky is blue in one long and winding sentence.", "Rayleigh.",
          "And sunsets?", "Red.", system="You are terse."),
    _conv("c", "one", "1", "two", "2", "three", "3"),
    _conv("d", "What is a fox?", "An animal.", "trailing user turn"),
    _conv("e", "Name a prime number larger than ten", "Eleven."),
]


def _run(target, conversations, path: Path, **config):
    return regenerate(target, conversations, path,
                      config=RegenerateConfig(max_new_tokens=NEW, max_prompt_tokens=400, **config))


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def unbatched(lively_target, tmp_path_factory) -> Path:
    """Greedy, one conversation at a time (no padding at all)."""
    path = tmp_path_factory.mktemp("regen") / "bs1.jsonl"
    _run(lively_target, CONVERSATIONS, path, batch_size=1)
    return path


def _argmax_reply(target, messages: list[dict[str, str]]) -> str:
    """Reference greedy decoding: a full forward per token, no cache, no padding, no generate."""
    tok = target.tokenizer
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    seq = torch.tensor([ids["input_ids"]])  # [1, T]
    stop = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    reply: list[int] = []
    with torch.inference_mode():
        for _ in range(NEW):
            nxt = int(target.model(seq).logits[0, -1].argmax())
            if nxt in stop:
                break
            reply.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], 1)
    return tok.decode(reply, skip_special_tokens=True)


def test_batched_greedy_equals_unbatched(lively_target, unbatched, tmp_path):
    path = tmp_path / "bs3.jsonl"
    report = _run(lively_target, CONVERSATIONS, path, batch_size=3)
    assert path.read_text() == unbatched.read_text()
    replies = [m["content"] for r in _records(path) for m in r["messages"]
               if m["role"] == "assistant"]
    assert len(set(replies)) == len(replies) == 8  # replies depend on the prompt: not vacuous
    assert report.turns_regenerated == 8 and report.turns_truncated == 8
    assert report.new_tokens == 8 * NEW and report.tokens_per_second > 0


def test_replies_are_greedy_continuations_of_regenerated_history(lively_target, unbatched):
    c = _records(unbatched)[2]["messages"]  # conversation "c": three turns
    assert c[1]["content"] == _argmax_reply(lively_target, c[:1])
    assert c[3]["content"] == _argmax_reply(lively_target, c[:3])  # c[1] is the regenerated reply
    assert c[5]["content"] == _argmax_reply(lively_target, c[:5])
    b = _records(unbatched)[1]["messages"]  # with a system message
    assert b[4]["content"] == _argmax_reply(lively_target, b[:4])


def test_messages_keep_structure_and_replace_replies(unbatched):
    records = _records(unbatched)
    assert [r["id"] for r in records] == [c.id for c in CONVERSATIONS]
    for record, conv in zip(records, CONVERSATIONS):
        original = conv.messages[:len(record["messages"])]
        assert [m["role"] for m in record["messages"]] == [m["role"] for m in original]
        assert record["messages"][-1]["role"] == "assistant"
        for new, old in zip(record["messages"], original):
            if old["role"] == "assistant":
                assert new["content"] != old["content"] and new["content"].strip()
            else:
                assert new == old
        turns = sum(m["role"] == "assistant" for m in conv.messages)
        assert record["regenerated"] is True
        assert record["num_regenerated_turns"] == record["truncated_turns"] == turns
    assert len(records[3]["messages"]) == 2  # "d": the trailing user turn is dropped
    loaded, report = load_conversations(unbatched)  # the loader reads the output back
    assert [c.messages for c in loaded] == [r["messages"] for r in records]
    assert not report.skipped


def test_resume_after_crash_mid_line(lively_target, unbatched, tmp_path, caplog):
    path = tmp_path / "out.jsonl"
    _run(lively_target, CONVERSATIONS, path, batch_size=2)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2])  # crashed mid-write
    with caplog.at_level(logging.WARNING, logger="eaglewire.data.regenerate"):
        report = _run(lively_target, CONVERSATIONS, path, batch_size=2)
    assert "partial line" in caplog.text
    assert report.conversations_skipped_resumed == 2 and report.conversations_done == 3
    resumed = path.read_text().splitlines(keepends=True)
    assert resumed[:2] == lines[:2]
    assert path.read_text() == unbatched.read_text()  # greedy: the same file as one clean run
    again = _run(lively_target, CONVERSATIONS, path, batch_size=2)  # nothing left to do
    assert again.conversations_done == 0 and again.conversations_skipped_resumed == 5
    assert [r["id"] for r in _records(path)] == ["a", "b", "c", "d", "e"]


def test_sampling_is_reproducible_from_the_seed(lively_target, unbatched, tmp_path):
    convs = CONVERSATIONS[:3]
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    runs = {}
    for name, seed in (("first", 7), ("again", 7), ("other", 8)):
        _run(lively_target, convs, tmp_path / name, batch_size=3, temperature=1.0, seed=seed)
        runs[name] = (tmp_path / name).read_text()
    assert runs["first"] == runs["again"]
    assert runs["first"] != runs["other"]
    assert runs["first"] != "".join(unbatched.read_text().splitlines(keepends=True)[:3])
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's RNG is left alone


@pytest.mark.parametrize("field, value, message", [
    ("max_new_tokens", 0, "max_new_tokens must be an integer >= 1, got 0"),
    ("batch_size", 2.5, "batch_size must be an integer >= 1, got 2.5"),
    ("seed", -1, "seed must be an integer >= 0, got -1"),
    ("max_turns", 0, "max_turns must be an integer >= 1 or None, got 0"),
    ("max_prompt_tokens", 0, "max_prompt_tokens must be an integer >= 1, got 0"),
    ("temperature", -0.5, r"temperature must be a finite number >= 0 \(0 = greedy\), got -0.5"),
    ("temperature", float("nan"), "temperature must be a finite number"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\], got 0.0"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\], got 1.5"),
])
def test_config_validation_names_field_value_and_range(field, value, message):
    with pytest.raises(ValueError, match=message):
        RegenerateConfig(**{field: value})


# ------------------------------------------------------------------ scripted stub target

class ScriptedModel(nn.Module):
    """A ``generate`` that returns scripted replies; records the batches it was given."""

    def __init__(self, script, pad_id: int):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))  # Target.device reads a parameter
        self.generation_config = None
        self.script, self.pad_id, self.calls = script, pad_id, []

    def generate(self, *, input_ids, attention_mask, generation_config):
        self.calls.append((input_ids.clone(), attention_mask.clone()))
        rows = [self.script(len(self.calls) - 1, row) for row in range(len(input_ids))]
        width = max(len(r) for r in rows)
        new = torch.tensor([r + [self.pad_id] * (width - len(r)) for r in rows])  # [B, N]
        return torch.cat([input_ids, new], 1)


def _stub(tokenizer, script) -> Target:
    return Target(model=ScriptedModel(script, tokenizer.pad_token_id), tokenizer=tokenizer)


def test_stop_token_is_stripped_and_batches_are_left_padded(smollm2_tokenizer, tmp_path):
    tok = smollm2_tokenizer
    end, words = tok.convert_tokens_to_ids("<|im_end|>"), tok.encode(" yes no")
    target = _stub(tok, lambda call, row: words + [end] if row == 0 else words * 10)
    path = tmp_path / "out.jsonl"
    report = _run(target, [_conv("short", "hi", "x"), _conv("long", "hello " * 20, "y")], path,
                  batch_size=2)
    first, second = _records(path)
    assert first["messages"][1]["content"] == " yes no" and first["truncated_turns"] == 0
    assert second["truncated_turns"] == 1  # no stop token: kept as truncated
    assert report.new_tokens == len(words) + 1 + len(words) * 10
    input_ids, mask = target.model.calls[0]
    short = int(mask[0].sum())
    assert short < mask.shape[1] and mask[0, :-short].eq(0).all() and mask[0, -short:].eq(1).all()
    assert input_ids[0, :-short].eq(tok.pad_token_id).all() and mask[1].eq(1).all()


def test_long_prompts_empty_replies_and_max_turns_cut_conversations(smollm2_tokenizer, tmp_path):
    tok = smollm2_tokenizer
    end, word = tok.convert_tokens_to_ids("<|im_end|>"), tok.encode(" ok")
    # call 0 gets long2, empty, many (long1's first prompt is too long); call 1 gets empty, many
    script = lambda call, row: [end] if (call, row) == (1, 0) else word + [end]  # noqa: E731
    convs = [_conv("long2", "hi", "x", "word " * 500, "y"), _conv("long1", "word " * 500, "x"),
             _conv("empty", "hi", "x", "again", "y"), _conv("many", "1", "x", "2", "y", "3", "z")]
    path = tmp_path / "out.jsonl"
    target = _stub(tok, script)
    report = _run(target, convs, path, batch_size=4, max_turns=2)
    assert [len(ids) for ids, _ in target.model.calls] == [3, 2]
    records = {r["id"]: r for r in _records(path)}
    assert set(records) == {"long2", "empty", "many"}  # "long1": nothing to keep, not written
    assert [m["role"] for m in records["long2"]["messages"]] == ["user", "assistant"]
    assert len(records["empty"]["messages"]) == 2  # its second reply came out empty
    assert records["many"]["num_regenerated_turns"] == 2 and len(records["many"]["messages"]) == 4
    assert (report.conversations_done, report.conversations_cut, report.conversations_dropped) \
        == (3, 2, 1)


def test_duplicate_ids_are_written_once(smollm2_tokenizer, tmp_path):
    tok = smollm2_tokenizer
    reply = tok.encode(" ok") + [tok.eos_token_id]
    path = tmp_path / "out.jsonl"
    report = _run(_stub(tok, lambda call, row: reply), [_conv("x", "a", "b")] * 3, path,
                  batch_size=2)
    assert [r["id"] for r in _records(path)] == ["x"]
    assert report.conversations_skipped_duplicate == 2


def test_pace_ends_the_run_at_its_limit_cutting_the_batch_and_counts_resumed_ones(smollm2_tokenizer, tmp_path):
    tok = smollm2_tokenizer
    reply = tok.encode(" ok") + [tok.eos_token_id]
    target, path = _stub(tok, lambda call, row: reply), tmp_path / "out.jsonl"
    seen = []

    def pace(limit):
        return lambda done, report: seen.append((done, report.conversations_run)) or limit

    config = RegenerateConfig(max_new_tokens=NEW, batch_size=2)
    report = regenerate(target, CONVERSATIONS, path, config=config, pace=pace(3))
    assert [r["id"] for r in _records(path)] == ["a", "b", "c"]  # the second batch cut to its limit
    assert seen == [(2, 2), (3, 3)] and report.conversations_done == 3
    report = regenerate(target, CONVERSATIONS, path, config=config, pace=pace(4))  # a resume, a higher limit
    assert [r["id"] for r in _records(path)] == ["a", "b", "c", "d"]
    assert seen[2:] == [(2, 0), (4, 1)] and report.conversations_skipped_resumed == 3
