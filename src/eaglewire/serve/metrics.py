"""/metrics of ``eaglewire serve``: the server's counters as Prometheus text, written by
prometheus_client; its speculative counters are vLLM 0.33.0's names under the ``eaglewire_`` prefix,
so one reader (engines/serving/spec_decode_metrics.py) serves both.
"""

from __future__ import annotations

import threading
from collections import Counter

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from eaglewire.core.generation import GenerationStats


class Metrics:
    """Counters for /metrics; updated from the decoding thread and the event loop."""

    def __init__(self, max_accept: int, routes: tuple[str, ...]) -> None:
        self._lock, self.routes = threading.Lock(), routes
        self.requests: Counter[tuple[str, int]] = Counter()
        self.cancelled = self.prompt_tokens = self.generated = 0
        self.accept_counts = [0] * max_accept  # rounds whose accept length was i + 1
        self.position_accepts = [0] * (max_accept - 1)  # rounds that accepted draft depth i + 1
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted = 0  # rounds that drafted, vLLM's counters
        self.generation_seconds, self.last_tokens_per_second = 0.0, 0.0
        self.batch_size, self.speculating = 0, False  # the last step's live sequences, and whether it drafted
        self.steps: Counter[bool] = Counter()  # steps by whether they drafted

    def observe_step(self, batch_size: int, speculating: bool) -> None:
        """One step of the batch: how many sequences it advanced, and whether it was a speculative round."""
        with self._lock:
            self.batch_size, self.speculating = batch_size, speculating
            self.steps[speculating] += 1

    def count_request(self, path: str, status: int) -> None:
        with self._lock:
            self.requests[(path if path in self.routes else "other", status)] += 1

    def observe(self, stats: GenerationStats, *, cancelled: bool) -> None:
        with self._lock:
            self.cancelled += cancelled
            self.prompt_tokens += stats.prompt_tokens
            self.generated += stats.new_tokens
            for n in stats.accept_lengths:
                self.accept_counts[min(n, len(self.accept_counts)) - 1] += 1
            for d, n in enumerate(stats.position_accepts[:len(self.position_accepts)]):
                self.position_accepts[d] += n
            for a, v in zip(stats.accept_lengths, stats.verified_lengths):
                if v > 1:  # a round that drafted: vLLM's num_drafts
                    self.spec_drafts += 1
                    self.spec_draft_tokens += v - 1
                    self.spec_accepted += a - 1
            self.generation_seconds += stats.total_seconds
            if not cancelled:
                self.last_tokens_per_second = stats.tokens_per_second

    def families(self, *, waiting: int, running: int) -> list:
        """The metrics as prometheus_client metric families (a snapshot)."""
        requests = CounterMetricFamily("eaglewire_requests", "HTTP requests by route and status code",
                                       labels=["path", "status"])
        position = GaugeMetricFamily("eaglewire_position_acceptance",
                                     "share of verify passes that accepted draft depth d", labels=["position"])
        steps = CounterMetricFamily("eaglewire_decode_steps", "decoding steps of the batch, by kind", labels=["kind"])
        with self._lock:
            for speculating in (False, True):
                steps.add_metric(["speculative" if speculating else "plain"], self.steps[speculating])
            for (path, status), n in sorted(self.requests.items()):
                requests.add_metric([path, str(status)], n)
            rounds = sum(self.accept_counts)
            cumulative = [sum(self.accept_counts[:i + 1]) for i in range(len(self.accept_counts))]
            accept = HistogramMetricFamily(
                "eaglewire_accept_length", "tokens per target verify pass (bonus token included)",
                buckets=[(str(i + 1), n) for i, n in enumerate(cumulative)] + [("+Inf", rounds)],
                sum_value=sum((i + 1) * n for i, n in enumerate(self.accept_counts)))
            for d, n in enumerate(self.position_accepts):
                position.add_metric([str(d + 1)], n / max(rounds, 1))
            return self._spec_counters() + [
                requests,
                CounterMetricFamily("eaglewire_requests_cancelled", "generations stopped by a client that left",
                                    value=self.cancelled),
                CounterMetricFamily("eaglewire_prompt_tokens", "prompt tokens prefilled", value=self.prompt_tokens),
                CounterMetricFamily("eaglewire_generated_tokens", "tokens generated", value=self.generated),
                accept, position,
                CounterMetricFamily("eaglewire_generation_seconds", "seconds the engine spent generating",
                                    value=self.generation_seconds),
                GaugeMetricFamily("eaglewire_tokens_per_second", "decode speed of the last finished request",
                                  value=self.last_tokens_per_second),
                GaugeMetricFamily("eaglewire_queue_depth", "requests waiting for the engine", value=waiting),
                GaugeMetricFamily("eaglewire_requests_running", "requests being generated", value=running),
                GaugeMetricFamily("eaglewire_batch_size", "sequences the last decoding step advanced together",
                                  value=self.batch_size if running else 0),
                GaugeMetricFamily("eaglewire_speculating", "1 when the last step was a speculative round (the "
                                  "schedule's choice for its batch size), 0 when plain", value=int(self.speculating)),
                steps,
            ]

    def _spec_counters(self) -> list:
        """vLLM 0.33.0's speculative counters (vllm/v1/spec_decode/metrics.py, SpecDecodingProm)
        under eaglewire's prefix, ``position`` from 0 as vLLM's; none without a draft, as vLLM."""
        if not self.position_accepts:
            return []
        per_pos = CounterMetricFamily("eaglewire_spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=["position"])
        for d, n in enumerate(self.position_accepts):
            per_pos.add_metric([str(d)], n)
        return [CounterMetricFamily("eaglewire_spec_decode_num_drafts", "Number of spec decoding drafts.",
                                    value=self.spec_drafts),
                CounterMetricFamily("eaglewire_spec_decode_num_draft_tokens", "Number of draft tokens.",
                                    value=self.spec_draft_tokens),
                CounterMetricFamily("eaglewire_spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                    value=self.spec_accepted),
                per_pos]

    def render(self, *, waiting: int, running: int) -> bytes:
        """The Prometheus text exposition (format 0.0.4), written by prometheus_client."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Snapshot(self.families(waiting=waiting, running=running)))
        return generate_latest(registry)


class _Snapshot:
    """A prometheus_client collector of families taken at one scrape."""

    def __init__(self, families: list) -> None:
        self._families = families

    def collect(self):
        return iter(self._families)
