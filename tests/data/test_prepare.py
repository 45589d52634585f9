"""prepare cannot lose data silently: keyed resumes, a completion flag, skipped records on record."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest

import eaglewire.data.prepare as prepare_module
from eaglewire.data.conversations import PLAIN_TEMPLATE
from eaglewire.data.prepare import PrepareConfig, prepare
from eaglewire.data.shards import ShardError
from eaglewire.data.sources import ShardSource


def write_chats(path, n: int, *, start: int = 0, extra: str = "") -> None:
    """JSONL without ids: a record's id is its line index, as with most real files."""
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
        {"role": "assistant", "content": f"It is {2 * i}, since {i} and {i} make {2 * i}."}]}) + "\n"
        for i in range(start, start + n)) + extra)


def config(tmp_path, data, **kw) -> PrepareConfig:
    return PrepareConfig(**{"out": str(tmp_path / "shards"), "data": str(data), "max_length": 64,
                            "batch_tokens": 256, "shard_tokens": 64, **kw})


def manifest(tmp_path) -> dict:
    return json.loads((tmp_path / "shards" / "manifest.json").read_text())


def test_rerun_with_other_input_is_refused_with_the_fix(tmp_path, chat_tiny_target):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_chats(a, 3)
    write_chats(b, 5, start=100)  # ids 0..4 again, other conversations
    prepare(config(tmp_path, a), target=chat_tiny_target, progress=False)
    with pytest.raises(ValueError, match=r"other input.*--out.*--overwrite"):
        prepare(config(tmp_path, b), target=chat_tiny_target, progress=False)
    assert manifest(tmp_path)["source"]["path"] == str(a)  # the record is left alone

    # The same file rewritten in place is other input too.
    write_chats(a, 3, start=50)
    with pytest.raises(ValueError, match="file: recorded"):
        prepare(config(tmp_path, a), target=chat_tiny_target, progress=False)


def test_rerun_with_other_settings_is_refused_and_overwrite_starts_over(tmp_path, chat_tiny_target):
    data = tmp_path / "a.jsonl"
    write_chats(data, 4)
    prepare(config(tmp_path, data), target=chat_tiny_target, progress=False)
    with pytest.raises(ValueError, match=r"max_length: recorded 64, now 50"):
        prepare(config(tmp_path, data, max_length=50), target=chat_tiny_target, progress=False)
    s = prepare(config(tmp_path, data, max_length=50, overwrite=True), target=chat_tiny_target, progress=False)
    assert s.resumed_sequences == 0 and s.sequences == 4
    m = manifest(tmp_path)
    assert m["source"]["max_length"] == 50
    assert max(n for sh in m["shards"] for n in sh["sequence_lengths"]) <= 50


def test_same_command_resumes(tmp_path, chat_tiny_target):
    data = tmp_path / "a.jsonl"
    write_chats(data, 4)
    prepare(config(tmp_path, data), target=chat_tiny_target, progress=False)
    s = prepare(config(tmp_path, data), target=chat_tiny_target, progress=False)
    assert s.resumed_sequences == 4 and s.sequences == 4


def test_an_interrupted_run_is_marked_and_train_refuses_it(tmp_path, chat_tiny_target, monkeypatch, caplog):
    data = tmp_path / "a.jsonl"
    write_chats(data, 12)
    real = prepare_module.capture_batch
    calls = []

    def capture_then_stop(*a, **k):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(prepare_module, "capture_batch", capture_then_stop)
    with pytest.raises(KeyboardInterrupt):
        prepare(config(tmp_path, data, batch_tokens=64, shard_tokens=1), target=chat_tiny_target, progress=False)
    m = manifest(tmp_path)
    assert m["status"]["complete"] is False and m["status"]["conversations"] == 12
    stored = m["totals"]["sequences"]
    assert 0 < stored < 12

    with pytest.raises(ShardError, match=rf"incomplete.*{stored} sequences from the 12 conversations.*"
                                         r"--allow-incomplete-data"):
        ShardSource(str(tmp_path / "shards"), chat_tiny_target)
    with caplog.at_level(logging.WARNING):
        source = ShardSource(str(tmp_path / "shards"), chat_tiny_target, allow_incomplete=True)
    assert len(source.sequence_ids) == stored
    assert "INCOMPLETE" in caplog.text and "12 conversations" in caplog.text

    monkeypatch.setattr(prepare_module, "capture_batch", real)
    prepare(config(tmp_path, data, batch_tokens=64, shard_tokens=1), target=chat_tiny_target, progress=False)  # the resume
    assert manifest(tmp_path)["status"]["complete"] is True
    assert len(ShardSource(str(tmp_path / "shards"), chat_tiny_target).sequence_ids) == 12


