"""What each engine says it accepted, read from text and bodies written by the engines' own code:
vLLM 0.33.0's metric definitions and per-request accumulator and SGLang 0.5.23's meta_info
builder are executed from the pinned wheels on stubs; llama.cpp's metrics text is the one
tools/server/server-task.cpp writes. eaglewire's server is checked against vLLM's shapes."""

from __future__ import annotations

import ast
import functools
import types
from dataclasses import dataclass, field
from typing import Any

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from eaglewire.engines import eaglewire as own
from eaglewire.engines import sglang, vllm
from eaglewire.engines.serving import spec_decode_metrics as vllm_shaped
from eaglewire.engines.llamacpp import server as llamacpp_server
import eaglewire.engines.serving.served_counts as served
from eaglewire.engines.serving.served_counts import per_pos_from_histogram

pytestmark = pytest.mark.engines


def _definitions(source: str, names: set[str], *, strip_annotations: bool = False) -> str:
    """The source of the top-level classes / functions ``names`` (methods of a class by
    ``Class.method``), argument annotations dropped where they name the engine's own types."""
    tree, out = ast.parse(source), []
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in names:
            out.append(node)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and f"{node.name}.{item.name}" in names:
                    out.append(item)
    assert len(out) == len(names), f"the wheel no longer defines all of {sorted(names)}: re-read it"
    if strip_annotations:
        for node in out:
            for fn in ast.walk(node):
                if isinstance(fn, ast.FunctionDef):
                    fn.returns = None
                    for a in fn.args.args + fn.args.kwonlyargs:
                        a.annotation = None
    return "\n\n".join(ast.unparse(n) for n in out)


# ------------------------------------------------------------------ vLLM 0.33.0

def _vllm_prom(wheels, registry: CollectorRegistry, num_spec_tokens: int, engines: int = 1):
    """vLLM's SpecDecodingProm and SpecDecodingStats, run from the wheel on a private registry."""
    ns = {"dataclass": dataclass, "field": field, "prometheus_client": prometheus_client,
          "SpeculativeConfig": object, "np": None, "time": None, "logger": None}
    exec(_definitions(wheels["vllm"].text("vllm/v1/metrics/utils.py"), {"create_metric_per_engine"},
                      strip_annotations=True), ns)
    exec(_definitions(wheels["vllm"].text("vllm/v1/spec_decode/metrics.py"),
                      {"SpecDecodingStats", "SpecDecodingProm"}), ns)

    class Prom(ns["SpecDecodingProm"]):
        _counter_cls = functools.partial(prometheus_client.Counter, registry=registry)

    labels = {i: ["tiny-model", str(i)] for i in range(engines)}
    prom = Prom(types.SimpleNamespace(num_speculative_tokens=num_spec_tokens), ["model_name", "engine"], labels)
    return prom, ns["SpecDecodingStats"]


ROUNDS = [(3, 3), (3, 0), (3, 1), (2, 2), (3, 3)]  # (drafted, accepted) per verify step


def test_vllm_counters_read_as_vllm_writes_them(wheels):
    registry = CollectorRegistry()
    prom, Stats = _vllm_prom(wheels, registry, num_spec_tokens=3, engines=2)
    for engine in (0, 1):  # two engines (data parallel): the reading sums them
        stats = Stats.new(3)
        for drafted, accepted in ROUNDS:
            stats.observe_draft(drafted, accepted)
        prom.observe(stats, engine_idx=engine)
    got = vllm_shaped.spec_counters(generate_latest(registry).decode(), vllm.METRICS_PREFIX)
    assert got == {"drafts": 10, "draft_tokens": 28, "accepted": 18, "per_pos": [8, 6, 4]}


def test_vllm_per_request_metrics_read_as_vllm_writes_them(wheels):
    ns = {"dataclass": dataclass, "field": field, "Any": Any}
    exec(_definitions(wheels["vllm"].text("vllm/v1/metrics/stats.py"), {"RequestSpecDecodeMetrics"}), ns)
    metrics = ns["RequestSpecDecodeMetrics"].new(3)
    for drafted, accepted in ROUNDS:
        metrics.observe(drafted, accepted, detailed=True)
    body = {"choices": [{"text": "x", "token_ids": [1, 2]}], "metrics": {"speculative_decoding": metrics.to_dict()}}
    assert vllm_shaped.request_spec_metrics(body) == {"drafts": 5, "draft_tokens": 14, "accepted": 9,
                                                      "per_pos": [4, 3, 2]}
    assert vllm_shaped.request_spec_metrics({"choices": [], "metrics": None}) is None  # without the flag


