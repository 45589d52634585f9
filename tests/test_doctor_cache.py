"""The doctor's cache (doctor/cache.py): a second run with the same draft, target, data and settings reads
the server-independent checks back instead of recomputing them, prints the same report, and anything those
checks read, changed, recomputes them. The conftest gives each test an empty cache of its own."""

from __future__ import annotations

import json

import pytest

from eaglewire.doctor import cache as doctor_cache
from eaglewire.doctor.doctor_config import DoctorConfig

PROMPTS = ["Name three primary colors.", "What is the capital of France?", "Write a haiku about rain.",
           "Give me two tips for better sleep.", "What does a CPU do?", "Why is the sky blue?"]


@pytest.fixture
def setup(tmp_path, chat_tiny_target):
    from tiny import save_random_draft

    save_random_draft(tmp_path / "d", chat_tiny_target)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": p}, {"role": "assistant", "content": f"Here is my answer to: {p} " * 3}]}) + "\n"
        for i, p in enumerate(PROMPTS)))
    return DoctorConfig(draft=str(tmp_path / "d"), conversations=str(chats), engine_prompts=1, engine_tokens=8)


def _run(config, target):
    from eaglewire.doctor import run_doctor

    return run_doctor(config, target=target)


def _checks(report):
    return [(c.name, c.verdict, c.summary, c.evidence, c.fix) for c in report.checks]


def test_a_second_run_reads_the_checks_back_and_prints_the_same_report(setup, chat_tiny_target):
    cold = _run(setup, chat_tiny_target)
    assert "reused" not in cold.facts and "capture" in cold.stage_seconds
    assert len(list(doctor_cache.cache_root().glob("*.json"))) == 1
    warm = _run(setup, chat_tiny_target)
    assert "capture" not in warm.stage_seconds and "tune" not in warm.stage_seconds  # nothing recomputed
    computed = len(cold.checks) - [c.name for c in cold.checks].index("vocab coverage")  # the rest run each time
    assert warm.facts["reused"].startswith(f"{computed} checks computed at ")
    assert _checks(warm) == _checks(cold) and warm.layouts == cold.layouts and warm.accuracy == cold.accuracy
    assert warm.facts["judged tokens"] == cold.facts["judged tokens"]
    body = lambda r: [line for line in r.render().splitlines()[2:]]  # noqa: E731 (the facts line differs)
    assert body(warm) == body(cold)


def test_no_cache_neither_reads_nor_writes(setup, chat_tiny_target):
    from dataclasses import replace

    _run(setup, chat_tiny_target)
    (written,) = doctor_cache.cache_root().glob("*.json")
    again = _run(replace(setup, cache=False), chat_tiny_target)
    assert "reused" not in again.facts and "capture" in again.stage_seconds
    assert list(doctor_cache.cache_root().glob("*.json")) == [written]


def test_what_the_checks_read_is_keyed_and_where_to_send_is_not(setup, chat_tiny_target, tmp_path):
    from dataclasses import replace

    from eaglewire.doctor.measure import Sequence
    import torch

    seqs = [Sequence("a", torch.tensor([1, 2, 3, 4]), torch.tensor([False, False, True, True]))]
    from eaglewire.core.configs import config_record

    key = lambda c, s=seqs, v=None: doctor_cache.cache_key(config_record(c), tmp_path / "d",  # noqa: E731
                                                           chat_tiny_target, s, v)
    base = key(setup)
    # where to send the served check, where to write, how long to probe: the cached checks never read them
    assert key(replace(setup, engine_url="http://x:1", json="/tmp/r.json", probe_tokens=0)) == base
    assert key(replace(setup, steps=2)) != base
    assert key(setup, v="0.33.0") != base  # the server's version names the layouts swept
    other = [Sequence("a", torch.tensor([1, 2, 3, 5]), torch.tensor([False, False, True, True]))]
    assert key(setup, other) != base
    (tmp_path / "chats.jsonl").write_text((tmp_path / "chats.jsonl").read_text() + "\n")  # a file's content
    assert key(setup) != base
    weights = next((tmp_path / "d").glob("*.safetensors"))
    before = key(setup)
    weights.write_bytes(weights.read_bytes()[:-1] + bytes([weights.read_bytes()[-1] ^ 1]))  # one bit of the draft
    assert key(setup) != before


def test_a_cut_or_foreign_cache_file_is_a_miss(tmp_path, caplog):
    cached = doctor_cache.Cached(before=[], after=[], layouts=[], accuracy={"acc@0": 0.5}, facts={"judged tokens": 9},
                                 extras={}, stage_seconds={"capture": 1.0}, created=doctor_cache.now())
    path = doctor_cache.store("k", cached, tmp_path)
    assert doctor_cache.load("k", tmp_path) == cached
    path.write_text(path.read_text()[:60])  # cut mid-write by another tool, or a full disk
    with caplog.at_level("WARNING"):
        assert doctor_cache.load("k", tmp_path) is None
    path.write_text(json.dumps({"format": 0, "checks": []}))  # another format
    assert doctor_cache.load("k", tmp_path) is None
    assert caplog.text.count("unreadable") == 2


def test_an_unwritable_cache_loses_only_the_reuse(tmp_path, caplog):
    root = tmp_path / "taken"
    root.write_text("a file where the cache directory would be")  # fails for root too, unlike a chmod
    cached = doctor_cache.Cached(before=[], after=[], layouts=[], accuracy={}, facts={"judged tokens": 0}, extras={},
                                 stage_seconds={}, created=doctor_cache.now())
    with caplog.at_level("WARNING"):
        assert doctor_cache.store("k", cached, root) is None
    assert "not written" in caplog.text
    assert doctor_cache.store("k", cached, tmp_path / "dir") is not None
    assert doctor_cache.load("k", tmp_path / "dir") == cached
