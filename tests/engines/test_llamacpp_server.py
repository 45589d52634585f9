"""The real llama-server (``-m llamacpp``): the exported reference draft loads unedited, greedy
outputs with and without it are identical, and τ comes from llama.cpp's own counters.

Skipped unless llama-server is installed (``eaglewire engines install llamacpp``); with
EAGLEWIRE_BUILD_LLAMACPP=1 the fixture builds it into the cache first (~25 min on 2 cores).
"""

from __future__ import annotations

import json
import os

import pytest

from eaglewire.engines.command_settings import EngineRunConfig

from eaglewire.engines import llamacpp as engine
from load_checks import (check_answers_under_load_as_alone, check_doctor_sees_other_clients,
                         check_timed_load_counts_every_sequences_rounds)

pytestmark = pytest.mark.llamacpp

PROMPTS = ["Write a short poem about the sea.", "What is the capital of France? Explain briefly.",
           "Give me three tips for learning to cook."]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def server_binary():
    if engine.find_server() is None or engine.find_tree() is None:
        if os.environ.get("EAGLEWIRE_BUILD_LLAMACPP") != "1":
            pytest.skip(f"llama-server is not installed: {engine.INSTALL_HINT} "
                        "(or set EAGLEWIRE_BUILD_LLAMACPP=1 to build it here, ~25 min on 2 cores)")
        engine.install()
    return engine.require_server()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, server_binary):
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter needs sentencepiece (eaglewire[llamacpp])")
    from eaglewire.engines import export_draft

    out = tmp_path_factory.mktemp("llamacpp-export")
    report = export_draft("reference", "llamacpp", out, outtype="q8_0", target_outtype="f32", num_steps=3)
    return out, report


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer):
    from eaglewire.decode.text import encode_prompt

    return [encode_prompt(smollm2_tokenizer, p, chat=True) for p in PROMPTS]


@pytest.fixture(scope="module")
def drafted_server(exported, server_binary):
    out, _ = exported
    config = engine.ServerConfig(model=out / "target-f32.gguf", draft=out / "draft-q8_0.gguf", n_max=3)
    with engine.LlamaServer(server_binary, config, log_path=out / "draft-server.log") as server:
        yield server


def test_exported_draft_loads_unedited_with_the_contracts_layers(exported, drafted_server, prompt_ids):
    from eaglewire.engines.llamacpp import draft_layers, read_gguf_metadata

    out, report = exported
    assert draft_layers(read_gguf_metadata(out / "draft-q8_0.gguf")) == report.aux_boundaries == [2, 15, 27]
    answer = engine.complete(drafted_server.url, prompt_ids[0], n_predict=8)
    assert "loading draft model" in drafted_server.log_path.read_text()
    assert answer["timings"]["draft_n"] > 0  # the draft is in use


def test_greedy_outputs_are_identical_and_tau_is_llamacpps(exported, server_binary, drafted_server, prompt_ids,
                                                           tmp_path):
    out, _ = exported
    plain = engine.ServerConfig(model=out / "target-f32.gguf")
    with engine.LlamaServer(server_binary, plain, log_path=tmp_path / "plain.log") as server:
        expected = [engine.complete(server.url, ids, n_predict=NEW_TOKENS)["tokens"] for ids in prompt_ids]
    served = engine.measure_served(drafted_server.url, prompt_ids, max_new_tokens=NEW_TOKENS)
    assert served.outputs == expected  # speculation is lossless
    assert all(len(o) > 0 for o in expected)
    assert served.draft_tokens > 0 and served.drafts > 0  # verify steps counted from /metrics
    assert served.tau == pytest.approx(1 + served.accepted / served.drafts)
    assert 1.0 < served.tau <= 4.0  # a chain of 3 accepts between none and all
    print(json.dumps({"tau": served.tau, "drafted": served.draft_tokens, "accepted": served.accepted,
                      "verify_steps": served.drafts}))


def test_bench_runs_llamacpp_plain_and_drafted(exported, tmp_path):
    from eaglewire.bench.bench_command import BenchConfig, run_bench, same_output_as_plain, tau_pooled
    from eaglewire.bench.bench_report import write_report

    out, _ = exported
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "chat": True}) + "\n" for p in PROMPTS[:2]))
    config = BenchConfig(dataset=str(prompts), draft="reference", engine=["llamacpp"], configs="1,0,0,0;1,3,1,4;1,6,4,24",
                         max_new_tokens=16, warmup=0, out=str(tmp_path / "bench"),
                         run=EngineRunConfig(engine_target=str(out / "target-f32.gguf"),
                                             engine_draft=str(out / "draft-q8_0.gguf")))
    result = run_bench(config, progress=False)
    assert [r.name for r in result.rows] == ["llamacpp 1,0,0,0", "llamacpp 1,3,1,4"]  # trees are eaglewire's alone
    plain, drafted = result.rows
    assert same_output_as_plain(drafted, result.rows) == 2
    assert tau_pooled(plain.stats) == 1.0 and tau_pooled(drafted.stats) > 1.0
    names = {p.name for p in write_report(result, config.out_dir)}
    assert {"bench.json", "bench.md"} <= names


