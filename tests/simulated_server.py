"""A server that runs the draft under one wiring, without a server: for the doctor's served-wiring tests and
benchmarks/experiments/doctor/doctor_probes.py. Greedy decoding is lossless, so a real server wired that way answers with the
target's own greedy text and counts what the wiring's replay of the greedy chain accepts on it."""

from __future__ import annotations

from eaglewire.doctor.served_tau.probes import build_all, greedy_replies, replay_texts
from eaglewire.engines.serving.served_counts import ServedCounts, add_lists


class SimulatedServer:
    """prompts -> ServedCounts, as a server running ``draft`` under ``wiring`` at a chain of ``steps`` reports them
    (per request), ``tokens`` new tokens each."""

    def __init__(self, target, draft, wiring, tokens: int, steps: int, engine: str = "vllm") -> None:
        self.target, self.draft, self.tokens, self.steps, self.engine = target, draft, tokens, steps, engine
        self.built = build_all({0: wiring}, draft)
        self.requests = 0

    def __call__(self, prompts: list[list[int]]) -> ServedCounts:
        counts = ServedCounts(self.engine, source="per-request")
        outputs = greedy_replies(self.target, prompts, self.tokens)
        self.requests += len(prompts)
        counts.outputs = outputs
        for got in replay_texts(self.target, self.draft, self.built, prompts, outputs, self.steps):
            if got:
                counts.drafts += got[0].drafts
                counts.draft_tokens += got[0].draft_tokens
                counts.accepted += got[0].accepted
                counts.accepted_per_pos = add_lists(counts.accepted_per_pos, got[0].accepted_per_pos)
        return counts
