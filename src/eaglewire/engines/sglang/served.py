"""What SGLang (0.5.23) computes a draft with, read from its ``config.json`` as SGLang reads it, and what a
running SGLang server says it accepted (``/generate``'s meta_info, ``/metrics``): ``doctor --engine-url``."""

from __future__ import annotations

from typing import Any

from eaglewire.engines.sglang.readings import NAME, VERSION, num_aux

# ---------------------------------------------------------------- what the draft computes

_LLAMA_EAGLE3 = "sglang/srt/models/llama_eagle3.py"
SERVED_CITED = {
    "norm_before_residual": f"{_LLAMA_EAGLE3} LlamaDecoderLayer.forward: the residual is always the un-normed "
                            "hidden state; SGLang never reads norm_before_residual",
    "norm_before_fc / fc_norm / norm_output": f"{_LLAMA_EAGLE3} LlamaModel.__init__: eagle_config['norm_before_fc'] "
                                              "first, then the top-level key; fc_norm or use_aux_norm; norm_output",
    "layer fields": "transformers' LlamaConfig (model_type llama): its defaults fill missing keys",
    "draft_vocab_size / lm_head": f"{_LLAMA_EAGLE3} LlamaForCausalLMEagle3.__init__: tie_word_embeddings -> the "
                                  "embedding is the head; draft_vocab_size missing -> load_lm_head_from_target "
                                  "(the target's head over its whole vocabulary)",
    "d2t / t2d": f"{_LLAMA_EAGLE3} load_weights: hot_token_id = d2t + arange (offsets); t2d skipped",
    "embedding": "sglang/srt/speculative/eagle_worker_v2.py: EAGLE3 always set_embed(the target's embedding)",
    "dtype": "the server's --dtype: the target's",
}


def read_served(d: dict[str, Any], tensors: set[str] | None = None, *, own_embedding_differs: bool = False):
    """``ServedDraft``: what SGLang 0.5.23 computes a draft with, from its ``config.json`` ``d`` as SGLang
    reads it (``SERVED_CITED``); ``tensors`` / ``own_embedding_differs`` as for vLLM (SGLang always
    shares the target's embedding, so only the head depends on them)."""
    from eaglewire.engines.serving.served_draft import ServedDraft
    from eaglewire.engines.formats.eagle3_layout import LLAMA_DEFAULTS, parse_rope

    c = {**LLAMA_DEFAULTS, "tie_word_embeddings": False, **{k: v for k, v in d.items() if v is not None}}
    nested = d.get("eagle_config") if isinstance(d.get("eagle_config"), dict) else {}
    norms = {"norm_before_residual": False,
             "norm_before_fc": bool(nested.get("norm_before_fc", c.get("norm_before_fc", False))),
             "fc_norm": bool(c.get("fc_norm") or c.get("use_aux_norm")), "norm_output": bool(c.get("norm_output", False))}
    heads = int(c["num_attention_heads"])
    theta, rope = parse_rope(d)
    vd = d.get("draft_vocab_size")
    head = "embedding" if c["tie_word_embeddings"] else ("target" if vd is None else "draft")
    return ServedDraft(
        engine=f"SGLang {VERSION}", norms=norms, draft_vocab_size=int(vd) if vd is not None else None,
        target_hidden_size=int(c.get("target_hidden_size") or c["hidden_size"]), num_aux=num_aux(d),
        hidden_size=int(c["hidden_size"]), head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
        rms_norm_eps=float(c["rms_norm_eps"]), rope_theta=theta, rope_parameters=rope, embedding="target",
        lm_head=head, cited=dict(SERVED_CITED),
        norm_sections={"norm_before_fc": "eagle_config"} if "norm_before_fc" in nested else {})


def served_config_key(d: dict[str, Any]) -> str:
    """Where SGLang reads the draft layer's fields (the top level)."""
    return ""


# ---------------------------------------------------------------- served acceptance (doctor --engine-url)
# Read from SGLang 0.5.23. Per request: the native ``/generate`` answers {"text", "output_ids",
# "meta_info"} (sglang/srt/managers/tokenizer_manager.py, _handle_batch_output), and for a
# finished request with speculation meta_info carries ``completion_tokens`` and, from
# _calculate_spec_decoding_metrics, ``spec_verify_ct`` (verify steps), ``spec_num_correct_drafts``
# (accepted drafted tokens, no bonus), ``spec_num_proposed_drafts`` (spec_verify_ct x
# (speculative_num_draft_tokens - 1)), ``spec_accept_length`` (completion_tokens / spec_verify_ct,
# which counts the prefill's first token too) and ``spec_correct_drafts_histogram`` ([j]: verify
# steps that accepted j drafts, from Req.update_spec_correct_drafts_histogram in
# sglang/srt/managers/schedule_batch.py). Counters: sglang/srt/observability/metrics_collector.py,
# ``sglang:spec_accept_length`` (a Gauge: the last logging interval's batch mean, not a total),
# ``sglang:spec_verify_calls_total`` and ``sglang:generation_tokens_total`` (Counters, incremented
# per finished request in observe_one_finished_request); the /metrics route needs --enable-metrics.

