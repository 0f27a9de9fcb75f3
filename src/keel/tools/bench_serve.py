"""`keel bench serve`: a load generator for any OpenAI-compatible server, with vLLM's serving metrics.

The metrics are those of vLLM's `benchmark_serving.py` / `vllm bench serve` (`calculate_metrics`), so
numbers from keel's server and from vLLM's can be compared side by side.

Requests
--------
Every request is streamed: `POST {base_url}/v1/completions` (`--endpoint completions`, the prompt as
`prompt`) or `/v1/chat/completions` (`--endpoint chat`, the prompt as one user message), with
`stream: true`, `stream_options: {"include_usage": true}`, `max_tokens` = the request's output length,
`temperature`, and `ignore_eos: true` with `--ignore-eos` (so that output lengths are exact on servers
that support it: vLLM, keel). The response is read as server-sent events, `data: {...}` lines up to
`data: [DONE]`. A "content chunk" is an event whose first choice carries non-empty `text`
(completions) or a non-empty delta `content` (chat; `reasoning_content` / `reasoning` count too).

Arrivals
--------
As vLLM's `get_request`: inter-arrival gaps are drawn from a gamma distribution with shape
`--burstiness` and scale `1 / (rate * burstiness)` (Poisson arrivals at burstiness 1; below 1 burstier,
above 1 more regular), seeded by `--seed`; their running sum is rescaled so that the last request is
sent exactly `num_prompts / rate` seconds after the start. `--request-rate inf` sends every request at
once. `--max-concurrency C` caps the requests in flight (an asyncio semaphore); requests that arrive
while C are in flight wait, so the achieved rate can be lower than `--request-rate`.

Per-request measurements (time.perf_counter, from just before the request is sent)
-------------------------------------------------------------------------------------
- TTFT: time to the first content chunk. Chunks without text (a chat `role` delta, which some servers
  send before prefill) are not counted; this is where keel differs from vLLM, which stops the TTFT
  clock at any chunk with a `choices` entry.
- ITL: the gaps between successive content chunks (one value per gap; a chunk that carries several
  tokens is still one gap).
- E2EL: time to the end of the stream (`data: [DONE]` or the server closing it).
- Output tokens: `usage.completion_tokens` from the final usage event if the server sends one,
  otherwise the number of content chunks (the client has no tokenizer).
- Input tokens: `usage.prompt_tokens` if sent, otherwise the client-side estimate of the dataset.
- TPOT: (E2EL - TTFT) / (output_tokens - 1), for requests with more than one output token.
A request fails on a non-200 status, an `{"error": ...}` event, a broken or unparsable stream, no
content chunk at all, or `--timeout` seconds without finishing. Failures are counted and their error
text kept (the first few are printed); they never stop the run.

Aggregate metrics (as vLLM's `calculate_metrics`; only completed requests contribute)
-------------------------------------------------------------------------------------
- duration: from the start of the arrival schedule to the completion of the last request.
- request throughput = completed / duration; output token throughput = total output tokens /
  duration; total token throughput = (total input + total output tokens) / duration.
- goodput (only with `--goodput`): requests meeting every given SLO / duration. SLOs are in ms, e.g.
  `--goodput ttft:500 tpot:50 e2el:10000`; a request with at most one output token counts as TPOT 0.
- TTFT, TPOT, ITL (pooled over all gaps of all requests) and E2EL: mean, median, standard deviation
  (population) and the `--percentiles` (numpy's linear interpolation), in milliseconds. A metric with
  no samples reports 0.

Datasets
--------
- No `--dataset`: each prompt is random common English words, one per wanted token, so the
  server-side prompt length is only approximately `--input-len` (it depends on the tokenizer and, for
  chat, on the chat template). Prefer `--dataset` for anything you will quote.
- `--dataset FILE.jsonl`: one JSON object per line, `{"prompt": str, "output_len": int (optional)}`.
  Prompts are used in file order, cycling when `--num-prompts` exceeds the file; a line without
  `output_len` uses the sampled `--output-len`.
- `--dataset` any other file: a plain-text corpus. Each prompt is a window of consecutive words
  starting at a random position (wrapping around the end) of about the request's input length, counted
  as whitespace-separated words * 4/3 (a common words-to-tokens ratio for English BPE tokenizers).
Input and output lengths are drawn uniformly from [L * (1 - F), L * (1 + F)] with F = `--range-ratio`,
as vLLM's random dataset (F = 0: every request gets exactly L).

Output
------
A vLLM-style table on stdout and, with `--result-file`, a JSON file (written atomically) with every
metric under vLLM's key names (`mean_ttft_ms`, `p99_itl_ms`, ...), the per-request arrays `input_lens`,
`output_lens`, `ttfts`, `itls`, `e2els` (seconds) and `errors` ("" for a success; failed requests
have 0 in the numeric arrays), the command-line configuration (API key omitted), the label and date.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from keel.atomic import write_json_atomic
from keel.errors import KeelError
from keel.jsonl import iter_jsonl

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MAX_ERRORS_SHOWN = 5

# Short, frequent English words: almost every BPE vocabulary has each of them (with its leading space)
# as a single token, so N random words make a prompt of about N tokens.
_WORDS = (
    "the of and to in is was for on are as with his they at be this from have or by one had not but "
    "what all were when we there can an your which their said if do will each about how up out them "
    "then she many some so these would other into has more her two like him see time could no make "
    "than first been its who now people my made over did down only way find use may water long little "
    "very after words called just where most know get through back much before go good new write our "
    "used me man too any day same right look think also around another came come work three must "
    "because does part even place well such here take why help put different away again off went old "
    "number great tell men say small every found still between name should home big give air line set "
    "own under read last never us left end along while might next sound below saw something thought "
    "both few those always show large often together asked house world going want school important "
    "until form food keep children feet land side without boy once animal life enough took four head "
    "above kind began almost live page got earth need far hand high year mother light country father"
).split()


@dataclass
class BenchServeConfig:
    """Everything one benchmark run needs; `config_from_args` builds it from the command line."""

    base_url: str
    model: str
    endpoint: str = "completions"
    num_prompts: int = 200
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    dataset: str | None = None
    seed: int = 0
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    goodput: dict[str, float] = field(default_factory=dict)
    percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 99.0])
    timeout: float = 600.0
    disable_tqdm: bool = False
    label: str | None = None
    result_file: str | None = None

    def validate(self) -> None:
        """Raise KeelError naming the first option that is out of range."""
        if not self.base_url.startswith(("http://", "https://")):
            raise KeelError(f"--base-url: {self.base_url!r} is not an http:// or https:// URL")
        if self.endpoint not in ENDPOINTS:
            raise KeelError(f"--endpoint: {self.endpoint!r} is not one of {', '.join(ENDPOINTS)}")
        checks = [
            ("--num-prompts", self.num_prompts, self.num_prompts >= 1, ">= 1"),
            ("--request-rate", self.request_rate, self.request_rate > 0, "> 0 (or inf)"),
            ("--burstiness", self.burstiness, 0 < self.burstiness < math.inf, "> 0 and finite"),
            ("--input-len", self.input_len, self.input_len >= 1, ">= 1"),
            ("--output-len", self.output_len, self.output_len >= 1, ">= 1"),
            ("--range-ratio", self.range_ratio, 0 <= self.range_ratio < 1, "in [0, 1)"),
            ("--timeout", self.timeout, self.timeout > 0, "> 0"),
        ]
        if self.max_concurrency is not None:
            checks.append(("--max-concurrency", self.max_concurrency, self.max_concurrency >= 1, ">= 1"))
        for name, value, ok, wanted in checks:
            if not ok:
                raise KeelError(f"{name} must be {wanted} (got {value})")
        for key, value in self.goodput.items():
            if key not in GOODPUT_METRICS or value < 0:
                raise KeelError(
                    f"--goodput: {key}:{value} must be one of {', '.join(GOODPUT_METRICS)} with a value >= 0"
                )
        for p in self.percentiles:
            if not 0 <= p <= 100:
                raise KeelError(f"--percentiles: {p} is not in [0, 100]")


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int  # client-side estimate; the server's usage.prompt_tokens replaces it when sent
    output_len: int


@dataclass
class RequestOutput:
    """What one request measured; times in seconds."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    error: str = ""


