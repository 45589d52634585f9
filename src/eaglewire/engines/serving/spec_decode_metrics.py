"""vLLM's speculative-decoding metrics: the shape vLLM's server exports and ``eaglewire serve`` exports too
(under its own prefix, serve/metrics.py Metrics), read by both engines' ``measure_served`` (engines/vllm/readings.py,
engines/eaglewire.py). Not an engine: it lives below both.

Read from vLLM 0.33.0: the counters from vllm/v1/spec_decode/metrics.py, SpecDecodingProm.__init__
(``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens``, and
``..._num_accepted_tokens_per_pos`` with label ``position`` from 0, each also labelled
``model_name`` and ``engine``; prometheus_client adds ``_total``); the per-request figures from
vllm/v1/metrics/stats.py, RequestSpecDecodeMetrics.to_dict, served as ``metrics.speculative_decoding``
of a completion (vllm/entrypoints/generate/base/protocol.py, PerRequestMetrics) when vLLM runs with
``--per-request-spec-decode-metrics summary|detailed``; the generated ids as ``choices[0].token_ids``
with ``return_token_ids`` (vllm/entrypoints/openai/completion/protocol.py, CompletionResponseChoice).
A name below is the counter's without the server's prefix (``vllm:``, ``eaglewire_``).
"""

from __future__ import annotations

from typing import Any

import eaglewire.engines.serving.served_counts as served

SPEC_DRAFTS = "spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "spec_decode_num_accepted_tokens_total"
SPEC_PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"  # label "position", 0 = the first drafted token
PER_REQUEST_FLAG = "--per-request-spec-decode-metrics summary"


def spec_counters(text: str, prefix: str) -> dict[str, Any] | None:
    """vLLM's speculative counters in Prometheus text (summed over engines and models):
    {drafts, draft_tokens, accepted, per_pos}; None when the server exports none (no speculation)."""
    rows = served.samples(text)
    drafts = served.total(rows, prefix + SPEC_DRAFTS)
    if drafts is None:
        return None
    per_pos = served.by_label(rows, prefix + SPEC_PER_POS, "position")
    return {"drafts": int(drafts), "draft_tokens": int(served.total(rows, prefix + SPEC_DRAFT_TOKENS) or 0),
            "accepted": int(served.total(rows, prefix + SPEC_ACCEPTED) or 0),
            "per_pos": [int(per_pos.get(i, 0)) for i in range(max(per_pos) + 1)] if per_pos else []}


def request_spec_metrics(response: dict[str, Any]) -> dict[str, Any] | None:
    """A completion's ``metrics.speculative_decoding`` -> {drafts, draft_tokens, accepted, per_pos};
    None when absent (vLLM started without --per-request-spec-decode-metrics, or n > 1)."""
    spec = (response.get("metrics") or {}).get("speculative_decoding")
    if not spec:
        return None
    histogram = [int(x) for x in spec.get("acceptance_histogram") or []]
    return {"drafts": int(spec["num_spec_steps"]), "draft_tokens": int(spec["num_draft_tokens"]),
            "accepted": int(spec["num_accepted_draft_tokens"]), "per_pos": served.per_pos_from_histogram(histogram)}


def complete_ids(url: str, prompt_ids: list[int], *, max_tokens: int, timeout: float, who: str) -> dict[str, Any]:
    """A greedy ``/v1/completions`` of the token ids ``prompt_ids``, its generated ids returned."""
    body = {"prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True,
            "stream": False}
    return served.post_json(url.rstrip("/") + "/v1/completions", body, timeout=timeout, who=who)


def measure_served(url: str, prompts: list[list[int]], *, max_new_tokens: int, timeout: float = 900.0,
                   prefix: str, engine: str, traffic_names: tuple[str, str]) -> served.ServedCounts:
    """Greedy completions of ``prompts`` from the vLLM-shaped server at ``url`` and what it says it
    accepted: per-request metrics where every answer carries them, else the counters' difference;
    ``traffic_names`` the server's (generated tokens counter, running requests gauge), read for other clients'
    work in between."""
    who = f"{engine} server"
    metrics_url = url.rstrip("/") + "/metrics"
    before = served.get_text(metrics_url, timeout=timeout, who=who)
    answers = [complete_ids(url, p, max_tokens=max_new_tokens, timeout=timeout, who=who) for p in prompts]
    after = served.get_text(metrics_url, timeout=timeout, who=who)
    out = served.ServedCounts(engine=engine, outputs=[list((a.get("choices") or [{}])[0].get("token_ids") or [])
                                                      for a in answers])
    generated, running = traffic_names
    out.others = served.traffic_between(before, after, out.outputs, generated=generated, running=running)
    per_request = [request_spec_metrics(a) for a in answers]
    if per_request and all(r is not None for r in per_request):
        for r in per_request:
            out.drafts += r["drafts"]
            out.draft_tokens += r["draft_tokens"]
            out.accepted += r["accepted"]
            out.accepted_per_pos = served.add_lists(out.accepted_per_pos, r["per_pos"])
        out.source = "per-request"
        return out
    start, end = (spec_counters(t, prefix) if t else None for t in (before, after))
    if start is None or end is None:
        raise served.ServedError(
            f"the {engine} server at {url} reports no speculative counters ({prefix}{SPEC_DRAFTS} at /metrics)"
            " and no per-request metrics: it runs without speculation"
            + f", or without {PER_REQUEST_FLAG} and metrics"
            + "; start it with the draft")
    out.drafts, out.draft_tokens, out.accepted = (end[k] - start[k] for k in ("drafts", "draft_tokens", "accepted"))
    out.accepted_per_pos = [e - (start["per_pos"][i] if i < len(start["per_pos"]) else 0)
                            for i, e in enumerate(end["per_pos"])]
    out.notes.append(f"{served.OTHER_TRAFFIC}: start the server with {PER_REQUEST_FLAG}")
    return out
