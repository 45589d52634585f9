"""A server engine under load, on fake servers: tune's costs from a loaded server's wall time and its own round
counter, the schedule and launch advice they give, bench's closed loop of clients, and the flags that route
`tune --concurrency` / `bench --concurrency` to a server engine. (The real llama-server and vLLM under load:
tests/engines/test_llamacpp_load.py, tests/real_vllm/test_vllm_load.py.)"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest

from eaglewire.concurrency import server_measurement
from eaglewire.concurrency.server_measurement import (launch_advice, launched_shape, load_once, measure_load,
                                              measure_server_concurrency, measure_tau, stream_lengths)
from eaglewire.concurrency.closed_loop import table
from eaglewire.concurrency.server_closed_loop import bench_server_concurrency, closed_loop_server
from eaglewire.cli import main
from eaglewire.concurrency.schedule import Schedule, ScheduleRange
from eaglewire.decode.spec_config import SpecConfig
from eaglewire.engines.interface import RunSettings, ServedFiles, Shape

CHAIN1, CHAIN3 = SpecConfig.chain(1), SpecConfig.chain(3)


class FakeServer:
    """Answers prompt-determined tokens (the prompt's first id, then counting up), ``eos_after`` of them unless told
    to ignore EOS; counts ``tokens_per_round`` tokens a drafting round, every request's rounds together."""

    def __init__(self, shape: Shape, *, tokens_per_round: float = 2.0, eos_after: int = 10, honours_ignore_eos=True,
                 fail_on: int | None = None, together: int | None = None) -> None:
        self.shape, self.tokens_per_round, self.eos_after = shape, tokens_per_round, eos_after
        self.honours_ignore_eos, self.fail_on = honours_ignore_eos, fail_on
        # together: requests answer only in groups of this many in flight at once (a BrokenBarrierError otherwise)
        self.together = None if together is None else threading.Barrier(together, timeout=10)
        self.rounds = 0
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()

    def complete(self, ids, *, max_new_tokens, temperature, seed, ignore_eos=False):
        if ids[0] == self.fail_on:
            raise RuntimeError("the server broke")
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        n = max_new_tokens if ignore_eos and self.honours_ignore_eos else min(max_new_tokens, self.eos_after)
        if self.together is not None:
            self.together.wait()
        with self.lock:
            self.in_flight -= 1
            if not self.shape.plain:
                self.rounds += round((n - 1) / self.tokens_per_round)
        return [ids[0] + k for k in range(n)]

    def spec_rounds(self):
        return None if self.shape.plain else self.rounds


class FakeRuntime:
    label = "fake"

    def __init__(self, **server_kwargs) -> None:
        self.server_kwargs, self.launches = server_kwargs, []

    @contextmanager
    def serve(self, files, shape, settings, *, log_path, draft_timing=False):
        self.launches.append((shape, settings.slots))
        yield FakeServer(shape, **self.server_kwargs)


PROMPTS = [[100 * (i + 1), 7, 8] for i in range(6)]


def test_a_tree_is_not_launched_on_a_server_engine():
    assert launched_shape(CHAIN3) == Shape(n_max=3)
    with pytest.raises(ValueError, match="drafts chains"):
        launched_shape(SpecConfig(num_steps=3, topk=2, num_draft_tokens=6))


def test_a_load_holds_its_batch_and_refuses_a_server_that_stops_at_eos():
    server = FakeServer(Shape(3), together=4, tokens_per_round=31 / 8)
    load_once(server, PROMPTS, 4, 32, each=2)  # answers only while the 4 streams are in flight together
    assert server.most_in_flight == 4 and server.rounds == 4 * 2 * 8  # each stream's 2 requests, back to back
    with pytest.raises(RuntimeError, match="ignore_eos"):
        load_once(FakeServer(Shape(), honours_ignore_eos=False), PROMPTS, 2, 32)


def test_streams_later_requests_arrive_spread_out_with_the_same_tokens_each():
    """Lockstep streams would prefill their next requests together when plain and apart when speculative: each
    stream's first request is shifted by its place, every stream decodes the same total."""
    lengths = [stream_lengths(b, 4, 64, 2) for b in range(4)]
    assert lengths == [[32, 96], [48, 80], [64, 64], [80, 48]]
    assert [sum(x) for x in lengths] == [128] * 4
    assert stream_lengths(0, 1, 64, 1) == [64] and sum(stream_lengths(3, 8, 64, 3)) == 192


def test_round_costs_split_a_loads_wall_time_by_the_servers_own_round_count(monkeypatch):
    """4 streams x 33 tokens at 2 tokens a round: 64 rounds, 16 a sequence; 2 s a load -> 125 ms a round. Plain:
    32 steps after the prefill's token -> 62.5 ms a step."""
    monkeypatch.setattr(server_measurement, "load_once", lambda server, prompts, batch, tokens, each:
                        (server.complete(prompts[0], max_new_tokens=tokens, temperature=0, seed=0, ignore_eos=True),
                         setattr(server, "rounds", server.rounds + 3 * 16), 2.0)[-1])  # the other 3 streams' rounds
    spec = measure_load(FakeServer(Shape(3)), PROMPTS, 4, speculative=True, tokens=33, warmup=1, repeats=4)
    plain = measure_load(FakeServer(Shape()), PROMPTS, 4, speculative=False, tokens=33, warmup=1, repeats=4)
    assert spec.cost.seconds == [pytest.approx(0.125)] * 4 and spec.tau == pytest.approx(4 * 32 / 64)
    assert plain.cost.seconds == [pytest.approx(2.0 / 32)] * 4 and plain.tau is None


def test_tau_is_tokens_after_the_prefill_over_rounds():
    server = FakeServer(Shape(3), tokens_per_round=2.5, eos_after=11)  # 10 tokens after the first: 4 rounds each
    assert measure_tau(server, PROMPTS, max_new_tokens=64) == pytest.approx(2.5)


def test_a_server_engines_schedule_and_what_to_launch(monkeypatch, tmp_path):
    """Made-up loads: plain's step 10/12/20 ms at 1/2/4 streams, chain 3's round 14/17/60 ms at tau 2 (the fake's
    tokens a round), tau 1 with 4 in flight: chain 3 at 1.43x and 1.41x plain at 1 and 2 streams, 0.33x at 4 (its
    own tau, not the 0.67x tau alone would predict) -- launch it up to 2."""
    wall = {(None, 1): 10, (None, 2): 12, (None, 4): 20, (3, 1): 14, (3, 2): 17, (3, 4): 60}  # ms a step / round

    def fake_load(server, prompts, batch, tokens, each):
        rounds_per_stream = each * round((tokens - 1) / server.tokens_per_round) * (2 if batch == 4 else 1)
        if not server.shape.plain:
            server.rounds += batch * rounds_per_stream
            return wall[(3, batch)] / 1e3 * rounds_per_stream
        return wall[(None, batch)] / 1e3 * each * (tokens - 1)

    monkeypatch.setattr(server_measurement, "load_once", fake_load)
    runtime = FakeRuntime(tokens_per_round=2.0, eos_after=11)  # 10 tokens after the prefill's: 5 rounds
    report = measure_server_concurrency(runtime, ServedFiles(tmp_path, tmp_path), RunSettings(), PROMPTS, [1, 2, 4],
                                        [CHAIN3], tokens=33, log_dir=tmp_path)
    assert runtime.launches == [(Shape(), 4), (Shape(3), 4)]  # one launch per shape, slots for the most streams
    assert report.taus == {"chain 3": pytest.approx(2.0)}
    speedups = {p.batch: round(p.speedup, 2) for p in report.predictions if p.shape is not None}
    assert speedups == {1: round(2 * 10 / 14, 2), 2: round(2 * 12 / 17, 2), 4: round(1 * 20 / 60, 2)}
    assert "chain 3: 2.00 alone, 2.00 at 1, 2.00 at 2, 1.00 at 4" in report.notes[1]  # 4 streams: half the tau
    assert [report.schedule.shape_for(b) for b in (1, 2, 3, 4, 8)] == [CHAIN3, CHAIN3, None, None, None]
    advice = launch_advice(report.schedule, lambda s: f"--n-max {s.num_steps}")
    assert advice == ["expecting 1-2 concurrent requests: launch it with --n-max 3",
                      "expecting 3 or more concurrent requests: launch it plain",
                      "a speculative launch loses above 2 concurrent requests (the engine cannot switch its shape "
                      "by load)"]


def test_launch_advice_for_one_load_and_for_every_load():
    assert launch_advice(Schedule([ScheduleRange(1, None)]), str) == [
        "expecting 1 or more concurrent requests: launch it plain"]
    assert launch_advice(Schedule([ScheduleRange(1, CHAIN1), ScheduleRange(8, CHAIN3)]), shape_label) == [
        "expecting 1 concurrent request: launch it with chain 1", "expecting 2 or more concurrent requests: "
        "launch it with chain 3"]


def shape_label(spec: SpecConfig) -> str:
    return f"chain {spec.num_steps}"


def test_clients_keep_their_number_of_requests_in_flight_and_every_answer_lands_in_its_prompts_place():
    server = FakeServer(Shape(3), eos_after=9, together=3)
    row = closed_loop_server(server, PROMPTS, 3, max_new_tokens=16, name="fake chain 3")
    assert server.most_in_flight == 3
    assert row.outputs == [[p[0] + k for k in range(9)] for p in PROMPTS]
    assert row.speculative_steps == 6 * 4  # every request's rounds, from the server's counter
    assert not row.streamed and row.to_dict()["ttft_p50_s"] is None and len(row.per_token) == 6
    with pytest.raises(RuntimeError, match="broke"):
        closed_loop_server(FakeServer(Shape(), fail_on=PROMPTS[2][0]), PROMPTS, 2, max_new_tokens=8)


def test_bench_on_a_server_engine_compares_each_launch_with_plain_at_the_same_load(tmp_path):
    runtime = FakeRuntime(eos_after=5)
    rows = bench_server_concurrency(runtime, ServedFiles(tmp_path, tmp_path), RunSettings(),
                                    {"fake plain": Shape(), "fake chain 3": Shape(3)}, PROMPTS, [1, 4],
                                    max_new_tokens=16, temperature=0.0, seed=0, warmup=1, log_dir=tmp_path,
                                    progress=False)
    assert [(r.name, r.clients) for r in rows] == [("fake plain", 1), ("fake chain 3", 1), ("fake plain", 4),
                                                   ("fake chain 3", 4)]
    assert [slots for _, slots in runtime.launches] == [4, 4]
    assert all(r.same_as_plain == len(PROMPTS) for r in rows) and rows[0].vs_plain == 1.0
    shown = table(rows)
    assert "answers whole: no time to first token" in shown and "rounds" in shown


def test_concurrency_flags_route_to_a_server_engine_or_say_why_not(capsys):
    from eaglewire.bench.bench_command import BenchConfig
    from eaglewire.tune.tune_command import IN_PROCESS_SHAPES, SERVER_SHAPES, TuneConfig

    assert TuneConfig(draft="reference", engine="vllm", concurrency=[1, 2]).concurrency_shapes == SERVER_SHAPES
    assert TuneConfig(draft="reference", concurrency=[1, 2]).concurrency_shapes == IN_PROCESS_SHAPES
    assert main(["tune", "--draft", "reference", "--engine", "sglang", "--costs", "stated", "--concurrency", "1,2"]) == 2
    assert "is priced by --costs stated" in capsys.readouterr().err
    assert main(["tune", "--draft", "reference", "--shapes", "1,1,2"]) == 2
    assert "give --concurrency too" in capsys.readouterr().err
    BenchConfig(draft="reference", engine=["llamacpp"], configs="1,0,0,0;1,3,1,4", concurrency=[1, 2])
    with pytest.raises(ValueError, match="only eaglewire's engine"):
        BenchConfig(draft="reference", engine=["vllm"], configs="1,0,0,0;1,3,1,4", concurrency=[1, 2],
                    schedule="s.json")
    with pytest.raises(ValueError, match="one engine at a time"):
        BenchConfig(draft="reference", engine=["eaglewire", "vllm"], configs="1,0,0,0;1,3,1,4", concurrency=[1])
