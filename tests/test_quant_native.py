"""Quantized weights without a float detour: GGUF blocks on the integer kernels (--quantize gguf),
quantized MoE experts, quantizing while loading, and quantized checkpoints saved to disk.

References: gguf.quants.dequantize (what the float load computes) for the GGUF blocks; the float
model for whole-model bounds; quantize-at-load for the saved checkpoints (bit-identical logits).
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file
from torch import nn

from keel import kernels
from keel.errors import KeelError, WeightsError
from keel.model.moe import GroupedExperts
from keel.quant import QuantizedGroupedExperts, QuantizedLinear, quantize_model
from keel.quant.linear import (
    _pack_int4,
    _unpack_int4,
    dequantize_int4,
    int8_from_blocks,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
    unpack_nibbles,
)
from keel.quant.loading import load_model
from keel.weights.gguf import open_gguf
from test_gguf import TOKENS, build_hf, random_blocks, write_block_gguf, write_gguf
from tiny_models import save_byte_tokenizer, save_hf_model

pytestmark = pytest.mark.isa  # run again under KEEL_CPU_ISA=avx2 by `make test`


@pytest.fixture(autouse=True)
def torch_kernels(monkeypatch):
    """These tests pin torch's integer kernels and their layouts (float activations, exact products);
    keel's own block kernels (int8 activations) are tested in tests/test_kernels.py."""
    monkeypatch.setenv("KEEL_KERNELS", "0")
    monkeypatch.setattr(kernels, "_ACTIVE", None)  # read again here, and as before after the test


GREEDY_TOKENS = 8


@pytest.fixture(autouse=True)
def one_thread():
    # torch's int4/int8 CPU kernels run an OpenMP region per call; with 2 threads on a shared 2-core
    # machine a call can wait on a descheduled thread (measured 8 ms instead of 60 us). One thread
    # keeps these tests fast and changes no result.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rel(reference: torch.Tensor, ours: torch.Tensor) -> float:
    return ((ours.float() - reference.float()).norm() / reference.float().norm()).item()


def quantized_layers(model: nn.Module) -> list[QuantizedLinear]:
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


# --------------------------------------------------------------------------------- building blocks
def test_direct_construction_equals_quantizing_a_float_weight():
    torch.manual_seed(0)
    w, bias, x = torch.randn(48, 128), torch.randn(48), torch.randn(3, 128)
    q8, s8 = quantize_int8(w)
    a, b = QuantizedLinear.from_int8(q8, s8, bias, torch.float32), QuantizedLinear.from_float(w, "int8", bias=bias)
    assert torch.equal(a(x), b(x))
    q4, s4, m4 = quantize_int4(w, 32)
    a = QuantizedLinear.from_int4(q4.to(torch.uint8), s4, m4, 32, bias, torch.float32)
    b = QuantizedLinear.from_float(w, "int4", 32, bias)
    assert torch.equal(a(x), b(x))
    assert rel(x @ dequantize_int4(q4, s4, m4).T + bias, a(x)) < 1e-6
    assert not any(isinstance(t, nn.Parameter) for t in a.parameters())  # integer buffers only
    # The portable nibble form and the kernels' own layouts are exact inverses.
    assert torch.equal(unpack_nibbles(pack_nibbles(q4)), q4.to(torch.uint8))
    for n in (16, 48, 80, 112, 256):  # every CPU row-blocking (64/32/16-row blocks)
        q = torch.randint(0, 16, (n, 96), dtype=torch.int32)
        assert torch.equal(_unpack_int4(_pack_int4(q, "cpu"), n, 96), q), n
    with pytest.raises(ValueError, match="multiples of 16"):
        QuantizedLinear.from_int8(torch.zeros(4, 40, dtype=torch.int8), torch.ones(4))


def test_kernel_shape_limits_keep_layers_float():
    """The bfloat16 int8 CPU kernel crashes on widths that are not multiples of 16 and the CPU int4
    packing needs 16-row multiples: such layers stay float instead."""
    model = nn.ModuleDict({"odd": nn.Linear(40, 16), "one": nn.Linear(64, 1), "ok": nn.Linear(64, 32)})
    assert quantize_model(model, "int8")["kept"] == 1 and isinstance(model["odd"], nn.Linear)
    model = nn.ModuleDict({"one": nn.Linear(64, 1), "ok": nn.Linear(64, 32)})
    assert quantize_model(model, "int4", 32)["kept"] == 1 and isinstance(model["one"], nn.Linear)