def _vllm_field_names(wheels, path: str, cls: str) -> list[str]:
    for node in wheels["vllm"].tree(path).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return [n.target.id for n in node.body if isinstance(n, ast.AnnAssign)]
    pytest.fail(f"vLLM {vllm.VERSION} has no {cls} in {path}: re-read it")


def test_eaglewires_per_request_metrics_are_vllms(wheels):
    """The same rounds through eaglewire's builder and vLLM's accumulator give the same body."""
    from eaglewire.core.generation import GenerationStats
    from eaglewire.serve.response_bodies import SpeculativeDecodingMetrics, spec_decoding_metrics

    assert list(SpeculativeDecodingMetrics.model_fields) == _vllm_field_names(
        wheels, "vllm/entrypoints/generate/base/protocol.py", "SpeculativeDecodingMetrics")
    ns = {"dataclass": dataclass, "field": field, "Any": Any}
    exec(_definitions(wheels["vllm"].text("vllm/v1/metrics/stats.py"), {"RequestSpecDecodeMetrics"}), ns)
    theirs = ns["RequestSpecDecodeMetrics"].new(3)
    for drafted, accepted in ROUNDS:
        theirs.observe(drafted, accepted, detailed=True)
    stats = GenerationStats(accept_lengths=[a + 1 for _, a in ROUNDS] + [1],
                            verified_lengths=[d + 1 for d, _ in ROUNDS] + [1])  # a last round that drafted nothing
    ours = spec_decoding_metrics(stats, 3, "detailed").speculative_decoding.model_dump(exclude_none=True)
    assert ours == theirs.to_dict()
    assert "per_step_accepted" not in spec_decoding_metrics(stats, 3, "summary").model_dump(exclude_none=True)[
        "speculative_decoding"]
    assert spec_decoding_metrics(stats, 3, "none") is None


def test_eaglewires_counters_are_vllms_names_under_its_prefix(wheels):
    """The counter names eaglewire's /metrics writes are vLLM's, with ``vllm:`` -> ``eaglewire_``."""
    from eaglewire.core.generation import GenerationStats
    from eaglewire.serve.metrics import Metrics

    registry = CollectorRegistry()
    prom, Stats = _vllm_prom(wheels, registry, num_spec_tokens=3)
    stats = Stats.new(3)
    for drafted, accepted in ROUNDS:
        stats.observe_draft(drafted, accepted)
    prom.observe(stats)
    metrics = Metrics(4, ("/metrics",))
    metrics.observe(GenerationStats(accept_lengths=[a + 1 for _, a in ROUNDS],
                                    verified_lengths=[d + 1 for d, _ in ROUNDS],
                                    position_accepts=[sum(a > i for _, a in ROUNDS) for i in range(3)]),
                    cancelled=False)
    theirs = generate_latest(registry).decode()
    ours = metrics.render(waiting=0, running=0).decode()
    assert vllm_shaped.spec_counters(ours, own.METRICS_PREFIX) == vllm_shaped.spec_counters(theirs, vllm.METRICS_PREFIX)
    names = lambda text, prefix: {line.split()[2].removeprefix(prefix) for line in text.splitlines()
                                  if line.startswith("# TYPE") and "spec_decode" in line
                                  and not line.split()[2].endswith("_created")}  # vLLM turns these off
    assert names(ours, own.METRICS_PREFIX) == names(theirs, vllm.METRICS_PREFIX)


def test_the_traffic_each_vllm_shaped_server_exports_is_named_as_it_writes_it(wheels):
    """The counter of generated tokens and the gauge of running requests the doctor reads for other clients' work:
    vLLM's as vllm/v1/metrics/loggers.py names them (prometheus_client adds ``_total`` to a counter), eaglewire
    serve's as its /metrics renders them."""
    from eaglewire.serve.metrics import Metrics

    loggers = wheels["vllm"].text("vllm/v1/metrics/loggers.py")
    from eaglewire.engines.vllm.readings import TRAFFIC

    generated, running = TRAFFIC
    assert f'name="{generated.removesuffix("_total")}"' in loggers and f'name="{running}"' in loggers
    rows = served.samples(Metrics(4, ("/metrics",)).render(waiting=0, running=2).decode())
    assert served.total(rows, own.TRAFFIC[0]) == 0 and served.total(rows, own.TRAFFIC[1]) == 2


