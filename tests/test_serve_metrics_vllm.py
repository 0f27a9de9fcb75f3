"""`/metrics` under vLLM's names and meanings: a real `keel serve` over HTTP, a few requests (streamed and not,
n > 1, chat, a prefix-cache hit), the scrapes parsed by prometheus_client's parser.

The names are vLLM's, the queries are those of vLLM's own Grafana dashboard: what a vLLM dashboard or alert
rule reads must be there, with vLLM's labels, and mean what vLLM means by it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_serve_http import GREEDY, client, model_dir, start_server  # noqa: F401 - model_dir is a fixture

MODEL = "tiny"  # the served name start_server passes
NUM_BLOCKS = 256

# vLLM v1's Prometheus series as (family, type), from vllm/v1/metrics/loggers.py (PrometheusStatLogger, v0.12;
# documented at docs.vllm.ai/en/latest/usage/metrics/ and /design/metrics/). Counter families are named as
# prometheus_client's parser names them: without the `_total` their samples carry. Not here: series of
# features keel does not have (LoRA, multi-modal cache, KV connector, sleep mode) and opt-in ones (KV block
# residency, NaN counting).
VLLM_SERIES = [
    ("vllm:num_requests_running", "gauge"),
    ("vllm:num_requests_waiting", "gauge"),
    ("vllm:kv_cache_usage_perc", "gauge"),
    ("vllm:prefix_cache_queries", "counter"),
    ("vllm:prefix_cache_hits", "counter"),
    ("vllm:num_preemptions", "counter"),
    ("vllm:prompt_tokens", "counter"),
    ("vllm:generation_tokens", "counter"),
    ("vllm:request_success", "counter"),
    ("vllm:request_prompt_tokens", "histogram"),
    ("vllm:request_generation_tokens", "histogram"),
    ("vllm:iteration_tokens_total", "histogram"),
    ("vllm:request_max_num_generation_tokens", "histogram"),
    ("vllm:request_params_n", "histogram"),
    ("vllm:request_params_max_tokens", "histogram"),
    ("vllm:time_to_first_token_seconds", "histogram"),
    ("vllm:inter_token_latency_seconds", "histogram"),
    ("vllm:time_per_output_token_seconds", "histogram"),  # deprecated in vLLM 0.11; older dashboards read it
    ("vllm:request_time_per_output_token_seconds", "histogram"),
    ("vllm:e2e_request_latency_seconds", "histogram"),
    ("vllm:request_queue_time_seconds", "histogram"),
    ("vllm:request_inference_time_seconds", "histogram"),
    ("vllm:request_prefill_time_seconds", "histogram"),
    ("vllm:request_decode_time_seconds", "histogram"),
    ("vllm:cache_config_info", "gauge"),
]
# prometheus_client's process and platform collectors, which vLLM's registry carries.
PROCESS_SERIES = [
    ("process_cpu_seconds", "counter"),
    ("process_resident_memory_bytes", "gauge"),
    ("process_start_time_seconds", "gauge"),
    ("python_info", "gauge"),
    ("python_gc_collections", "counter"),
]
# The queries of vLLM's Grafana dashboard, examples/observability/prometheus_grafana/grafana.json, with its
# `$model_name` variable (the dashboard repeats each quantile for 0.5, 0.9, 0.95 and 0.99).
SEL = '{model_name="$model_name"}'
RANGE = "[$__rate_interval]"


def _quantile(h: str) -> str:
    return f"histogram_quantile(0.99, sum by(le) (rate({h}_bucket{SEL}{RANGE})))"


def _mean(h: str) -> str:
    return f"rate({h}_sum{SEL}{RANGE})\n/\nrate({h}_count{SEL}{RANGE})"


DASHBOARD = [
    _quantile("vllm:e2e_request_latency_seconds"),
    _mean("vllm:e2e_request_latency_seconds"),
    f"rate(vllm:prompt_tokens_total{SEL}{RANGE})",
    f"rate(vllm:generation_tokens_total{SEL}{RANGE})",
    _quantile("vllm:inter_token_latency_seconds"),
    _mean("vllm:inter_token_latency_seconds"),
    f"vllm:num_requests_running{SEL}",
    f"vllm:num_requests_waiting{SEL}",
    _quantile("vllm:time_to_first_token_seconds"),
    _mean("vllm:time_to_first_token_seconds"),
    f"vllm:kv_cache_usage_perc{SEL}",
    f"sum by(le) (increase(vllm:request_prompt_tokens_bucket{SEL}{RANGE}))",
    f"sum by(le) (increase(vllm:request_generation_tokens_bucket{SEL}{RANGE}))",
    f"sum by(finished_reason) (increase(vllm:request_success_total{SEL}{RANGE}))",
    f"rate(vllm:request_queue_time_seconds_sum{SEL}{RANGE})",
    f"rate(vllm:request_prefill_time_seconds_sum{SEL}{RANGE})",
    f"rate(vllm:request_decode_time_seconds_sum{SEL}{RANGE})",
    f"rate(vllm:request_max_num_generation_tokens_sum{SEL}{RANGE})",
]
SELECTOR = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)\{model_name="\$model_name"\}')


@dataclass
class Scrape:
    families: dict  # family name -> prometheus_client Metric

    def samples(self, name: str, **labels: str) -> list:
        """Every sample called `name` whose labels include `labels` (a PromQL selector's equality matchers)."""
        return [
            s
            for f in self.families.values()
            for s in f.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def value(self, name: str, **labels: str) -> float:
        return sum(s.value for s in self.samples(name, model_name=MODEL, **labels))


def scrape(server) -> Scrape:
    text = httpx.get(server.base_url + "/metrics").text
    return Scrape({f.name: f for f in text_string_to_metric_families(text)})


@dataclass
class Traffic:
    before: Scrape  # fresh server, no request yet
    after_plain: Scrape  # after request A
    before_hit: Scrape  # = after_plain
    after_hit: Scrape  # after request B, which reuses A's prompt prefix
    after: Scrape  # after every request
    prompt_tokens: list[int]  # one per engine request (a choice of an API call is one)
    generated: list[int]
    max_tokens: list[int]
    ns: list[int]  # n of each API prompt
    cached_tokens_hit: int  # usage.prompt_tokens_details.cached_tokens of request B

    def delta(self, name: str, **labels: str) -> float:
        return self.after.value(name, **labels) - self.before.value(name, **labels)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):  # noqa: F811 - model_dir is test_serve_http's fixture
    log = tmp_path_factory.mktemp("metrics") / "server.log"
    proc = start_server(
        model_dir, "--num-blocks", str(NUM_BLOCKS), "--max-model-len", "1024", log_path=log
    ).wait_ready()
    yield proc
    assert proc.terminate() == 0, proc.tail(40)


@pytest.fixture(scope="module")
def traffic(server) -> Traffic:
    """A: plain completion; B: streamed, A's prompt plus a suffix (a prefix-cache hit); C: n = 2; D: streamed chat."""
    c = client(server)
    shared = "The metrics of a serving engine, as vLLM names them: counters and histograms."
    before = scrape(server)
    a = c.completions.create(model=MODEL, prompt=shared, max_tokens=6, **GREEDY)
    after_plain = scrape(server)
    stream = c.completions.create(
        model=MODEL,
        prompt=shared + " And more.",
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    b = [chunk for chunk in stream][-1].usage
    after_hit = scrape(server)
    # n > 1 samples (vLLM refuses it greedy); ignore_eos keeps both choices 4 tokens long
    sampled = {"temperature": 1.0, "seed": 3, "extra_body": {"ignore_eos": True}}
    cc = c.completions.create(model=MODEL, prompt="two of them", n=2, max_tokens=4, **sampled)
    stream = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    d = [chunk for chunk in stream][-1].usage
    after = scrape(server)
    assert [a.usage.completion_tokens, b.completion_tokens, cc.usage.completion_tokens, d.completion_tokens] == [
        6,
        5,
        8,
        3,
    ]
    return Traffic(
        before=before,
        after_plain=after_plain,
        before_hit=after_plain,
        after_hit=after_hit,
        after=after,
        prompt_tokens=[a.usage.prompt_tokens, b.prompt_tokens, cc.usage.prompt_tokens, cc.usage.prompt_tokens]
        + [d.prompt_tokens],
        generated=[6, 5, 4, 4, 3],
        max_tokens=[6, 5, 4, 4, 3],
        ns=[1, 1, 2, 1],
        cached_tokens_hit=b.prompt_tokens_details.cached_tokens,
    )


# ---------------------------------------------------------------- names, types, labels
@pytest.mark.parametrize("when", ["before", "after"])
def test_every_vllm_series_is_there_with_vllms_type_and_labels(traffic, when):
    """Before any request too: vLLM creates its series at start, so a dashboard has lines from the first scrape."""
    got = getattr(traffic, when)
    for name, kind in VLLM_SERIES:
        family = got.families.get(name)
        assert family is not None, f"{name} missing"
        assert family.type == kind, (name, family.type)
        assert family.samples, name
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            assert s.labels.get("model_name") == MODEL and s.labels.get("engine") == "0", (s.name, s.labels)
            if name != "vllm:cache_config_info":  # its other labels are the config
                # vLLM's labels and no others: a tenant label would split every rate() a dashboard draws.
                assert set(s.labels) <= {"model_name", "engine", "le", "finished_reason"}, (s.name, s.labels)
    for name, kind in PROCESS_SERIES:
        assert got.families[name].type == kind, name
    assert got.samples("process_resident_memory_bytes")[0].value > 0


def test_old_keel_duplicates_are_gone(traffic):
    """A series vLLM has is exported once, as vLLM's: no `keel:` twin of it."""
    vllm = {name.removeprefix("vllm:") for name, _ in VLLM_SERIES}
    keel = [name.removeprefix("keel:") for name in traffic.after.families if name.startswith("keel:")]
    assert keel, "keel's own series (tenants, rejections) are missing"
    assert not vllm & set(keel), vllm & set(keel)


def test_cache_config_info_carries_the_cache_config(traffic):
    (info,) = traffic.after.samples("vllm:cache_config_info")
    assert info.value == 1
    assert info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == str(NUM_BLOCKS)
    assert info.labels["enable_prefix_caching"] == "True" and info.labels["cache_dtype"] == "auto"


# ---------------------------------------------------------------- meanings
def test_token_counts_mean_what_vllm_means(traffic):
    t = traffic
    prompts, generated = sum(t.prompt_tokens), sum(t.generated)
    requests = len(t.prompt_tokens)  # engine requests: the n = 2 call is two
    assert t.delta("vllm:request_prompt_tokens_count") == requests
    assert t.delta("vllm:request_prompt_tokens_sum") == prompts
    assert t.delta("vllm:prompt_tokens_total") == prompts
    assert t.delta("vllm:prefix_cache_queries_total") == prompts  # each request looks its prompt up once
    assert t.delta("vllm:request_generation_tokens_count") == requests
    assert t.delta("vllm:request_generation_tokens_sum") == generated
    assert t.delta("vllm:generation_tokens_total") == generated
    assert t.delta("vllm:request_success_total", finished_reason="length") == requests
    assert t.delta("vllm:request_params_max_tokens_sum") == sum(t.max_tokens)
    # Per API prompt (vLLM's parent request): n, and the longest of its choices.
    assert t.delta("vllm:request_params_n_count") == len(t.ns)
    assert t.delta("vllm:request_params_n_sum") == sum(t.ns)
    assert t.delta("vllm:request_params_n_bucket", le="1.0") == t.ns.count(1)
    assert t.delta("vllm:request_max_num_generation_tokens_sum") == 6 + 5 + 4 + 3


def test_iteration_tokens_are_each_steps_prompt_and_generated_tokens(traffic):
    """vLLM's iteration: the prompts whose prefill finished in the step plus the tokens it generated, so over
    a run the histogram's sum is prompt_tokens_total + generation_tokens_total."""
    t = traffic
    steps = t.delta("vllm:iteration_tokens_total_count")
    assert t.delta("vllm:iteration_tokens_total_sum") == sum(t.prompt_tokens) + sum(t.generated)
    assert max(t.generated) <= steps <= sum(t.generated)  # every token needs a step; every step made one
    # One request at a time but for the n = 2 pair: decode steps carry 1 token (2 for the pair), the prefill
    # steps a whole prompt (more than 8 tokens).
    assert t.delta("vllm:iteration_tokens_total_bucket", le="1.0") >= (6 - 1) + (5 - 1) + (3 - 1)
    assert t.delta("vllm:iteration_tokens_total_bucket", le="8.0") < steps
    assert t.delta("vllm:iteration_tokens_total_bucket", le="+Inf") == steps


def test_latencies_are_vllms_intervals(traffic):
    t = traffic
    requests = len(t.prompt_tokens)
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time"):
        assert t.delta(f"vllm:{name}_seconds_count") == requests, name
    for name in ("request_decode_time", "request_inference_time", "request_time_per_output_token"):
        assert t.delta(f"vllm:{name}_seconds_count") == requests, name
    # Per token gap, not per request: (tokens - 1) per request without speculative decoding.
    gaps = sum(g - 1 for g in t.generated)
    assert t.delta("vllm:inter_token_latency_seconds_count") == gaps
    assert t.delta("vllm:time_per_output_token_seconds_count") == gaps
    assert t.delta("vllm:time_per_output_token_seconds_sum") == t.delta("vllm:inter_token_latency_seconds_sum")
    ttft, queue = t.delta("vllm:time_to_first_token_seconds_sum"), t.delta("vllm:request_queue_time_seconds_sum")
    prefill, decode = t.delta("vllm:request_prefill_time_seconds_sum"), t.delta("vllm:request_decode_time_seconds_sum")
    inference, e2e = t.delta("vllm:request_inference_time_seconds_sum"), t.delta("vllm:e2e_request_latency_seconds_sum")
    assert prefill > 0 and decode > 0 and queue >= 0
    assert ttft == pytest.approx(queue + prefill, abs=1e-6)  # arrival -> scheduled -> first token
    assert inference == pytest.approx(prefill + decode, abs=1e-6)  # scheduled -> first token -> last token
    assert t.delta("vllm:inter_token_latency_seconds_sum") == pytest.approx(decode, abs=1e-6)  # the gaps add up
    assert e2e >= queue + inference - 1e-6  # finished at (or just after) the last token


def test_request_time_per_output_token_is_one_requests_mean_gap(traffic):
    """Request A alone: its mean time per output token is its decode time over its tokens after the first."""
    a, b = traffic.before, traffic.after_plain

    def delta(name: str) -> float:
        return b.value(name) - a.value(name)

    assert delta("vllm:request_time_per_output_token_seconds_count") == 1
    tpot, decode = (
        delta("vllm:request_time_per_output_token_seconds_sum"),
        delta("vllm:request_decode_time_seconds_sum"),
    )
    assert tpot > 0 and tpot * (6 - 1) == pytest.approx(decode, rel=1e-9)
    assert delta("vllm:inter_token_latency_seconds_sum") / delta("vllm:inter_token_latency_seconds_count") == (
        pytest.approx(tpot, rel=1e-9)
    )


def test_prefix_cache_hits_are_the_reused_prompt_tokens(traffic):
    hits = traffic.after_hit.value("vllm:prefix_cache_hits_total") - traffic.before_hit.value(
        "vllm:prefix_cache_hits_total"
    )
    assert hits == traffic.cached_tokens_hit > 0
    assert traffic.before.value("vllm:prefix_cache_hits_total") == 0


def test_per_tenant_series_stay_keels(traffic):
    t = traffic
    assert t.delta("keel:tenant_generation_tokens_total", tenant="anonymous") == sum(t.generated)
    assert t.delta("keel:tenant_request_success_total", tenant="anonymous", finished_reason="length") == len(
        t.generated
    )


# ---------------------------------------------------------------- vLLM's Grafana dashboard
def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """PromQL's histogram_quantile over cumulative bucket counts {le: count}: linear inside the bucket."""
    bounds = sorted(buckets)
    total = buckets[math.inf]
    rank, lower, below = q * total, 0.0, 0.0
    for le in bounds:
        if buckets[le] >= rank:
            if le == math.inf:
                return lower
            return lower + (le - lower) * (rank - below) / (buckets[le] - below)
        lower, below = le, buckets[le]
    raise AssertionError("unreachable: +Inf holds every observation")


def dashboard_buckets(t: Traffic, name: str) -> dict[float, float]:
    """`sum by(le) (increase(NAME{model_name=...}[...]))` over the traffic, as the dashboard computes it."""
    out: dict[float, float] = {}
    for s in t.after.samples(name, model_name=MODEL):
        assert "le" in s.labels, s
        le = float(s.labels["le"])
        out[le] = out.get(le, 0.0) + s.value
    for s in t.before.samples(name, model_name=MODEL):
        out[float(s.labels["le"])] -= s.value
    counts = [out[le] for le in sorted(out)]
    assert counts == sorted(counts), f"{name}: buckets not cumulative"
    assert math.inf in out
    return out


@pytest.mark.parametrize("expr", DASHBOARD)
def test_vllm_dashboard_query_finds_its_series(traffic, expr):
    t = traffic
    names = SELECTOR.findall(expr)
    assert names, expr
    for name in names:
        assert t.after.samples(name, model_name=MODEL), f"{expr}: no series {name}"
    if "histogram_quantile" in expr or "_bucket" in expr:
        (name,) = names
        buckets = dashboard_buckets(t, name)
        base = name.removesuffix("_bucket")
        assert buckets[math.inf] == t.delta(base + "_count") > 0
        for q in (0.5, 0.9, 0.95, 0.99):
            value = histogram_quantile(q, buckets)
            assert 0 <= value <= max(le for le in buckets if le != math.inf), (expr, q, value)
    if "\n/\n" in expr:  # rate(x_sum) / rate(x_count): one-to-one vector matching on identical label sets
        sums, counts = names
        labels = lambda n: sorted(tuple(sorted(s.labels.items())) for s in t.after.samples(n, model_name=MODEL))  # noqa: E731
        assert labels(sums) == labels(counts), expr
        assert t.delta(sums) / t.delta(counts) > 0
    if "finished_reason" in expr:
        assert t.delta("vllm:request_success_total", finished_reason="length") == len(t.generated)


def test_dashboard_quantiles_land_in_the_true_buckets(traffic):
    """The heatmaps' buckets count the right requests: the median prompt and generation lengths the dashboard
    would show lie in the buckets holding the true medians."""
    for name, values in (
        ("vllm:request_prompt_tokens_bucket", traffic.prompt_tokens),
        ("vllm:request_generation_tokens_bucket", traffic.generated),
    ):
        buckets = dashboard_buckets(traffic, name)
        median = sorted(values)[len(values) // 2]
        upper = min(le for le in buckets if le >= median)
        lower = max((le for le in buckets if le < median), default=0.0)
        assert lower <= histogram_quantile(0.5, buckets) <= upper, (name, values, buckets)


def test_model_name_variable_lists_the_served_model(traffic):
    """The dashboard's `$model_name` variable is `label_values(model_name)`."""
    names = {
        s.labels["model_name"] for f in traffic.after.families.values() for s in f.samples if "model_name" in s.labels
    }
    assert names == {MODEL}