SPEC_ACCEPT_LENGTH = "sglang:spec_accept_length"
SPEC_VERIFY_CALLS = "sglang:spec_verify_calls_total"
GENERATION_TOKENS = "sglang:generation_tokens_total"
RUNNING_REQUESTS = "sglang:num_running_reqs"  # a Gauge set each logging interval (SchedulerMetricsCollector)


def meta_spec(meta_info: dict[str, Any]) -> dict[str, Any] | None:
    """One answer's ``meta_info`` -> {drafts, draft_tokens, accepted, per_pos}; None when it holds
    no speculative figures (a server without speculation, or a request it did not verify)."""
    import eaglewire.engines.serving.served_counts as served

    verify = int(meta_info.get("spec_verify_ct") or 0)
    if verify <= 0:
        return None
    histogram = [int(x) for x in meta_info.get("spec_correct_drafts_histogram") or []]
    if "spec_num_correct_drafts" in meta_info:
        accepted = int(meta_info["spec_num_correct_drafts"])
    elif histogram:
        accepted = sum(j * n for j, n in enumerate(histogram))
    else:  # SGLang's own accept length counts the prefill token: one too many per request
        accepted = int(meta_info.get("completion_tokens", verify)) - verify - 1
    return {"drafts": verify, "draft_tokens": int(meta_info.get("spec_num_proposed_drafts") or 0),
            "accepted": max(accepted, 0), "per_pos": served.per_pos_from_histogram(histogram)}


def generate_ids(url: str, prompt_ids: list[int], *, max_new_tokens: int, timeout: float) -> dict[str, Any]:
    """A greedy native ``/generate`` of the token ids ``prompt_ids``."""
    import eaglewire.engines.serving.served_counts as served

    body = {"input_ids": list(prompt_ids), "stream": False,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens}}
    return served.post_json(url.rstrip("/") + "/generate", body, timeout=timeout, who="SGLang server")


def spec_gauges(text: str) -> dict[str, float]:
    """SGLang's speculative metrics in Prometheus text: the accept-length gauge (mean over its
    label sets) and the verify-call / generated-token counters (summed)."""
    import eaglewire.engines.serving.served_counts as served

    rows = served.samples(text)
    gauges = [v for n, _, v in rows if n == SPEC_ACCEPT_LENGTH]
    out = {k: v for k, v in ((SPEC_VERIFY_CALLS, served.total(rows, SPEC_VERIFY_CALLS)),
                             (GENERATION_TOKENS, served.total(rows, GENERATION_TOKENS))) if v is not None}
    if gauges:
        out[SPEC_ACCEPT_LENGTH] = sum(gauges) / len(gauges)
    return out


def measure_served(url: str, prompts: list[list[int]], *, max_new_tokens: int, timeout: float = 900.0):
    """Greedy generations of ``prompts`` from the SGLang server at ``url`` and what it says it
    accepted: each answer's meta_info; the metrics (with --enable-metrics) beside them."""
    import eaglewire.engines.serving.served_counts as served

    metrics_url = url.rstrip("/") + "/metrics"
    before = served.get_text(metrics_url, timeout=timeout, who="SGLang server")
    answers = [generate_ids(url, p, max_new_tokens=max_new_tokens, timeout=timeout) for p in prompts]
    after = served.get_text(metrics_url, timeout=timeout, who="SGLang server")
    out = served.ServedCounts(engine=NAME, outputs=[list(a.get("output_ids") or []) for a in answers],
                              source="per-request")
    per_request = [meta_spec(a.get("meta_info") or {}) for a in answers]
    if not any(per_request):
        raise served.ServedError(f"the SGLang server at {url} reports no spec_verify_ct in meta_info: it runs "
                                 "without speculation; start it with --speculative-algorithm EAGLE3 and the draft")
    for r in filter(None, per_request):
        out.drafts += r["drafts"]
        out.draft_tokens += r["draft_tokens"]
        out.accepted += r["accepted"]
        out.accepted_per_pos = served.add_lists(out.accepted_per_pos, r["per_pos"])
    if not out.accepted_per_pos:
        out.notes.append("meta_info holds no spec_correct_drafts_histogram: no per-position acceptance")
    out.others = served.traffic_between(before, after, out.outputs, generated=GENERATION_TOKENS, running=RUNNING_REQUESTS)
    if before is not None and after is not None:
        start, end = spec_gauges(before), spec_gauges(after)
        if SPEC_ACCEPT_LENGTH in end:
            out.notes.append(f"{SPEC_ACCEPT_LENGTH} {end[SPEC_ACCEPT_LENGTH]:.2f} (SGLang's gauge: the last "
                             "logging interval's batches, any client's)")
        if SPEC_VERIFY_CALLS in end and GENERATION_TOKENS in end:
            calls = end[SPEC_VERIFY_CALLS] - start.get(SPEC_VERIFY_CALLS, 0.0)
            tokens = end[GENERATION_TOKENS] - start.get(GENERATION_TOKENS, 0.0)
            if calls > 0:
                out.notes.append(f"counters: {tokens:.0f} generated tokens over {calls:.0f} verify calls, "
                                 f"{tokens / calls:.2f} per call ({served.OTHER_TRAFFIC})")
    else:
        out.notes.append("no /metrics (SGLang without --enable-metrics): read from meta_info alone")
    return out
