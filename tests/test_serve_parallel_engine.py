"""Parallel serving end to end (keel.serve.parallel): tensor- and pipeline-parallel worker processes on
gloo give the single-process engine's greedy outputs, offline and through `keel serve` with the official
openai client; per-rank weight bytes; a worker killed mid-generation fails the server fast."""

from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest
import torch

from keel.errors import KeelError
from keel.serve import LLM, EngineConfig, SamplingParams
from keel.serve.openai.child import ServerProcess
from keel.serve.parallel.executor import node_ranks
from keel.serve.parallel.stage import micro_batches, selected_rows
from keel.serve.runner import Chunk
from keel.weights.loader import open_checkpoint
from keel.weights.shard import TensorParallelLayout
from tiny_models import save_byte_tokenizer, save_hf_model

SMOLLM2 = "smollm2-135m-instruct"
PROMPTS = [[1, 5, 9, 200, 3, 77, 12], [4, 4, 250, 8], list(range(10, 60)), [7]]


def _shapes(config) -> dict[str, tuple[int, ...]]:
    from keel.model.transformer import Transformer

    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in Transformer(config).named_parameters()}


def _outputs(llm: LLM, params: list[SamplingParams]) -> list:
    return [out.outputs[0] for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def _params() -> list[SamplingParams]:
    """Greedy requests, one with logprobs, and a seeded sampled one (rank 0 samples with the same generator)."""
    return [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True),
    ]