def test_dtype_moves_follow_the_scales():
    layer = QuantizedLinear.from_float(torch.randn(32, 64), "int4", 32)
    layer.to(torch.bfloat16)
    assert layer.compute_dtype == torch.bfloat16 and layer(torch.randn(2, 64)).dtype == torch.bfloat16


# ------------------------------------------------------------------------------------- GGUF blocks
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_gguf_blocks_decode_to_gguf_dequantize(tmp_path, qtype):
    """Codes and scales straight from the raw bytes reproduce gguf.quants.dequantize exactly (nibble
    order, fp16 scales, Q4_1 mins, the K-quants' packed 6-bit scales and mins, fifth bits and bit
    pairs, Q6_K's half-block scales), with llama's q/k un-permute applied to codes and scales alike.
    The K-quant blocks are random bytes (gguf cannot produce them): every bit of the layout counts."""
    rng = np.random.default_rng(int(qtype))
    raw = {"blk.0.attn_v.weight": random_blocks(qtype, 128, 256, rng)}
    raw["blk.0.attn_q.weight"] = random_blocks(qtype, 256, 256, rng)
    write_block_gguf(tmp_path / "b.gguf", qtype, raw)
    reader = open_gguf(tmp_path / "b.gguf").reader
    for name in ("model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.q_proj.weight"):
        blocks = reader.get_blocks(name)
        n, k = blocks.codes.shape
        assert blocks.kind == ("int4" if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K) else "int8")
        assert blocks.types == (qtype.name,) and blocks.group == (16 if qtype == Q.Q6_K else 32)
        assert blocks.codes.dtype == (torch.uint8 if blocks.kind == "int4" else torch.int8)
        g = blocks.group
        grouped = blocks.codes.float().reshape(n, k // g, g) * blocks.scales[..., None]
        if blocks.mins is not None:
            grouped = grouped + blocks.mins[..., None]
        assert torch.equal(grouped.reshape(n, k), reader.get(name)), name


def quantized_blocks(qtype: Q, rows: int, cols: int, seed: int = 0):
    """Realistic blocks: gguf's own quantizer on Gaussian weights with per-row scale spread."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.2, 2, (rows, 1)) * 0.02).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(rows, cols)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q4_blocks_repack_exactly(tmp_path, qtype, dtype):
    raw, deq = quantized_blocks(qtype, 96, 256)
    write_block_gguf(tmp_path / "b.gguf", qtype, {"blk.0.attn_v.weight": raw})
    blocks = open_gguf(tmp_path / "b.gguf").reader.get_blocks("model.layers.0.self_attn.v_proj.weight")
    layer = QuantizedLinear.from_int4(blocks.codes, blocks.scales, blocks.mins, 32, dtype=dtype)
    x = torch.randn(7, 256)
    want = x @ torch.from_numpy(deq).T
    got = layer(x.to(dtype))
    # float32: the same weights, only the summation order differs. bfloat16: the kernels take
    # bfloat16 scales and zeros (torch requires the activations' dtype), a relative rounding of 2^-9,
    # on top of bfloat16 activations and outputs.
    assert rel(want, got) < (1e-5 if dtype == torch.float32 else 1e-2), rel(want, got)


def test_q8_0_converts_to_per_channel_int8_within_its_bound(tmp_path):
    raw, deq = quantized_blocks(Q.Q8_0, 96, 512)
    write_block_gguf(tmp_path / "b.gguf", Q.Q8_0, {"blk.0.attn_v.weight": raw})
    blocks = open_gguf(tmp_path / "b.gguf").reader.get_blocks("model.layers.0.self_attn.v_proj.weight")
    q, scales = int8_from_blocks(blocks.codes, blocks.scales)
    w = torch.from_numpy(deq)
    # Bit for bit what per-channel int8 makes of the dequantized weights ...
    ref_q, ref_scales = quantize_int8(w)
    assert torch.equal(q, ref_q) and torch.equal(scales, ref_scales)
    # ... so the stated bound: |w' - w| <= scale_n / 2 = max_k |w_nk| / 254 per element, and
    # |y'_n - y_n| <= scale_n / 2 * sum_k |x_k| per output.
    err = (q.float() * scales[:, None] - w).abs()
    assert (err <= scales[:, None] / 2 * (1 + 1e-6)).all()
    layer = QuantizedLinear.from_int8(q, scales, dtype=torch.float32)
    x = torch.randn(5, 512)
    want = x @ w.T
    bound = scales[None, :] / 2 * x.abs().sum(dim=1, keepdim=True)
    assert ((layer(x) - want).abs() <= bound + 1e-5).all()
    assert rel(want, layer(x)) < 0.01  # measured 0.8% on these rows (Q8_0's own error vs the original: 0.5%)


# ------------------------------------------------------------------------------- --quantize gguf
@pytest.mark.parametrize(("qtype", "bound"), [(Q.Q4_0, 1e-5), (Q.Q4_1, 1e-5), (Q.Q8_0, 0.02)])
def test_tiny_gguf_with_the_gguf_scheme_matches_the_float_load(tmp_path, qtype, bound):
    """float32 compute: Q4_0/Q4_1 give the float-expanded model's logits to float tolerance; Q8_0,
    per-channel int8 from the blocks, within 2% (random tiny model; measured 0.9%)."""
    path = write_gguf(build_hf("llama"), tmp_path / "m.gguf", qtype=qtype)
    reference = load_model(path, "float32")
    loaded = load_model(path, "float32", quantize="gguf", quant_keep=())
    layers = quantized_layers(loaded.model)
    assert len(layers) == 2 * 7 and {m.scheme for m in layers} == {"int8" if qtype == Q.Q8_0 else "int4"}
    assert type(loaded.model.lm_head) is nn.Linear  # tied: the head is the float embedding matrix
    stats = loaded.model.quantization["stats"]
    assert stats["quantized"] == 14 and stats["bytes_after"] < stats["bytes_before"] / 2
    with torch.no_grad():
        assert rel(reference.model(TOKENS), loaded.model(TOKENS)) < bound


def test_k_quants_on_torch_kernels(tmp_path):
    """Without keel's kernels: Q4_K runs on torch's int4 kernel as groups of 32 exactly (its float32
    sub-block scales and mins); Q5_K (8-bit codes with mins) and Q6_K (a scale per 16) have no torch
    kernel and load as float."""
    from tiny_models import build_hf_model

    model = build_hf_model("llama", 0, num_hidden_layers=1, hidden_size=256, intermediate_size=512)
    path = write_gguf(model, tmp_path / "m.gguf", qtype=Q.Q4_K, mixed={"attn_v": Q.Q6_K, "ffn_down": Q.Q5_K})
    reference = load_model(path, "float32")
    loaded = load_model(path, "float32", quantize="gguf", quant_keep=())
    attn, mlp = loaded.model.layers["0"].self_attn, loaded.model.layers["0"].mlp
    assert type(attn.v_proj) is nn.Linear and type(mlp.down_proj) is nn.Linear
    assert isinstance(attn.q_proj, QuantizedLinear) and attn.q_proj.layout == "aten" and attn.q_proj.group_size == 32
    with torch.no_grad():
        assert rel(reference.model(TOKENS), loaded.model(TOKENS)) < 1e-5


def test_gguf_scheme_reads_no_quantized_weight_as_float(tmp_path, monkeypatch):
    """Memory at load: a Q4 linear weight is never dequantized (the float reader is not asked for it)."""
    from keel.weights.gguf import GGUFTensorReader

    path = write_gguf(build_hf("llama-bias"), tmp_path / "m.gguf", qtype=Q.Q4_1)  # untied: own output tensor
    asked: list[str] = []
    real = GGUFTensorReader.get
    monkeypatch.setattr(GGUFTensorReader, "get", lambda self, name: asked.append(name) or real(self, name))
    loaded = load_model(path, "float32", quantize="gguf", quant_keep=())
    assert isinstance(loaded.model.lm_head, QuantizedLinear)  # its own quantized output tensor
    assert not [n for n in asked if n.endswith("_proj.weight") or n == "lm_head.weight"], asked
    assert any(n.endswith("q_proj.bias") for n in asked)  # biases load as float
    monkeypatch.undo()
    reference = load_model(path, "float32")
    with torch.no_grad():
        assert rel(reference.model(TOKENS), loaded.model(TOKENS)) < 1e-5
    # The default under gguf keeps nothing (the file chose its head's type); a kept head loads as float.
    assert isinstance(load_model(path, "float32", quantize="gguf").model.lm_head, QuantizedLinear)
    kept = load_model(path, "float32", quantize="gguf", quant_keep=("lm_head",))
    assert type(kept.model.lm_head) is nn.Linear


def test_gguf_scheme_quantizes_moe_experts(tmp_path):
    hf = build_hf("mixtral")
    for per_expert in (False, True):
        path = write_gguf(hf, tmp_path / f"moe{per_expert}.gguf", qtype=Q.Q4_0, per_expert=per_expert)
        loaded = load_model(path, "float32", quantize="gguf")
        experts = loaded.model.layers["0"].mlp.experts
        assert isinstance(experts, QuantizedGroupedExperts) and experts.scheme == "int4"
        with torch.no_grad():
            assert rel(load_model(path, "float32").model(TOKENS), loaded.model(TOKENS)) < 1e-5


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_int_schemes_on_a_gguf_file_equal_quantizing_after_the_float_load(tmp_path, scheme):
    """int8/int4 while loading read each float weight once (here dequantized GGUF blocks) and give
    quantize_model's result bit for bit."""
    path = write_gguf(build_hf("qwen2"), tmp_path / "m.gguf", qtype=Q.Q8_0)  # q/k/v biases
    at_load = load_model(path, "float32", quantize=scheme, quant_group_size=32)
    after = load_model(path, "float32").model
    assert quantize_model(after, scheme, 32, {"lm_head"}) == at_load.model.quantization["stats"]
    with torch.no_grad():
        assert torch.equal(at_load.model(TOKENS), after(TOKENS))


def test_gguf_scheme_errors(tmp_path):
    save_hf_model("llama", tmp_path / "hf")
    with pytest.raises(KeelError, match=r"hf: --quantize gguf .* integer blocks .* has none") as e:
        load_model(tmp_path / "hf", quantize="gguf")
    assert "\n" not in str(e.value)
    with pytest.raises(KeelError, match="while loading"):
        quantize_model(load_model(tmp_path / "hf").model, "gguf")


# ------------------------------------------------------------------------------- --quantize auto
def test_auto_runs_a_gguf_files_blocks_on_cpu_and_loads_everything_else_in_float(tmp_path):
    """The engine's default (vLLM runs a GGUF file quantized): a GGUF file with integer blocks gets the gguf scheme,
    a float GGUF file, an HF directory, "none" and a CUDA device get float."""
    from keel.quant.loading import resolve_scheme
    from keel.weights.loader import open_checkpoint

    hf = build_hf("llama")
    blocks = write_gguf(hf, tmp_path / "q.gguf", qtype=Q.Q4_1)
    auto = load_model(blocks, "float32", quantize="auto")
    assert auto.model.quantization["scheme"] == "gguf" and len(quantized_layers(auto.model)) == 2 * 7
    explicit = load_model(blocks, "float32", quantize="gguf")
    expanded = load_model(blocks, "float32", quantize="none")
    assert not quantized_layers(expanded.model) and not hasattr(expanded.model, "quantization")
    with torch.no_grad():
        assert torch.equal(auto.model(TOKENS), explicit.model(TOKENS))
        assert torch.equal(expanded.model(TOKENS), load_model(blocks, "float32").model(TOKENS))  # the library's default
    save_hf_model("llama", tmp_path / "hf")
    for float_source in (write_gguf(hf, tmp_path / "f.gguf"), tmp_path / "hf"):
        assert not quantized_layers(load_model(float_source, "float32", quantize="auto").model)
    checkpoint = open_checkpoint(blocks)
    assert resolve_scheme(checkpoint, "auto", "cpu") == "gguf"
    assert resolve_scheme(checkpoint, "auto", "cuda:0") is None  # CUDA runs the blocks only when asked by name
    assert resolve_scheme(checkpoint, "int8", "cpu") == "int8" and resolve_scheme(checkpoint, "none") is None


def test_auto_is_the_engine_default_and_keep_as_needs_a_quantized_model(tmp_path):
    from keel.serve import EngineConfig, LLMEngine
    from keel.serve.openai.options import ModelSource, ServeOptions
    from keel.serve.openai.server import _load_engine_only

    path = write_gguf(build_hf("llama"), tmp_path / "q.gguf", qtype=Q.Q4_0)
    config = EngineConfig.of(num_blocks=16, max_model_len=64, compile=False)
    assert config.quant.quantize == "auto" and config.quant.scheme is None
    engine = LLMEngine(str(path), config)
    assert engine.model.quantization["scheme"] == "gguf"
    # The naive baseline puts the weights into transformers' model: it takes the blocks expanded to float.
    naive = _load_engine_only(ModelSource(str(path)), ServeOptions(engine="naive"), config)
    assert not quantized_layers(naive.loaded.model)
    # --quant-keep-as: a second tier of a quantized model; refused by name where the model loads in float.
    assert EngineConfig.of(quant_keep_as="int8").quant.quantize == "auto"
    with pytest.raises(KeelError, match="--quant-keep-as needs a quantized model"):
        EngineConfig.of(quantize="none", quant_keep_as="int8")
    save_hf_model("llama", tmp_path / "hf")
    with pytest.raises(KeelError, match=r"hf: --quant-keep-as int8 needs a quantized model") as e:
        load_model(tmp_path / "hf", quantize="auto", quant_keep_as="int8")
    assert "\n" not in str(e.value)
    kept = load_model(path, "float32", quantize="auto", quant_keep_as="int8")  # the head as int8, the rest as stored
    assert isinstance(kept.model.lm_head, QuantizedLinear) and kept.model.lm_head.scheme == "int8"


def test_auto_keeps_the_experts_in_float_for_expert_offloading(tmp_path):
    """--expert-cache moves float experts between host and slots: under auto a GGUF MoE file's experts load in float
    and the rest runs its blocks; the tokens are those of the same split without offloading."""
    from keel.serve import EngineConfig, LLMEngine, SamplingParams

    path = str(write_gguf(build_hf("mixtral"), tmp_path / "moe.gguf", qtype=Q.Q4_0))
    base = dict(num_blocks=32, max_model_len=64, compile=False)
    offloaded = LLMEngine(path, EngineConfig.of(**base, expert_cache=2))
    layer = offloaded.model.layers["0"]
    assert type(layer.mlp.experts) is GroupedExperts and quantized_layers(layer.self_attn)
    resident = LLMEngine(path, EngineConfig.of(**base, quant_keep=("lm_head", "*.experts")))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = []
    for engine in (offloaded, resident):
        engine.add_request([5, 6, 7, 8], params)
        while engine.has_unfinished_requests():
            outputs = engine.step()
        tokens.append(outputs[0].outputs[0].token_ids)
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6


# The real SmolLM2 GGUF, in `make test-slow` (the default suite's budget); the synthetic GGUFs' scheme tests stay.
@pytest.mark.slow
def test_smollm2_gguf_scheme_greedy_matches_the_float_load():
    """The packaged Q4_1 file on the int4 kernels (bfloat16, the fast CPU path) generates what the
    float32 expansion generates."""
    from keel.serve.sampling import SamplingParams
    from reference_generate import stream_tokens

    try:
        reference = load_model("smollm2-135m-instruct", "float32")
    except KeelError as e:
        pytest.skip(str(e))
    loaded = load_model("smollm2-135m-instruct", "auto", quantize="gguf")  # auto: bfloat16 when quantizing
    assert loaded.model.dtype == torch.bfloat16
    layers = quantized_layers(loaded.model)
    assert len(layers) == 30 * 7 and all(m.scheme == "int4" and m.group_size == 32 for m in layers)
    ids = reference.tokenizer.encode("The capital of France is")
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    want = list(stream_tokens(reference.model, ids, params))
    assert list(stream_tokens(loaded.model, ids, params)) == want


# ----------------------------------------------------------------------------------------- experts
def grouped_reference(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    out, start = torch.zeros(x.shape[0], down.shape[1]), 0
    for e, end in enumerate(offsets):
        gate, up = (x[start:end] @ gate_up[e].T).chunk(2, dim=-1)
        out[start:end] = (torch.nn.functional.silu(gate) * up) @ down[e].T
        start = end
    return out


@pytest.mark.parametrize(("scheme", "group"), [("int8", 0), ("int4", 32)])
def test_quantized_experts_match_their_dequantized_weights(scheme, group):
    torch.manual_seed(0)
    experts = GroupedExperts(4, 64, 96)
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=0.05)
        experts.down_proj.normal_(std=0.05)
    holder = nn.ModuleDict({"experts": experts})
    stats = quantize_model(holder, scheme, group or 128)
    quantized = holder["experts"]
    assert isinstance(quantized, QuantizedGroupedExperts) and stats["experts"] == 1
    deq = []
    for w in (experts.gate_up_proj.detach(), experts.down_proj.detach()):
        if scheme == "int8":
            deq.append(torch.stack([dequantize_int8_(e) for e in w]))
        else:
            deq.append(torch.stack([dequantize_int4(*quantize_int4(e, group)) for e in w]))
    x = torch.randn(11, 64)
    offsets = [3, 3, 11, 11]  # experts 1 and 3 get no rows (skipped)
    want = grouped_reference(*deq, x, offsets)
    got = quantized(x, torch.tensor(offsets, dtype=torch.int32))
    assert rel(want, got) < 1e-5
    assert rel(grouped_reference(experts.gate_up_proj.detach(), experts.down_proj.detach(), x, offsets), got) < (
        0.02 if scheme == "int8" else 0.15
    )


def dequantize_int8_(w: torch.Tensor) -> torch.Tensor:
    q, s = quantize_int8(w)
    return q.float() * s[:, None]


@pytest.mark.parametrize(("name", "scheme"), [("qwen3_moe", "int8"), ("qwen3_moe", "int4"), ("qwen2_moe", "int4")])
def test_tiny_moe_quantized_stays_close(tmp_path, name, scheme):
    """Every linear layer and the experts; quantizing while loading equals quantize_model after a
    float load bit for bit. Bounds for these random tiny models: 3% at int8, 30% at int4 g32."""
    save_hf_model(name, tmp_path, moe_intermediate_size=64)
    reference = load_model(tmp_path, "float32")
    after = load_model(tmp_path, "float32").model
    stats = quantize_model(after, scheme, 32, keep=set())
    moe_layers = [i for i in range(reference.config.num_layers) if reference.config.is_moe_layer(i)]
    assert stats["experts"] == len(moe_layers) > 0
    at_load = load_model(tmp_path, "float32", quantize=scheme, quant_group_size=32, quant_keep=())
    assert at_load.model.quantization["stats"] == stats
    with torch.no_grad():
        want, got = reference.model(TOKENS), at_load.model(TOKENS)
        assert torch.equal(got, after(TOKENS))
    assert rel(want, got) < (0.03 if scheme == "int8" else 0.3), rel(want, got)
    if name == "qwen2_moe":  # the shared expert's Linear(H, 1) gate has too few rows for int4
        assert isinstance(at_load.model.layers["0"].mlp.shared_expert_gate, nn.Linear)


def test_experts_and_offloading(tmp_path):
    from keel.serve.offload import enable_expert_offload

    save_hf_model("qwen3_moe", tmp_path, moe_intermediate_size=64)
    loaded = load_model(tmp_path, "float32")
    offload = enable_expert_offload(loaded, 2, prefetch=False)
    with pytest.raises(KeelError, match=r"--expert-cache.*\*\.experts"):
        quantize_model(loaded.model, "int8", keep={"lm_head"})
    stats = quantize_model(loaded.model, "int8", keep={"lm_head", "*.experts"})  # offloaded experts stay float
    assert stats["experts"] == 0 and stats["quantized"] > 0
    with torch.no_grad():
        loaded.model(TOKENS)
    offload.close()
    quantized = load_model(tmp_path, "float32", quantize="int8")
    with pytest.raises(KeelError, match="quantized MoE experts"):
        enable_expert_offload(quantized, 2, prefetch=False)


def test_experts_under_expert_parallelism(tmp_path):
    """Quantized after sharding: the all-to-all dispatcher calls the local quantized experts."""
    import torch.distributed as dist

    from keel.model.expert_parallel import AllToAllDispatcher, shard_experts

    save_hf_model("qwen3_moe", tmp_path / "m", moe_intermediate_size=64)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        single = load_model(tmp_path / "m", "float32")
        quantize_model(single.model, "int4", 32)
        sharded = load_model(tmp_path / "m", "float32")
        shard_experts(sharded.model, dist.group.WORLD)
        quantize_model(sharded.model, "int4", 32)
        assert isinstance(sharded.model.layers["0"].mlp.dispatcher, AllToAllDispatcher)
        with torch.no_grad():
            assert torch.equal(single.model(TOKENS), sharded.model(TOKENS))
        with pytest.raises(KeelError, match="quantized MoE experts"):  # sharding needs float experts
            shard_experts(load_model(tmp_path / "m", "float32", quantize="int8").model, dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def test_mla_kv_b_proj_stays_float(tmp_path):
    """Multi-head latent attention reads kv_b_proj.weight as a matrix when attending over the cache."""
    from keel.serve.sampling import SamplingParams
    from reference_generate import stream_tokens

    save_hf_model("deepseek_v3", tmp_path)
    loaded = load_model(tmp_path, "float32", quantize="int8")
    attn = loaded.model.layers["1"].self_attn
    assert type(attn.kv_b_proj) is nn.Linear and isinstance(attn.q_b_proj, QuantizedLinear)
    assert isinstance(loaded.model.layers["1"].mlp.experts, QuantizedGroupedExperts)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert len(list(stream_tokens(loaded.model, [5, 6, 7], params))) == 3  # the cached (absorbed) path


# ------------------------------------------------------------------------------------------ saving
@pytest.mark.parametrize(("name", "scheme"), [("llama", "int4"), ("llama-bias", "int8"), ("mixtral", "int4")])
def test_saved_quantized_model_loads_to_identical_logits(tmp_path, name, scheme):
    from keel.quant.save import save_quantized

    save_hf_model(name, tmp_path / "hf")
    save_byte_tokenizer(tmp_path / "hf")
    keep = ("layers.1.self_attn.o_proj",)  # a plan: the head (tied for llama) quantized too
    quant = save_quantized(tmp_path / "hf", tmp_path / "q", scheme, 32, keep)
    out = tmp_path / "q"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "q"]  # no temporary left behind
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= {
        p.name for p in out.iterdir()
    }
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == quant and quant["quant_method"] == "keel"
    assert "layers.1.self_attn.o_proj" in quant["modules_not_converted"]
    tensors = load_file(out / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.weight" not in tensors  # integers only, no float copy
    assert tensors["model.layers.0.self_attn.q_proj.qweight"].dtype == (torch.int8 if scheme == "int8" else torch.uint8)
    at_load = load_model(tmp_path / "hf", "float32", quantize=scheme, quant_group_size=32, quant_keep=keep)
    saved = load_model(out, "float32")
    assert saved.model.quantization["stats"] == at_load.model.quantization["stats"]
    assert isinstance(saved.model.lm_head, QuantizedLinear)
    assert type(saved.model.layers["1"].self_attn.o_proj) is nn.Linear
    if name == "mixtral":
        assert isinstance(saved.model.layers["0"].mlp.experts, QuantizedGroupedExperts)
    with torch.no_grad():
        assert torch.equal(saved.model(TOKENS), at_load.model(TOKENS))
    assert saved.tokenizer is not None and saved.tokenizer.encode("hi") == at_load.tokenizer.encode("hi")
    assert quantize_model(saved.model, scheme)["quantized"] == at_load.model.quantization["stats"]["quantized"]
    with pytest.raises(KeelError, match="already quantized"):
        quantize_model(saved.model, "int8" if scheme == "int4" else "int4")


def test_a_kept_name_that_matches_no_layer_is_refused(tmp_path):
    """A misspelt --quant-keep entry would quantize the layer it meant to keep: refused, naming it, wherever the
    list is read (load, save, a float model quantized by the engine); a speculative draft takes its target's list
    and may lack some of its layers."""
    from keel.quant.save import save_quantized
    from keel.serve import EngineConfig, LLMEngine

    save_hf_model("llama", tmp_path / "hf")
    for keep in (("lm-head",), ("model.layers.1.self_attn.o_proj",), ("lm_head", "layers.9.*")):
        with pytest.raises(KeelError, match=f"--quant-keep {keep[-1]!r}: matches no layer") as info:
            load_model(tmp_path / "hf", "float32", quantize="int8", quant_keep=keep)
        assert "\n" not in str(info.value)
        with pytest.raises(KeelError, match=f"--quant-keep {keep[-1]!r}"):
            save_quantized(tmp_path / "hf", tmp_path / "q", "int8", 128, keep)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing written
    loaded = load_model(tmp_path / "hf", "float32")
    with pytest.raises(KeelError, match="--quant-keep 'lm-head'"):
        LLMEngine(loaded, EngineConfig.of(quantize="int8", quant_keep=("lm-head",), max_model_len=64))
    keep = ("layers.*.mlp.down_proj", "embed_tokens")
    model = load_model(tmp_path / "hf", "float32", quantize="int8", quant_keep=keep).model
    layer = model.layers["1"].mlp
    assert type(layer.down_proj) is nn.Linear and isinstance(layer.up_proj, QuantizedLinear)
    draft = load_model(tmp_path / "hf", "float32", quantize="int8", quant_keep=("layers.9.*",), check_kept=False)
    assert isinstance(draft.model.lm_head, QuantizedLinear)


def test_corrupted_saved_tensors_are_clear_errors(tmp_path):
    from keel.quant.save import save_quantized

    save_hf_model("llama", tmp_path / "hf")
    save_quantized(tmp_path / "hf", tmp_path / "q", "int4", 32)
    file = tmp_path / "q" / "model.safetensors"
    original = load_file(file)
    name = "model.layers.1.mlp.down_proj.scales"
    cases = {
        "missing": ({k: v for k, v in original.items() if k != name}, rf"{name}' is missing .*layers.1.mlp.down_proj"),
        "shape": ({**original, name: original[name][:, :1].contiguous()}, rf"{name}' is float32 \[64, 1\], expected"),
        "dtype": ({**original, name: original[name].half()}, rf"{name}' is float16"),
        "values": ({**original, name: torch.full_like(original[name], float("nan"))}, "non-finite"),
    }
    for case, (tensors, message) in cases.items():
        save_file(tensors, file, metadata={"format": "pt"})
        with pytest.raises(WeightsError, match=message) as e:
            load_model(tmp_path / "q")
        assert "\n" not in str(e.value), case
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    config["quantization_config"]["scheme"] = "int3"
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match="scheme must be one of"):
        load_model(tmp_path / "q")


def test_quantize_save_cli_and_serving_the_directory(tmp_path, capsys):
    save_hf_model("llama", tmp_path / "hf", intermediate_size=128)
    save_byte_tokenizer(tmp_path / "hf")
    # In-process (the CLI's own main; keel's commands as a user runs them: tests/test_cli_errors.py).
    from keel.cli import main

    save = ["quantize", "save", str(tmp_path / "hf"), "--quantize", "int8", "--out", str(tmp_path / "q")]
    assert main(save) == 0
    assert "int8, 1 modules kept in float" in capsys.readouterr().out  # lm_head
    # The saved directory serves; saving into it again is refused (not empty): keel's one line and exit 1.
    assert main(["generate", str(tmp_path / "q"), "--prompt", "hi", "--max-tokens", "3"]) == 0
    capsys.readouterr()
    assert main(save) == 1
    err = capsys.readouterr().err
    assert err.startswith("keel: error:") and "not empty" in err and err.count("\n") == 1, err


def test_kept_layers_as_int8_second_tier():
    """--quant-keep-as int8: an int4 model whose kept layers (the head) run int8 instead of float: its
    error sits between keeping them float and quantizing them to int4 too."""
    import copy

    from keel.config import ModelConfig
    from keel.model.transformer import build_model
    from keel.quant.apply import quantize_kept

    config = ModelConfig(
        architecture="llama",
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
    )
    torch.manual_seed(0)
    ref = build_model(config).eval()
    x = torch.randint(0, 256, (1, 12))
    want = ref(x)
    keep = ("lm_head", "layers.0.mlp.*")
    kept_float, tiered, all_int4 = copy.deepcopy(ref), copy.deepcopy(ref), copy.deepcopy(ref)
    quantize_model(kept_float, "int4", 64, set(keep))
    quantize_model(tiered, "int4", 64, set(keep))
    quantize_model(all_int4, "int4", 64, set())
    assert type(tiered.lm_head) is torch.nn.Linear
    assert quantize_kept(tiered, keep, "int8") == 4
    assert isinstance(tiered.lm_head, QuantizedLinear) and tiered.lm_head.scheme == "int8"
    assert tiered.layers["0"].mlp.down_proj.scheme == "int8" and tiered.layers["1"].mlp.down_proj.scheme == "int4"
    assert quantize_kept(tiered, keep, "int8") == 0  # already quantized: nothing to do

    def err(model):
        return ((model(x) - want).norm() / want.norm()).item()

    assert err(kept_float) < err(tiered) < err(all_int4)
    assert err(tiered) < 1.1 * err(kept_float)
    with pytest.raises(KeelError, match="quant-keep-as"):
        quantize_kept(tiered, ("lm_head",), "fp8")
