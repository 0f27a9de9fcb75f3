"""Issue 25's block features turned on together, in combinations no transformers family has, against an
independent reference decoder written here in plain torch from ModelConfig's option definitions (it imports
nothing of keel.model): the model's float32 logits, and greedy tokens served through the engine (paged KV cache,
chunked prefill, prefix caching). Every option a combination turns on is shown live: the reference with that
option turned off is far from keel's logits. Each feature against the family that has it: tests/test_families.py
and tests/test_architectures.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from keel.config import ModelConfig
from keel.model.transformer import build_model
from keel.serve import LLM, SamplingParams
from keel.weights.checkpoint import Checkpoint, LoadedModel

TOL = 1e-4
LIVE = 10 * TOL  # an option turned off in the reference moves the logits ten times the tolerance

# ----------------------------------------------------------------------------------------- the reference


def _rms_norm(x, weight, eps, offset):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight)


def _layer_norm(x, weight, bias, eps):
    centred = x - x.mean(-1, keepdim=True)
    out = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * weight
    return out if bias is None else out + bias


_ACT = {
    "silu": lambda x: x * torch.sigmoid(x),
    "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
    "gelu_tanh": lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
}


def _rotate(x, positions, theta, rotary):
    """Rotary over the first `rotary` channels of each head ([S, H, D]), rotate-half pairs (i, i + rotary/2)."""
    half = rotary // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary)
    angle = positions.double()[:, None] * freqs  # [S, half]
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    x1, x2, rest = x[..., :half], x[..., half:rotary], x[..., rotary:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def reference_logits(c: ModelConfig, w: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
    """[S, V] float64 logits of one sequence, from the option definitions in keel.config."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # float64 products this small take ~100x longer on two threads
    try:
        return _reference_logits(c, w, tokens)
    finally:
        torch.set_num_threads(threads)


