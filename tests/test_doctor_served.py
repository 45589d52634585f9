"""``doctor --engine-url``: what a running server says it accepted, against the replay of the same
greedy chain on the server's own text. Pure pieces first, the engines' HTTP readings against a stub
server speaking their shapes, then eaglewire's own server end to end on the real target with the
reference draft: wired as trained it matches the replay, fed the wrong layers it is named a
serving-side fault."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from eaglewire.engines import Ability
from eaglewire.doctor.verdicts import Check, DoctorReport
from eaglewire.doctor.served_tau.served_check import (Replayed, candidate_causes, chain_length, replay_chain, served_check)
from eaglewire.engines.serving.served_counts import OtherTraffic, ServedCounts, ServedError, other_traffic
from servers import live_server, vllm_metrics

# ------------------------------------------------------------------ pure pieces


def test_replay_chain_follows_the_greedy_rounds_and_caps_the_last():
    # S=2 steps over T=8 tokens, prompt of 3: roots at 3, then as accepted
    right = torch.zeros(2, 8, dtype=torch.bool)
    right[:, 2] = True  # the round rooted at 3 (state of 2) accepts both steps
    right[0, 5] = True  # the round rooted at 6 (state of 5) accepts one, but only one token is left
    got = replay_chain(right, 3)
    # rounds rooted at 3 (accepts 2 -> next root 6), at 6 (room 1: drafts 1, accepts 1), then no room
    assert (got.drafts, got.draft_tokens, got.accepted, got.accepted_per_pos) == (2, 3, 3, [2, 1])
    assert got.tau == pytest.approx(2.5)


def test_chain_length_from_the_servers_own_counts():
    assert chain_length(ServedCounts("x", drafts=10, draft_tokens=28, accepted_per_pos=[1, 1, 1]), 5) == 3
    assert chain_length(ServedCounts("x", drafts=10, draft_tokens=30, accepted_per_pos=[4, 1]), 5) == 3  # SGLang
    assert chain_length(ServedCounts("x"), 5) == 5


def _replayed(drafts=100, draft_tokens=300, accepted=150, per_pos=(80, 50, 20), agreeing=400):
    return Replayed(drafts, draft_tokens, accepted, list(per_pos), judged=400, agreeing=agreeing)


def test_served_as_replayed_passes_and_shows_each_position():
    counts = ServedCounts("vllm", drafts=100, draft_tokens=300, accepted=148, accepted_per_pos=[80, 49, 19],
                          source="per-request")
    check = served_check(counts, _replayed(), DoctorReport("d", "t"))
    assert check.verdict == "ok" and "served τ 2.48" in check.summary
    assert any("per position, served/replayed: 0.80/0.80, 0.49/0.50, 0.19/0.20" in e for e in check.evidence)


def test_served_below_the_replay_is_a_serving_fault_naming_what_no_check_ruled_out():
    report = DoctorReport("d", "t")
    report.add(Check("engine wiring", "ok", "as trained"))
    report.add(Check("serving flags", "warn", "p-min"))
    counts = ServedCounts("sglang", drafts=120, draft_tokens=360, accepted=60, accepted_per_pos=[50, 8, 2])
    check = served_check(counts, _replayed(), report)
    assert check.verdict == "fail" and "serving-side fault" in check.summary
    assert "layers the engine feeds" not in check.fix  # the wiring check passed
    assert "launch flags" in check.fix and "decoding path" in check.fix and "norm_before_residual" in check.fix
    # a server whose text is not this target's greedy text: another target comes first
    causes = candidate_causes(report, _replayed(agreeing=300))
    assert causes[0].startswith("the server's target is not the one measured here") and "75.0%" in causes[0]


def test_a_difference_within_noise_or_tolerance_is_no_fault():
    # 2 of 300 fewer accepted: inside the binomial interval, and 0.02 of τ
    counts = ServedCounts("vllm", drafts=100, draft_tokens=300, accepted=148)
    assert served_check(counts, _replayed(), DoctorReport("d", "t")).verdict == "ok"
    many = ServedCounts("vllm", drafts=100, draft_tokens=300, accepted=190)  # more than the text allows
    assert served_check(many, _replayed(), DoctorReport("d", "t")).verdict == "warn"
    nothing = ServedCounts("llamacpp")
    assert served_check(nothing, _replayed(), DoctorReport("d", "t")).verdict == "fail"


def test_other_clients_work_is_what_the_counter_grew_beyond_the_doctors_own():
    # 100 -> 180 generated, the doctor's 2 answers held 60: 20 beyond, less one a request the counter may add
    got = other_traffic(generated=(100, 180), running=(0, 2), own_tokens=60, requests=2)
    assert (got.generated, got.running, got.busy) == (18, 2, True)
    assert got.describe() == "2 other request(s) in flight and 18 tokens generated for other clients"
    idle = other_traffic(generated=(100, 161), running=(0, 0), own_tokens=60, requests=2)  # one extra: its own
    assert (idle.generated, idle.busy, idle.describe()) == (0, False, "no other client's request")
    assert other_traffic(generated=(None, 5), running=(None, None), own_tokens=1, requests=1).generated is None


BUSY = OtherTraffic(generated=512, running=3)


def test_a_fault_read_on_a_busy_server_from_counters_is_inconclusive():
    """Counters count the other clients' rounds: τ 1.50 against 2.50 replayed is no evidence about the wiring."""
    faulty = dict(drafts=120, draft_tokens=360, accepted=60, accepted_per_pos=[50, 8, 2])
    assert served_check(ServedCounts("vllm", **faulty), _replayed(), DoctorReport("d", "t")).verdict == "fail"
    check = served_check(ServedCounts("vllm", **faulty, others=BUSY), _replayed(), DoctorReport("d", "t"))
    assert check.verdict == "inconclusive" and "busy server (3 other request(s) in flight and 512 tokens" in check.summary
    assert "counters count the other clients' verify steps" in check.summary and "no other client" in check.fix
    too_many = ServedCounts("vllm", drafts=100, draft_tokens=300, accepted=190, others=BUSY)  # a warn, likewise
    assert served_check(too_many, _replayed(), DoctorReport("d", "t")).verdict == "inconclusive"