@pytest.mark.parametrize(
    ("arch", "tp", "pp"),
    [
        ("llama", 2, 1),
        ("qwen3", 2, 1),
        ("mixtral", 2, 1),
        ("qwen2_moe-ep", 2, 1),
        ("llama-bias", 1, 2),
        # GPT-OSS: sinks cut with their heads, expert biases with the experts' rows or by expert, down's added once
        ("gpt_oss", 2, 1),
        ("gpt_oss-ep", 2, 1),
        # GLM-4.5: DeepSeek's router replicated, routed and shared experts cut by width, per-head q/k norms
        pytest.param("glm4_moe", 2, 1, marks=pytest.mark.slow),
        # Granite MoE: experts stored stacked under their own names, each rank's cut read through the renames
        pytest.param("granitemoe", 2, 1, marks=pytest.mark.slow),
        # dots.llm1: DeepSeek's experts behind Qwen3's attention, a sliding layer
        pytest.param("dots1", 2, 1, marks=pytest.mark.slow),
        # ERNIE 4.5 MoE: its [1, E] selection bias read whole, interleaved rotary rows cut by head
        pytest.param("ernie4_5_moe", 2, 1, marks=pytest.mark.slow),
        # with biases everywhere: the shared expert's down bias, summed by the block's all-reduce, added once
        pytest.param("ernie4_5_moe+bias", 2, 1, marks=pytest.mark.slow),
        # DeepSeek-V2 / V3: latent attention's heads cut by rank (its latent cached whole on each), the float32
        # softmax router choosing by groups, V3's sigmoid one with its selection bias; a pipeline of two stages
        ("deepseek_v2", 2, 1),
        pytest.param("deepseek_v3", 2, 1, marks=pytest.mark.slow),
        pytest.param("deepseek_v2", 1, 2, marks=pytest.mark.slow),
        pytest.param("llama", 2, 2, marks=pytest.mark.slow),
        # Phi: the LM head's bias cut with its vocabulary rows
        pytest.param("phi", 2, 1, marks=pytest.mark.slow),
        # GLM-4: each rank's q/k rows are read through the family's regrouped rotary channels
        pytest.param("glm4", 2, 1, marks=pytest.mark.slow),
        # Llama 4: transposed experts cut by width (each rank scales its own input share), chunked layers
        pytest.param("llama4", 2, 1, marks=pytest.mark.slow),
        pytest.param("llama4-ep", 2, 1, marks=pytest.mark.slow),
        # GLM-4.7-Flash's and Mistral 4's latent attention (Mistral 4's queries scaled by position) cut by heads
        pytest.param("glm4_moe_lite", 2, 1, marks=pytest.mark.slow),
        pytest.param("mistral4", 2, 1, marks=pytest.mark.slow),
        # DeepSeek-V3.2 / GLM-5: the indexer replicated (every rank selects the same keys for its heads, its index
        # keys cached whole on each); two stages, each layer's selection its own
        pytest.param("deepseek_v32", 2, 1, marks=pytest.mark.slow),
        pytest.param("glm_moe_dsa", 2, 1, marks=pytest.mark.slow),
        pytest.param("deepseek_v32", 1, 2, marks=pytest.mark.slow),
        # A.X-K2: the gated query's projection cut by heads (each head's query and gate rows), gated norms replicated
        pytest.param("axk2", 2, 1, marks=pytest.mark.slow),
        # OLMo: q, k and v clamped on each rank's heads, weightless LayerNorms (no tensors to read)
        pytest.param("olmo", 2, 1, marks=pytest.mark.slow),
        # NanoChat: the embedding's weightless norm on the first stage of two, reversed rotation
        pytest.param("nanochat", 1, 2, marks=pytest.mark.slow),
        pytest.param("nanochat", 2, 1, marks=pytest.mark.slow),
        # Cohere 2 MoE: the shared expert averaged with the routed experts on each rank's partial output, interleaved
        # rotary rows cut by head
        pytest.param("cohere2_moe", 2, 1, marks=pytest.mark.slow),
        # Granite MoE SWA: sinks cut with their heads beside sliding layers, Granite's scalars, experts stacked under
        # transformers' names read through the renames, the shared MLP's fused rows cut per rank
        pytest.param("granitemoe_swa", 2, 1, marks=pytest.mark.slow),
        # Kolibri 1: the selection bias on the logits (read through its rename), sandwich norms, experts split by rank
        pytest.param("kolibri1", 2, 1, marks=pytest.mark.slow),
        pytest.param("kolibri1-ep", 2, 1, marks=pytest.mark.slow),
        # BLOOM: each rank's heads take their ALiBi slopes (3 of 6), per-head q/k/v rows cut by head; the
        # embedding's own LayerNorm on the first stage of two
        pytest.param("bloom", 2, 1, marks=pytest.mark.slow),
        pytest.param("bloom", 1, 2, marks=pytest.mark.slow),
    ],
)
def test_parallel_engine_matches_one_process(tmp_path, arch, tp, pp):
    """TP 2 (llama, qwen3 with n-gram speculation, and MoE: mixtral with its experts cut by width, qwen2_moe
    with its experts split over the 2 ranks and its shared expert cut: TP 2 x EP 2), PP 2 and TP 2 x PP 2
    (4 workers): the same tokens as the single-process engine,
    with a token budget small enough that prompts are chunked and steps mix prefill and decode (and each rank's
    share of the start-up dummy step run in step with its peers)."""
    arch, expert_parallel, _ = arch.partition("-ep")
    arch, biased, _ = arch.partition("+bias")
    save_hf_model(arch, tmp_path, tie_word_embeddings=(arch == "llama"), **({"use_bias": True} if biased else {}))
    config = dict(kv_cache_memory="8MiB", max_num_batched_tokens=16, max_model_len=256, compile=False, dtype="float32")
    if arch == "qwen3":  # n-gram speculation: drafts travel with the step, rank 0 verifies them
        config["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    expected = _outputs(LLM(str(tmp_path), EngineConfig.of(**config)), _params())
    parallel = dict(tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_expert_parallel=bool(expert_parallel))
    llm = LLM(str(tmp_path), EngineConfig.of(**config, **parallel))
    try:
        got = _outputs(llm, _params())
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        for want, have in zip(expected[1].logprobs, got[1].logprobs, strict=True):
            assert have.token_id == want.token_id
            assert have.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks  # every block back
        if arch == "qwen3":
            assert llm.engine.spec_num_draft_tokens > 0
        reports = llm.engine.executor.reports
        assert sorted(reports) == list(range(tp * pp))
        assert len({r.num_blocks for r in reports.values()}) == 1  # one block table serves every rank
        if pp == 1:  # each rank: 1/tp of the sharded weights plus the replicated ones (float32: 4 bytes each)
            model_config = open_checkpoint(str(tmp_path)).config
            shapes = _shapes(model_config)
            total = sum(torch.Size(s).numel() for s in shapes.values())
            for rank, report in reports.items():
                layout = TensorParallelLayout(model_config, tp, rank, bool(expert_parallel))
                replicated = sum(torch.Size(s).numel() for n, s in shapes.items() if layout.shard_of(n) is None)
                assert report.weight_bytes == 4 * ((total - replicated) // tp + replicated)
                assert report.peak_at_load > report.weight_bytes
    finally:
        llm.engine.shutdown()


def test_one_rank_in_a_worker_process(tmp_path):
    """--distributed-executor-backend mp with tp = pp = 1 (vLLM's option): the one rank runs in a worker, the
    path a single GPU can prove on NCCL (tests/test_cuda.py); the single-process engine's tokens. uni with
    more than one rank is one line."""
    save_hf_model("llama", tmp_path)
    config = dict(kv_cache_memory="8MiB", max_model_len=256, compile=False, dtype="float32")
    expected = _outputs(LLM(str(tmp_path), EngineConfig.of(**config)), _params())
    llm = LLM(str(tmp_path), EngineConfig.of(**config, distributed_executor_backend="mp"))
    try:
        assert sorted(llm.engine.executor.reports) == [0]
        assert [o.token_ids for o in _outputs(llm, _params())] == [o.token_ids for o in expected]
    finally:
        llm.engine.shutdown()
    with pytest.raises(KeelError, match="--distributed-executor-backend uni runs one rank"):
        LLM(str(tmp_path), EngineConfig.of(**config, tensor_parallel_size=2, distributed_executor_backend="uni"))


def test_an_idle_server_keeps_its_workers(tmp_path):
    """The followers wait on the control group for the next step, within --distributed-timeout; rank 0 renews
    that wait while the engine has nothing to run, so a server idle for longer still serves (before, every
    worker failed on the first request after an idle minute)."""
    save_hf_model("llama", tmp_path)
    config = dict(kv_cache_memory="8MiB", max_model_len=256, compile=False, dtype="float32")
    llm = LLM(str(tmp_path), EngineConfig.of(**config, tensor_parallel_size=2, distributed_timeout=3))
    try:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        first = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
        time.sleep(7)  # over twice the timeout
        assert llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids == first
    finally:
        llm.engine.shutdown()


# In make test-slow (15 s on the 2-core AVX2 machine), to keep make test within its budget.
@pytest.mark.slow
def test_parallel_engine_keeps_structured_outputs(tmp_path):
    """The engine fills the grammar's bitmasks and ships them with the step; rank 0's sampler applies them:
    TP 2 gives the single-process engine's constrained tokens (greedy and seeded), which match the regex."""
    import re

    from keel.serve.structured import StructuredOutputsParams

    save_hf_model("llama", tmp_path)
    save_byte_tokenizer(tmp_path)
    pattern = r"[a-f]{3}-[0-9]{2}"
    spec = StructuredOutputsParams.of(regex=pattern)
    params = [
        SamplingParams(max_tokens=12, temperature=0, structured_outputs=spec),
        SamplingParams(max_tokens=12, temperature=1.0, seed=3, structured_outputs=spec),
        SamplingParams(
            max_tokens=12, temperature=0, structured_outputs=StructuredOutputsParams.of(choice=["up", "down"])
        ),
    ]
    config = dict(kv_cache_memory="8MiB", max_model_len=256, compile=False, dtype="float32")
    prompts = ["hello there", "abc", "which way?"]
    expected = [
        o.outputs[0] for o in LLM(str(tmp_path), EngineConfig.of(**config)).generate(prompts, params, use_tqdm=False)
    ]
    llm = LLM(str(tmp_path), EngineConfig.of(**config, tensor_parallel_size=2))
    try:
        got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert re.fullmatch(pattern, got[0].text) and re.fullmatch(pattern, got[1].text) and got[2].text in ("up", "down")


def test_smollm2_gguf_shards_reassemble():
    """GGUF slices (Q4_1 and Q8_0 blocks, llama's permuted q/k rows) put together equal the whole tensor."""
    checkpoint = open_checkpoint(SMOLLM2)
    reader, config = checkpoint.reader, checkpoint.config
    layouts = [TensorParallelLayout(config, 3, r) for r in range(3)]
    for name in sorted(reader.names()):
        if not name.startswith(("model.layers.0.", "model.embed_tokens")):
            continue
        keel_name = name.removeprefix("model.")
        shard = layouts[0].shard_of(keel_name)
        parts = [reader.get_shard(name, lay.shard_of(keel_name)) for lay in layouts]
        full = reader.get(name)
        if shard is None:
            assert all(torch.equal(p, full) for p in parts), name
        else:
            assert torch.equal(torch.cat(parts, dim=shard.dim), full), name


def test_layout_helpers():
    chunks = [Chunk([0], 0, [1] * n, logits) for n, logits in [(30, "last"), (1, "last"), (1, "all"), (5, "none")]]
    assert [len(g) for g in micro_batches(chunks, 2)] == [1, 3]
    assert [len(g) for g in micro_batches(chunks, 8)] == [1, 1, 1, 1]
    assert sum(micro_batches(chunks, 3), []) == chunks
    assert selected_rows(chunks) == [range(0, 1), range(1, 2), range(2, 3), range(3, 3)]
    assert node_ranks(8, 2, 1) == range(4, 8)
    with pytest.raises(KeelError, match="do not divide evenly"):
        node_ranks(6, 4, 0)


def test_unsupported_layouts_fail_before_any_worker_starts(tmp_path):
    save_hf_model("llama", tmp_path)  # 4 heads, 2 KV heads, 3 layers
    with pytest.raises(KeelError, match="4 attention heads do not divide into 3 ranks"):
        LLM(str(tmp_path), kv_cache_memory="8MiB", tensor_parallel_size=3)
    with pytest.raises(KeelError, match="--quantize gguf"):
        LLM(str(tmp_path), kv_cache_memory="8MiB", tensor_parallel_size=2, quantize="gguf")
    with pytest.raises(KeelError, match="only 3 layers"):
        LLM(str(tmp_path), kv_cache_memory="8MiB", pipeline_parallel_size=4)
    with pytest.raises(KeelError, match="needs a mixture-of-experts model"):
        LLM(str(tmp_path), kv_cache_memory="8MiB", tensor_parallel_size=2, enable_expert_parallel=True)


def _chat(client: openai.OpenAI, model: str, text: str, stream: bool) -> str:
    messages = [{"role": "user", "content": text}]
    if not stream:
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0)
        return reply.choices[0].message.content
    pieces = client.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)