@dataclass
class LatencyStats:
    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: dict[float, float]


@dataclass
class BenchmarkResult:
    completed: int
    failed: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None  # None unless SLOs were given
    output_throughput: float
    total_token_throughput: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    # Per request, in send order; seconds; failed requests have 0 / [] and a non-empty error.
    input_lens: list[int]
    output_lens: list[int]
    ttfts: list[float]
    itls: list[list[float]]
    e2els: list[float]
    errors: list[str]
    config: dict[str, Any] = field(default_factory=dict)
    date: str = ""


# ---------------------------------------------------------------------------------------------------
# Parsing


def parse_goodput(items: list[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> `{"ttft": 500.0, "tpot": 50.0}` (milliseconds), as vLLM's --goodput."""
    slos: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not sep or key not in GOODPUT_METRICS or not number >= 0 or math.isinf(number):
            raise KeelError(
                f"--goodput: {item!r} is not KEY:VALUE with KEY one of {', '.join(GOODPUT_METRICS)} "
                "and VALUE a number of milliseconds >= 0"
            )
        slos[key] = number
    return slos


def parse_percentiles(text: str) -> list[float]:
    """`"50,90,99"` -> `[50.0, 90.0, 99.0]`."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 <= p <= 100 for p in values):
        raise KeelError(f"--percentiles: {text!r} is not a comma-separated list of numbers in [0, 100]")
    return values


# ---------------------------------------------------------------------------------------------------
# Requests and arrivals


def _sample_lens(length: int, ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    # vLLM's random dataset: uniform integers in [floor(L(1-F)), ceil(L(1+F))], at least 1.
    low = max(1, math.floor(length * (1 - ratio)))
    high = max(low, math.ceil(length * (1 + ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def _words_to_tokens(n_words: int) -> int:
    return max(1, round(n_words * 4 / 3))


def _read_dataset(path: Path) -> str:
    if not path.is_file():
        raise KeelError(f"--dataset: {path}: no such file")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KeelError(f"--dataset: {path}: cannot read as UTF-8 text ({e})") from None


def _load_jsonl(path: Path, text: str) -> list[tuple[str, int | None]]:
    rows: list[tuple[str, int | None]] = []
    for lineno, obj in iter_jsonl(text.splitlines(), f"--dataset: {path}"):
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise KeelError(f'--dataset: {path}:{lineno}: expected an object with a string "prompt"')
        output_len = obj.get("output_len")
        if output_len is not None and (
            isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1
        ):
            raise KeelError(f'--dataset: {path}:{lineno}: "output_len" must be a positive integer')
        rows.append((obj["prompt"], output_len))
    if not rows:
        raise KeelError(f"--dataset: {path}: no prompts")
    return rows


def build_requests(config: BenchServeConfig) -> list[SampleRequest]:
    """The prompts and output lengths of the run, in send order (deterministic for a given --seed)."""
    rng = np.random.default_rng(config.seed)
    n = config.num_prompts
    input_lens = _sample_lens(config.input_len, config.range_ratio, n, rng)
    output_lens = _sample_lens(config.output_len, config.range_ratio, n, rng)
    if config.dataset is None:
        words = np.array(_WORDS)
        prompts = [" ".join(rng.choice(words, size=length)) for length in input_lens]
        return [SampleRequest(p, length, out) for p, length, out in zip(prompts, input_lens, output_lens, strict=True)]

    path = Path(config.dataset)
    text = _read_dataset(path)
    if path.suffix.lower() == ".jsonl":
        rows = _load_jsonl(path, text)
        requests = []
        for i in range(n):
            prompt, output_len = rows[i % len(rows)]
            prompt_len = _words_to_tokens(len(prompt.split()))
            requests.append(SampleRequest(prompt, prompt_len, output_len or output_lens[i]))
        return requests

    corpus = np.array(text.split())
    if corpus.size == 0:
        raise KeelError(f"--dataset: {path}: no words in the corpus")
    requests = []
    for length, output_len in zip(input_lens, output_lens, strict=True):
        n_words = max(1, round(length * 3 / 4))
        start = int(rng.integers(0, corpus.size))
        window = corpus.take(np.arange(start, start + n_words), mode="wrap")
        requests.append(SampleRequest(" ".join(window), _words_to_tokens(n_words), output_len))
    return requests


def arrival_offsets(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send time of each request, in seconds after the start, exactly as vLLM's `get_request`."""
    if math.isinf(request_rate):
        return [0.0] * num
    # A private RandomState draws the same stream as vLLM's np.random.seed(seed) + np.random.gamma.
    rng = np.random.RandomState(seed)
    theta = 1.0 / (request_rate * burstiness)
    offsets = np.cumsum(rng.gamma(shape=burstiness, scale=theta, size=num))
    if num and offsets[-1] > 0:
        # vLLM rescales so the run lasts exactly num / rate: the raw sum is a few % off, which would
        # make throughput differ from seed to seed.
        offsets *= (num / request_rate) / offsets[-1]
    return [float(x) for x in offsets]


def _has_content(choice: Any, chat: bool) -> bool:
    if not isinstance(choice, dict):
        return False
    if not chat:
        return bool(choice.get("text"))
    delta = choice.get("delta") or {}
    return isinstance(delta, dict) and any(delta.get(k) for k in ("content", "reasoning_content", "reasoning"))


class _StreamError(Exception):
    """A response that is not a well-formed OpenAI stream; the message is the request's error text."""


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _error_text(error: Any) -> str:
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return json.dumps(error) if not isinstance(error, str) else error


async def _consume_stream(response: httpx.Response, out: RequestOutput, start: float, chat: bool) -> float:
    """Read the SSE stream into `out`; return the time the stream ended. Raises on a malformed event."""
    usage: dict[str, Any] | None = None
    last = start
    chunks = 0
    async for raw in response.aiter_lines():
        now = time.perf_counter()
        line = raw.strip()
        # Blank lines separate events; ":" lines are keep-alive comments; event:/id:/retry: carry nothing we use.
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        try:
            data = json.loads(payload)
        except json.JSONDecodeError:
            raise _StreamError(f"unparsable SSE event {_one_line(payload, 120)!r}") from None
        if not isinstance(data, dict):
            raise _StreamError(f"unexpected SSE event {_one_line(payload, 120)!r}")
        if data.get("error"):
            raise _StreamError(f"error event: {_error_text(data['error'])}")
        if isinstance(data.get("usage"), dict):
            usage = data["usage"]
        choices = data.get("choices") or []
        if choices and _has_content(choices[0], chat):
            if chunks == 0:
                out.ttft = now - start
            else:
                out.itl.append(now - last)
            last = now
            chunks += 1
    end = time.perf_counter()
    if chunks == 0:
        raise _StreamError("the stream ended without any generated text")
    completion_tokens = usage.get("completion_tokens") if usage else None
    prompt_tokens = usage.get("prompt_tokens") if usage else None
    # Like vLLM: a missing or zero completion count falls back to the client's own count.
    out.output_tokens = completion_tokens if isinstance(completion_tokens, int) and completion_tokens > 0 else chunks
    if isinstance(prompt_tokens, int) and prompt_tokens > 0:
        out.prompt_len = prompt_tokens
    return end


async def _send_request(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], config: BenchServeConfig, request: SampleRequest
) -> RequestOutput:
    chat = config.endpoint == "chat"
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": request.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    if config.ignore_eos:
        body["ignore_eos"] = True
    out = RequestOutput(prompt_len=request.prompt_len)
    start = time.perf_counter()
    try:
        # One deadline for the whole request: httpx's timeouts are per read, and a server that keeps
        # trickling tokens would never trip them.
        async with asyncio.timeout(config.timeout):
            async with client.stream("POST", url, json=body, headers=headers) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode("utf-8", errors="replace")
                    out.error = _one_line(f"HTTP {response.status_code}: {text}")
                    return out
                end = await _consume_stream(response, out, start, chat)
        out.e2el = end - start
        out.success = True
    except TimeoutError:
        out.error = f"timed out after {config.timeout:g} s"
    except _StreamError as e:
        out.error = _one_line(str(e))
    except Exception as e:  # a benchmark reports a broken request, it never dies of one
        out.error = _one_line(f"{type(e).__name__}: {e}")
    if not out.success:
        out.ttft, out.itl, out.output_tokens = 0.0, [], 0
    return out


def _normalized_base_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    # Accept the OpenAI-client style ".../v1" as well.
    return base[: -len("/v1")] if base.endswith("/v1") else base


async def _check_server(
    client: httpx.AsyncClient, base: str, headers: dict[str, str], config: BenchServeConfig
) -> None:
    url = f"{base}/v1/models"
    try:
        response = await client.get(url, headers=headers, timeout=min(30.0, config.timeout))
    except httpx.HTTPError as e:
        raise KeelError(f"--base-url: cannot reach {url} ({type(e).__name__}: {_one_line(str(e), 200)})") from None
    if response.status_code != 200:
        raise KeelError(f"--base-url: GET {url} returned HTTP {response.status_code}: {_one_line(response.text, 200)}")
    try:
        served = [m.get("id") for m in response.json().get("data", [])]
    except (ValueError, AttributeError):
        served = []
    if served and config.model not in served:
        print(
            f"keel: warning: --model {config.model!r} is not in {url} ({', '.join(map(str, served))})", file=sys.stderr
        )


# ---------------------------------------------------------------------------------------------------
# Metrics


def _stats(values: list[float], percentiles: list[float]) -> LatencyStats:
    # `values or 0`: vLLM reports 0 for a metric without samples rather than NaN.
    data = values or 0
    return LatencyStats(
        mean_ms=float(np.mean(data)) * 1000,
        median_ms=float(np.median(data)) * 1000,
        std_ms=float(np.std(data)) * 1000,
        percentiles_ms={p: float(np.percentile(data, p)) * 1000 for p in percentiles},
    )


def calculate_metrics(
    outputs: list[RequestOutput], duration: float, percentiles: list[float], goodput: dict[str, float]
) -> BenchmarkResult:
    """Aggregate per-request outputs exactly as vLLM's `calculate_metrics` (config and date left empty)."""
    output_lens: list[int] = []
    total_input = 0
    ttfts: list[float] = []
    tpots: list[float] = []
    all_tpots: list[float] = []  # with 0 for single-token requests, for the goodput check only
    itls: list[float] = []
    e2els: list[float] = []
    for out in outputs:
        if not out.success:
            output_lens.append(0)
            continue
        output_lens.append(out.output_tokens)
        total_input += out.prompt_len
        tpot = 0.0
        if out.output_tokens > 1:
            tpot = (out.e2el - out.ttft) / (out.output_tokens - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls.extend(out.itl)
        ttfts.append(out.ttft)
        e2els.append(out.e2el)
    completed = len(ttfts)
    total_output = sum(output_lens)

    request_goodput = None
    if goodput:
        per_metric = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        keys = [k for k in GOODPUT_METRICS if k in goodput]
        good = sum(all(goodput[k] / 1000 >= per_metric[k][i] for k in keys) for i in range(completed))
        request_goodput = good / duration

    return BenchmarkResult(
        completed=completed,
        failed=len(outputs) - completed,
        duration=duration,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=completed / duration,
        request_goodput=request_goodput,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        ttft=_stats(ttfts, percentiles),
        tpot=_stats(tpots, percentiles),
        itl=_stats(itls, percentiles),
        e2el=_stats(e2els, percentiles),
        input_lens=[out.prompt_len for out in outputs],
        output_lens=output_lens,
        ttfts=[out.ttft for out in outputs],
        itls=[list(out.itl) for out in outputs],
        e2els=[out.e2el for out in outputs],
        errors=[out.error for out in outputs],
    )


def _config_dict(config: BenchServeConfig) -> dict[str, Any]:
    d = asdict(config)
    d.pop("api_key")  # never write a secret into a results file
    d["request_rate"] = "inf" if math.isinf(config.request_rate) else config.request_rate
    return d


async def run_benchmark(config: BenchServeConfig) -> BenchmarkResult:
    """Run one benchmark against the server and return its metrics. Raises KeelError on bad input."""
    config.validate()
    requests = build_requests(config)
    offsets = arrival_offsets(len(requests), config.request_rate, config.burstiness, config.seed)
    base = _normalized_base_url(config.base_url)
    url = base + ENDPOINTS[config.endpoint]
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # httpx pools at most 100 connections by default, which would silently cap the concurrency.
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency)
    semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else contextlib.nullcontext()

    # No httpx timeouts: _send_request puts one deadline on the whole request, so a slow request fails
    # with a single clear message instead of whichever of httpx's per-phase timeouts fires first.
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:
        await _check_server(client, base, headers, config)
        progress = _progress(len(requests), config.disable_tqdm)

        async def limited(request: SampleRequest) -> RequestOutput:
            async with semaphore:
                out = await _send_request(client, url, headers, config, request)
            if progress is not None:
                progress.update(1)
            return out

        try:
            start = time.perf_counter()
            tasks = []
            for request, offset in zip(requests, offsets, strict=True):
                delay = start + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(limited(request)))
            outputs = await asyncio.gather(*tasks)
            duration = time.perf_counter() - start
        finally:
            if progress is not None:
                progress.close()

    result = calculate_metrics(list(outputs), duration, config.percentiles, config.goodput)
    result.config = _config_dict(config)
    result.date = datetime.now().astimezone().isoformat(timespec="seconds")
    return result