def test_a_busy_server_is_judged_where_its_figures_are_the_doctors_own():
    faulty = dict(drafts=120, draft_tokens=360, accepted=60, accepted_per_pos=[50, 8, 2], source="per-request")
    # per-request figures that load does not move (vLLM): still a fault, the traffic in the evidence
    check = served_check(ServedCounts("vllm", **faulty, others=BUSY), _replayed(), DoctorReport("d", "t"))
    assert check.verdict == "fail" and any("3 other request(s) in flight" in e for e in check.evidence)
    # an engine whose acceptance moves with the requests beside a sequence: inconclusive, saying why
    moved = OtherTraffic(running=1, load_changes_acceptance="llama.cpp accepts fewer beside others")
    check = served_check(ServedCounts("llamacpp", **faulty, others=moved), _replayed(), DoctorReport("d", "t"))
    assert check.verdict == "inconclusive" and "llama.cpp accepts fewer beside others" in check.summary
    # a pass stays a pass; nothing drafted stays a fail whatever the load
    as_replayed = ServedCounts("vllm", drafts=100, draft_tokens=300, accepted=148, others=BUSY)
    assert served_check(as_replayed, _replayed(), DoctorReport("d", "t")).verdict == "ok"
    assert served_check(ServedCounts("llamacpp", others=moved), _replayed(), DoctorReport("d", "t")).verdict == "fail"
    idle = ServedCounts("vllm", **faulty, others=OtherTraffic(generated=0))
    check = served_check(idle, _replayed(), DoctorReport("d", "t"))
    assert check.verdict == "fail" and any("the server had no other client's request" in e for e in check.evidence)


def test_engine_url_is_taken_for_every_engine_that_can_be_measured():
    from eaglewire.doctor.doctor_config import DoctorConfig
    from eaglewire import engines

    measured = engines.names(Ability.MEASURE, aliases=False)
    assert set(measured) == {"eaglewire", "sglang", "vllm", "llamacpp"}
    for name in measured:
        assert DoctorConfig(draft="d", engine=name, engine_url="http://x").engine_url == "http://x"


# ------------------------------------------------------------------ the engines' HTTP readings