# ------------------------------------------------------------------ SGLang 0.5.23

def test_sglang_meta_info_read_as_sglang_writes_it(wheels):
    """meta_info built by SGLang's own _calculate_spec_decoding_metrics, its histogram by
    Req.update_spec_correct_drafts_histogram."""
    src = wheels["sglang"].text
    ns: dict[str, Any] = {"get_spec": lambda: types.SimpleNamespace(speculative_num_draft_tokens=4),
                          "_ragged_verify_cap_accept": lambda: False}
    exec(_definitions(src("sglang/srt/managers/tokenizer_manager.py"),
                      {"TokenizerManager._calculate_spec_decoding_metrics"}, strip_annotations=True), ns)
    exec(_definitions(src("sglang/srt/managers/schedule_batch.py"), {"Req.update_spec_correct_drafts_histogram"},
                      strip_annotations=True), ns)
    req = types.SimpleNamespace(spec_correct_drafts_histogram=[])
    for _, accepted in ROUNDS:
        ns["update_spec_correct_drafts_histogram"](req, accepted)
    correct = sum(a for _, a in ROUNDS)
    recv = types.SimpleNamespace(spec_verify_ct=[5], spec_num_correct_drafts=[correct], completion_tokens=[15],
                                 spec_correct_drafts_histogram=[req.spec_correct_drafts_histogram],
                                 spec_num_cap_tokens=None, spec_num_block_accept_tokens=None,
                                 spec_cap_lens_histogram=None)
    meta = {"completion_tokens": 15}
    ns["_calculate_spec_decoding_metrics"](None, meta, recv, 0)
    assert meta["spec_accept_length"] == 3.0  # SGLang's own: completion tokens / verify steps
    got = sglang.meta_spec(meta)
    assert got == {"drafts": 5, "draft_tokens": 15, "accepted": 9, "per_pos": [4, 3, 2]}
    assert sglang.meta_spec({"completion_tokens": 15}) is None  # no speculation


def test_sglang_metric_names_are_its_own(wheels):
    source = wheels["sglang"].text("sglang/srt/observability/metrics_collector.py")
    for name in (sglang.SPEC_ACCEPT_LENGTH, sglang.SPEC_VERIFY_CALLS, sglang.GENERATION_TOKENS, sglang.RUNNING_REQUESTS):
        assert f'name="{name}"' in source, name  # SGLang names its counters with _total
    registry = CollectorRegistry()
    labels = ["model_name", "engine_type"]
    gauge = prometheus_client.Gauge(sglang.SPEC_ACCEPT_LENGTH, "x", labels, registry=registry)
    calls = prometheus_client.Counter(sglang.SPEC_VERIFY_CALLS.removesuffix("_total"), "x", labels, registry=registry)
    tokens = prometheus_client.Counter(sglang.GENERATION_TOKENS.removesuffix("_total"), "x",
                                       labels + ["is_streaming"], registry=registry)
    gauge.labels("m", "unified").set(2.5)
    calls.labels("m", "unified").inc(10)
    tokens.labels("m", "unified", "false").inc(25)
    assert sglang.spec_gauges(generate_latest(registry).decode()) == {
        sglang.SPEC_ACCEPT_LENGTH: 2.5, sglang.SPEC_VERIFY_CALLS: 10.0, sglang.GENERATION_TOKENS: 25.0}


# ------------------------------------------------------------------ llama.cpp b11434

LLAMACPP_METRICS = """# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 28
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted by the target model
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 18
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 10
# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 8
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 6
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 4
"""


def test_llamacpp_counters_are_vllms_names_under_its_prefix():
    """As tools/server/server-task.cpp writes them (server_task_result_metrics::to_json)."""
    assert vllm_shaped.spec_counters(LLAMACPP_METRICS, "llamacpp:") == {"drafts": 10, "draft_tokens": 28,
                                                                         "accepted": 18, "per_pos": [8, 6, 4]}
    assert llamacpp_server._per_pos(llamacpp_server.parse_metrics(LLAMACPP_METRICS)) == [8, 6, 4]


def test_histogram_to_positions():
    assert per_pos_from_histogram([1, 1, 1, 2]) == [4, 3, 2]
    assert per_pos_from_histogram([]) == []
