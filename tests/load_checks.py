"""The checks both real engines' load tests run on one launched server (a chain of 3, 4 slots): llama-server in
tests/engines/test_llamacpp_server.py, vLLM in tests/real_vllm/test_vllm_load.py."""

from __future__ import annotations


def check_answers_under_load_as_alone(server, prompts: list[list[int]], new_tokens: int) -> None:
    """3 clients over each prompt twice (bench --concurrency's closed loop): every greedy answer equals the same
    request sent alone, and the drafting rounds, from the engine's per-sequence counter, give 1..4 tokens a round."""
    from eaglewire.concurrency.server_closed_loop import closed_loop_server

    requests = prompts * 2
    alone = [server.complete(ids, max_new_tokens=new_tokens, temperature=0.0, seed=0) for ids in requests]
    row = closed_loop_server(server, requests, 3, max_new_tokens=new_tokens)
    assert row.outputs == alone and all(len(o) > 0 for o in alone)
    after_prefill = sum(len(o) - 1 for o in alone)  # the first token of each comes with its prefill
    assert after_prefill / 4 <= row.speculative_steps <= after_prefill  # 1..4 tokens a round, per sequence


def check_timed_load_counts_every_sequences_rounds(server, prompts: list[list[int]]) -> None:
    """4 streams x 17 tokens past EOS, twice: each stream's 16 tokens after the prefill's take 4..16 rounds of a
    chain of 3, so the server's counter (summed over sequences, not batched steps) gives 1..4 tokens a round."""
    from eaglewire.concurrency.server_measurement import measure_load

    load = measure_load(server, prompts, 4, speculative=True, tokens=17, warmup=0, repeats=2)
    assert len(load.cost.seconds) == 2 and min(load.cost.seconds) > 0
    assert 1.0 <= load.tau <= 4.0


def check_doctor_sees_other_clients(server, measure, prompts: list[list[int]], running_gauge: str) -> None:
    """The doctor's reading of this server (``measure``, the engine's measure_served) says no other client when
    it is alone, and the other request when one is in flight while it measures (``running_gauge``: the server's
    running-requests gauge, full sample name, polled until the other request runs)."""
    import threading
    import time

    import eaglewire.engines.serving.served_counts as served

    alone = measure(server.url, prompts[:1], max_new_tokens=8)
    assert alone.others is not None and not alone.others.busy, alone.others

    def running() -> float:
        return served.total(served.samples(served.get_text(server.url + "/metrics", timeout=30, who="server")),
                            running_gauge) or 0.0

    other = threading.Thread(target=server.complete, args=(prompts[1],),
                             kwargs=dict(max_new_tokens=256, temperature=0.0, seed=0, ignore_eos=True))
    other.start()
    try:
        deadline = time.monotonic() + 60
        while running() < 1 and other.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        busy = measure(server.url, prompts[:1], max_new_tokens=8)
    finally:
        other.join(300)
    assert busy.others is not None and busy.others.running >= 1, busy.others
    assert busy.outputs == alone.outputs  # the doctor's own answer unchanged beside it