# ~60 s, in `make test-slow`: workers behind HTTP also in test_killed_worker_fails_the_server_fast, SmolLM2's TP
# shards in test_smollm2_gguf_shards_reassemble, TP engines against one process in
# test_parallel_engine_matches_one_process.
@pytest.mark.slow
def test_keel_serve_tp3_smollm2_with_the_openai_client():
    """`keel serve --tensor-parallel-size 3` on SmolLM2 (9 heads, 3 KV heads, read slice by slice from its
    GGUF file): chat (streamed and not) and completions over HTTP give the single-process engine's greedy
    text. In float32: in bfloat16 each rank's partial sums round differently from one process's, so greedy
    tokens may part after a while (as in any TP implementation)."""
    llm = LLM(SMOLLM2, kv_cache_memory="64MiB", max_model_len=1024, compile=False, dtype="float32")
    questions = ["What is the capital of France?", "Name a colour."]
    tokenizer = llm.engine.tokenizer
    chats = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]  # as the server does
    greedy = SamplingParams(max_tokens=20, temperature=0)
    expected = [o.outputs[0].text for o in llm.generate([*chats, tokenizer.encode("1, 2, 3,")], greedy, use_tqdm=False)]
    server = ServerProcess(
        SMOLLM2,
        "--tensor-parallel-size",
        "3",
        "--kv-cache-memory",
        "64MiB",
        "--max-model-len",
        "1024",
        "--dtype",
        "float32",
    )
    try:
        server.wait_ready(timeout=240)
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        got = [
            _chat(client, SMOLLM2, questions[0], stream=False),
            _chat(client, SMOLLM2, questions[1], stream=True),
            client.completions.create(model=SMOLLM2, prompt="1, 2, 3,", max_tokens=20, temperature=0).choices[0].text,
        ]
        assert got == expected
        assert "Paris" in got[0]
        assert "replicated" not in server.log_path.read_text()  # 3 KV heads over 3 ranks: split, not replicated
        assert server.terminate() == 0
    finally:
        server.terminate()


