"""ALiBi (`position_embedding` "alibi": each head's scaled scores gain slope * (key position - query position)) on
every attention path: the slopes against transformers' Bloom, MPT and Falcon, the paged KV cache's `torch` backend
(decode groups and prefill chunks), keel's C++ kernel, each over float and int8 caches, the Triton backend (its
kernel interpreted on CPU), the compiled decode step's op, and the model's own attention (training). The families
against transformers: tests/test_architectures.py (Bloom, MPT, Falcon-RW)."""

from __future__ import annotations

import math

import pytest
import torch

from keel import kernels
from keel.config import ModelConfig
from keel.model.attention import alibi_slopes
from keel.model.transformer import build_model
from keel.serve.attention_backends import ENV
from keel.serve.kv_cache import DecodeGroup, PagedKVCache, StepPlan, decode_mask
from test_kv_int8 import STEP1, STEP2, both_steps_on_backend

pytestmark = pytest.mark.isa  # the kernels' choice differs by ISA

# six query heads (not a power of two: the interleaved slopes too) over two KV heads
CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=256,
    hidden_size=96,
    intermediate_size=128,
    num_layers=1,
    num_heads=6,
    num_kv_heads=2,
    head_dim=16,
    position_embedding="alibi",
)
SLOPES = alibi_slopes(6) * 4  # steeper than a real model's, so that the bias moves every output


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 6, 8, 12, 16, 20, 32, 40])
def test_the_slopes_are_transformers_bloom_mpt_and_falcon_ones(heads):
    """Bloom's `_get_alibi_slopes`, Falcon's `build_alibi_tensor` (its float32 slopes, read back from the bias of
    position 1 before its bfloat16 rounding) and MPT's `build_mpt_alibi_tensor` at its default alibi_bias_max 8;
    MPT's at another alibi_bias_max too."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    torch.testing.assert_close(alibi_slopes(heads), _get_alibi_slopes(heads, "cpu"), rtol=0, atol=0)
    for bias_max in (8, 5):
        mpt = build_mpt_alibi_tensor(heads, 2, bias_max)[:, 0, 0]  # position 0 - 1 = -1: minus the slopes
        torch.testing.assert_close(alibi_slopes(heads, bias_max), -mpt, rtol=1e-6, atol=0)
    n = 2 ** math.floor(math.log2(heads))
    assert alibi_slopes(heads)[0] == 2 ** (-8 / n)


def reference(inputs, slopes, window):
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
            distance = torch.tensor(seen, dtype=torch.float64) - p
            for h in range(q.shape[1]):
                scores = k[h // group] @ q[0, h, offset + i].double() * CONFIG.head_dim**-0.5
                if slopes is not None:
                    scores = scores + slopes[h].double() * distance
                out[0, h, offset + i] = scores.softmax(0) @ v[h // group]
        offset += n
    return out


def random_inputs(device: str = "cpu") -> list[tuple]:
    """(q, k, v) of both steps."""
    gen = torch.Generator().manual_seed(0)
    inputs = []
    for steps in (STEP1, STEP2):
        t = sum(n for _, _, n in steps)
        q = torch.randn(1, CONFIG.num_heads, t, CONFIG.head_dim, generator=gen)
        k, v = (torch.randn(1, t, CONFIG.num_kv_heads, CONFIG.head_dim, generator=gen) for _ in range(2))
        inputs.append((q.to(device), k.to(device), v.to(device)))
    return inputs


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(
    ("backend", "int8"), [("torch", False), ("torch", True), ("kernels", False), ("kernels", True), ("triton", False)]
)
def test_every_paged_backend_biases_the_scores(backend, int8, window, monkeypatch):
    """A decode group of two lengths and a prefill chunk over a cached prefix (tests/test_kv_int8.py's steps),
    against a float64 reference with the slopes, on every backend (float and int8 caches); the bias changes the
    output (the reference without it is far)."""
    out, inputs = both_steps_on_backend(CONFIG, random_inputs, backend, int8, window, monkeypatch, None, SLOPES)
    want = reference(inputs, SLOPES, window)
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)
    assert (want - reference(inputs, None, window)).abs().max() > 0.1


def test_the_c_kernel_splits_its_tiles_by_row_with_the_bias(monkeypatch):
    """keel's C++ kernel over a long prefill chunk (tiles of several rows, vectorised where the ISA allows) and
    its rows one at a time (the row body): the same numbers, with the slopes."""
    if not kernels.active():
        pytest.skip("keel's kernels are not active here")
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block, length = 6, 2, 16, 4, 37
    keys, values = (torch.randn(kv_heads, 12 * block, dim, generator=gen) for _ in range(2))
    q = torch.randn(length, heads, dim, generator=gen)
    table = torch.randperm(12, generator=gen)[None].int()
    positions = torch.arange(length)
    args = (keys, values, None, None, table)
    whole = torch.ops.keel.paged_attention(
        q, *args, torch.zeros(length, dtype=torch.long), positions, block, 0, dim**-0.5, dim, 0.0, None, SLOPES
    )
    rows = torch.cat([
        torch.ops.keel.paged_attention(q[i : i + 1], *args, None, positions[i : i + 1], block, 0, dim**-0.5, dim,
                                       0.0, None, SLOPES)
        for i in range(length)
    ])  # fmt: skip
    torch.testing.assert_close(whole, rows, atol=1e-6, rtol=1e-5)
    plain = torch.ops.keel.paged_attention(
        q, *args, torch.zeros(length, dtype=torch.long), positions, block, 0, dim**-0.5, dim
    )
    assert (whole - plain).abs().max() > 0.1


@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_the_compiled_decode_op_biases_the_scores_as_the_eager_cache(backend, monkeypatch):
    """keel::paged_decode_attention (the compiled decode graph's op) with the slopes, rows of three widths (in
    length groups under `torch`, each walking its own table under `kernels`): the eager cache's rows on the
    torch path; without the slopes, other rows."""
    from keel.serve.compiled_decode import paged_decode_attention

    if backend == "kernels" and not kernels.active():
        pytest.skip("keel's kernels are not active here")
    monkeypatch.setenv(ENV, "torch")
    gen = torch.Generator().manual_seed(0)
    caches = [PagedKVCache(CONFIG, 8, 4, torch.float32) for _ in range(2)]
    for a, b in zip(caches[1].keys + caches[1].values, caches[0].keys + caches[0].values, strict=True):
        a.copy_(b.copy_(torch.randn(b.shape, generator=gen)))
    h, hkv, d = CONFIG.num_heads, CONFIG.num_kv_heads, CONFIG.head_dim
    q = torch.randn(1, h, 3, d, generator=gen)
    k, v = (torch.randn(1, 3, hkv, d, generator=gen) for _ in range(2))
    tables = torch.tensor([[1, 2, 0, 0, 0], [3, 4, 5, 6, 7], [6, 0, 0, 0, 0]])
    positions, widths = torch.tensor([6, 19, 2]), torch.tensor([2, 5, 1])
    slots = torch.tensor([2 * 4 + 2, 7 * 4 + 3, 6 * 4 + 2])
    caches[0].plan = StepPlan(slots, [DecodeGroup(torch.arange(3), tables, positions, True)], [])
    eager = caches[0].attend(0, q, k, v, None, None, None, SLOPES)
    mask = decode_mask(positions, 20, None)
    args = (q, k, v, caches[1].keys[0], caches[1].values[0], slots, tables, widths, mask, positions, 0, 4, d**-0.5)
    monkeypatch.setenv(ENV, backend)
    torch.testing.assert_close(paged_decode_attention(*args, 0.0, None, SLOPES), eager, atol=1e-5, rtol=1e-5)
    assert (paged_decode_attention(*args) - eager).abs().max() > 0.1


def test_an_alibi_model_trains_and_its_cacheless_forward_is_the_reference():
    """The model's own attention (no cache: explicit scores with the bias) against float64 attention with the
    slopes, by layer output; gradients flow through it."""
    torch.manual_seed(0)
    model = build_model(CONFIG)
    attn = model.layers["0"].self_attn
    assert attn.alibi is not None and not model.rotates  # no layer rotates under ALiBi
    tokens = torch.randint(0, 256, (2, 12))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    grad = attn.q_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    from keel.model.attention import AttentionMetadata

    x = torch.randn(1, 9, CONFIG.hidden_size)
    with torch.no_grad():
        got = attn(x, AttentionMetadata.for_sequence(1, 9))
        q, k, v = (p(x).view(1, 9, -1, 16).transpose(1, 2).double() for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        k, v = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
        pos = torch.arange(9, dtype=torch.float64)
        scores = q @ k.transpose(-1, -2) / 4 + attn.alibi.double().view(1, -1, 1, 1) * (pos[None] - pos[:, None])
        scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
        want = attn.o_proj(scores.softmax(-1).matmul(v).transpose(1, 2).reshape(1, 9, -1).float())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
