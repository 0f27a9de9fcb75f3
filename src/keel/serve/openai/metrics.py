"""Prometheus metrics under vLLM's names, types, labels and meanings, so a vLLM Grafana dashboard and alert
rules work against keel unchanged.

Every series vLLM has is exported as vLLM v1 exports it (vllm/v1/metrics/loggers.py, PrometheusStatLogger;
docs.vllm.ai "Production Metrics"): the `vllm:` prefix, vLLM's type and buckets, and exactly vLLM's labels,
`model_name` (the served name) and `engine` ("0": one engine per server). Nothing else is added to them: a
`tenant` label would split `rate(vllm:prompt_tokens_total[5m])` into one series per tenant and change what a
dashboard panel or an alert rule on it computes. What vLLM has no series for keeps the `keel:` prefix:
per-tenant tokens and requests, rejections, expert offloading.

Three sources feed them:
- the engine's snapshot (AsyncEngine.stats(): published by the engine thread after each step, so a scrape
  never waits for a step): gauges, the token, prefix-cache, preemption and speculation counters, and the
  tokens of each step;
- each output the server receives (`on_output`): TTFT when a request's first token arrives, inter-token
  latencies as later ones do, as vLLM observes them per iteration;
- each finished engine request (`on_finished`; a choice of an API call is one) and each prompt whose choices
  have all finished (`on_prompt_finished`): the per-request histograms.

Intervals as vLLM defines them (vllm/v1/metrics/stats.py), on the engine's clock: arrival = the engine
accepted the request, scheduled = first scheduled (a preemption does not reset it), first / last token =
the steps that produced them. Queue = scheduled - arrival; prefill = first token - scheduled; decode = last
token - first token; inference = last token - scheduled; e2e = finished - arrival; TTFT = first token -
arrival. An inter-token latency is the gap between two steps that produced tokens for a request (speculative
decoding emits several tokens in one step: one gap). A request's time per output token is decode / (tokens
- 1), 0 for a one-token request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import accumulate
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from keel.serve.step_tokens import ITERATION_TOKENS_BUCKETS

if TYPE_CHECKING:
    from keel.serve.outputs import RequestOutput

# vLLM's buckets (vllm/v1/metrics/loggers.py), in seconds.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TTFT_BUCKETS += [20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0]
ITL_BUCKETS += [40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
REQUEST_LATENCY_BUCKETS += [120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
N_BUCKETS = [1, 2, 5, 10, 20]
VLLM_LABELS = ["model_name", "engine"]
ENGINE_INDEX = "0"  # vLLM labels each engine core of a data-parallel server; keel runs one
FINISH_REASONS = ("stop", "length", "abort")  # vLLM creates every reason's series at start


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets for token counts, to the context length."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class _EngineCollector(Collector):
    """The series read from the engine's last published snapshot at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], dict], cache_info: dict[str, str]) -> None:
        self.values = [model_name, ENGINE_INDEX]
        self.stats = stats
        self.cache_info = cache_info

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s)
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s)
        yield self._counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", s
        )
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", s)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", s)
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s)
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.", s)
        yield self._iteration_tokens(s)
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[*self.cache_info, *VLLM_LABELS],
        )
        info.add_metric([*self.cache_info.values(), *self.values], 1)
        yield info
        if "spec_decode_num_drafts" in s:  # speculative decoding is on
            yield from self._spec_decode(s)
        if "expert_cache_queries" in s:  # expert offloading is on
            yield from _expert_metrics(s, self.values[0])

    def _gauge(self, name: str, doc: str, s: dict) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=VLLM_LABELS)
        g.add_metric(self.values, s.get(name.removeprefix("vllm:"), 0))
        return g

    def _counter(self, name: str, doc: str, s: dict, key: str | None = None) -> CounterMetricFamily:
        key = key or _STATS_KEYS.get(name, name.removeprefix("vllm:"))
        c = CounterMetricFamily(name, doc, labels=VLLM_LABELS)
        c.add_metric(self.values, s.get(key, 0))
        return c

    def _iteration_tokens(self, s: dict) -> HistogramMetricFamily:
        """From the engine's per-bucket counts (engines without them, e.g. --engine naive: an empty histogram)."""
        counts = s.get("iteration_tokens_counts") or [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        cumulative = list(accumulate(counts))
        bounds = [floatToGoString(b) for b in ITERATION_TOKENS_BUCKETS] + ["+Inf"]
        h = HistogramMetricFamily(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", labels=VLLM_LABELS
        )
        h.add_metric(self.values, list(zip(bounds, cumulative, strict=True)), s.get("iteration_tokens_sum", 0))
        return h

    def _spec_decode(self, s: dict) -> Iterator[Metric]:
        """vLLM's SpecDecodingProm (vllm/v1/spec_decode/metrics.py): acceptance rate = accepted / draft tokens,
        mean acceptance length = 1 + accepted / drafts."""
        yield self._counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", s)
        yield self._counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", s)
        yield self._counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", s)
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*VLLM_LABELS, "position"],
        )
        for position, accepted in enumerate(s["spec_decode_num_accepted_tokens_per_pos"]):
            per_pos.add_metric([*self.values, str(position)], accepted)
        yield per_pos


