"""`keel bench serve` against a fake OpenAI-compatible server whose timings and token counts are known.

The fake server runs uvicorn on its own thread and event loop, so the client's clock measures real
network streaming. Tolerances are loose: the CI machine is small and often busy.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from keel.cli import build_parser
from keel.errors import KeelError
from keel.tools.bench_serve import (
    BenchServeConfig,
    RequestOutput,
    arrival_offsets,
    build_requests,
    calculate_metrics,
    parse_goodput,
    run_benchmark,
)

PROMPT_TOKENS = 7  # what the fake server reports as usage.prompt_tokens


@dataclass
class FakeState:
    ttft: float = 0.05  # seconds before the first token
    itl: float = 0.02  # seconds between tokens
    usage: bool = True
    tokens_per_chunk: int = 1  # usage.completion_tokens = chunks * this
    inflight: int = 0
    max_inflight: int = 0
    arrivals: list[float] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    async def respond(request: Request, chat: bool) -> Any:
        body = await request.json()
        state.arrivals.append(time.perf_counter())
        state.bodies.append(body)
        state.auth.append(request.headers.get("authorization"))
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if "FAIL500" in prompt:
            return JSONResponse({"error": {"message": "internal boom"}}, status_code=500)
        n = body["max_tokens"]

        async def stream():
            state.inflight += 1
            state.max_inflight = max(state.max_inflight, state.inflight)
            try:
                if chat:  # a role-only delta before prefill, as many servers send: not a token
                    yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                await asyncio.sleep(10.0 if "HANG" in prompt else state.ttft)
                for i in range(n):
                    if i:
                        await asyncio.sleep(state.itl)
                    if "ERROREVENT" in prompt and i == 1:
                        yield _sse({"error": {"message": "engine died", "code": 500}})
                        return
                    choice = {"index": 0, "delta": {"content": f"t{i} "}} if chat else {"index": 0, "text": f"t{i} "}
                    yield _sse({"choices": [choice]})
                if state.usage:
                    usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n * state.tokens_per_chunk}
                    yield _sse({"choices": [], "usage": usage})
                yield "data: [DONE]\n\n"
            finally:
                state.inflight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await respond(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await respond(request, chat=True)

    return app


@dataclass
class FakeServer:
    url: str
    state: FakeState


@pytest.fixture(scope="module")
def server_handle():
    state = FakeState()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        make_app(state), log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield FakeServer(f"http://127.0.0.1:{port}", state)
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def server(server_handle: FakeServer) -> FakeServer:
    # One server for the module, fresh behaviour and counters for every test.
    server_handle.state.__init__()
    return server_handle


def make_config(server: FakeServer, **kw: Any) -> BenchServeConfig:
    defaults: dict[str, Any] = dict(model="fake", num_prompts=4, input_len=8, output_len=5, disable_tqdm=True)
    return BenchServeConfig(base_url=server.url, **(defaults | kw))


def run(config: BenchServeConfig):
    return asyncio.run(run_benchmark(config))


def test_completions_metrics_match_injected_timings(server: FakeServer) -> None:
    config = make_config(server, ignore_eos=True, goodput={"ttft": 10_000, "e2el": 10_000})
    r = run(config)
    n = config.output_len
    assert (r.completed, r.failed) == (4, 0)
    assert r.total_output_tokens == 4 * n and r.output_lens == [n] * 4
    assert r.total_input_tokens == 4 * PROMPT_TOKENS and r.input_lens == [PROMPT_TOKENS] * 4
    # Injected: TTFT 50 ms, then n-1 gaps of 20 ms, so E2EL ~130 ms and TPOT ~20 ms.
    assert 45 <= r.ttft.mean_ms <= 600  # upper bound loose: a busy 2-core machine delays the first connection
    assert 18 <= r.itl.median_ms <= 80
    assert 18 <= r.tpot.mean_ms <= 80
    assert 120 <= r.e2el.mean_ms <= r.ttft.mean_ms + (n - 1) * 80  # the first token's delay, then n-1 gaps
    assert all(len(gaps) == n - 1 for gaps in r.itls)
    for ttft, gaps, e2el in zip(r.ttfts, r.itls, r.e2els, strict=True):
        assert e2el >= ttft + sum(gaps) - 1e-9
    assert sorted(r.ttft.percentiles_ms) == [50.0, 90.0, 99.0]
    assert r.request_throughput == pytest.approx(4 / r.duration)
    assert r.output_throughput == pytest.approx(4 * n / r.duration)
    assert r.total_token_throughput == pytest.approx(4 * (n + PROMPT_TOKENS) / r.duration)
    assert r.request_goodput == pytest.approx(r.request_throughput)  # generous SLOs: every request is good
    body = server.state.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == n and body["ignore_eos"] is True and body["model"] == "fake"
    assert body["temperature"] == 0.0 and len(body["prompt"].split()) == 8


def test_chat_ttft_ignores_role_chunk_and_usage_is_preferred(server: FakeServer) -> None:
    server.state.tokens_per_chunk = 2  # usage says 2 tokens per streamed chunk
    r = run(make_config(server, endpoint="chat", num_prompts=2))
    assert (r.completed, r.failed) == (2, 0)
    assert r.ttft.mean_ms >= 45  # the empty role delta arrives at once; the clock waits for text
    assert r.output_lens == [10, 10] and r.total_output_tokens == 20
    # TPOT divides by the usage count: (4 gaps of 20 ms) / (10 - 1) ~ 9 ms.
    assert 7 <= r.tpot.mean_ms <= 40
    assert server.state.bodies[0]["messages"][0]["role"] == "user"


def test_without_usage_counts_content_chunks(server: FakeServer) -> None:
    server.state.usage = False
    r = run(make_config(server, num_prompts=2, output_len=4, goodput={"ttft": 1}))
    assert r.output_lens == [4, 4]
    assert r.input_lens == [8, 8]  # the client's estimate: one random word per token
    assert r.request_goodput == 0.0  # no request has TTFT under 1 ms


def test_failures_are_counted_not_fatal(server: FakeServer, tmp_path: Path) -> None:
    rows = [
        {"prompt": "hello there", "output_len": 3},
        {"prompt": "FAIL500 please"},
        {"prompt": "ERROREVENT now", "output_len": 4},
        {"prompt": "HANG forever", "output_len": 2},
        {"prompt": "world", "output_len": 2},
    ]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    r = run(make_config(server, dataset=str(dataset), num_prompts=5, timeout=2.0))
    assert (r.completed, r.failed) == (2, 3)
    assert r.errors[0] == "" and r.errors[4] == ""
    assert "HTTP 500" in r.errors[1] and "internal boom" in r.errors[1]
    assert "engine died" in r.errors[2]
    assert "timed out" in r.errors[3]
    assert r.output_lens == [3, 0, 0, 0, 2] and r.ttfts[1:4] == [0.0, 0.0, 0.0]
    assert sorted(b["max_tokens"] for b in server.state.bodies) == [2, 2, 3, 4, 5]  # FAIL500 takes --output-len


def test_finite_rate_spreads_arrivals_over_num_over_rate(server: FakeServer) -> None:
    server.state.ttft, server.state.itl = 0.01, 0.01
    num, rate = 6, 12.0
    r = run(make_config(server, num_prompts=num, output_len=2, request_rate=rate, seed=3))
    expected = arrival_offsets(num, rate, 1.0, 3)
    spread = server.state.arrivals[-1] - server.state.arrivals[0]
    assert spread == pytest.approx(expected[-1] - expected[0], abs=0.15)
    assert num / rate <= r.duration <= num / rate + 1.0


def test_infinite_rate_sends_everything_at_once(server: FakeServer) -> None:
    server.state.ttft = 2.0  # long enough for all 8 to be sent on a loaded machine (0.3 s and 1 s flaked under load)
    r = run(make_config(server, num_prompts=8, output_len=1))
    assert r.completed == 8 and server.state.max_inflight == 8


def test_max_concurrency_is_respected(server: FakeServer) -> None:
    r = run(make_config(server, num_prompts=6, output_len=3, max_concurrency=2))
    assert r.completed == 6 and server.state.max_inflight == 2


def test_cli_writes_table_and_json(server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    parser = build_parser()
    out = tmp_path / "results" / "run.json"
    args = parser.parse_args(
        [
            "bench",
            "serve",
            "--base-url",
            server.url + "/v1/",
            "--model",
            "fake",
            "--num-prompts",
            "3",
            "--input-len",
            "8",
        ]
        + ["--output-len", "3", "--result-file", str(out), "--label", "smoke", "--disable-tqdm"]
        + ["--goodput", "ttft:5000", "tpot:5000", "--percentiles", "50,99.9", "--api-key", "sekrit"]
    )
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "Serving Benchmark Result" in table and "P99.9 TTFT (ms):" in table and "Request goodput" in table
    assert server.state.auth == ["Bearer sekrit"] * 3
    text = out.read_text()
    assert "sekrit" not in text
    data = json.loads(text)
    assert data["label"] == "smoke" and data["completed"] == 3 and data["request_rate"] == "inf"
    assert data["total_output_tokens"] == 9 and data["output_lens"] == [3, 3, 3]
    assert {"mean_ttft_ms", "std_itl_ms", "p99.9_e2el_ms", "median_tpot_ms", "date", "config"} <= data.keys()
    assert len(data["itls"]) == 3 and len(data["e2els"]) == 3 and data["errors"] == ["", "", ""]
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])
    assert [p.name for p in out.parent.iterdir()] == ["run.json"]  # no temp file left behind


def test_calculate_metrics_is_vllms() -> None:
    ok = RequestOutput(success=True, prompt_len=10, output_tokens=11, ttft=0.1, itl=[0.1] * 10, e2el=1.1)
    single = RequestOutput(success=True, prompt_len=5, output_tokens=1, ttft=0.5, e2el=0.6)
    failed = RequestOutput(success=False, prompt_len=9, error="HTTP 500")
    outputs = [ok, single, failed]

    r = calculate_metrics(outputs, 2.0, [50, 99], {})
    assert (r.completed, r.failed, r.total_input_tokens, r.total_output_tokens) == (2, 1, 15, 12)
    assert r.request_goodput is None
    assert r.request_throughput == 1.0 and r.output_throughput == 6.0 and r.total_token_throughput == 13.5
    assert r.tpot.mean_ms == pytest.approx(100)  # single-token requests have no TPOT
    assert r.ttft.mean_ms == pytest.approx(300) and r.ttft.std_ms == pytest.approx(200)
    assert r.itl.mean_ms == pytest.approx(100) and r.e2el.median_ms == pytest.approx(850)
    assert r.output_lens == [11, 1, 0]

    def goodput(slos: dict[str, float]) -> float | None:
        return calculate_metrics(outputs, 2.0, [50], slos).request_goodput

    assert goodput({"ttft": 200}) == 0.5
    assert goodput({"tpot": 50}) == 0.5  # the single-token request counts as TPOT 0
    assert goodput({"e2el": 1000}) == 0.5
    assert goodput({"ttft": 600, "tpot": 150}) == 1.0
    assert calculate_metrics([failed], 1.0, [50], {}).ttft.mean_ms == 0.0  # no samples -> 0, not NaN


def test_arrival_offsets() -> None:
    offsets = arrival_offsets(50, 10.0, 1.0, 0)
    assert offsets[-1] == pytest.approx(5.0) and offsets == sorted(offsets) and offsets[0] > 0
    assert offsets == arrival_offsets(50, 10.0, 1.0, 0)
    assert arrival_offsets(4, float("inf"), 1.0, 0) == [0.0] * 4
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    regular = arrival_offsets(50, 10.0, 1000.0, 0)
    regular_gaps = [b - a for a, b in zip(regular, regular[1:], strict=False)]
    assert max(regular_gaps) - min(regular_gaps) < max(gaps) - min(gaps)


def test_datasets(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"w{i}" for i in range(100)))
    requests = build_requests(BenchServeConfig("http://x", "m", num_prompts=5, input_len=40, dataset=str(corpus)))
    for req in requests:
        ids = [int(w[1:]) for w in req.prompt.split()]
        assert len(ids) == 30 and req.prompt_len == 40  # 40 tokens ~ 30 words
        assert all((b - a) % 100 == 1 for a, b in zip(ids, ids[1:], strict=False))  # one window, wrapping

    # --range-ratio 0.5: input lengths uniform in [50, 150], output lengths in [64, 192] (default 128).
    ranged = build_requests(BenchServeConfig("http://x", "m", num_prompts=200, input_len=100, range_ratio=0.5))
    sizes = [len(r.prompt.split()) for r in ranged]
    assert 50 <= min(sizes) < 60 and 140 < max(sizes) <= 150
    assert all(64 <= r.output_len <= 192 for r in ranged)


def test_bad_input_is_a_keel_error(tmp_path: Path) -> None:
    for bad in (["ttft=500"], ["foo:1"], ["ttft:abc"], ["tpot:-1"]):
        with pytest.raises(KeelError, match="--goodput"):
            parse_goodput(bad)
    parser = build_parser()
    args = parser.parse_args(
        ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--goodput", "ttft"]
    )
    with pytest.raises(KeelError, match="--goodput"):
        args.func(args)

    missing = tmp_path / "nope.jsonl"
    with pytest.raises(KeelError, match="nope.jsonl"):
        asyncio.run(run_benchmark(BenchServeConfig("http://127.0.0.1:9", "m", dataset=str(missing))))
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(KeelError, match=r"bad.jsonl:2"):
        build_requests(BenchServeConfig("http://x", "m", dataset=str(bad_jsonl)))

    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    with pytest.raises(KeelError, match="cannot reach"):
        asyncio.run(run_benchmark(BenchServeConfig(f"http://127.0.0.1:{closed_port}", "m", num_prompts=1)))
