"""HTTP-level Prometheus metrics, in a registry of their own beside the engine's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "northmk:"
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class HTTPMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            PREFIX + "http_requests", "HTTP requests by route and status.",
            ["method", "route", "status"], registry=self.registry,
        )
        self.duration = Histogram(
            PREFIX + "http_request_duration_seconds", "HTTP request handling time (streams: to the last byte).",
            ["route"], buckets=DURATION_BUCKETS, registry=self.registry,
        )
        self.in_flight = Gauge(
            PREFIX + "http_requests_in_flight", "HTTP requests being handled.", registry=self.registry
        )

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        self.duration.labels(route).observe(seconds)