def test_skipped_records_and_truncation_go_into_the_manifest(tmp_path, chat_tiny_target, caplog):
    data = tmp_path / "a.jsonl"
    bad = json.dumps({"messages": [{"role": "user", "content": "only a question"}]})
    write_chats(data, 2, extra=f"{{not json\n{bad}\n" + '{"messages": [{"role": "user", "con')
    with caplog.at_level(logging.INFO):
        prepare(config(tmp_path, data), target=chat_tiny_target, progress=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("line 3 is not JSON" in w for w in warnings)  # seen without -v
    report = manifest(tmp_path)["status"]["load_report"]
    assert report["skipped_records"] == [{"id": "2", "line": 3, "reason": "malformed record"},
                                         {"id": "3", "line": 4, "reason": "no assistant turn"},
                                         {"id": "4", "line": 5, "reason": "malformed record"}]
    assert report["truncated"] is True and report["dropped_bytes"] > 0


# ---------------------------------------------------------------- base models (no chat template)

@pytest.fixture(scope="module")
def base_target_dir(tmp_path_factory, chat_tiny_target):
    """The tiny target saved with a tokenizer that has no chat template, like a base model."""
    import copy

    path = tmp_path_factory.mktemp("base")
    tok = copy.deepcopy(chat_tiny_target.tokenizer)
    tok.chat_template = None
    chat_tiny_target.model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return path


def test_base_model_is_refused_before_loading_with_the_options(tmp_path, base_target_dir, monkeypatch):
    data = tmp_path / "a.jsonl"
    write_chats(data, 2)

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before the template check")

    monkeypatch.setattr(prepare_module, "load_target", no_loading)
    with pytest.raises(ValueError, match=r"no chat template.*--chat-template FILE.*--template plain"):
        prepare(config(tmp_path, data, target=str(base_target_dir)), progress=False)
    with pytest.raises(FileNotFoundError, match="--chat-template"):
        prepare(config(tmp_path, data, target=str(base_target_dir), chat_template=str(tmp_path / "none.jinja")),
                progress=False)


@pytest.mark.parametrize("how", ["plain", "file"])
def test_base_model_with_a_template_records_it_and_trains(tmp_path, base_target_dir, how):
    from eaglewire.model.target import load_target

    data = tmp_path / "a.jsonl"
    write_chats(data, 4)
    if how == "plain":
        text, kw = PLAIN_TEMPLATE, {"template": "plain"}
    else:
        text = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}{{ eos_token }}{% endfor %}" \
               "{% if add_generation_prompt %}<assistant> {% endif %}"
        (tmp_path / "t.jinja").write_text(text)
        kw = {"chat_template": str(tmp_path / "t.jinja")}
    s = prepare(config(tmp_path, data, target=str(base_target_dir), device="cpu", **kw), progress=False)
    assert s.sequences == 4 and s.loss_tokens > 0
    m = manifest(tmp_path)
    assert m["contract"]["target"]["chat_template_sha256"] == hashlib.sha256(text.encode()).hexdigest()

    # train's source adopts the recorded template for the base target, so the contract matches
    base = load_target(str(base_target_dir), device="cpu")
    source = ShardSource(str(tmp_path / "shards"), base)
    assert len(source.sequence_ids) == 4


def test_plain_and_chat_template_together_are_refused():
    with pytest.raises(ValueError, match="not both"):
        PrepareConfig(out="x", template="plain", chat_template="t.jinja")
    with pytest.raises(ValueError, match="template must be one of chat, plain"):
        PrepareConfig(out="x", template="raw")


@pytest.mark.parametrize("kw, message", [
    (dict(labels="topk"), r"--labels 'topk' is not a labels mode"),
    (dict(state_dtype="fp16"), r"--state-dtype bf16 or fp8"),
    (dict(storage_dtype="fp16", state_dtype="bf16"), r"--state-dtype fp16 or fp8"),
])
def test_compact_storage_flags_are_checked_before_any_work(kw, message):
    with pytest.raises(ValueError, match=message):
        PrepareConfig(out="o", **kw)


# ---------------------------------------------------------------- the chat template's thinking switch

@pytest.fixture(scope="module")
def thinking(chat_tiny_target):
    from tiny import thinking_target

    return thinking_target(chat_tiny_target)


def _think_tokens(tokenizer) -> list[int]:
    return tokenizer("<think>", add_special_tokens=False)["input_ids"]