# Engine stats keys whose names differ from the series'.
_STATS_KEYS = {"vllm:num_preemptions": "num_preemptions_total", "vllm:prompt_tokens": "prompt_tokens_total"}
_STATS_KEYS["vllm:generation_tokens"] = "generation_tokens_total"


def _expert_metrics(s: dict, model_name: str) -> Iterator[Metric]:
    """Expert offloading (keel.serve.offload.stats), which vLLM has no series for: a use is one distinct expert
    needed by one forward of one MoE layer."""

    def family(kind: type, name: str, doc: str, key: str) -> Metric:
        m = kind(name, doc, labels=["model_name"])
        m.add_metric([model_name], s[key])
        return m

    yield family(
        GaugeMetricFamily,
        "keel:expert_cache_hit_rate",
        "Expert uses served by a resident expert (0-1).",
        "expert_cache_hit_rate",
    )
    yield family(
        CounterMetricFamily,
        "keel:expert_cache_queries",
        "Expert uses (distinct experts per MoE layer forward).",
        "expert_cache_queries",
    )
    yield family(
        CounterMetricFamily, "keel:expert_cache_hits", "Expert uses whose expert was resident.", "expert_cache_hits"
    )
    yield family(CounterMetricFamily, "keel:expert_loads", "Experts copied into resident slots.", "expert_loads_total")
    yield family(
        CounterMetricFamily,
        "keel:expert_bytes_loaded",
        "Bytes of experts copied into resident slots.",
        "expert_bytes_loaded_total",
    )
    yield family(
        CounterMetricFamily,
        "keel:expert_load_stall_seconds",
        "Seconds forwards waited for expert loads.",
        "expert_load_stall_seconds_total",
    )
    yield family(
        GaugeMetricFamily,
        "keel:expert_prefetch_accuracy",
        "Routed token-slots whose expert the prefetch predictor picked.",
        "expert_prefetch_accuracy",
    )


