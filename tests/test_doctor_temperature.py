"""``doctor --temperature``: the temperature users sample at, given or read from the traffic's requests,
llama-server's --temp or the target's generation_config.json as vLLM 0.33.0 and SGLang 0.5.23 apply
it, and the draft's expected τ there (the engines' rule: a greedy draft token x accepted with p_T(x))
beside greedy's, on the training-time unroll of the held-out sequences."""

from __future__ import annotations

import json

import pytest
import torch

from eaglewire.acceptance.trace import trace_text
from eaglewire.doctor.measure import Sequence
from eaglewire.doctor.verdicts import DoctorReport
from eaglewire.doctor.temperature import (SamplingSettings, check_sampling, reply_spans, sampled_acceptance,
                                       served_temperature, traffic_temperature)
from eaglewire.engines.llamacpp import launch_temperature as llamacpp_temperature
from eaglewire.engines.sglang import launch_temperature as sglang_temperature
from eaglewire.engines.vllm import launch_temperature as vllm_temperature

LAYOUT = [2, 4, 5]
STEPS = 3


@pytest.fixture(scope="module")
def small(one_thread):
    """A tiny random target over 256 tokens (its predictions depend on the context) and a random
    EAGLE-3 draft for it: acceptance is neither 0 nor 1 anywhere."""
    from eaglewire.model.draft import DraftConfig, Eagle3Draft
    from tiny import tiny_target

    target = tiny_target("llama", vocab_size=256, num_layers=8, hidden_size=64, initializer_range=0.2)
    V = target.vocab_size
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig.from_target(target.text_config, num_aux=len(LAYOUT), draft_vocab_size=V,
                                                vocab_size=V))
    draft.set_vocab(torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    return target, draft.eval()


@pytest.fixture(scope="module")
def sequences():
    """Held-out-like sequences: a prompt, a reply, and (the second) a user turn between two replies."""
    g = torch.Generator().manual_seed(1)
    one = torch.randint(0, 256, (40,), generator=g)
    two = torch.randint(0, 256, (48,), generator=g)
    mask_one = torch.arange(40) >= 8
    mask_two = (torch.arange(48) >= 6) & (torch.arange(48) < 20) | (torch.arange(48) >= 30)
    return [Sequence("a", one, mask_one), Sequence("b", two, mask_two)]


def by_hand(target, draft, seqs, temperature: float) -> float:
    """Mean over every reply position t (a round whose drafted tokens all lie inside its reply) of
    1 + Σ_k Π_(j<=k) p_T(x_j), from trace.py's probabilities in float64."""
    total, n = 0.0, 0
    for seq in seqs:
        p = trace_text(target, draft, LAYOUT, seq.input_ids.tolist(), 0, steps=STEPS,
                       temperature=temperature).target_prob.double()  # [S, T]
        for s, e in reply_spans(seq.loss_mask):
            for t in range(s - 1, e - 1 - STEPS):
                alive, gained = 1.0, 1.0
                for j in range(STEPS):
                    alive *= float(p[j, t])
                    gained += alive
                total, n = total + gained, n + 1
    return total / n


def test_sampled_tau_is_the_expected_acceptance_of_the_traced_probabilities(small, sequences):
    target, draft = small
    assert reply_spans(sequences[1].loss_mask) == [(6, 20), (30, 48)]
    got = sampled_acceptance(target, draft, LAYOUT, sequences, steps=STEPS, temperature=0.7)
    # the same products, summed in float32 (torch.cumprod) there and float64 here: equal to rounding
    assert got.tau == pytest.approx(by_hand(target, draft, sequences, 0.7), abs=1e-5)
    assert got.greedy_tau == pytest.approx(by_hand(target, draft, sequences, 0.0), abs=1e-9)
    assert got.rounds == (40 - 8 - STEPS) + (14 - STEPS) + (18 - STEPS) and got.sequences == 2
    assert 1.0 <= got.greedy_tau <= STEPS + 1 and 1.0 < got.tau <= STEPS + 1
    assert got.tau != pytest.approx(got.greedy_tau, abs=1e-4)
    # near T = 0 the target's distribution is its argmax: sampling accepts what greedy does
    cold = sampled_acceptance(target, draft, LAYOUT, sequences, steps=STEPS, temperature=1e-4)
    assert cold.tau == pytest.approx(cold.greedy_tau, abs=1e-3)


def test_a_dflash_draft_is_measured_on_its_blocks(small, sequences):
    """A DFlash draft's n tokens come from one block (trace_blocks): the trained block for eaglewire,
    n + 1 tokens for llama.cpp, which runs [last token, mask x n]."""
    from eaglewire.acceptance.trace import trace_blocks
    from tiny import random_dflash_draft

    target, _ = small
    draft, _ = random_dflash_draft(target, tuple(LAYOUT), block_size=4)
    for engine, block_len in (("eaglewire", 4), ("llamacpp", 3)):
        got = sampled_acceptance(target, draft, LAYOUT, sequences, steps=2, temperature=0.7, engine=engine)
        assert got.chain == 2 and 1.0 < got.tau <= 3.0
        total, n = 0.0, 0
        for seq in sequences:
            p = trace_blocks(target, draft, LAYOUT, seq.input_ids.tolist(), 0, temperature=0.7,
                             block_lens=[block_len])[block_len].target_prob.double()
            for s, e in reply_spans(seq.loss_mask):
                for t in range(s - 1, e - 1 - 2):
                    total, n = total + 1 + float(p[0, t]) + float(p[0, t] * p[1, t]), n + 1
        assert got.tau == pytest.approx(total / n, abs=1e-5)


def config(**kw):
    base = dict(temperature=None, traffic=None, traffic_prompts=32, engine="eaglewire", engine_flags=None,
                target="no-such-target-dir", draft="runs/draft")
    return SamplingSettings(**{**base, **kw})


def test_the_temperature_users_sample_at_is_read_from_the_traffic_and_llama_server_and_named(small, sequences,
                                                                                             tmp_path):
    target, draft = small
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("\n".join([
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": 0.7}),
        json.dumps({"custom_id": "r", "body": {"prompt": "complete me", "temperature": 0.7}}),
        json.dumps({"prompt": "cold", "temperature": 0}),
        json.dumps({"messages": [{"role": "user", "content": "no temperature"}]}),
        json.dumps({"response": {"choices": []}})]) + "\n")  # a logged response: no request
    found = traffic_temperature(traffic, limit=32)
    assert (found.value, found.source) == (0.7, "2 of 4 --traffic requests")
    assert any("0 (1)" in n for n in found.notes) and any("1 send none" in n for n in found.notes)

    report = DoctorReport(draft="d", target="t")
    check = check_sampling(report, config(traffic=str(traffic)), target, draft, LAYOUT, sequences, STEPS)
    assert check.name == "sampling" and check.verdict == "warn"
    assert check.summary.startswith("users sample at T 0.7 (from 2 of 4 --traffic requests); at that temperature "
                                    "the draft accepts τ ")
    assert f"for a chain of {STEPS} vs " in check.summary and "greedy" in check.summary
    assert report.sampling["temperature"] == 0.7 and report.to_dict()["sampling"]["chain"] == STEPS
    assert f"τ {report.sampling['sampled_tau']:.2f}" in check.summary

    llama = DoctorReport(draft="d", target="t")
    check = check_sampling(llama, config(engine="llamacpp", engine_flags="llama-server -m t.gguf --temp 0.8 -c 4096"),
                           target, draft, LAYOUT, sequences, STEPS)
    assert check.verdict == "warn"
    assert "users sample at T 0.8 (from llama-server's --temp in --engine-flags)" in check.summary
    assert "common_sampler_sample_and_accept_n" in check.evidence[0]
    assert llamacpp_temperature("--temperature=-1", None).value == 0.0  # llama.cpp clamps at 0: greedy


def test_greedy_users_are_ok_and_unknown_ones_get_no_line(small, sequences):
    target, draft = small
    report = DoctorReport(draft="d", target="t")
    check = check_sampling(report, config(temperature=0.0), target, draft, LAYOUT, sequences, STEPS)
    assert check.verdict == "ok" and "greedily" in check.summary and not report.sampling
    assert check_sampling(report, config(), target, draft, LAYOUT, sequences, STEPS) is None
    assert check_sampling(report, config(engine="llamacpp", engine_flags="llama-server -m t.gguf"),
                          target, draft, LAYOUT, sequences, STEPS) is None  # no --temp given: not known
    bad = check_sampling(report, config(engine="llamacpp", engine_flags="--temp warm"), target, draft, LAYOUT,
                         sequences, STEPS)
    assert bad.verdict == "skip" and "--temp 'warm'" in bad.summary


def test_vllm_and_sglang_default_requests_to_the_models_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    found = vllm_temperature("vllm serve M", tmp_path)
    assert found.value == 0.6 and "generation_config.json" in found.source and "vLLM" in found.source
    assert any("do_sample false" in n for n in found.notes)  # neither engine reads it
    assert vllm_temperature("vllm serve M --generation-config vllm", tmp_path) is None
    assert vllm_temperature("--override-generation-config '{\"temperature\": 0.3}'", tmp_path).value == 0.3
    assert vllm_temperature("--override-generation-config.temperature 0.2", None).value == 0.2
    assert sglang_temperature("--model-path M", tmp_path).value == 0.6
    assert sglang_temperature("--sampling-defaults openai", tmp_path) is None
    assert vllm_temperature("vllm serve M", None) is None  # no model directory to read
    # through the doctor's reading: the --target directory, the engine's own table entry
    assert served_temperature(config(engine="sglang", target=str(tmp_path))).value == 0.6
    assert served_temperature(config(engine="speculators", target=str(tmp_path))).value == 0.6  # served by vLLM
    assert served_temperature(config(engine="eaglewire", target=str(tmp_path))) is None
    assert served_temperature(config(engine="sglang", target=str(tmp_path), temperature=0.9)).source == "--temperature"


def test_doctor_reports_the_sampled_tau_beside_greedy_and_in_json(tmp_path, chat_tiny_target):
    """The whole path on a tiny target: --temperature reaches the report and its JSON."""
    from eaglewire.doctor import run_doctor
    from eaglewire.doctor.doctor_config import DoctorConfig
    from tiny import save_random_draft

    save_random_draft(tmp_path / "d", chat_tiny_target)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "an answer " * 6}]}) + "\n"
        for i in range(3)))
    report = run_doctor(DoctorConfig(draft=str(tmp_path / "d"), conversations=str(chats), engine_prompts=1,
                                     engine_tokens=4, tune=False, temperature=0.7, json=str(tmp_path / "r.json")),
                        target=chat_tiny_target)
    names = [c.name for c in report.checks]
    check = report.checks[names.index("sampling")]
    assert names.index("sampling") == names.index("acceptance") + 1
    assert check.verdict == "warn" and check.summary.startswith("users sample at T 0.7 (from --temperature)")
    saved = json.loads((tmp_path / "r.json").read_text())["sampling"]
    assert saved["source"] == "--temperature" and saved["sequences"] == 3
    assert 1.0 <= saved["greedy_tau"] <= saved["chain"] + 1 and 1.0 <= saved["sampled_tau"] <= saved["chain"] + 1
    assert saved["sampled_tau"] != saved["greedy_tau"]


def test_a_negative_temperature_is_refused_on_the_command_line(capsys):
    from eaglewire.cli import main

    assert main(["doctor", "--draft", "runs/none", "--temperature", "-0.5"]) == 2
    assert "--temperature must be >= 0 (0: greedy), got -0.5" in capsys.readouterr().err
    from eaglewire.doctor.doctor_config import DoctorConfig

    with pytest.raises(ValueError, match="cannot run with --stored"):
        DoctorConfig(draft="d", stored=True, data="x", temperature=0.7)
