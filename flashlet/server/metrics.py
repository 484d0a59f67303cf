"""Prometheus metrics, one CollectorRegistry per app (never the global one)."""

from __future__ import annotations

import bisect
import itertools
import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from flashlet.core.request import FinishReason

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)
ENDPOINTS = ("/health", "/generate", "/generate_stream", "/v1/models", "/v1/completions",
             "/v1/chat/completions", "/metrics", "/openapi.json", "/docs")
METHODS = ("GET", "POST", "HEAD", "PUT", "DELETE", "PATCH", "OPTIONS")


class EngineCollector:
    """Per-core gauges (label `core`) read at scrape time from each engine core's latest stats:
    the client's `core_stats()` (CoreClient: from every core's last step message)."""

    def __init__(self, loop):
        self.loop = loop

    def describe(self):
        return []  # collected lazily: the engine may not exist yet

    def collect(self):
        per_core = self.loop.core_stats()
        gauges = [
            ("flashlet_requests_running", "Requests the scheduler is running", "running"),
            ("flashlet_requests_waiting", "Requests accepted and waiting to be scheduled",
             "waiting"),
            ("flashlet_requests_in_flight", "Requests routed to the core and not finished",
             "in_flight"),
            ("flashlet_kv_pages_used", "KV pool pages in use (requests and prefix cache)",
             "kv_pages_used"),
            ("flashlet_kv_pages_total", "KV pool size in pages", "kv_pages_total"),
            ("flashlet_kv_tokens_total", "KV pool size in tokens (twice as many with an fp8 "
             "cache in the same memory)", "kv_tokens_total"),
            ("flashlet_kv_pages_cached", "KV pages held by the prefix cache", "kv_pages_cached"),
            ("flashlet_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / "
             "prompt tokens admitted", "prefix_cache_hit_rate"),
        ]
        for name, doc, key in gauges:
            family = GaugeMetricFamily(name, doc, labels=["core"])
            for core, s in enumerate(per_core):
                family.add_metric([str(core)], float(s.get(key, 0)))
            yield family
        yield self._kv_cache_dtype(per_core)
        yield GaugeMetricFamily("flashlet_engine_ready", "1 once every engine core is loaded, "
                                "while one takes requests",
                                value=1.0 if self.loop.is_ready else 0.0)
        up = GaugeMetricFamily("flashlet_engine_core_up", "1 while the core takes requests, 0 "
                               "once it died or while it is stalled", labels=["core"])
        for core, s in enumerate(per_core):
            up.add_metric([str(core)], float(s.get("up", 1.0)))
        yield up
        counters = [("flashlet_preemptions", "Requests preempted for KV pages", "num_preemptions"),
                    ("flashlet_engine_steps", "Engine steps run", "num_steps"),
                    ("flashlet_requests_routed", "Requests routed to the core", "routed"),
                    # Speculative decoding (vLLM's names): a draft is one request's proposals
                    # in one verify step; acceptance rate = accepted / draft tokens.
                    ("flashlet_spec_decode_num_drafts", "Speculative drafts verified",
                     "spec_num_drafts"),
                    ("flashlet_spec_decode_num_draft_tokens", "Speculative tokens proposed and "
                     "verified", "spec_num_draft_tokens"),
                    ("flashlet_spec_decode_num_accepted_tokens", "Speculative tokens accepted",
                     "spec_num_accepted_tokens")]
        for name, doc, key in counters:
            family = CounterMetricFamily(name, doc, labels=["core"])
            for core, s in enumerate(per_core):
                family.add_metric([str(core)], float(s.get(key, 0)))
            yield family


    @staticmethod
    def _kv_cache_dtype(per_core: list[dict]) -> GaugeMetricFamily:
        """An info gauge: 1 with the dtype the core's KV pool stores as a label."""
        family = GaugeMetricFamily("flashlet_kv_cache_dtype_info", "1, labelled with the "
                                   "dtype the core's KV pool stores", labels=["core", "dtype"])
        for core, s in enumerate(per_core):
            if s.get("kv_cache_dtype"):
                family.add_metric([str(core), s["kv_cache_dtype"]], 1.0)
        return family