@contextmanager
def stub_server(routes: dict[str, list]):
    """A loopback HTTP server answering each path with the next body of its list (JSON, text, or an int: that HTTP
    error)."""
    calls: list[tuple[str, dict | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, body):
            if isinstance(body, int):
                self.send_error(body)
                return
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path not in routes:
                self.send_error(404)
                return
            calls.append((self.path, None))
            self._answer(routes[self.path].pop(0))

        def do_POST(self):
            calls.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            self._answer(routes[self.path].pop(0))

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", calls
    finally:
        server.shutdown()
        thread.join(5)


def test_vllm_counters_are_a_difference_and_say_other_traffic_counts():
    from eaglewire.engines import vllm

    answer = {"choices": [{"text": "x", "token_ids": [5, 6, 7]}]}
    routes = {"/metrics": [vllm_metrics(10, 30, 12, [6, 4, 2]), vllm_metrics(14, 42, 17, [8, 6, 3])],
              "/v1/completions": [answer, answer]}
    with stub_server(routes) as (url, calls):
        got = vllm.measure_served(url, [[1, 2], [3]], max_new_tokens=4)
    assert (got.drafts, got.draft_tokens, got.accepted, got.accepted_per_pos) == (4, 12, 5, [2, 2, 1])
    assert got.source == "counters" and got.outputs == [[5, 6, 7]] * 2 and "other clients" in got.notes[0]
    assert got.others is not None and got.others.generated is None and not got.others.busy  # no such counter here
    body = calls[1][1]
    assert body["prompt"] == [1, 2] and body["temperature"] == 0 and body["return_token_ids"] is True


def test_vllm_reading_sees_other_clients_in_its_counter_and_gauge():
    from eaglewire.engines import vllm

    def metrics(generated, running):
        return vllm_metrics(10, 30, 12, [6, 4, 2]) + (
            "# TYPE vllm:generation_tokens_total counter\n"
            f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {generated}\n'
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}\n')

    answer = {"choices": [{"text": "x", "token_ids": [5, 6, 7]}]}
    routes = {"/metrics": [metrics(40, 1), metrics(140, 0)], "/v1/completions": [answer]}
    with stub_server(routes) as (url, _):
        got = vllm.measure_served(url, [[1, 2]], max_new_tokens=4)
    assert (got.others.generated, got.others.running) == (96, 1)  # 100 generated, 3 + 1 the doctor's own


def test_vllm_per_request_metrics_win_over_counters():
    from eaglewire.engines import vllm

    spec = {"mean_acceptance_length": 2.0, "draft_acceptance_rate": 0.33, "acceptance_histogram": [1, 1, 1, 1],
            "num_spec_steps": 4, "num_accepted_draft_tokens": 6, "num_draft_tokens": 12, "num_spec_tokens": 3}
    answer = {"choices": [{"text": "x", "token_ids": [5]}], "metrics": {"speculative_decoding": spec}}
    routes = {"/metrics": [vllm_metrics(10, 30, 12, [6, 4, 2]), vllm_metrics(99, 99, 99, [9, 9, 9])],
              "/v1/completions": [answer]}
    with stub_server(routes) as (url, _):
        got = vllm.measure_served(url, [[1]], max_new_tokens=4)
    assert (got.drafts, got.accepted, got.accepted_per_pos, got.source) == (4, 6, [3, 2, 1], "per-request")


def test_sglang_reads_meta_info_and_shows_its_gauge():
    from eaglewire.engines import sglang

    meta = {"completion_tokens": 15, "spec_verify_ct": 5, "spec_num_correct_drafts": 9,
            "spec_num_proposed_drafts": 15, "spec_accept_length": 3.0, "spec_correct_drafts_histogram": [1, 1, 1, 2]}
    metrics = ("# TYPE sglang:spec_accept_length gauge\nsglang:spec_accept_length{model_name=\"m\"} 2.7\n"
               "# TYPE sglang:spec_verify_calls_total counter\nsglang:spec_verify_calls_total{model_name=\"m\"} 5\n")
    routes = {"/metrics": [metrics, metrics], "/generate": [{"text": "x", "output_ids": [4, 5], "meta_info": meta}]}
    with stub_server(routes) as (url, calls):
        got = sglang.measure_served(url, [[1, 2]], max_new_tokens=8)
    assert (got.drafts, got.draft_tokens, got.accepted, got.accepted_per_pos) == (5, 15, 9, [4, 3, 2])
    assert got.outputs == [[4, 5]] and any("sglang:spec_accept_length 2.70" in n for n in got.notes)
    assert calls[1][1] == {"input_ids": [1, 2], "stream": False,
                           "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}}
    routes = {"/metrics": [metrics, metrics], "/generate": [{"text": "x", "output_ids": [4], "meta_info": {}}]}
    with stub_server(routes) as (url, _), pytest.raises(ServedError, match="without speculation"):
        sglang.measure_served(url, [[1]], max_new_tokens=8)


def test_a_server_that_is_not_there_is_named():
    from eaglewire.engines import vllm

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ServedError, match="--engine-url"):
        vllm.measure_served(f"http://127.0.0.1:{port}", [[1]], max_new_tokens=2, timeout=5)


def test_a_server_failing_on_the_requests_is_told_from_one_that_is_not_there():
    """vLLM serving a copy whose d2t holds absolute ids dies at the first draft and answers 500 (BENCHMARKS.md,
    against a real vLLM): the fix names the copy it cannot compute with and the user's copy to restart it on, not
    the URL."""
    from eaglewire.doctor.doctor_config import DoctorConfig
    from eaglewire.doctor.served_tau.served_check import ServedSettings, unanswered_fix
    from eaglewire.engines import vllm

    served = DoctorConfig(draft="d", engine="vllm", engine_url="http://x", engine_config="/exports/mine/config.json"
                          ).settings(ServedSettings)
    with stub_server({"/metrics": [vllm_metrics(1, 3, 1, [1, 0, 0])], "/v1/completions": [500]}) as (url, _):
        with pytest.raises(ServedError, match="answered 500") as failed:
            vllm.measure_served(url, [[1]], max_new_tokens=2)
    fix = unanswered_fix(failed.value, served)
    assert "failed on a request" in fix and "absolute target ids" in fix and "restart it on /exports/mine" in fix
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ServedError) as absent:
        vllm.measure_served(f"http://127.0.0.1:{port}", [[1]], max_new_tokens=2, timeout=5)
    assert unanswered_fix(absent.value, served).startswith("check that --engine-url http://x is the vllm server")


