"""The doctor compares the chat-template switch the draft's data was rendered with against serving's:
from --chat-template-kwargs, the engine's launch flags (as vLLM 0.33.0, SGLang 0.5.23 and llama-server
read them) and the traffic's own chat_template_kwargs; judged by what the target's template renders."""

from __future__ import annotations

import json

import pytest

from eaglewire.core.contract import HiddenStateContract
from eaglewire.doctor.verdicts import DoctorReport
from eaglewire.doctor.template_switch import ServingSwitch, check_template_switch, renders_alike, traffic_switches
from eaglewire.doctor.traffic import load_traffic

OFF, ON = {"enable_thinking": False}, {"enable_thinking": True}


@pytest.fixture(scope="module")
def thinking(chat_tiny_target):
    from tiny import thinking_target

    return thinking_target(chat_tiny_target)


def contract(target, kwargs):
    return HiddenStateContract(aux_boundaries=(2, 4, 5), target=target.fingerprint, chat_template_kwargs=kwargs)


def serving(engine="eaglewire", flags=None, kwargs=None):
    """How serving is launched, as check_template_switch takes it."""
    return dict(engine=engine, engine_flags=flags, chat_template_kwargs=kwargs)


def judge(target, trained, launch, traffic=None):
    report = DoctorReport(draft="d", target="t")
    return check_template_switch(report, contract(target, trained), target.tokenizer, traffic, **launch)


def test_the_template_decides_whether_two_switches_differ(thinking, chat_tiny_target):
    assert not renders_alike(thinking.tokenizer, OFF, {})
    assert renders_alike(thinking.tokenizer, ON, {})  # the template's own default: no mismatch
    assert renders_alike(chat_tiny_target.tokenizer, OFF, {})  # SmolLM2's template ignores the switch
    assert not renders_alike(None, OFF, {})  # no template to render: the mappings differ


def test_serving_with_another_switch_than_training_fails_naming_both_and_the_flag(thinking):
    flags = "vllm serve M --speculative-config '{\"method\": \"eagle3\"}'"  # no default: the template's
    check = judge(thinking, OFF, serving("vllm", flags))
    assert check.verdict == "fail"
    assert 'chat_template_kwargs {"enable_thinking": false}' in check.summary and "defaults" in check.summary
    assert "--default-chat-template-kwargs '{\"enable_thinking\": false}'" in check.fix
    assert "--enable-thinking" in check.fix  # or retrain on what serving renders
    assert judge(thinking, OFF, serving("vllm", flags + " --default-chat-template-kwargs "
                                              "'{\"enable_thinking\": false}'")).verdict == "ok"
    llama = judge(thinking, OFF, serving("llamacpp", "llama-server -m t.gguf"))
    assert llama.verdict == "fail" and "--reasoning off" in llama.fix
    assert judge(thinking, {}, serving(kwargs='{"enable_thinking": true}')).verdict == "ok"
    assert judge(thinking, {}, serving(kwargs="[1]")).verdict == "fail"  # unreadable: named


def test_traffic_requests_carry_their_own_switch_over_the_launch_default(tmp_path, thinking):
    path = tmp_path / "traffic.jsonl"
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    path.write_text("\n".join(json.dumps(r) for r in [
        {**chat, "chat_template_kwargs": OFF}, {"body": {**chat, "chat_template_kwargs": ON}}, chat,
        {"prompt": "plain"}]) + "\n")
    traffic = load_traffic(path, 10)
    assert traffic[0].template_kwargs == OFF and traffic[1].template_kwargs == ON
    assert [(s.kwargs, s.source) for s in traffic_switches(traffic, None)] == [
        (OFF, "1 of 3 traffic chat request(s)"), (ON, "1 of 3 traffic chat request(s)")]
    check = judge(thinking, ON, serving(), traffic)
    assert check.verdict == "fail" and "1 of 3 traffic" in check.summary and "send" in check.fix
    assert judge(thinking, OFF, serving(), traffic[:1]).verdict == "ok"
    # ordinary requests (no chat_template_kwargs of their own) under a launch default render with the default
    launch = ServingSwitch(OFF, "launch flags")
    assert [(s.kwargs, s.source) for s in traffic_switches(traffic[2:], launch)] == [
        (OFF, "1 of 1 traffic chat request(s)")]


def test_a_draft_that_records_no_switch_is_skipped_and_no_source_adds_no_check(thinking):
    assert judge(thinking, None, serving(kwargs='{"enable_thinking": false}')).verdict == "skip"
    assert judge(thinking, OFF, serving()) is None


def test_the_doctor_reports_it_end_to_end(tmp_path, thinking):
    from eaglewire.doctor import run_doctor
    from eaglewire.doctor.doctor_config import DoctorConfig
    from tiny import save_random_draft

    save_random_draft(tmp_path / "d", thinking, chat_template_kwargs=OFF)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "an answer " * 4}]}) + "\n"
        for i in range(2)))
    report = run_doctor(DoctorConfig(draft=str(tmp_path / "d"), conversations=str(chats), engine_prompts=0,
                                     tune=False, chat_template_kwargs='{"enable_thinking": true}'), target=thinking)
    check = {c.name: c for c in report.checks}["template switch"]
    assert check.verdict == "fail" and report.status == "failed"
