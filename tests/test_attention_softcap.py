"""Attention-score soft-capping (Gemma 2's `attn_logit_softcapping`: each scaled score -> cap * tanh(score / cap)
before the mask) on every attention path of the paged KV cache: the `torch` backend's decode groups and prefill
chunks, keel's C++ kernel, each over float and int8 caches, the Triton backend (its kernel interpreted on CPU),
the compiled decode step's op, and a served Llama-shaped model with a cap (where keel's fused CPU layer would
otherwise run) against the reference generator. The model's own attention and Gemma 2 against transformers:
tests/test_families.py and tests/test_architectures.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from keel import kernels
from keel.config import ModelConfig
from keel.model import transformer
from keel.model.transformer import build_model
from keel.quant.loading import load_model
from keel.serve import LLM, SamplingParams
from keel.serve.attention_backends import ENV
from keel.serve.kv_cache import DecodeGroup, PagedKVCache, StepPlan, decode_mask
from keel.weights.names import keel_to_hf
from reference_generate import stream_tokens
from test_kv_int8 import STEP1, STEP2, both_steps_on_backend

pytestmark = pytest.mark.isa  # the kernels' choice differs by ISA

CAP = 2.0
CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    attn_logit_softcapping=CAP,
)


def reference(inputs, cap, window):
    """Step 2's output [1, H, T, D] in float64: each token over its sequence's keys so far (both steps')."""
    keys, values = {}, {}
    for steps, (_, k, v) in zip((STEP1, STEP2), inputs, strict=True):
        offset = 0
        for table, start, n in steps:
            for i in range(n):
                keys[tuple(table), start + i] = k[0, offset + i].double()
                values[tuple(table), start + i] = v[0, offset + i].double()
            offset += n
    q = inputs[1][0]
    group, out, offset = q.shape[1] // CONFIG.num_kv_heads, torch.empty(q.shape, dtype=torch.float64), 0
    for table, start, n in STEP2:
        for i in range(n):
            p = start + i
            seen = [j for j in range(p + 1) if window is None or p - j < window]
            k = torch.stack([keys[tuple(table), j] for j in seen], dim=1)  # [H_kv, L, D]
            v = torch.stack([values[tuple(table), j] for j in seen], dim=1)
            for h in range(q.shape[1]):
                scores = k[h // group] @ q[0, h, offset + i].double() * CONFIG.head_dim**-0.5
                if cap:
                    scores = cap * torch.tanh(scores / cap)
                out[0, h, offset + i] = scores.softmax(0) @ v[h // group]
        offset += n
    return out


def random_inputs(device: str = "cpu") -> list[tuple]:
    """(q, k, v) of both steps; queries three times larger than unit, so that the cap bends many scores."""
    gen = torch.Generator().manual_seed(0)
    inputs = []
    for steps in (STEP1, STEP2):
        t = sum(n for _, _, n in steps)
        q = torch.randn(1, CONFIG.num_heads, t, CONFIG.head_dim, generator=gen) * 3
        k, v = (torch.randn(1, t, CONFIG.num_kv_heads, CONFIG.head_dim, generator=gen) for _ in range(2))
        inputs.append((q.to(device), k.to(device), v.to(device)))
    return inputs


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(
    ("backend", "int8"), [("torch", False), ("torch", True), ("kernels", False), ("kernels", True), ("triton", False)]
)
def test_every_paged_backend_caps_the_scores(backend, int8, window, monkeypatch):
    """A decode group of two lengths and a prefill chunk over a cached prefix (tests/test_kv_int8.py's steps),
    against a float64 reference with the cap, on every backend (float and int8 caches); the cap changes the
    output (the reference without it is far)."""
    out, inputs = both_steps_on_backend(CONFIG, random_inputs, backend, int8, window, monkeypatch)
    want = reference(inputs, CAP, window)
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)
    assert (want - reference(inputs, None, window)).abs().max() > 0.1


def test_the_c_kernel_is_chosen_for_capped_scores(monkeypatch):
    """keel's C++ paged-attention kernel caps scores itself: a capped model's cache takes it as others do."""
    monkeypatch.delenv(ENV, raising=False)
    expected = "kernels" if kernels.active() else "torch"
    for cap in (CAP, None):
        config = dataclasses.replace(CONFIG, attn_logit_softcapping=cap)
        assert PagedKVCache(config, 8, 16, torch.float32).attention_backend() == expected


@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_the_compiled_decode_op_caps_the_scores_as_the_eager_cache(backend, monkeypatch):
    """keel::paged_decode_attention (the compiled decode graph's op) with the cap, rows of three widths (in
    length groups under `torch`, each walking its own table under `kernels`): the eager cache's rows on the
    torch path; without the cap, other rows."""
    from keel.serve.compiled_decode import paged_decode_attention

    if backend == "kernels" and not kernels.active():
        pytest.skip("keel's kernels are not active here")
    monkeypatch.setenv(ENV, "torch")
    gen = torch.Generator().manual_seed(0)
    caches = [PagedKVCache(CONFIG, 8, 4, torch.float32) for _ in range(2)]
    for a, b in zip(caches[1].keys + caches[1].values, caches[0].keys + caches[0].values, strict=True):
        a.copy_(b.copy_(torch.randn(b.shape, generator=gen)))
    h, hkv, d = CONFIG.num_heads, CONFIG.num_kv_heads, CONFIG.head_dim
    q = torch.randn(1, h, 3, d, generator=gen) * 3
    k, v = (torch.randn(1, 3, hkv, d, generator=gen) for _ in range(2))
    tables = torch.tensor([[1, 2, 0, 0, 0], [3, 4, 5, 6, 7], [6, 0, 0, 0, 0]])
    positions, widths = torch.tensor([6, 19, 2]), torch.tensor([2, 5, 1])
    slots = torch.tensor([2 * 4 + 2, 7 * 4 + 3, 6 * 4 + 2])
    caches[0].plan = StepPlan(slots, [DecodeGroup(torch.arange(3), tables, positions, True)], [])
    eager = caches[0].attend(0, q, k, v, None, window=None)
    mask = decode_mask(positions, 20, None)
    args = (q, k, v, caches[1].keys[0], caches[1].values[0], slots, tables, widths, mask, positions, 0, 4, d**-0.5)
    monkeypatch.setenv(ENV, backend)
    torch.testing.assert_close(paged_decode_attention(*args, CAP), eager, atol=1e-5, rtol=1e-5)
    assert (paged_decode_attention(*args) - eager).abs().max() > 0.1


def test_a_capped_model_trains():
    """The model's own attention computes capped scores explicitly (SDPA has no cap): gradients flow."""
    torch.manual_seed(0)
    model = build_model(CONFIG)
    tokens = torch.randint(0, 256, (2, 12))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    grad = model.layers["0"].self_attn.q_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_a_served_capped_model_gives_the_reference_tokens(tmp_path, monkeypatch):
    """A Llama-shaped model given a cap, served (paged cache, prefill chunks, batched decodes, keel's kernels
    where they run): the reference generator's greedy tokens, not the uncapped model's; keel's fused CPU layer,
    which runs the uncapped model's steps, steps aside for it."""
    monkeypatch.delenv(ENV, raising=False)
    torch.manual_seed(0)
    config = dataclasses.replace(CONFIG, num_layers=2, layer_types=[], attn_logit_softcapping=None)
    model = build_model(config)
    with torch.no_grad():  # weights of std 0.1, not 0.02: varied greedy tokens, scores the cap bends
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    save_file(keel_to_hf(config, model.state_dict().items()), tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf()))
    fused = []  # whether each call of the fused stack / layer ran (keel.model.fused_layer)
    for name in ("fused_layers", "fused_forward"):
        real = getattr(transformer, name)
        monkeypatch.setattr(transformer, name, lambda *a, real=real: fused.append(real(*a)) or fused[-1])
    prompts = [list(range(5, 25)), [7, 8, 9]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for cap in (None, 1.0):
        loaded = load_model(tmp_path, "float32")
        loaded.model.config.attn_logit_softcapping = cap  # the modules' and the cache's reading of it
        for layer in loaded.model.layers.values():
            layer.self_attn.softcap = cap
        with torch.no_grad():
            want = [list(stream_tokens(loaded.model, p, params)) for p in prompts]
        llm = LLM(
            loaded, adapt=True, num_blocks=16, block_size=8, max_model_len=64, max_num_batched_tokens=16, device="cpu"
        )
        fused.clear()
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want, cap
        tokens[cap] = got
        ran = any(out is not None for out in fused)
        if cap is None:
            assert ran == kernels.active()  # where the kernels run, the uncapped model's layers run fused
        else:
            # the C++ kernel caps the scores where it runs; keel::decoder_layers, which does not, steps aside
            assert not ran and llm.engine.cache.attention_backend() == ("kernels" if kernels.active() else "torch")
    assert tokens[1.0] != tokens[None]
