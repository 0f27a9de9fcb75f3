"""keel plan: published model configs and the ZeRO arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from keel.config import ModelConfig
from keel.errors import ConfigError, KeelError
from keel.model.transformer import Transformer
from keel.plan.zero import zero_bytes_per_gpu

CONFIGS = Path(__file__).parent / "fixtures" / "configs"

# Published totals and active parameters in billions, with the unit the publication rounds to
# (tests/fixtures/configs/SOURCES.md). A count passes within 1% plus half that unit. The active count
# compared is the one a token multiplies (`active_matmul`: without the input embedding lookup), the
# count behind 6N FLOPs per token; counting the lookup too puts Kimi-K2 at 32.86B against its 32B.
PUBLISHED = {
    "llama-3.1-405b": ((405, 1), (405, 1)),
    "deepseek-v3": ((671, 1), (37, 1)),
    "kimi-k2": ((1040, 10), (32, 1)),  # the technical report's 1.04T
    "qwen3-235b-a22b": ((235, 1), (22, 1)),
    "mixtral-8x22b": ((141, 1), (39, 1)),
}


def close(count: int, published: tuple[float, float]) -> bool:
    value, unit = published
    return abs(count / 1e9 - value) <= 0.01 * value + unit / 2


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_parameter_counts(name):
    config = ModelConfig.from_json_file(CONFIGS / f"{name}.json", structure_only=True)
    counts = config.param_counts()
    # The analytic count is the model keel would build (on the meta device: no memory).
    with torch.device("meta"):
        model = Transformer(config)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    total, active = PUBLISHED[name]
    assert close(counts["total"], total), counts["total"]
    assert close(counts["active_matmul"], active), counts["active_matmul"]
    assert counts["active"] - counts["active_matmul"] == (
        0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    )


def test_quantized_release_configs_read_for_structure_only():
    with pytest.raises(ConfigError, match="quantized checkpoints"):
        ModelConfig.from_json_file(CONFIGS / "deepseek-v3.json")
    config = ModelConfig.from_json_file(CONFIGS / "deepseek-v3.json", structure_only=True)
    assert config.is_mla and config.num_experts == 256 and config.num_experts_per_tok == 8


def test_zero_matches_the_paper():
    """ZeRO (Rajbhandari et al. 2020), mixed-precision Adam: 16 bytes/param unsharded; stage 1:
    4Ψ + 12Ψ/N; stage 2: 2Ψ + 14Ψ/N; stage 3: 16Ψ/N. Its example: 7.5B parameters, N = 64."""
    psi, n = 7.5e9, 64
    got = [zero_bytes_per_gpu(psi, n, stage) / 1e9 for stage in range(4)]
    assert got[0] == pytest.approx(120.0)
    assert got[1] == pytest.approx(4 * 7.5 + 12 * 7.5 / 64)
    assert got[2] == pytest.approx(2 * 7.5 + 14 * 7.5 / 64)
    assert got[3] == pytest.approx(16 * 7.5 / 64)
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]
    with pytest.raises(ValueError):
        zero_bytes_per_gpu(psi, n, 4)


def test_cluster_specs():
    from keel.errors import KeelError
    from keel.plan.hardware import parse_cluster

    cluster = parse_cluster("2048xH800")
    assert cluster.count == 2048 and cluster.nodes == 256 and cluster.gpu.memory == 80e9
    assert parse_cluster("8 x h200").gpu.name == "H200" and parse_cluster("B200").count == 1
    assert parse_cluster("16xH100").gpu.name == "H100-SXM"
    for bad in ("8xV100", "eightxH100", "0xH100"):
        with pytest.raises(KeelError):
            parse_cluster(bad)


@pytest.mark.parametrize("kind", ["auto", "int8"])
def test_kv_capacity_equals_the_engines_block_count(tmp_path, kind):
    """The planner's capacity for a budget is the pool the engine builds from the same budget."""
    from keel.plan.kv import kv_capacity
    from keel.quant.loading import load_model
    from keel.serve import EngineConfig, LLMEngine
    from tiny_models import save_hf_model

    save_hf_model("llama", tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    budget = 3 * 2**20 + 12345
    engine = LLMEngine(
        loaded, EngineConfig.of(kv_cache_memory=budget, block_size=8, max_model_len=256, kv_cache_dtype=kind)
    )
    plan = kv_capacity(loaded.config, budget, loaded.model.dtype, kind, block_size=8, context=256)
    assert plan["blocks"] == engine.kv.num_blocks
    assert plan["sequences"] == engine.kv.num_blocks // 32


def test_mla_kv_counts_the_latent_only():
    """DeepSeek-V3: 61 layers x (512 latent + 64 rope key) x 2 bytes = 70,272 bytes per token in bf16,
    where uncompressed heads would take 61 x 128 heads x (192 key + 128 value) x 2 = 4,997,120."""
    from keel.plan.kv import kv_capacity

    config = ModelConfig.from_json_file(CONFIGS / "deepseek-v3.json", structure_only=True)
    plan = kv_capacity(config, 141 * 10**9, context=32768)
    assert plan["bytes_per_token"] == 61 * (512 + 64) * 2
    assert plan["sequences"] == 141 * 10**9 // (61 * 576 * 2 * 16) // 2048


# ------------------------------------------------------------------------------- serving plan
def _fixture(name: str) -> ModelConfig:
    return ModelConfig.from_json_file(CONFIGS / f"{name}.json", structure_only=True)


def test_serving_plan_roofline_dense():
    """Llama-3.1-405B in fp8 on 8 H200s, tp 8: a batch-1 decode step reads this GPU's weights and
    one sequence's KV once; decode turns compute-bound where 2 FLOP per weight byte x B reaches
    peak x mfu / bandwidth."""
    from keel.plan.hardware import parse_cluster
    from keel.plan.serve import plan_serving

    config, cluster = _fixture("llama-3.1-405b"), parse_cluster("8xH200")
    layouts = plan_serving(config, cluster, context=8192, weights="fp8", mfu=0.6)
    best = layouts[0]
    assert (best.tp, best.pp, best.replicas) == (8, 1, 1) and best.fits
    gpu = cluster.gpu
    weights = config.param_counts()["total"] / 8  # fp8: one byte per weight
    assert best.weights_gb == pytest.approx(weights / 1e9)
    assert best.kv_bytes_per_token == config.num_layers * 2 * 1 * config.head_dim * 2  # one KV head per rank, bf16
    read = (config.param_counts()["total"] - config.vocab_size * config.hidden_size) / 8  # the embedding is a lookup
    memory_ms = 1000 * (read + 8192 * best.kv_bytes_per_token) / gpu.hbm_bandwidth
    comm_ms = 1000 * 2 * config.hidden_size * 2 * 2 * 7 / 8 * config.num_layers / gpu.link
    assert best.decode_ms_batch1 == pytest.approx(memory_ms + comm_ms, rel=1e-6)
    want = 1
    while 2 * want * 1.0 < gpu.bf16_flops * 0.6 / gpu.hbm_bandwidth:  # FLOP per byte read, fp8 weights
        want *= 2
    assert best.compute_bound_batch == want
    # Sequences of 8192 tokens that fit the memory left after the weights and a 5% reserve.
    free = gpu.memory * 0.85 - weights
    assert best.sequences == int(free // (best.kv_bytes_per_token * 16)) // (8192 // 16)


def test_serving_plan_mla_moe_fit_and_offloading():
    """DeepSeek-V3 does not fit 8 H200s in bf16 (1.34 TB of weights) but does in fp8; MLA's latent is
    the same on every tp rank; without room, the plan says which share of experts stays resident."""
    from keel.plan.hardware import parse_cluster
    from keel.plan.serve import plan_serving

    config, cluster = _fixture("deepseek-v3"), parse_cluster("8xH200")
    bf16 = plan_serving(config, cluster, context=32768, weights="bf16")
    assert not any(lay.fits for lay in bf16)
    tp8 = next(lay for lay in bf16 if lay.tp == 8)
    assert 0.5 < tp8.resident_expert_share < 1.0
    fp8 = plan_serving(config, cluster, context=32768, weights="fp8")
    best = fp8[0]
    assert best.fits and best.tp == 8
    assert best.kv_bytes_per_token == 61 * (512 + 64) * 2  # replicated latent, not split by tp
    assert best.sequences > 0 and best.compute_bound_batch > 0
    # More sequences per step cost more per step but give more tokens per second.
    small = plan_serving(config, cluster, context=32768, weights="fp8", batch=1)[0]
    assert small.decode_ms < best.decode_ms and small.tokens_per_s < best.tokens_per_s


def test_plan_serve_cli(tmp_path, capsys):
    import json
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "keel",
        "plan",
        "serve",
        str(CONFIGS / "qwen3-235b-a22b.json"),
        "--gpus",
        "8xH100",
        "--context",
        "16384",
        "--json",
        str(tmp_path / "plan.json"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "235.1B parameters" in out.stdout and "tok/s" in out.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["layouts"] and plan["layouts"][0]["fits"]
    # The errors in-process (the CLI's own main): keel's one line and exit 1, no traceback.
    from keel.cli import main

    capsys.readouterr()
    assert main(cmd[3:7] + ["8xV100", "--context", "16"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("keel: error: unknown GPU 'V100'") and err.count("\n") == 1, err
    assert main(cmd[3:7] + ["1xA100", "--context", "16"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("keel: error:") and "does not fit 1xA100" in err and err.count("\n") == 1, err


def test_custom_hardware_overrides():
    """A part not in the table: the A100's figures with 640 GB of memory make one GPU hold Qwen3-235B."""
    import argparse

    from keel.cli.plan import add_cluster_arguments, cluster_from_args
    from keel.plan.serve import plan_serving

    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus")
    add_cluster_arguments(parser)
    args = parser.parse_args(["--gpus", "1xA100", "--gpu-memory", "640", "--hbm-tbs", "10", "--gpus-per-node", "4"])
    cluster = cluster_from_args(args)
    assert cluster.gpu.memory == 640e9 and cluster.gpu.hbm_bandwidth == 10e12 and cluster.gpu.per_node == 4
    assert cluster.gpu.bf16_flops == 312e12  # the rest stays the A100's
    assert plan_serving(_fixture("qwen3-235b-a22b"), cluster, 4096)[0].fits
    with pytest.raises(KeelError, match="--gpu-memory"):
        cluster_from_args(parser.parse_args(["--gpus", "1xA100", "--gpu-memory", "0"]))


# ------------------------------------------------------------------------------- activations
def test_gpt_layer_formula():
    from keel.plan.activations import gpt_layer_bytes

    # sbh (34 + 5as/h): s = 2048, b = 1, h = 12288, a = 96 (GPT-3 175B), in GB per layer.
    assert gpt_layer_bytes(2048, 1, 12288, 96) == 2048 * 12288 * (34 + 5 * 96 * 2048 / 12288)
    assert gpt_layer_bytes(2048, 1, 12288, 96, t=8, flash=True) == 2048 * 12288 * 34 / 8


@pytest.mark.parametrize("recipe", ["bf16", "fp32", "autocast"])
@pytest.mark.parametrize("moe", [False, True])
def test_layer_activation_bytes_match_what_autograd_saves(moe, recipe):
    """The planner's per-layer activation bytes against the bytes autograd really keeps for backward
    in a keel layer (saved-tensor hooks), in each recipe keel trains with (bf16 weights, float32,
    autocast to bf16 over float32 weights): within 15%. Weights (and their autocast copies) are not
    activations: only tensors with the batch and sequence (or token-slot) dimensions count."""
    import contextlib

    from keel.model.attention import AttentionMetadata
    from keel.model.transformer import build_model
    from keel.plan.activations import ActivationPrecision, layer_activation_bytes

    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=80, architecture="mixtral") if moe else {}
    config = ModelConfig(
        **{
            **dict(
                architecture="llama",
                vocab_size=128,
                hidden_size=96,
                intermediate_size=176,
                num_layers=1,
                num_heads=6,
                num_kv_heads=2,
                head_dim=16,
            ),
            **extra,
        }
    )
    weights = torch.bfloat16 if recipe == "bf16" else torch.float32
    precision = ActivationPrecision.of(2 if recipe == "bf16" else 4, 4 if recipe == "fp32" else 2)
    assert precision.autocast == (recipe == "autocast")
    torch.manual_seed(0)
    model = build_model(config).to(weights)
    b, s = 3, 40
    x = torch.randn(b, s, config.hidden_size, dtype=weights, requires_grad=True)
    meta = AttentionMetadata.for_sequence(b, s)
    meta.rope = model.rotary(meta.positions, torch.float32 if recipe == "fp32" else torch.bfloat16)
    saved: dict[int, int] = {}

    def pack(t):
        shape = tuple(t.shape)
        k = config.num_experts_per_tok if moe else 1
        if len(shape) >= 1 and (shape[0] == b and s in shape[1:] or shape[0] in (b * s, b * s * k)):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if recipe == "autocast" else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with autocast:
            out = model.layers["0"](x, meta)
        out.float().sum().backward()
    measured = sum(saved.values())
    predicted = layer_activation_bytes(config, s, b, precision=precision)
    assert abs(predicted - measured) / measured < 0.15, (predicted, measured)
    assert layer_activation_bytes(config, s, b, recompute="full", precision=precision) == (
        b * s * config.hidden_size * precision.residual
    )


# ------------------------------------------------------------------------------- training plan
def _rank(layouts, **want) -> int:
    """Position among the layouts that fit of the best one with the wanted fields."""
    fitting = [lay for lay in layouts if lay.fits]
    return next(i for i, lay in enumerate(fitting) if all(getattr(lay, k) == v for k, v in want.items()))


def test_published_training_layouts_are_feasible_and_ranked():
    """DeepSeek-V3's layout (PP16 x EP64, ZeRO-1 data parallelism, 2,048 H800s, 4K sequences, 15,360
    per step) and Llama 3 405B's (TP8 x PP16 x DP128 on 16K H100s, 8K sequences, 16M tokens): both
    fit and rank in the top 15% of the layouts that fit (docs/PLAN.md says where and why)."""
    from keel.plan.hardware import parse_cluster
    from keel.plan.train import plan_training

    deepseek = plan_training(_fixture("deepseek-v3"), parse_cluster("2048xH800"), 4096, 15360 * 4096)
    fitting = sum(lay.fits for lay in deepseek)
    rank = _rank(deepseek, tp=1, pp=16, ep=64, zero=1)
    assert rank < 0.15 * fitting, (rank, fitting)
    llama = plan_training(_fixture("llama-3.1-405b"), parse_cluster("16384xH100"), 8192, 16 * 2**20)
    fitting = sum(lay.fits for lay in llama)
    rank = _rank(llama, tp=8, pp=16, dp=128)
    assert rank < 0.15 * fitting, (rank, fitting)
    best = llama[0]
    assert best.fits and 0.1 < best.mfu < 0.6


def test_pipeline_schedules_recomputation_precision_and_optimizers():
    """Bubbles: ZB-V < interleaved < 1F1B at the same micro-batches; interleaving keeps more
    activations; selective recomputation sits between none and full in memory and time; fp8 speeds
    the matmuls (and is refused where there are no fp8 tensor cores); Muon keeps less state than
    AdamW; an HSDP shard group inside a node holds more states than sharding over every rank."""
    from keel.errors import KeelError
    from keel.plan.hardware import parse_cluster
    from keel.plan.train import evaluate, plan_training

    config, cluster = _fixture("llama-3.1-405b"), parse_cluster("1024xH100")
    args = (config, cluster, 8192, 4 * 2**20)
    lay = {
        s: evaluate(*args, tp=8, pp=8, ep=1, zero=1, micro_batch=1, recompute="full", schedule=s)
        for s in ("1f1b", "interleaved", "zbv")
    }
    assert lay["zbv"].bubble < lay["interleaved"].bubble < lay["1f1b"].bubble
    m, pp = lay["1f1b"].microbatches, 8
    assert lay["1f1b"].bubble == pytest.approx((pp - 1) / (m + pp - 1))
    assert lay["interleaved"].activations_gb > lay["1f1b"].activations_gb == pytest.approx(lay["zbv"].activations_gb)
    by_rc = {
        rc: evaluate(*args, tp=8, pp=8, ep=1, zero=1, micro_batch=1, recompute=rc)
        for rc in ("none", "selective", "full")
    }
    assert by_rc["full"].activations_gb < by_rc["selective"].activations_gb < by_rc["none"].activations_gb
    assert by_rc["none"].compute_s < by_rc["selective"].compute_s < by_rc["full"].compute_s
    fp8 = evaluate(*args, tp=8, pp=8, ep=1, zero=1, micro_batch=1, recompute="full", precision="fp8")
    assert fp8.compute_s < 0.6 * by_rc["full"].compute_s
    with pytest.raises(KeelError, match="fp8"):
        plan_training(config, parse_cluster("64xA100"), 8192, 2**20, precision="fp8")
    muon = evaluate(*args, tp=8, pp=8, ep=1, zero=1, micro_batch=1, recompute="full", optimizer="muon")
    assert muon.states_gb < by_rc["full"].states_gb
    full_shard = evaluate(*args, tp=8, pp=1, ep=1, zero=3, micro_batch=1, recompute="full")
    hsdp = evaluate(*args, tp=8, pp=1, ep=1, zero=3, micro_batch=1, recompute="full", dp_shard=8)
    assert hsdp.dp_shard == 8 and full_shard.dp_shard == 128
    assert hsdp.states_gb == pytest.approx(full_shard.states_gb * 128 / 8)
    assert evaluate(*args, tp=8, pp=1, ep=1, zero=1, micro_batch=1, recompute="full", dp_shard=8) is None


def test_training_memory_adds_up():
    """A layout's model states are the ZeRO arithmetic on its shard; recomputation only shrinks
    activations; a model too large for one GPU does not fit there."""
    from keel.plan.hardware import parse_cluster
    from keel.plan.train import evaluate

    config = _fixture("llama-3.1-405b")
    params = config.param_counts()["total"]
    cluster = parse_cluster("1024xH100")
    lay = evaluate(config, cluster, 8192, 4 * 2**20, tp=8, pp=8, ep=1, zero=1, micro_batch=1, recompute="none")
    assert lay.dp == 16
    assert lay.states_gb == pytest.approx(params / 64 * (4 + 12 / 16) / 1e9)
    assert lay.weights_gb == pytest.approx(params / 64 * 2 / 1e9) and lay.grads_gb == lay.weights_gb
    assert lay.optimizer_gb == pytest.approx(params / 64 * 12 / 16 / 1e9)
    assert lay.layer_activations_recompute_gb < lay.layer_activations_gb
    full = evaluate(config, cluster, 8192, 4 * 2**20, tp=8, pp=8, ep=1, zero=1, micro_batch=1, recompute="full")
    assert full.activations_gb < lay.activations_gb and full.states_gb == lay.states_gb
    assert full.compute_s == pytest.approx(lay.compute_s * 4 / 3)
    single = evaluate(
        config, parse_cluster("1xH100"), 8192, 8192, tp=1, pp=1, ep=1, zero=3, micro_batch=1, recompute="full"
    )
    assert not single.fits


def test_serving_plan_request_rate():
    """With a request rate a replica runs at the smallest batch whose Little's-law throughput,
    B / (t(B) x output + B x prefill), covers its share; a rate above what the best layout sustains
    is reported as missed, with the most it can take."""
    from keel.plan.hardware import parse_cluster
    from keel.plan.serve import plan_serving

    config, cluster = _fixture("llama-3.1-405b"), parse_cluster("16xH200")
    base = plan_serving(config, cluster, 8192, weights="fp8", request_rate=0.5, output_tokens=512)
    best = base[0]
    assert best.rate_ok and best.fits and best.batch < best.sequences
    most = best.max_request_rate
    fast = plan_serving(config, cluster, 8192, weights="fp8", request_rate=0.9 * most, output_tokens=512)
    same = next(lay for lay in fast if (lay.tp, lay.pp) == (best.tp, best.pp))
    assert same.rate_ok and same.batch > best.batch and same.decode_ms > best.decode_ms
    assert same.tokens_per_s == pytest.approx(0.9 * most * 512)
    over = plan_serving(config, cluster, 8192, weights="fp8", request_rate=10 * most, output_tokens=512)
    assert not any(lay.rate_ok for lay in over if lay.fits)
    with pytest.raises(KeelError, match="output-tokens"):
        plan_serving(config, cluster, 8192, request_rate=1.0, output_tokens=8192)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_every_fixture_plans_training_and_serving(name):
    """Both planners on every published config: layouts that fit on 1,024 H100s for training (4K
    sequences, 16M tokens per step) and on 16 H200s in fp8 for serving at 8K tokens, memory within
    what fits, throughput positive."""
    from keel.plan.hardware import parse_cluster
    from keel.plan.serve import plan_serving
    from keel.plan.train import plan_training

    config = _fixture(name)
    train = plan_training(config, parse_cluster("1024xH100"), 4096, 16 * 2**20, micro_batches=(1,))
    best = train[0]
    assert best.fits and best.total_gb <= 80 * 0.9 and best.tokens_per_s_per_gpu > 0 and 0 < best.mfu < 1
    serve = plan_serving(config, parse_cluster("16xH200"), 8192, weights="fp8")
    assert serve[0].fits and serve[0].sequences > 0 and serve[0].tokens_per_s > 0


def test_decode_roofline_is_the_serving_plans():
    """The roofline benchmarks set beside measurements (bench/decode_batch.py) is the serving plan's:
    the same step time for the same layout, bandwidth-bound at batch 1, compute-bound at a large batch."""
    from keel.plan.hardware import parse_cluster
    from keel.plan.serve import decode_roofline, plan_serving

    config, cluster = _fixture("llama-3.1-405b"), parse_cluster("8xH200")
    layout = plan_serving(config, cluster, context=8192, weights="fp8", mfu=0.6)[0]
    ms, compute_bound = decode_roofline(config, cluster.gpu, 1, 8192, weights="fp8", tp=layout.tp, pp=layout.pp)
    assert ms == pytest.approx(layout.decode_ms_batch1) and not compute_bound
    _, compute_bound = decode_roofline(config, cluster.gpu, 4096, 16, weights="fp8", tp=8)
    assert compute_bound


def test_serving_plan_of_a_hybrid_model_reserves_states_and_one_process(tmp_path):
    """Qwen3.5's Gated DeltaNet layers: K/V for its attention layers only, each sequence's recurrent state beside its
    blocks, and only one-process layouts fit (keel serves recurrent layers in one process)."""
    from keel.model.recurrent import RecurrentStates
    from keel.plan.hardware import parse_cluster
    from keel.plan.serve import plan_serving
    from tiny_models import save_hf_model

    save_hf_model("qwen3_5", tmp_path)
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    layouts = plan_serving(config, parse_cluster("2xH100"), context=4096)
    one = next(layout for layout in layouts if layout.tp * layout.pp == 1)
    attention = config.layer_types.count("full_attention")
    assert one.kv_bytes_per_token == attention * 2 * config.num_kv_heads * config.head_dim * 2
    state = RecurrentStates.bytes_per_slot(config, torch.bfloat16)
    assert one.sequences == int(one.kv_gb * 1e9 // (one.kv_bytes_per_token * 4096 + state))
    assert one.fits and not any(layout.fits for layout in layouts if layout.tp * layout.pp > 1)


def test_a_model_without_attention_layers_plans_states_only(tmp_path):
    """Mamba 2: no KV bytes per token; as many sequences as their states fit, in the planner's layouts (every token
    of theirs held, one-process layouts only) and in the engine's capacity (kv_capacity: the engine's slots for the
    same budget), and each decode step reads and writes the batch's states."""
    from keel.model.recurrent import RecurrentStates
    from keel.plan.hardware import parse_cluster
    from keel.plan.kv import kv_capacity
    from keel.plan.serve import decode_roofline, plan_serving
    from keel.quant.loading import load_model
    from keel.serve import EngineConfig, LLMEngine
    from tiny_models import save_hf_model

    save_hf_model("mamba2", tmp_path)
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    state = RecurrentStates.bytes_per_slot(config, torch.bfloat16)
    layouts = plan_serving(config, parse_cluster("2xH100"), context=4096)
    one = next(layout for layout in layouts if layout.tp * layout.pp == 1)
    assert one.kv_bytes_per_token == 0 and one.sequences == int(one.kv_gb * 1e9 // state)
    assert one.tokens == one.sequences * 4096
    assert one.fits and not any(layout.fits for layout in layouts if layout.tp * layout.pp > 1)
    gpu = parse_cluster("1xH100").gpu
    assert decode_roofline(config, gpu, 64, 4096)[0] > decode_roofline(config, gpu, 1, 4096)[0]
    loaded = load_model(tmp_path, "float32")
    budget = 5 * RecurrentStates.bytes_per_slot(config, torch.float32) + 7
    engine = LLMEngine(loaded, EngineConfig.of(kv_cache_memory=budget, max_model_len=256, compile=False))
    plan = kv_capacity(loaded.config, budget, torch.float32, context=256)
    assert plan["blocks"] == plan["sequences"] == engine.kv.num_blocks == 5
    assert plan["bytes_per_token"] == 0 and plan["tokens"] == 5 * 256