class ServerMetrics:
    """The server's registry: vLLM's per-request series, keel's per-tenant ones, the engine collector and the
    process collectors."""

    def __init__(
        self,
        model_name: str,
        engine_stats: Callable[[], dict],
        *,
        max_model_len: int = 2**16,
        cache_info: dict[str, str] | None = None,
    ) -> None:
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        values = (model_name, ENGINE_INDEX)
        lengths = build_1_2_5_buckets(max_model_len)

        def histogram(name: str, doc: str, buckets: list) -> Histogram:
            # Bound to the one label set at start, as vLLM does: every series exists before the first request.
            return Histogram(name, doc, VLLM_LABELS, buckets=buckets, registry=r).labels(*values)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        # vLLM's name for the same observations before 0.11 (deprecated there, still on older dashboards).
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds. Same as vllm:inter_token_latency_seconds.",
            ITL_BUCKETS,
        )
        self.request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", lengths)
        self.generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", lengths
        )
        self.max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            lengths,
        )
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", lengths
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*VLLM_LABELS, "finished_reason"],
            registry=r,
        )
        for reason in FINISH_REASONS:
            self.success.labels(*values, reason)
        tenant_labels = ["model_name", "tenant"]
        self.tenant_prompt_tokens = Counter(
            "keel:tenant_prompt_tokens", "Prompt tokens of admitted API calls, per tenant.", tenant_labels, registry=r
        )
        self.tenant_generation_tokens = Counter(
            "keel:tenant_generation_tokens", "Generated tokens, per tenant.", tenant_labels, registry=r
        )
        self.tenant_success = Counter(
            "keel:tenant_request_success",
            "Finished engine requests by finish reason, per tenant.",
            [*tenant_labels, "finished_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "keel:request_rejected",
            "Requests answered with an error, by reason.",
            [*tenant_labels, "reason"],
            registry=r,
        )
        r.register(_EngineCollector(model_name, engine_stats, cache_info or {}))
        # What vLLM's default registry also carries: process_* (CPU, memory, fds), python_info, python_gc_*.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)

    def on_admitted(self, tenant: str, prompt_tokens: int) -> None:
        self.tenant_prompt_tokens.labels(self.model_name, tenant).inc(prompt_tokens)

    def on_output(self, tenant: str, out: RequestOutput, seen: int, count: int) -> None:
        """An engine request's output after a step; `seen`: its tokens already passed here, `count`: its tokens
        with this output's (its outputs may be deltas). Observes the TTFT with its first token and one
        inter-token latency per later step that produced tokens."""
        if count > seen:
            self.tenant_generation_tokens.labels(self.model_name, tenant).inc(count - seen)
        stats = out.metrics
        if stats is None or count <= seen:
            return
        # The engine thread goes on appending to token_times: read only the first `count`, which this output
        # already reflects.
        times = stats.token_times
        if seen == 0 and stats.first_token is not None:
            self.ttft.observe(stats.first_token - stats.arrival)
        for i in range(max(seen, 1), min(count, len(times))):
            gap = times[i] - times[i - 1]
            if gap > 0:  # tokens of one step (accepted drafts) share its time: one gap per step
                self.itl.observe(gap)
                self.tpot.observe(gap)

    def on_finished(
        self,
        tenant: str,
        finish_reason: str,
        out: RequestOutput | None = None,
        max_tokens: int | None = None,
        generated: int = 0,
    ) -> None:
        """An engine request ended: `out` is its final output (None when it was aborted without one), after
        `generated` tokens."""
        self.success.labels(self.model_name, ENGINE_INDEX, finish_reason).inc()
        self.tenant_success.labels(self.model_name, tenant, finish_reason).inc()
        stats = out.metrics if out is not None else None
        if stats is None:
            return
        self.prompt_tokens.observe(len(out.prompt_token_ids))
        self.generation_tokens.observe(generated)
        if max_tokens:
            self.params_max_tokens.observe(max_tokens)
        if stats.finished is not None:
            self.e2e.observe(stats.finished - stats.arrival)
        scheduled, first = stats.first_scheduled, stats.first_token
        if scheduled is not None:
            self.queue.observe(scheduled - stats.arrival)
        if first is None or scheduled is None or not stats.token_times:
            return
        last = stats.token_times[-1]  # finished: the engine appends no more
        decode = last - first
        self.prefill.observe(first - scheduled)
        self.decode.observe(decode)
        self.inference.observe(last - scheduled)
        self.request_tpot.observe(decode / (generated - 1) if generated > 1 else 0.0)

    def on_prompt_finished(self, n: int, max_generation_tokens: int) -> None:
        """Every choice of one prompt of an API call finished (vLLM's parent request of n children)."""
        self.params_n.observe(n)
        self.max_generation_tokens.observe(max_generation_tokens)

    def on_rejected(self, tenant: str, reason: str) -> None:
        self.rejected.labels(self.model_name, tenant, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
