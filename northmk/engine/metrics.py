"""Prometheus metrics of the engine, in their own registry (the server exposes it at /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "northmk:"
# Seconds; fine at the low end where CPU tests and GPU decode both land.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
               0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
               30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests with a choice in the decode batch or in prefill.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting for admission (new or preempted).")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV pages in use, 0..1.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished prefills.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Sequences preempted for lack of KV pages.")
        self.request_success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                       labels + ["finished_reason"], registry=self.registry)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a choice.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last choice finishing.", E2E_BUCKETS)
        self.model_name = model_name

    def request_finished(self, reason: str, latency_s: float) -> None:
        self.request_success.labels(self.model_name, reason).inc()
        self.e2e.observe(latency_s)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