class BatchHistogram:
    """A Prometheus histogram that takes `count` equal observations at the cost of one.

    prometheus_client's Histogram takes one at a time (two locked increments each); a stream
    handler that fell behind the engine takes many tokens at once, when the API process can
    least afford it. This one owns its counts and is scraped as any histogram is."""

    def __init__(self, name: str, documentation: str, buckets, registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self.upper_bounds = tuple(float(b) for b in buckets) + (float("inf"),)
        self.counts = [0] * len(self.upper_bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        if count < 1:
            return
        bucket = bisect.bisect_left(self.upper_bounds, value)  # the first bound >= value
        with self._lock:
            self.counts[bucket] += count
            self.sum += value * count

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self):
        with self._lock:
            counts, total = list(self.counts), self.sum
        cumulative = itertools.accumulate(counts)
        buckets = [(floatToGoString(b), c) for b, c in zip(self.upper_bounds, cumulative)]
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets,
                                    sum_value=total)


class WarmCollector:
    """flashlet_api_server_warm{api_server=K}: 1 once API process K has run its warm-up (and,
    with --api-server-count > 1, accepts connections); every process reports every process."""

    def __init__(self, server):
        self.server = server

    def describe(self):
        return []

    def collect(self):
        family = GaugeMetricFamily("flashlet_api_server_warm", "1 once the API process has run "
                                   "its warm-up and accepts connections", labels=["api_server"])
        for index, warm in enumerate(self.server.warm_flags()):
            family.add_metric([str(index)], 1.0 if warm else 0.0)
        yield family


class Metrics:
    def __init__(self, loop):
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
        self.itl = BatchHistogram("flashlet_inter_token_latency_seconds",
                                  "Time between two successive tokens of one request",
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("flashlet_request_latency_seconds",
                             "Time from request arrival to its last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        r.register(EngineCollector(loop))
        # Each labelled child as labels() gave it: labels() checks and locks on every call
        # (2.7 us a counter increment against 1.0 through this dict), twice a request.
        self._children: dict[tuple, Any] = {}

    def _child(self, metric, *labels):
        child = self._children.get((metric, labels))
        if child is None:
            child = self._children[(metric, labels)] = metric.labels(*labels)
        return child

    def observe_http(self, path: str, method: str, status: int) -> None:
        endpoint = path if path in ENDPOINTS else "other"
        method = method if method in METHODS else "other"
        self._child(self.http_requests, endpoint, method, str(status)).inc()

    def observe_finished(self, endpoint: str, finish_reason: str | None, num_prompt: int,
                         num_cached: int, num_output: int, latency_s: float) -> None:
        self._child(self.requests_finished, endpoint, finish_reason or "unknown").inc()
        self.prompt_tokens.inc(num_prompt)
        self.cached_tokens.inc(num_cached)
        self.generation_tokens.inc(num_output)
        if finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.e2e.observe(latency_s)


# Requests a monitor sends, not a client's traffic: they take no part in the connections'
# turnaround (a probe's short connection, closed at once, left an entry that a later connection
# reusing its port, a loopback client's next, read as a gap of its own).
PROBE_PATHS = frozenset({"/debug/stats", "/metrics", "/health"})


class MetricsMiddleware:
    """Pure ASGI middleware counting every HTTP response by endpoint and status code, and (with
    `server`) when each request starts and its response ends on its client connection: the
    client's own turnaround in server.api_counters (diagnostics.py; read per request, the CLI
    replaces them after the app is built), PROBE_PATHS' requests apart."""

    def __init__(self, app, metrics: Metrics, server=None):
        self.app = app
        self.metrics = metrics
        self.server = server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]
        counters = connection = None
        if self.server is not None and scope.get("client") and scope.get("path") not in PROBE_PATHS:
            counters, connection = self.server.api_counters, tuple(scope["client"])
            counters.request_started(connection)

        async def send_and_record(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif counters is not None and not message.get("more_body", False):
                # the response's last byte: marked before it is sent, as the client may send
                # its next request before this task runs again
                counters.response_ended(connection)
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.observe_http(scope.get("path", ""), scope.get("method", ""), status[0])