def test_tune_times_llama_server_and_traces_its_own_text(exported, server_binary, prompt_ids, smollm2_target):
    """`tune --engine llamacpp` end to end: llama-server's own draft timer is read (rounds counted),
    every chain probed completes rounds, the draft is traced along the server's own text."""
    from eaglewire.tune.tune_command import TuneConfig, run_tune

    out, _ = exported
    config = TuneConfig(draft="reference", engine="llamacpp", run=EngineRunConfig(
                        engine_target=str(out / "target-f32.gguf"), engine_draft=str(out / "draft-q8_0.gguf")), max_steps=2, p_mins=[0.0, 0.5],
                        max_new_tokens=24, out=str(out / "tune" / "tune.json"))
    result = run_tune(config, target=smollm2_target, prompts=prompt_ids[:2])
    costs = result.costs
    assert 0 < costs.draft_step < costs.plain_step  # one draft layer costs less than the 30-layer target's step
    assert set(costs.verify) == {1, 2, 3} and min(costs.verify.values()) > 0  # both chains completed rounds
    assert len(result.ranked) == 1 + 2 * 2 and result.traced_tokens > 0
    chain = next(p for p in result.ranked if p.shape.n_max == 1 and p.shape.p_min == 0)
    assert 1.0 <= chain.tau <= 2.0 and chain.drafted == 1.0
    assert json.loads((out / "tune" / "tune.json").read_text())["costs"]["engine"] == "llamacpp"


def test_doctor_reads_llama_servers_tau_as_the_replay_predicts(drafted_server, smollm2_target, tmp_path):
    """`doctor --engine llamacpp --engine-url`: llama-server's own counters, per position, against
    the replay of the same chain on its own text (the f32 GGUF of the same weights: lossless)."""
    from eaglewire.doctor import run_doctor
    from eaglewire.doctor.doctor_config import DoctorConfig

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": p},
                                                                     {"role": "assistant", "content": "Sure."}]}) + "\n"
                             for i, p in enumerate(PROMPTS)))
    config = DoctorConfig(draft="reference", conversations=str(chats), engine="llamacpp",
                          engine_url=drafted_server.url, engine_prompts=len(PROMPTS), engine_tokens=NEW_TOKENS,
                          num_sequences=len(PROMPTS), tune=False)
    report = run_doctor(config, target=smollm2_target)
    check = {c.name: c for c in report.checks}["served acceptance"]
    served = report.to_dict()["served"]
    print(json.dumps(served))
    assert check.verdict == "ok", report.render()
    assert abs(served["tau"] - served["replayed_tau"]) <= 0.05, served
    assert served["chain"] == 3 and len(served["per_position"]) == 3 and served["tau"] > 1.0


# ------------------------------------------------------------------ under load: one server with 4 slots

@pytest.fixture(scope="module")
def loaded_server(exported, server_binary):
    """The exported draft served by 4 slots at once (continuous batching), a chain of 3: the load tests' one server."""
    from eaglewire.engines.interface import RunSettings, ServedFiles, Shape

    out, _ = exported
    files = ServedFiles(out / "target-f32.gguf", out / "draft-q8_0.gguf")
    with engine.RUNTIME.serve(files, Shape(3), RunSettings(slots=4, install=str(server_binary)),
                              log_path=out / "loaded-server.log") as server:
        yield server


def test_llama_server_under_load_answers_each_request_as_it_does_alone(loaded_server, prompt_ids):
    """Exact: llama.cpp computes a row's dot products alike whatever else is in the batch (its speculative output
    equals plain, a one-row pass, above)."""
    check_answers_under_load_as_alone(loaded_server, prompt_ids, NEW_TOKENS)


def test_tunes_load_on_llama_server_counts_every_sequences_rounds(loaded_server, prompt_ids):
    check_timed_load_counts_every_sequences_rounds(loaded_server, prompt_ids)


def test_the_doctors_reading_of_llama_server_sees_other_clients(loaded_server, prompt_ids):
    """A served acceptance read beside another client's request says so (llama.cpp b11434 accepts fewer drafted
    tokens with others in flight, so the doctor does not judge the wiring on such a reading)."""
    check_doctor_sees_other_clients(loaded_server, engine.measure_served, prompt_ids, "llamacpp:requests_processing")