def _reference_logits(c: ModelConfig, w: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
    w = {k: v.double() for k, v in w.items()}
    s, nh, nkv, d = len(tokens), c.num_heads, c.num_kv_heads, c.head_dim
    pos = torch.arange(s)

    def norm(name, x):
        if c.norm_type == "layer":
            return _layer_norm(x, w[name + ".weight"], w[name + ".bias"] if c.norm_bias else None, c.rms_norm_eps)
        return _rms_norm(x, w[name + ".weight"], c.rms_norm_eps, c.norm_weight_offset)

    def linear(name, x, bias):
        out = x @ w[name + ".weight"].T
        return out + w[name + ".bias"] if bias else out

    def attention(p, x, layer):
        q, k, v = (linear(f"{p}self_attn.{n}_proj", x, c.qkv_bias) for n in "qkv")
        qk = [f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]
        if c.qk_norm and c.qk_norm_scope == "all":
            q, k = (_rms_norm(t, w[n], c.rms_norm_eps, c.norm_weight_offset) for t, n in zip((q, k), qk, strict=True))
        q, k, v = q.view(s, nh, d), k.view(s, nkv, d), v.view(s, nkv, d)
        if c.qk_norm and c.qk_norm_scope == "head":
            q, k = (_rms_norm(t, w[n], c.rms_norm_eps, c.norm_weight_offset) for t, n in zip((q, k), qk, strict=True))
        sliding = c.layer_types[layer] == "sliding_attention"
        theta = c.sliding_rope_theta if sliding and c.sliding_rope_theta is not None else c.rope_theta
        rotary = int(d * c.partial_rotary_factor)
        q, k = _rotate(q, pos, theta, rotary), _rotate(k, pos, theta, rotary)
        allowed = pos[None, :] <= pos[:, None]
        if sliding and c.sliding_window:
            allowed &= pos[:, None] - pos[None, :] < c.sliding_window
        scale = d**-0.5 if c.attention_scale is None else c.attention_scale
        q = q.transpose(0, 1)
        k, v = (t.transpose(0, 1).repeat_interleave(nh // nkv, dim=0) for t in (k, v))
        scores = q @ k.transpose(1, 2) * scale  # [H, S, S]; head h reads kv head h // (nh / nkv)
        if c.attn_logit_softcapping is not None:
            scores = c.attn_logit_softcapping * torch.tanh(scores / c.attn_logit_softcapping)
        out = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v  # [H, S, D]
        return linear(f"{p}self_attn.o_proj", out.transpose(0, 1).reshape(s, nh * d), c.o_bias)

    def mlp(p, x):
        up = linear(f"{p}mlp.up_proj", x, c.mlp_bias)
        act = _ACT[c.hidden_act]
        inner = act(linear(f"{p}mlp.gate_proj", x, c.mlp_bias)) * up if c.mlp_gated else act(up)
        return linear(f"{p}mlp.down_proj", inner, c.mlp_bias)

    x = w["embed_tokens.weight"][tokens] * c.embedding_multiplier
    m, pre, post = c.residual_multiplier, c.norm_placement != "post", c.norm_placement != "pre"
    for layer in range(c.num_layers):
        p = f"layers.{layer}."
        if c.parallel_residual:
            n1 = norm(p + "input_layernorm", x)
            n2 = norm(p + "post_attention_layernorm", x) if c.post_attention_norm else n1
            x = x + m * (attention(p, n1, layer) + mlp(p, n2))
            continue
        a = attention(p, norm(p + "input_layernorm", x) if pre else x, layer)
        x = x + m * (norm(p + "attn_output_norm", a) if post else a)
        f = mlp(p, norm(p + "post_attention_layernorm", x) if pre else x)
        x = x + m * (norm(p + "mlp_output_norm", f) if post else f)
    x = norm("norm", x)
    logits = x @ w["embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"].T / c.logits_scaling
    cap = c.final_logit_softcapping
    return logits if cap is None else cap * torch.tanh(logits / cap)


# ------------------------------------------------------------------------------------------ the combinations

BASE = dict(
    architecture="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,  # q_size 64: wider than the hidden size
    rms_norm_eps=1e-5,
    max_position_embeddings=128,
)

COMBOS = {
    # LayerNorm with a bias, parallel residual with a norm each, half-width rotary, ungated erf-GELU MLP with
    # biases, q/k/v and o biases, an untied head, logits divided by 4.
    "a": dict(
        norm_type="layer",
        norm_bias=True,
        parallel_residual=True,
        partial_rotary_factor=0.5,
        hidden_act="gelu",
        mlp_gated=False,
        mlp_bias=True,
        qkv_bias=True,
        o_bias=True,
        logits_scaling=4.0,
        rope_theta=500.0,
    ),
    # RMSNorm scaling by (1 + w) (q/k norms too), sandwich norms, q/k norms per head, GeGLU, embedding x sqrt(h),
    # softmax scale 0.1 != 16 ** -0.5, attention and final soft-capping, sliding/global/sliding layers with a
    # window of 4 and a rope theta of their own, a tied head.
    "b": dict(
        norm_weight_offset=1.0,
        norm_placement="sandwich",
        qk_norm=True,
        hidden_act="gelu_tanh",
        embedding_multiplier=math.sqrt(32),
        attention_scale=0.1,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=3.0,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_theta=10000.0,
        sliding_rope_theta=20.0,
        tie_word_embeddings=True,
    ),
    # q/k norms over the whole projections, norms after the sublayers only, sublayer outputs x 0.5, SwiGLU, every
    # layer sliding over 5 tokens.
    "c": dict(
        qk_norm=True,
        qk_norm_scope="all",
        norm_placement="post",
        residual_multiplier=0.5,
        hidden_act="silu",
        sliding_window=5,
        rope_theta=100.0,
    ),
    # Parallel residual reading one norm (StableLM's option) with RMSNorm, sublayer outputs x 0.25, q/k norms per
    # head, a softmax scale of its own, tanh-GELU ungated MLP, logits divided by 0.5.
    "d": dict(
        parallel_residual=True,
        post_attention_norm=False,
        residual_multiplier=0.25,
        qk_norm=True,
        attention_scale=0.5,
        hidden_act="gelu_tanh",
        mlp_gated=False,
        logits_scaling=0.5,
        partial_rotary_factor=0.25,
        qkv_bias=True,
    ),
}

# Per combination: options turned off (or changed) one at a time in the reference; each must move the logits. Only
# changes whose reference reads weights keel's model has (or block norms, given unit scales by `_unit_norms`).
OFF = {
    "a": [
        dict(norm_bias=False),
        dict(parallel_residual=False),
        dict(partial_rotary_factor=1.0),
        dict(hidden_act="silu"),  # gelu_tanh: within 1e-4 of erf-GELU's logits here (in b: 1e-3 apart)
        dict(mlp_bias=False),
        dict(qkv_bias=False),
        dict(o_bias=False),
        dict(tie_word_embeddings=True),
        dict(logits_scaling=1.0),
    ],
    "b": [
        dict(norm_weight_offset=0.0),
        dict(norm_placement="pre"),
        dict(norm_placement="post"),
        dict(qk_norm=False),
        dict(hidden_act="gelu"),
        dict(hidden_act="silu"),
        dict(mlp_gated=False),
        dict(embedding_multiplier=1.0),
        dict(attention_scale=None),
        dict(attn_logit_softcapping=None),
        dict(final_logit_softcapping=None),
        dict(sliding_window=None),
        dict(sliding_rope_theta=None),
    ],
    "c": [
        dict(qk_norm=False),
        dict(norm_placement="sandwich"),
        dict(residual_multiplier=1.0),
        dict(hidden_act="gelu"),
        dict(sliding_window=None),
        dict(rope_theta=10000.0),
    ],
    "d": [
        dict(post_attention_norm=True),
        dict(residual_multiplier=1.0),
        dict(qk_norm=False),
        dict(attention_scale=None),
        dict(hidden_act="silu"),
        dict(logits_scaling=1.0),
        dict(partial_rotary_factor=0.5),
        dict(qkv_bias=False),
    ],
}


def make_model(options: dict, seed: int = 0):
    """(config, keel's Transformer for BASE + options, its weights by name): every parameter drawn at random, norm
    scales around 1 and biases too, so that a weight read in the wrong place shows."""
    config = ModelConfig(**BASE, **options)
    torch.manual_seed(seed)
    model = build_model(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name == "embed_tokens.weight":
                p.copy_(noise * (1.0 if config.embedding_multiplier == 1.0 else 0.2))
            elif p.dim() == 2:
                p.copy_(noise / math.sqrt(p.shape[1]))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 - config.norm_weight_offset + 0.3 * noise)
            else:  # biases
                p.copy_(0.3 * noise)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return config, model.eval(), weights


def _unit_norms(config: ModelConfig, weights: dict) -> dict:
    """`weights` with unit-scale, zero-bias block norms where `config` reads one that keel's model has not."""
    names = [
        f"layers.{i}.{n}" for i in range(config.num_layers) for n in ("input_layernorm", "post_attention_layernorm")
    ]
    names += [f"layers.{i}.{n}" for i in range(config.num_layers) for n in ("attn_output_norm", "mlp_output_norm")]
    h, added = config.hidden_size, {}
    for name in names:
        added.setdefault(name + ".weight", torch.full((h,), 1.0 - config.norm_weight_offset))
        added.setdefault(name + ".bias", torch.zeros(h))
    return {**added, **weights}


@pytest.mark.parametrize("combo", sorted(COMBOS))
def test_composed_features_give_the_reference_logits(combo):
    config, model, weights = make_model(COMBOS[combo])
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, config.vocab_size, (2, 12), generator=gen)  # longer than every window
    with torch.no_grad():
        got = model(batch).double()
    want = torch.stack([reference_logits(config, weights, row.tolist()) for row in batch])
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    assert got.abs().max() > 0.5  # logits of some size: the tolerance is not loose beside them
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight
    for off in OFF[combo]:
        changed = dataclasses.replace(config, **off)
        other = torch.stack([reference_logits(changed, _unit_norms(changed, weights), row.tolist()) for row in batch])
        assert (other - got).abs().max() > LIVE, f"{combo}: {off} does not change the logits"


def reference_greedy(config: ModelConfig, weights: dict, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, the reference recomputing the whole sequence at each step."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(reference_logits(config, weights, seq)[-1].argmax()))
    return seq[len(prompt) :]


def test_composed_features_serve_the_reference_greedy_tokens():
    """Combination b (sandwich (1 + w) RMSNorms, per-head q/k norms, GeGLU, embedding multiplier, softmax scale,
    both soft-caps, sliding/global layers with their own rope theta, tied head) through the engine: paged KV
    cache of 4-token blocks, prefill in chunks of at most 8 tokens, the second prompt's first two blocks from the
    prefix cache, the second and third prompts decoded together; sequences of ~20 tokens, five windows."""
    config, model, weights = make_model(COMBOS["b"])
    with torch.no_grad():  # sublayer outputs ~3x: else the tied head mostly repeats the last token
        for name, p in model.named_parameters():
            if name.endswith("output_norm.weight"):
                p.add_(2.0)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    shared = [3, 14, 15, 9, 26, 5, 35, 8]  # two blocks
    prompts = [shared + [40, 41, 42], shared + [50, 7], [60, 1, 2, 61, 33, 12, 17, 4, 9, 20, 11]]
    n = 10
    want = [reference_greedy(config, weights, p, n) for p in prompts]
    loaded = LoadedModel(model, Checkpoint(path=None, format="hf", config=config, reader=None, tokenizer=None))
    llm = LLM(
        loaded,
        adapt=True,
        num_blocks=32,
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
        max_num_seqs=4,
        compile=False,
        device="cpu",
    )
    greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts[0], greedy, use_tqdm=False)[0]
    rest = llm.generate(prompts[1:], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in [first, *rest]] == want
    assert rest[0].num_cached_tokens >= len(shared)  # the shared blocks came from the prefix cache
    assert len(set(sum(want, []))) > 10  # varied tokens, not one repeated
    # The served tokens are those of these options: the reference without one of them decodes others.
    offs = [{"attn_logit_softcapping": None}, {"sliding_window": None}, {"sliding_rope_theta": None}]
    offs += [{"attention_scale": None}, {"norm_weight_offset": 0.0}]
    for off in offs:
        changed = dataclasses.replace(config, **off)
        assert any(reference_greedy(changed, weights, p, n) != t for p, t in zip(prompts, want, strict=True)), off
