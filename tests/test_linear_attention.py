"""Recurrent layers: Gated DeltaNet (Qwen3.5's `linear_attention`: the delta rule against transformers' own
functions), LFM2's short convolutions (`conv`) and Mamba 2's mixers (Granite 4.0-H: the scan against transformers'
own function), served with a state per sequence (chunked prefill, preemption,
slots reused); the multimodal releases read on text, and what such models refuse. Logits, greedy tokens, align and
export of the tiny models run with every family in tests/test_architectures.py and tests/test_convert.py."""

from __future__ import annotations

import pytest
import torch

from keel.errors import KeelError
from keel.model.gated_delta import delta_rule_chunked, delta_rule_steps, prepare
from keel.model.selective_scan import selective_scan
from keel.model.ssd import ssd_chunked, ssd_steps
from keel.quant.loading import load_model
from keel.serve import LLM, EngineConfig, SamplingParams
from tiny_models import COMMON, TINY_CONFIGS, save_byte_tokenizer, save_hf_model

qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def _inputs(length: int, key_heads: int = 2, value_heads: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, length, key_heads, 16, generator=g)
    k = torch.randn(2, length, key_heads, 16, generator=g)
    v = torch.randn(2, length, value_heads, 8, generator=g)
    decay = -torch.rand(2, length, value_heads, generator=g)
    beta = torch.rand(2, length, value_heads, generator=g)
    state = torch.randn(2, value_heads, 16, 8, generator=g) * 0.1
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("length", [1, 5, 64, 150])
@pytest.mark.parametrize("heads", [(2, 4), (4, 4)])
def test_delta_rule_matches_transformers(length, heads):
    """Chunked and token by token, from a given state: transformers' reference functions' outputs and states."""
    q, k, v, decay, beta, state = _inputs(length, *heads)
    kwargs = dict(g=decay, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    want, want_state = qwen3_5.torch_chunk_gated_delta_rule(q, k, v, **kwargs)
    qp, kp, vp = prepare(q, k, v)
    for rule in (delta_rule_chunked, delta_rule_steps):
        out, final = rule(qp, kp, vp, decay.transpose(1, 2), beta.transpose(1, 2), state)
        torch.testing.assert_close(out.transpose(1, 2), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final, want_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 5, 64, 150])
