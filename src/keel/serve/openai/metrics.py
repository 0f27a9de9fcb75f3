"""Prometheus metrics, named after vLLM's (`vllm:` -> `keel:`) so its dashboards work unchanged.

Per-request metrics carry the labels `model_name` (vLLM's label, what its Grafana dashboard
selects on), `model` (the same value) and `tenant`. The engine's gauges and counters (running,
waiting, KV usage, prefix cache, preemptions) are read from the engine's last published stats at
scrape time by a custom collector, so a scrape never waits for a model step.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from keel.serve.request import RequestStats

# Buckets as vLLM's (seconds).
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
E2E_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
LABELS = ["model_name", "model", "tenant"]


class _EngineCollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], dict[str, float]]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self):
        s = self.stats()
        labels = ["model_name", "model"]
        values = [self.model_name, self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("keel:num_requests_running", "Requests in the engine's running batch.", s["num_requests_running"])
        yield gauge("keel:num_requests_waiting", "Requests waiting to be scheduled.", s["num_requests_waiting"])
        yield gauge("keel:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", s["kv_cache_usage_perc"])
        yield counter(
            "keel:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s["prefix_cache_queries"]
        )
        yield counter("keel:prefix_cache_hits", "Prompt tokens served by the prefix cache.", s["prefix_cache_hits"])
        yield counter("keel:num_preemptions", "Requests preempted (KV blocks ran out).", s["num_preemptions_total"])
        if "expert_cache_queries" in s:  # expert offloading is on
            yield from _expert_metrics(s, gauge, counter)
        if "spec_decode_num_drafts" in s:  # speculative decoding is on
            yield from _spec_metrics(s, counter, labels, values)


def _spec_metrics(s: dict, counter: Callable, labels: list[str], values: list[str]):
    """Speculative decoding, as vLLM's spec_decode_* counters: acceptance rate = accepted / draft tokens,
    mean accepted length = 1 + accepted / drafts."""
    yield counter(
        "keel:spec_decode_num_drafts",
        "Verification steps (one per request per step with drafts).",
        s["spec_decode_num_drafts"],
    )
    yield counter(
        "keel:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", s["spec_decode_num_draft_tokens"]
    )
    yield counter(
        "keel:spec_decode_num_accepted_tokens",
        "Draft tokens the target model accepted.",
        s["spec_decode_num_accepted_tokens"],
    )
    per_pos = CounterMetricFamily(
        "keel:spec_decode_num_accepted_tokens_per_pos",
        "Drafts accepted at each position of the draft.",
        labels=[*labels, "position"],
    )
    for position, accepted in enumerate(s["spec_decode_num_accepted_tokens_per_pos"]):
        per_pos.add_metric([*values, str(position)], accepted)
    yield per_pos


def _expert_metrics(s: dict[str, float], gauge: Callable, counter: Callable):
    """Expert offloading (keel.serve.offload.stats): a use is one distinct expert needed by one
    forward of one MoE layer."""
    yield gauge(
        "keel:expert_cache_hit_rate", "Expert uses served by a resident expert (0-1).", s["expert_cache_hit_rate"]
    )
    yield counter(
        "keel:expert_cache_queries", "Expert uses (distinct experts per MoE layer forward).", s["expert_cache_queries"]
    )
    yield counter("keel:expert_cache_hits", "Expert uses whose expert was resident.", s["expert_cache_hits"])
    yield counter("keel:expert_loads", "Experts copied into resident slots.", s["expert_loads_total"])
    yield counter(
        "keel:expert_bytes_loaded", "Bytes of experts copied into resident slots.", s["expert_bytes_loaded_total"]
    )
    yield counter(
        "keel:expert_load_stall_seconds",
        "Seconds forwards waited for expert loads.",
        s["expert_load_stall_seconds_total"],
    )
    yield gauge(
        "keel:expert_prefetch_accuracy",
        "Routed token-slots whose expert the prefetch predictor picked.",
        s["expert_prefetch_accuracy"],
    )


class ServerMetrics:
    """The server's registry: per-request histograms and counters, plus the engine collector."""

    def __init__(self, model_name: str, engine_stats: Callable[[], dict[str, float]]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "keel:time_to_first_token_seconds", "Time to first token.", LABELS, buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "keel:inter_token_latency_seconds",
            "Time between successive output tokens.",
            LABELS,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "keel:time_per_output_token_seconds",
            "Mean time per output token after the first.",
            LABELS,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "keel:e2e_request_latency_seconds", "Arrival to last token.", LABELS, buckets=E2E_BUCKETS, registry=r
        )
        self.queue = Histogram(
            "keel:request_queue_time_seconds", "Arrival to first scheduled.", LABELS, buckets=E2E_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("keel:prompt_tokens", "Prompt tokens of admitted requests.", LABELS, registry=r)
        self.generation_tokens = Counter("keel:generation_tokens", "Generated tokens.", LABELS, registry=r)
        self.success = Counter(
            "keel:request_success", "Finished requests by finish reason.", [*LABELS, "finished_reason"], registry=r
        )
        self.rejected = Counter(
            "keel:request_rejected", "Requests answered with an error, by reason.", [*LABELS, "reason"], registry=r
        )
        r.register(_EngineCollector(model_name, engine_stats))

    def _labels(self, tenant: str) -> dict[str, str]:
        return {"model_name": self.model_name, "model": self.model_name, "tenant": tenant}

    def on_admitted(self, tenant: str, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(**self._labels(tenant)).inc(prompt_tokens)

    def on_tokens(self, tenant: str, count: int) -> None:
        if count:
            self.generation_tokens.labels(**self._labels(tenant)).inc(count)

    def on_finished(self, tenant: str, stats: RequestStats | None, finish_reason: str) -> None:
        labels = self._labels(tenant)
        self.success.labels(**labels, finished_reason=finish_reason).inc()
        if stats is None:
            return
        if stats.queue_time is not None:
            self.queue.labels(**labels).observe(stats.queue_time)
        if stats.ttft is not None:
            self.ttft.labels(**labels).observe(stats.ttft)
        gaps = stats.inter_token_times
        itl = self.itl.labels(**labels)
        for gap in gaps:
            itl.observe(gap)
        if gaps:
            self.tpot.labels(**labels).observe(sum(gaps) / len(gaps))
        end = stats.finished if stats.finished is not None else (stats.token_times[-1] if stats.token_times else None)
        if end is not None:
            self.e2e.labels(**labels).observe(end - stats.arrival)

    def on_rejected(self, tenant: str, reason: str) -> None:
        self.rejected.labels(**self._labels(tenant), reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