# ------------------------------------------------------------------ eaglewire's server end to end

PROMPTS = ["Name three primary colors.", "What is the capital of France?", "Write a haiku about rain.",
           "Give me two tips for better sleep."]


@pytest.fixture(scope="module")
def reference(smollm2_target, tmp_path_factory):
    from eaglewire.engines.formats.foreign_draft import load_any_draft

    draft, contract, _, _ = load_any_draft("reference", target=smollm2_target)
    chats = tmp_path_factory.mktemp("served") / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"p{i}", "messages": [
        {"role": "user", "content": p}, {"role": "assistant", "content": "Sure."}]}) + "\n"
        for i, p in enumerate(PROMPTS)))
    return draft, contract, str(chats)


@contextmanager
def eaglewire_server(target, draft, contract, **kw):
    from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder
    from eaglewire.serve.routes import create_app

    app = create_app(SpecDecoder(target, draft, contract, SpecConfig.chain(3)), model_name="m", **kw)
    with live_server(app) as (url, _):
        yield url


def _served_doctor(target, chats, url):
    from eaglewire.doctor import run_doctor
    from eaglewire.doctor.doctor_config import DoctorConfig

    config = DoctorConfig(draft="reference", conversations=chats, engine="eaglewire", engine_url=url,
                          engine_prompts=len(PROMPTS), engine_tokens=32, num_sequences=len(PROMPTS), tune=False)
    report = run_doctor(config, target=target)
    return report, {c.name: c for c in report.checks}["served acceptance"]


@pytest.mark.real
def test_eaglewires_server_serves_the_tau_the_replay_predicts(smollm2_target, reference):
    draft, contract, chats = reference
    with eaglewire_server(smollm2_target, draft, contract) as url:
        report, check = _served_doctor(smollm2_target, chats, url)
    served = report.to_dict()["served"]
    assert check.verdict == "ok", report.render()
    # greedy decoding is lossless: the same chain on the same text accepts the same tokens, but the server drafts
    # with its batched step and the replay with the training-time unroll, other kernels (bf16 where native): a draft
    # token at a near-tie of its top two logits may flip, and one flip moves a round's acceptance by up to the
    # chain's length (seen: 46 vs 44 accepted over 38 rounds with the stage-6 reference, AVX-512 + avx512_bf16)
    assert abs(served["accepted"] - served["replayed_accepted"]) <= served["chain"], served
    assert served["drafts"] > 0
    assert served["tau"] > 1.0 and served["chain"] == 3 and len(served["per_position"]) == 3
    assert any(e.startswith("per position, served/replayed") for e in check.evidence)
    assert served["others"] == {"generated": 0, "running": 0}  # its own counter holds the doctor's tokens alone


@pytest.mark.real
def test_a_server_fed_the_wrong_layers_is_a_serving_side_fault(smollm2_target, reference):
    """The draft trained on [2, 15, 27] served [0, 2, 15] (the first three of four): the doctor's
    own measurements are fine, the server accepts less than the replay on its own text."""
    draft, contract, chats = reference
    wrong = dataclasses.replace(contract, aux_boundaries=(0, 2, 15))
    with eaglewire_server(smollm2_target, draft, wrong, per_request_metrics="summary") as url:
        report, check = _served_doctor(smollm2_target, chats, url)
    served = report.to_dict()["served"]
    assert check.verdict == "fail" and "serving-side fault" in check.summary, report.render()
    assert served["source"] == "per-request" and served["tau"] < served["replayed_tau"] - 0.05
    assert "layers the engine feeds the draft" in check.fix  # no engine config was given to rule it out
