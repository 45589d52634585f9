"""``doctor --traffic``: the users' prompts read in every form they come in, split by what differs,
judged against the held-out prompts with binomial noise, and the data to add named."""

from __future__ import annotations

import json

import pytest

from eaglewire.doctor.traffic import (SliceAccuracy, TrafficPrompt, difference_noise, length_bucket, load_traffic,
                                      looks_like_code, parse_prompt, slices_of, traffic_check)


def test_every_request_shape_becomes_a_prompt(tmp_path):
    chat = {"model": "m", "messages": [{"role": "developer", "content": "Be terse."},
                                       {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    logged = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}}
    lines = [json.dumps(chat), json.dumps(logged), json.dumps({"prompt": "complete me"}), json.dumps("a string"),
             "a plain line of text", "", json.dumps({"response": {"choices": []}})]
    path = tmp_path / "traffic.jsonl"
    path.write_text("\n".join(lines) + "\n")
    got = load_traffic(path, limit=10)
    assert got[0].messages == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]
    assert got[0].has_system and not got[1].has_system
    assert got[1].messages == [{"role": "user", "content": "a"}]  # the logged reply is not part of the prompt
    assert [p.text for p in got[2:]] == ["complete me", "a string", "a plain line of text"]
    assert len(got) == 5  # a logged response holds no prompt
    assert len(load_traffic(path, limit=2)) == 2
    listed = tmp_path / "traffic.json"
    listed.write_text(json.dumps([chat, "x"]))
    assert len(load_traffic(listed, limit=10)) == 2


def test_unreadable_traffic_is_refused_naming_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="--traffic"):
        load_traffic(tmp_path / "missing.jsonl", limit=4)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"id": 1}) + "\n")
    with pytest.raises(ValueError, match="holds no prompt"):
        load_traffic(empty, limit=4)
    with pytest.raises(ValueError, match="JSON object, string or text line"):
        parse_prompt(5, "f:1")


def test_code_and_prose_and_length_slices():
    assert looks_like_code("Fix this:\n```python\nx = 1\n```")
    assert looks_like_code("def f(x):\n    return x + 1\n")
    assert looks_like_code("for (int i = 0; i < n; i++) { a[i] = b[i]; }")
    assert not looks_like_code("Write a short poem about the sea, please. Make it rhyme.")
    assert [length_bucket(n) for n in (5, 128, 129, 3000)] == [
        "prompts of at most 128 tokens", "prompts of at most 128 tokens", "prompts of 129-512 tokens",
        "prompts over 2048 tokens"]
    prompt = TrafficPrompt([{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "hi"}],
                           None)
    assert slices_of(prompt, 40) == ["with a system prompt", "prompts of at most 128 tokens", "prose"]


def test_a_slice_that_accepts_clearly_less_names_the_data_to_add():
    slices = [SliceAccuracy("all traffic", 40, 2000, 0.38, 1.9),
              SliceAccuracy("with a system prompt", 20, 1000, 0.21, 1.4),
              SliceAccuracy("without a system prompt", 20, 1000, 0.44, 2.2),
              SliceAccuracy("prose", 40, 2000, 0.38, 1.9)]
    check = traffic_check(slices, heldout_acc0=0.45, heldout_n=2000, skipped=0)
    assert check.verdict == "warn"
    assert check.summary.startswith("traffic with a system prompt accepts 0.21 vs 0.45 held-out: add conversations "
                                    "with system prompts")
    assert "clearly less" in check.evidence[1] and "clearly less" not in check.evidence[2]
    assert "without a system prompt" not in check.fix  # within noise of the held-out data


def test_traffic_within_noise_is_no_drift_and_no_evidence_is_inconclusive():
    few = [SliceAccuracy("all traffic", 3, 60, 0.35, 1.7)]  # 0.10 less, but over 60 tokens: noise ±0.13
    assert difference_noise(0.35, 60, 0.45, 2000) > 0.10
    assert traffic_check(few, 0.45, 2000, 0).verdict == "ok"
    lower = [SliceAccuracy("all traffic", 40, 4000, 0.30, 1.6), SliceAccuracy("code", 40, 4000, 0.30, 1.6)]
    check = traffic_check(lower, 0.45, 4000, 1)
    assert check.verdict == "warn" and "code" in check.summary and "left out" in check.evidence[-1]
    assert traffic_check([SliceAccuracy("all traffic", 2, 0, 0.0, 1.0)], 0.45, 2000, 0).verdict == "inconclusive"


def test_doctor_measures_traffic_beside_the_held_out_prompts(tmp_path, chat_tiny_target):
    """The whole path on a tiny target: replies written, slices measured, the report and JSON carry them."""
    from eaglewire.doctor import run_doctor
    from eaglewire.doctor.doctor_config import DoctorConfig
    from tiny import save_random_draft

    target = chat_tiny_target
    save_random_draft(tmp_path / "d", target)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "an answer " * 4}]}) + "\n"
        for i in range(3)))
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("\n".join([json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                                           {"role": "user", "content": "hello"}]}),
                                  json.dumps({"prompt": "def f(x):\n    return x\n"}), "tell me a story"]) + "\n")
    report = run_doctor(DoctorConfig(draft=str(tmp_path / "d"), conversations=str(chats), engine_prompts=1,
                                     engine_tokens=4, tune=False, traffic=str(traffic), traffic_tokens=6),
                        target=target)
    check = {c.name: c for c in report.checks}["traffic drift"]
    names = [s["name"] for s in report.to_dict()["traffic"]["slices"]]
    assert names[0] == "all traffic" and {"with a system prompt", "without a system prompt", "code", "prose"} <= set(names)
    assert report.traffic["slices"][0]["prompts"] == 3 and report.traffic["held-out"]["prompts"] == 3
    assert check.evidence[0].startswith("held-out prompts, the target's own replies")
