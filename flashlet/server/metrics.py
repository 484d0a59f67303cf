"""Prometheus metrics, one CollectorRegistry per app (never the global one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from flashlet.server.engine_loop import EngineLoop

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)
ENDPOINTS = ("/health", "/generate", "/generate_stream", "/v1/models", "/v1/completions",
             "/v1/chat/completions", "/metrics", "/openapi.json", "/docs")
METHODS = ("GET", "POST", "HEAD", "PUT", "DELETE", "PATCH", "OPTIONS")


class EngineCollector:
    """Gauges read from the engine loop's latest stats snapshot at scrape time."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop

    def describe(self):
        return []  # collected lazily: the engine may not exist yet

    def collect(self):
        s = self.loop.snapshot or {}
        gauges = [
            ("flashlet_requests_running", "Requests the scheduler is running", s.get("running", 0)),
            ("flashlet_requests_waiting", "Requests accepted and waiting to be scheduled",
             s.get("waiting", 0) + self.loop._num_pending_submits),
            ("flashlet_kv_pages_used", "KV pool pages in use (requests and prefix cache)",
             s.get("kv_pages_used", 0)),
            ("flashlet_kv_pages_total", "KV pool size in pages", s.get("kv_pages_total", 0)),
            ("flashlet_kv_pages_cached", "KV pages held by the prefix cache",
             s.get("kv_pages_cached", 0)),
            ("flashlet_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / "
             "prompt tokens admitted", s.get("prefix_cache_hit_rate", 0.0)),
            ("flashlet_engine_ready", "1 once the model is loaded and the loop runs",
             1.0 if self.loop.is_ready else 0.0),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=float(value))
        yield CounterMetricFamily("flashlet_preemptions", "Requests preempted for KV pages",
                                  value=float(s.get("num_preemptions", 0)))
        yield CounterMetricFamily("flashlet_engine_steps", "Engine steps run",
                                  value=float(s.get("num_steps", 0)))


class Metrics:
    def __init__(self, loop: EngineLoop):
        self.registry = r = CollectorRegistry()
        self.http_requests = Counter(
            "flashlet_http_requests", "HTTP requests by endpoint, method and status code",
            ["endpoint", "method", "status"], registry=r)
        self.requests_finished = Counter(
            "flashlet_requests_finished", "Generation requests by endpoint and finish reason "
            "(stop, length, abort, error)", ["endpoint", "finish_reason"], registry=r)
        self.requests_rejected = Counter(
            "flashlet_requests_rejected", "Generation requests refused before queueing "
            "(overloaded, not_ready)", ["reason"], registry=r)
        self.prompt_tokens = Counter("flashlet_prompt_tokens", "Prompt tokens processed",
                                     registry=r)
        self.cached_tokens = Counter("flashlet_cached_prompt_tokens",
                                     "Prompt tokens served from the prefix cache", registry=r)
        self.generation_tokens = Counter("flashlet_generation_tokens", "Tokens generated",
                                         registry=r)
        self.ttft = Histogram("flashlet_time_to_first_token_seconds",
                              "Time from request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("flashlet_inter_token_latency_seconds",
                             "Time between two successive tokens of one request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("flashlet_request_latency_seconds",
                             "Time from request arrival to its last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        r.register(EngineCollector(loop))

    def observe_http(self, path: str, method: str, status: int) -> None:
        endpoint = path if path in ENDPOINTS else "other"
        method = method if method in METHODS else "other"
        self.http_requests.labels(endpoint, method, str(status)).inc()

    def observe_finished(self, endpoint: str, out, latency_s: float) -> None:
        self.requests_finished.labels(endpoint, out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids or ()))
        self.cached_tokens.inc(out.num_cached_tokens)
        self.generation_tokens.inc(len(out.token_ids or ()))
        if out.finish_reason in ("stop", "length"):
            self.e2e.observe(latency_s)


class MetricsMiddleware:
    """Pure ASGI middleware counting every HTTP response by endpoint and status code."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_and_record(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.observe_http(scope.get("path", ""), scope.get("method", ""), status[0])