def _holds(ids: list[int], part: list[int]) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_the_thinking_switch_renders_the_shards_and_goes_into_their_contract(tmp_path, thinking):
    """--no-enable-thinking renders every sequence with it (the template's <think></think> block is in the
    stored tokens) and the contract records it; without the flag the contract records the template's
    defaults ({}), and the sequences hold no such block."""
    from eaglewire.data.remote_regenerate import RemoteConfig
    from eaglewire.data.shards import ShardDataset

    data = tmp_path / "chats.jsonl"
    write_chats(data, 3)
    prepare(config(tmp_path, data, max_length=128, remote=RemoteConfig(enable_thinking=False)),
            target=thinking, progress=False)
    ds = ShardDataset(tmp_path / "shards")
    assert ds.contract.chat_template_kwargs == {"enable_thinking": False}
    assert manifest(tmp_path)["source"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert all(_holds(ds[i]["input_ids"].tolist(), _think_tokens(thinking.tokenizer)) for i in range(len(ds)))
    prepare(config(tmp_path, data, max_length=128, out=str(tmp_path / "plain")), target=thinking, progress=False)
    plain = ShardDataset(tmp_path / "plain")
    assert plain.contract.chat_template_kwargs == {}
    assert not _holds(plain[0]["input_ids"].tolist(), _think_tokens(thinking.tokenizer))


def test_in_process_regeneration_renders_its_prompts_with_the_switch(tmp_path, thinking, monkeypatch):
    from eaglewire.data import regenerate as regenerate_module
    from eaglewire.data.remote_regenerate import RemoteConfig

    seen = []
    real = regenerate_module.prompt_ids
    monkeypatch.setattr(regenerate_module, "prompt_ids", lambda tok, m, kw=None: seen.append(kw) or real(tok, m, kw))
    data = tmp_path / "chats.jsonl"
    write_chats(data, 2)
    prepare(config(tmp_path, data, max_length=128, regenerate=True, max_new_tokens=4,
                   remote=RemoteConfig(enable_thinking=False)), target=thinking, progress=False)
    assert seen and all(kw == {"enable_thinking": False} for kw in seen)
    assert manifest(tmp_path)["contract"]["chat_template_kwargs"] == {"enable_thinking": False}


def test_conversations_from_regenerate_carry_their_switch_and_another_flag_is_refused(tmp_path, thinking):
    """--data OUT.jsonl of `eaglewire regenerate`: its OUT.meta.json says which switch the replies were made
    with; the shards are rendered with it and record it. A flag saying otherwise without --regenerate is
    refused naming both (the replies were written under the file's)."""
    from eaglewire.data.remote_regenerate import META_FORMAT, RemoteConfig, meta_path

    data = tmp_path / "replies.jsonl"
    write_chats(data, 2)
    meta_path(data).write_text(json.dumps({"format": META_FORMAT, "version": 1, "settings": {
        "mode": "server", "model": "m", "chat_template_kwargs": {"enable_thinking": False}}}))
    prepare(config(tmp_path, data, max_length=128), target=thinking, progress=False)
    assert manifest(tmp_path)["contract"]["chat_template_kwargs"] == {"enable_thinking": False}
    with pytest.raises(ValueError, match=r'regenerated with chat_template_kwargs \{"enable_thinking": false\}.*'
                                         r"asks for chat_template_kwargs \{\"enable_thinking\": true\}"):
        prepare(config(tmp_path, data, out=str(tmp_path / "other"), remote=RemoteConfig(enable_thinking=True)),
                target=thinking, progress=False)

@pytest.mark.parametrize("dtype, native, want", [("auto", True, "bf16"), ("auto", False, "fp32"),
                                                 ("fp32", True, "fp32")])
def test_capture_precision_follows_the_cpu_and_is_recorded(tmp_path, target_dir, monkeypatch, dtype, native, want):
    """--dtype auto captures in bf16 where the CPU computes it natively; the manifest says which and why,
    and the contract's fingerprint (dtype, a soft field) records the target's compute dtype."""
    import eaglewire.core.machine as machine

    monkeypatch.setattr(machine, "native_bf16", lambda flags=None: native)
    data = tmp_path / "a.jsonl"
    write_chats(data, 3)
    prepare(config(tmp_path, data, target=str(target_dir), device="cpu", dtype=dtype), progress=False)
    m = manifest(tmp_path)
    recorded = m["status"]["capture_precision"]
    assert (recorded["dtype"], recorded["requested"], recorded["device"]) == (want, dtype, "cpu")
    assert ("no native bf16" in recorded["reason"]) == (dtype == "auto" and not native)
    assert m["contract"]["target"]["dtype"] == {"bf16": "bfloat16", "fp32": "float32"}[want]


def test_a_target_handed_to_prepare_records_its_own_dtype(tmp_path, chat_tiny_target):
    data = tmp_path / "a.jsonl"
    write_chats(data, 2)
    prepare(config(tmp_path, data), target=chat_tiny_target, progress=False)
    recorded = manifest(tmp_path)["status"]["capture_precision"]
    assert recorded["dtype"] == "fp32" and "handed to prepare" in recorded["reason"]