def test_per_channel_delta_rule_matches_transformers_kda(length):
    """Kimi Delta Attention's decay per key channel (g [B, H, T, Dk]), chunked and token by token, from a given
    state: transformers' chunk_kimi_delta_attention and recurrent_kimi_delta_attention (their torch references)."""
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, length, 3, 16, generator=gen) for _ in range(3))
    decay = -torch.rand(2, length, 3, 16, generator=gen) * 2
    beta = torch.rand(2, length, 3, generator=gen)
    state = torch.randn(2, 3, 16, 16, generator=gen) * 0.1
    kwargs = dict(g=decay, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    qp, kp, vp = prepare(q, k, v)
    for reference in (kimi.chunk_kimi_delta_attention, kimi.recurrent_kimi_delta_attention):
        want, want_state = reference(q, k, v, **kwargs)
        for rule in (delta_rule_chunked, delta_rule_steps):
            out, final = rule(qp, kp, vp, decay.transpose(1, 2), beta.transpose(1, 2), state)
            torch.testing.assert_close(out.transpose(1, 2), want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(final, want_state, atol=1e-5, rtol=1e-5)


def test_a_sequence_continues_from_its_state_across_chunks():
    q, k, v, decay, beta, state = _inputs(100)
    qp, kp, vp = prepare(q, k, v)
    g, b = decay.transpose(1, 2), beta.transpose(1, 2)
    whole, whole_state = delta_rule_chunked(qp, kp, vp, g, b, state)
    first, mid = delta_rule_chunked(qp[:, :, :37], kp[:, :, :37], vp[:, :, :37], g[:, :, :37], b[:, :, :37], state)
    rest, end = delta_rule_chunked(qp[:, :, 37:], kp[:, :, 37:], vp[:, :, 37:], g[:, :, 37:], b[:, :, 37:], mid)
    torch.testing.assert_close(torch.cat([first, rest], dim=2), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, whole_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 7, 150])
@pytest.mark.parametrize("groups", [1, 2])
def test_mamba2_scan_matches_transformers(length, groups):
    """Chunked and token by token, from a given state, with D's skip: transformers' mamba2_chunk_scan."""
    granite = pytest.importorskip("transformers.models.granitemoehybrid.modeling_granitemoehybrid")
    g = torch.Generator().manual_seed(0)
    heads, dim, size = 4, 8, 16
    x = torch.randn(2, length, heads, dim, generator=g)
    raw, a_log, skip, dt_bias = (
        torch.randn(*shape, generator=g) for shape in ((2, length, heads), (heads,), (heads,), (heads,))
    )
    b, c = (torch.randn(2, length, groups, size, generator=g) for _ in range(2))
    state = torch.randn(2, heads, dim, size, generator=g) * 0.1
    want, want_state = granite.mamba2_chunk_scan(
        x, raw, -a_log.exp(), b, c, chunk_size=32, D=skip, dt_bias=dt_bias, initial_states=state, dt_softplus=True,
        return_final_states=True,
    )  # fmt: skip
    step = torch.nn.functional.softplus(raw + dt_bias).transpose(1, 2)
    per_head = [t.repeat_interleave(heads // groups, dim=2).transpose(1, 2) for t in (b, c)]
    for scan in (ssd_chunked, ssd_steps):
        y, final = scan(x.transpose(1, 2), step, a_log, *per_head, state)
        y = (y + skip[:, None, None] * x.transpose(1, 2)).transpose(1, 2)
        assert ((y - want).abs().max() / want.abs().max()).item() < 1e-5
        torch.testing.assert_close(final, want_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 7, 150])
def test_mamba1_selective_scan_matches_transformers(length):
    """From an empty state, with D's skip and the gate: transformers' mamba_selective_scan (its torch reference); and
    continued across a split at any point from the state the first part leaves, as serving continues a sequence."""
    mamba = pytest.importorskip("transformers.models.mamba.modeling_mamba")
    g = torch.Generator().manual_seed(0)
    channels, size = 12, 8
    x, raw, gate = (torch.randn(2, length, channels, generator=g) for _ in range(3))
    b, c = (torch.randn(2, length, size, generator=g) for _ in range(2))
    a = -torch.rand(channels, size, generator=g) * 4
    skip, bias = torch.randn(channels, generator=g), torch.randn(channels, generator=g)
    want = mamba.mamba_selective_scan(
        x.transpose(1, 2), raw.transpose(1, 2), a, b.transpose(1, 2), c.transpose(1, 2), D=skip,
        z=gate.transpose(1, 2), delta_bias=bias, delta_softplus=True,
    ).transpose(1, 2)  # fmt: skip
    step = torch.nn.functional.softplus(raw + bias)
    empty = torch.zeros(2, channels, size)
    y, final = selective_scan(x, step, a, b, c, empty)
    got = (y + skip * x) * torch.nn.functional.silu(gate)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    if length == 1:
        return
    cut = length // 3
    first, mid = selective_scan(x[:, :cut], step[:, :cut], a, b[:, :cut], c[:, :cut], empty)
    rest, end = selective_scan(x[:, cut:], step[:, cut:], a, b[:, cut:], c[:, cut:], mid)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, final, atol=1e-5, rtol=1e-5)


def _expected(hf, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        return [
            hf.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, pad_token_id=0)[
                0, len(ids) :
            ].tolist()
            for ids in prompts
        ]


def _uncached_greedy(hf, ids: list[int], tokens: int) -> list[int]:
    out = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(tokens):
            out = torch.cat([out, hf(out, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize(
    "family",
    [
        "qwen3_5",
        "lfm2",
        "granitemoehybrid",
        pytest.param("falcon_h1", marks=pytest.mark.slow),
        pytest.param("zamba2", marks=pytest.mark.slow),
        pytest.param("jamba", marks=pytest.mark.slow),
        pytest.param("minimax", marks=pytest.mark.slow),
        pytest.param("recurrent_gemma", marks=pytest.mark.slow),
    ],
)
def test_engine_serves_states_through_chunked_prefill_and_preemption(tmp_path, family):
    """Six sequences, four state slots and a cache too small for all of them: prompts split into chunks of a
    16-token step, sequences preempted and recomputed, slots freed and reused; transformers' greedy tokens. The
    recurrent layers (Qwen3.5's Gated DeltaNet, LFM2's short convolutions, Granite 4.0-H's Mamba 2 mixers, Jamba's
    Mamba 1 mixers, MiniMax's lightning attention, RecurrentGemma's RG-LRU blocks) hold no KV blocks, Falcon-H1's
    hybrid layers both blocks and a state, and prefix caching is off. RecurrentGemma's 40-token prompts pass its
    8-position attention window, whose keys are kept as any attention layer's."""
    hf = save_hf_model(family, tmp_path)
    save_byte_tokenizer(tmp_path)
    prompts = [list(range(40 + i, 80 + i)) for i in range(5)] + [[9]]
    expected = _expected(hf, prompts, 32)
    if family == "recurrent_gemma":
        # transformers' recurrent block runs a one-token prompt on its decode path, whose convolution past is the
        # previous generate call's (or, on a fresh model, a hidden_size-wide zero state that fails beside a narrower
        # lru_width): its uncached forward gives the tokens of an empty past
        expected[-1] = _uncached_greedy(hf, prompts[-1], 32)
    config = EngineConfig.of(
        dtype="float32",
        compile=False,
        num_blocks=24,
        max_model_len=96,
        block_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=16,
    )
    llm = LLM(str(tmp_path), config)
    engine = llm.engine
    assert not engine.kv.enable_prefix_caching
    kinds = engine.model.config.layer_types
    assert [engine.cache.keys[i].numel() == 0 for i in range(len(kinds))] == [
        k not in ("full_attention", "sliding_attention", "hybrid") for k in kinds
    ]
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert engine.scheduler.num_preemptions > 0
    assert sorted(engine.runner.free_states) == [0, 1, 2, 3] and not engine.runner.state_of


@pytest.mark.parametrize("family, multimodal", [("qwen3_5", "Qwen3_5"), ("qwen3_5_moe", "Qwen3_5Moe")])
def test_the_text_model_of_a_multimodal_release_is_served(tmp_path, family, multimodal):
    """Qwen3.5's releases are `Qwen3_5ForConditionalGeneration` (`Qwen3_5MoeForConditionalGeneration`): the decoder
    under `model.language_model.`, the head at `lm_head`, the vision tower unread; transformers' logits and greedy
    tokens on text."""
    import transformers

    text = {**COMMON, **TINY_CONFIGS[family][2]}
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    config = getattr(transformers, f"{multimodal}Config")(text_config=text, vision_config=vision)
    hf = getattr(transformers, f"{multimodal}ForConditionalGeneration")(config)
    hf.eval().save_pretrained(tmp_path)
    save_byte_tokenizer(tmp_path)
    loaded = load_model(tmp_path, "float32")
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=tokens).logits
        ours = loaded.model(tokens)
        greedy = hf.generate(tokens, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ((ours - want).abs().max() / want.abs().max()).item() < 1e-5
    llm = LLM(str(tmp_path), EngineConfig.of(dtype="float32", compile=False, max_model_len=64))
    out = llm.generate([tokens[0].tolist()], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == greedy[0, 20:].tolist()


@pytest.mark.parametrize(
    "option, message",
    [
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative decoding"),
        (dict(kv_cache_dtype="int8"), "int8"),
    ],
)
def test_what_a_model_with_linear_attention_refuses(tmp_path, option, message):
    save_hf_model("qwen3_5", tmp_path)
    save_byte_tokenizer(tmp_path)
    with pytest.raises(KeelError, match=message):
        LLM(str(tmp_path), EngineConfig.of(dtype="float32", compile=False, max_model_len=64, **option))


@pytest.mark.parametrize("family", ["qwen3_5", "minimax", "recurrent_gemma"])
def test_parallel_layouts_are_refused_by_name(tmp_path, family):
    """Tensor parallelism (training and serving) and pipelined serving do not cut Gated DeltaNet, lightning or
    RG-LRU layers yet."""
    from types import SimpleNamespace

    from keel.config import ModelConfig
    from keel.errors import ConfigError
    from keel.serve.parallel.load import check_parallel_model
    from keel.train import config as train_config

    # RecurrentGemma's one KV head would be refused first for tp = 2
    save_hf_model(family, tmp_path, **({"num_key_value_heads": 2} if family == "recurrent_gemma" else {}))
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    for tp, pp in ((2, 1), (1, 2)):
        with pytest.raises(KeelError, match="linear_attention"):
            check_parallel_model(config, tmp_path, tp, pp)
    cfg = SimpleNamespace(parallel=train_config.ParallelSection(tp=2), moe=train_config.MoESection())
    with pytest.raises(ConfigError, match="linear_attention"):
        train_config._check_model_fits(cfg, config, 1, lambda message: ConfigError(message))


@pytest.mark.parametrize("family", ["qwen3_5", "granitemoehybrid", "mamba"])
def test_seeded_initialisation_of_the_recurrent_parameters(tmp_path, family):
    """Training from scratch: dt_bias and D start at 1 and A_log at each layer's spread of decay rates (not at the
    generic zero of biases), on the meta-device start as on a model built directly."""
    from keel.config import ModelConfig
    from keel.model.seeded_init import init_weights_seeded, materialize
    from keel.model.transformer import Transformer

    save_hf_model(family, tmp_path)
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    with torch.device("meta"):
        model = Transformer(config)
    materialize(model, "cpu", lambda m: init_weights_seeded(m, 0))
    direct = Transformer(config)
    mixer, built = model.layers["0"].self_attn, direct.layers["0"].self_attn
    if hasattr(mixer, "dt_bias"):  # Mamba 1's step bias is dt_proj's, zero as every bias
        assert torch.equal(mixer.dt_bias, torch.ones_like(mixer.dt_bias))
    assert torch.equal(mixer.A_log, built.A_log) and len(set(mixer.A_log.flatten().tolist())) == mixer.A_log.shape[-1]
    if hasattr(mixer, "D"):
        assert torch.equal(mixer.D, torch.ones_like(mixer.D))


def test_a_model_without_attention_layers_is_served_with_a_state_slot_per_sequence(tmp_path):
    """Every layer recurrent (Mamba 2): no KV rows at all, so each sequence's one block spans max_model_len and the
    budget holds states only: as many sequences at once as slots fit it (here three, under --max-num-seqs 8), the
    rest wait, prompts in chunks of a 24-token step; transformers' greedy tokens."""
    from keel.model.recurrent import RecurrentStates

    hf = save_hf_model("mamba2", tmp_path)
    save_byte_tokenizer(tmp_path)
    prompts = [list(range(30 + i, 50 + 3 * i)) for i in range(3)] + [[7]]
    expected = _expected(hf, prompts, 8)
    loaded = load_model(tmp_path, "float32")
    per_slot = RecurrentStates.bytes_per_slot(loaded.model.config, torch.float32)
    config = EngineConfig.of(
        dtype="float32", compile=False, max_model_len=64, max_num_seqs=8, kv_cache_memory=3 * per_slot + 1,
        max_num_batched_tokens=24,
    )  # fmt: skip
    llm = LLM(str(tmp_path), config)
    engine = llm.engine
    assert (engine.kv.num_blocks, engine.kv.block_size) == (3, 64)
    assert engine.cache.nbytes() == 0 and engine.cache.recurrent.conv[0].shape[0] == 3
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sorted(engine.runner.free_states) == [0, 1, 2] and not engine.runner.state_of


@pytest.mark.slow
def test_a_model_without_attention_layers_is_served_over_http(tmp_path):
    """`keel serve` of Mamba 2 (no KV cache), with the openai client: the texts of transformers' greedy tokens (as
    the engine in-process makes them) for prompts sent as token ids at once, streamed or not."""
    import concurrent.futures

    from keel.serve.openai.child import ServerProcess
    from test_serve_http import client

    hf = save_hf_model("mamba2", tmp_path / "m")
    save_byte_tokenizer(tmp_path / "m")
    prompts = [list(range(60 + i, 90 + 2 * i)) for i in range(4)]
    llm = LLM(str(tmp_path / "m"), EngineConfig.of(dtype="float32", compile=False, max_model_len=128))
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _expected(hf, prompts, 10)
    expected = [o.outputs[0].text for o in outs]
    args = ("--served-model-name", "tiny", "--threads", "1", "--max-model-len", "128", "--dtype", "float32")
    server = ServerProcess(tmp_path / "m", *args, log_path=tmp_path / "server.log").wait_ready()
    try:
        c = client(server)

        def complete(ids: list[int], stream: bool) -> str:
            kw = dict(model="tiny", prompt=ids, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
            if stream:
                return "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices)
            return c.completions.create(**kw).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(complete, prompts + prompts, [False] * 4 + [True] * 4))
        assert got == expected + expected
    finally:
        assert server.terminate() == 0, server.tail(40)


def test_a_conv_activation_other_than_silu_is_refused(tmp_path):
    """Gated DeltaNet and Mamba 2 apply SiLU to their convolutions: another activation is refused by the config."""
    import json

    from keel.config import ModelConfig
    from keel.errors import ConfigError

    save_hf_model("granitemoehybrid", tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ConfigError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf({**data, "hidden_act": "gelu"})


def test_kimi_linear_reads_moonshot_config_and_refuses_what_it_cannot_run(tmp_path):
    """Kimi Linear's released config.json nests its linear layers (1-indexed kda_layers / full_attn_layers) and names
    its dense layers by first_k_dense_replace: read as transformers reads them. A rotating latent attention
    (mla_use_nope false) and a router other than sigmoid are refused by name."""
    import json

    from keel.config import ModelConfig
    from keel.errors import ConfigError

    save_hf_model("kimi_linear", tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim"):
        del data[key]
    nested = dict(kda_layers=[1, 2, 4], full_attn_layers=[3], head_dim=8, num_heads=4, short_conv_kernel_size=2)
    config = ModelConfig.from_hf({**data, "linear_attn_config": nested, "first_k_dense_replace": 2})
    assert config.layer_types == ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    assert (config.linear_num_value_heads, config.linear_value_head_dim, config.linear_conv_kernel_dim) == (4, 8, 2)
    assert config.mlp_only_layers == [0, 1] and config.linear_variant == "kda" and not any(config.rope_layers)
    with pytest.raises(ConfigError, match="mla_use_nope"):
        ModelConfig.from_hf({**data, "mla_use_nope": False})
    with pytest.raises(ConfigError, match="moe_router_activation_func 'softmax'"):
        ModelConfig.from_hf({**data, "moe_router_activation_func": "softmax"})
    with pytest.raises(ConfigError, match="linear_variant 'kda'"):
        ModelConfig(**{**config.to_dict(), "linear_num_key_heads": 2}).validate()


def test_mamba2_steps_are_clamped_in_the_chunked_scan_only(tmp_path):
    """`time_step_limit` binds the chunked scan (prefill) and not a one-token step continuing a state (decode), as
    transformers' recurrent form runs it: with a limit that binds, each decode step's logprob is transformers'."""
    hf = save_hf_model("mamba2", tmp_path, time_step_limit=(0.0, 0.3))
    save_byte_tokenizer(tmp_path)
    prompt = list(range(30, 50))
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    want = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens, strict=True)]
    llm = LLM(str(tmp_path), EngineConfig.of(dtype="float32", compile=False, max_model_len=64, max_num_seqs=2))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == tokens
    assert max(abs(lp.logprob - w) for lp, w in zip(got.logprobs, want, strict=True)) < 1e-4