# In make test-slow (35 s on a 2-core AVX2 machine), to keep make test within its budget; worker failures at
# start-up are checked in make test (test_start_up_failures_name_the_rank).
@pytest.mark.slow
def test_killed_worker_fails_the_server_fast(tmp_path):
    """SIGKILL one worker mid-generation: the stream ends with an error, /health turns 503 and the server
    exits non-zero within 30 s; no collective is left hanging."""
    save_hf_model("llama", tmp_path, max_position_embeddings=4096)
    save_byte_tokenizer(tmp_path)
    server = ServerProcess(
        tmp_path, "--tensor-parallel-size", "2", "--kv-cache-memory", "16MiB", "--no-compile", "--dtype", "float32"
    )
    try:
        server.wait_ready(timeout=180)
        log = server.log_path.read_text()
        pid = int(log.split("worker rank 1 started (pid ")[1].split(")")[0])
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(
            model=str(tmp_path), prompt="hello", max_tokens=4000, stream=True, extra_body={"ignore_eos": True}
        )
        received = 0
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            for _ in stream:
                received += 1
                if received == 5:
                    import os

                    os.kill(pid, signal.SIGKILL)
                    killed = time.monotonic()
        assert received >= 5
        try:
            assert httpx.get(server.base_url + "/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass  # already gone: fine, it must have exited
        server.proc.wait(timeout=30)
        assert time.monotonic() - killed < 30
        assert server.proc.returncode not in (0, None)
        assert "worker rank 1 exited" in server.log_path.read_text()
    finally:
        server.terminate()


def test_auto_parallel_takes_the_planners_layout():
    """`keel serve --auto-parallel`: the serving planner's first layout keel can run."""
    from pathlib import Path

    from keel.plan.source import model_config
    from keel.serve.parallel.launch import auto_parallel

    fixtures = Path(__file__).parent / "fixtures" / "configs"
    llama405 = model_config(str(fixtures / "llama-3.1-405b.json"))
    assert auto_parallel(llama405, "8xH200", 8192)[:2] == (8, 1)  # 810 GB of bf16 weights: all 8 GPUs
    tp, pp, why = auto_parallel(llama405, "16xH100", 8192)
    assert tp * pp == 16 and tp <= 8 and "per GPU" in why  # tp stays inside a node
    small = open_checkpoint(SMOLLM2).config
    tp, pp, why = auto_parallel(small, "3xH200", 4096)
    assert (tp, pp) == (1, 1) and "run 2 more" in why  # fits one GPU: three replicas, this server is one
    with pytest.raises(KeelError, match="no layout"):
        auto_parallel(llama405, "2xA100", 8192)


def test_parallel_cli_errors_are_one_line(tmp_path, capsys, monkeypatch):
    """`keel serve` in-process (the CLI's own main; its one-line errors in a real process are in
    tests/test_serve_tenants.py and tests/test_expert_offload.py): refused before any worker or port."""
    from keel.cli import main
    from keel.net import free_port
    from keel.serve.openai import server

    def no_server():
        raise AssertionError("keel serve got past its checks and would start serving")

    monkeypatch.setattr(server, "_server_class", no_server)
    save_hf_model("llama", tmp_path)
    save_byte_tokenizer(tmp_path)
    cases = ((["-tp", "3"], ("4 attention heads", "3 ranks")), (["--auto-parallel"], ("--auto-parallel", "found none")))
    for args, needles in cases:
        capsys.readouterr()
        assert main(["serve", str(tmp_path), "--port", str(free_port()), *args]) == 1, args
        err = capsys.readouterr().err
        assert err.startswith("keel: error:") and err.count("\n") == 1 and all(n in err for n in needles), err
    from keel.serve.openai.server import resolve_auto_parallel

    with pytest.raises(KeelError, match="one or the other"):
        resolve_auto_parallel(str(tmp_path), "2xH200", EngineConfig.of(tensor_parallel_size=3))


@pytest.mark.slow  # ~27 s on 2 cores; the rendezvous options' checks and pipeline serving stay in `make test`
def test_two_nodes_on_one_host(tmp_path):
    """Multi-node serving through the rendezvous options, pipeline-parallel across the nodes (the layout
    for a slow link): node 1 runs its stage headless, node 0 the engine, the server and the first stage;
    the openai client gets the single-process tokens; node 1 exits 0 once node 0 stops."""
    import subprocess
    import sys

    from keel.net import free_port

    save_hf_model("llama", tmp_path)
    save_byte_tokenizer(tmp_path)
    expected = (
        LLM(str(tmp_path), kv_cache_memory="16MiB", compile=False, dtype="float32")
        .generate("hello", SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    port = str(free_port())
    common = [
        "--pipeline-parallel-size",
        "2",
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
        "--kv-cache-memory",
        "16MiB",
        "--dtype",
        "float32",
    ]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "keel.cli", "serve", str(tmp_path), *common, "--node-rank", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    node0 = ServerProcess(tmp_path, *common, "--node-rank", "0", "--no-compile")
    try:
        node0.wait_ready(timeout=180)
        client = openai.OpenAI(base_url=node0.base_url + "/v1", api_key="unused")
        reply = client.completions.create(model=str(tmp_path), prompt="hello", max_tokens=8, temperature=0)
        assert reply.choices[0].text == expected
        assert node0.terminate() == 0
        assert node1.wait(timeout=60) == 0
        assert "node 1 of 2: starting ranks 1-1 of 2" in node1.stdout.read()
    finally:
        node0.terminate()
        if node1.poll() is None:
            node1.kill()


# In make test-slow (33 s on the 2-core AVX2 machine), to keep make test within its budget.
@pytest.mark.slow
def test_quantized_shards(tmp_path):
    """int8 under TP 2: with the row-parallel layers kept in float, every quantized layer has the scales
    one process computes, so the tokens are the single-process int8 engine's; quantized row-parallel
    layers too (scales per rank's slice) shrink every rank's weights and still decode."""
    save_hf_model("llama", tmp_path, intermediate_size=256)
    base = dict(kv_cache_memory="8MiB", max_model_len=256, compile=False, dtype="float32", quantize="int8")
    keep = ("lm_head", "*.o_proj", "*.down_proj")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = LLM(str(tmp_path), EngineConfig.of(**base, quant_keep=keep)).generate(PROMPTS, params, use_tqdm=False)
    sizes = {}
    for name, quant_keep in (("column", keep), ("all", ("lm_head",))):
        llm = LLM(str(tmp_path), EngineConfig.of(**base, quant_keep=quant_keep, tensor_parallel_size=2))
        try:
            got = llm.generate(PROMPTS, params, use_tqdm=False)
            if name == "column":
                assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
            assert all(len(o.outputs[0].token_ids) == 12 for o in got)
            sizes[name] = [r.weight_bytes for r in llm.engine.executor.reports.values()]
        finally:
            llm.engine.shutdown()
    config = open_checkpoint(str(tmp_path)).config
    float_rank = 4 * sum(torch.Size(s).numel() for s in _shapes(config).values()) // 2
    assert all(q < c < float_rank for q, c in zip(sizes["all"], sizes["column"], strict=True))


def test_start_up_failures_name_the_rank(tmp_path):
    """A worker that fails to load reports why and which rank; one that never reports is named at the
    deadline; no worker is left behind either way."""
    import multiprocessing

    from safetensors.torch import load_file, save_file

    save_hf_model("llama", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.mlp.down_proj.weight"]  # only the last stage reads layer 2
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeelError, match=r"worker rank 1 failed to start: .*layers\.2\.mlp\.down_proj"):
        LLM(str(tmp_path), kv_cache_memory="8MiB", max_model_len=256, pipeline_parallel_size=2)
    with pytest.raises(KeelError, match=r"did not start within 0 s: rank\(s\) 0, 1 not ready"):
        LLM(str(tmp_path), kv_cache_memory="8MiB", max_model_len=256, tensor_parallel_size=2, startup_timeout=0.01)
    assert not multiprocessing.active_children()