def _progress(total: int, disabled: bool) -> Any:
    if disabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: no progress bar without it
        return None
    return tqdm(total=total, file=sys.stderr)


# ---------------------------------------------------------------------------------------------------
# Output


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def format_table(result: BenchmarkResult) -> str:
    """The result as vLLM prints it (same labels and layout), one metric per line."""
    config = result.config
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: float | int, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:<10{fmt}}")

    row("Successful requests:", result.completed)
    row("Failed requests:", result.failed)
    if config.get("max_concurrency") is not None:
        row("Maximum request concurrency:", config["max_concurrency"])
    if isinstance(config.get("request_rate"), int | float):
        row("Request rate configured (RPS):", config["request_rate"], ".2f")
    row("Benchmark duration (s):", result.duration, ".2f")
    row("Total input tokens:", result.total_input_tokens)
    row("Total generated tokens:", result.total_output_tokens)
    row("Request throughput (req/s):", result.request_throughput, ".2f")
    if result.request_goodput is not None:
        row("Request goodput (req/s):", result.request_goodput, ".2f")
    row("Output token throughput (tok/s):", result.output_throughput, ".2f")
    row("Total token throughput (tok/s):", result.total_token_throughput, ".2f")
    for attr, name, header in _SECTIONS:
        stats: LatencyStats = getattr(result, attr)
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {name} (ms):", stats.mean_ms, ".2f")
        row(f"Median {name} (ms):", stats.median_ms, ".2f")
        for p, value in stats.percentiles_ms.items():
            row(f"P{_p_word(p)} {name} (ms):", value, ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


def result_to_json(result: BenchmarkResult) -> dict[str, Any]:
    """The result as a JSON-ready dict, with vLLM's key names for every metric."""
    config = result.config
    d: dict[str, Any] = {
        "date": result.date,
        "label": config.get("label"),
        "endpoint_type": config.get("endpoint"),
        "base_url": config.get("base_url"),
        "model_id": config.get("model"),
        "num_prompts": config.get("num_prompts"),
        "request_rate": config.get("request_rate"),
        "burstiness": config.get("burstiness"),
        "max_concurrency": config.get("max_concurrency"),
        "goodput_slos_ms": config.get("goodput") or None,
        "duration": result.duration,
        "completed": result.completed,
        "failed": result.failed,
        "total_input_tokens": result.total_input_tokens,
        "total_output_tokens": result.total_output_tokens,
        "request_throughput": result.request_throughput,
        "request_goodput": result.request_goodput,
        "output_throughput": result.output_throughput,
        "total_token_throughput": result.total_token_throughput,
    }
    for attr, _, _ in _SECTIONS:
        stats: LatencyStats = getattr(result, attr)
        d[f"mean_{attr}_ms"] = stats.mean_ms
        d[f"median_{attr}_ms"] = stats.median_ms
        d[f"std_{attr}_ms"] = stats.std_ms
        for p, value in stats.percentiles_ms.items():
            d[f"p{_p_word(p)}_{attr}_ms"] = value
    d.update(
        input_lens=result.input_lens,
        output_lens=result.output_lens,
        ttfts=result.ttfts,
        itls=result.itls,
        e2els=result.e2els,
        errors=result.errors,
        config=config,
    )
    return d


def write_result_file(result: BenchmarkResult, path: str | Path) -> Path:
    """Write the JSON atomically (keel.atomic: temp file in the same directory, fsync, rename): never a half file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, result_to_json(result), allow_nan=False)
    return path
