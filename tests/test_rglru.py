"""Griffin's recurrent block (keel.model.rglru) against transformers' RecurrentGemmaRecurrentBlock, its state
continued across calls as serving continues a sequence, the RecurrentGemma config's readings and refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from keel.config import ModelConfig
from keel.errors import ConfigError, KeelError
from keel.model.attention import AttentionMetadata
from keel.model.recurrent import RecurrentStates
from keel.model.rglru import RGLRUBlock, lru_chunked, lru_scan
from tiny_models import COMMON, TINY_CONFIGS, build_hf_model


def _hf_dict(**overrides) -> dict:
    transformers = pytest.importorskip("transformers")
    _, _, extra = TINY_CONFIGS["recurrent_gemma"]
    config = transformers.RecurrentGemmaConfig(**{**COMMON, **extra, **overrides})
    return {**config.to_dict(), "architectures": ["RecurrentGemmaForCausalLM"]}


def _blocks(layer: int = 0):
    """transformers' recurrent block of the tiny model (its gate biases and norms perturbed) and keel's with its
    weights."""
    hf = build_hf_model("recurrent_gemma")
    block = hf.model.layers[layer].temporal_block
    config = ModelConfig.from_hf(_hf_dict())
    ours = RGLRUBlock(config, layer)
    ours.load_state_dict(block.state_dict())
    return config, block, ours


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("length", [1, 5, 40])
def test_recurrent_block_matches_transformers(length):
    """Both branches, the convolution, the gates, the sqrt(1 - a^2) scaling and the float32 scan, from an empty
    state."""
    _, block, ours = _blocks()
    x = torch.randn(2, length, 64, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(length).expand(2, length)
    with torch.no_grad():
        want, _ = block(x, positions, None, use_cache=False)
        got = ours(x, AttentionMetadata.for_sequence(2, length))
    assert _rel(got, want) < 1e-5


def test_a_token_at_position_0_resets_the_recurrence_as_transformers_does():
    """Packed sequences: the second starts at position 0 mid-row, where the LRU forgets (a = 0) and leaves its input
    unscaled; the convolution reaches across the boundary in transformers and in keel alike."""
    _, block, ours = _blocks()
    x = torch.randn(1, 20, 64, generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(12), torch.arange(8)])[None]
    with torch.no_grad():
        want, _ = block(x, positions, None, use_cache=False)
        got = ours(x, AttentionMetadata(positions=positions))
        unreset = ours(x, AttentionMetadata(positions=torch.arange(20)[None]))
    assert _rel(got, want) < 1e-5
    assert _rel(unreset, want) > 1e-3  # the reset shows


def test_the_chunked_scan_is_the_token_loop():
    """Over several chunks (of 7 here), from a given state, with a reset mid-chunk (log a = -inf: a = 0)."""
    g = torch.Generator().manual_seed(4)
    log_a = -torch.rand(2, 40, 12, generator=g) * 2
    log_a[0, 17] = float("-inf")
    x, state = torch.randn(2, 40, 12, generator=g), torch.randn(2, 12, generator=g)
    want, want_state = lru_scan(log_a.exp(), x, state)
    got, got_state = lru_chunked(log_a, x, state, chunk=7)
    assert _rel(got, want) < 1e-5 and _rel(got_state, want_state) < 1e-5


def test_gradients_are_transformers_through_resets():
    """Training: the block's gradients (the chunked scan, the reset's -inf, the bounded sqrt's derivative) equal
    transformers' where packed sequences restart at position 0; none is NaN."""
    _, block, ours = _blocks()
    x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(5))
    positions = torch.cat([torch.arange(25), torch.arange(15)])[None]
    block(x, positions, None, use_cache=False)[0].square().sum().backward()
    ours(x, AttentionMetadata(positions=positions)).square().sum().backward()
    theirs = dict(block.named_parameters())
    for name, param in ours.named_parameters():
        assert torch.isfinite(param.grad).all(), name
        assert _rel(param.grad, theirs[name].grad) < 1e-4, name


def test_a_model_built_for_training_starts_from_transformers_decays():
    """Built on the meta device and filled by the layout-independent initialisation (every parameter has a rule),
    or built plainly: the base decays spread over [0.9, 0.999] as transformers starts them."""
    from keel.model.seeded_init import init_weights_seeded, materialize
    from keel.model.transformer import Transformer

    config = ModelConfig.from_hf(_hf_dict())
    with torch.device("meta"):
        model = Transformer(config)
    materialize(model, "cpu", lambda m: init_weights_seeded(m, 0))  # the buffers (rotary's) recomputed too
    for built in (model, Transformer(config)):
        decay = (-torch.nn.functional.softplus(built.layers["1"].self_attn.rg_lru.recurrent_param)).exp()
        torch.testing.assert_close(decay[[0, -1]], torch.tensor([0.9, 0.999]), atol=1e-6, rtol=0)
        assert torch.isfinite(built(torch.tensor([[1, 2, 3]]))).all()


class _Cache:
    """The cache's one call a recurrent layer makes: this forward's spans of the states."""

    def __init__(self, states: RecurrentStates) -> None:
        self.states, self.spans = states, None

    def recurrent_spans(self, layer, meta):
        return self.spans


def test_a_sequence_continues_from_its_state_across_calls():
    """A prefill in two chunks, then one-token decodes beside another sequence's, from the served state (the
    convolution's last inputs and the LRU's float32 state): transformers' whole-sequence outputs."""
    config, block, ours = _blocks(1)
    x = torch.randn(1, 30, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, _ = block(x, torch.arange(30)[None], None, use_cache=False)
        states = RecurrentStates(config, 2, torch.float32, "cpu")
        cache = _Cache(states)
        outs = []
        for first, end in ((0, 11), (11, 25)):
            cache.spans = states.spans(1, [(0, end - first, 0)])
            meta = AttentionMetadata(positions=torch.arange(first, end)[None], cache=cache)
            outs.append(ours(x[:, first:end], meta))
        other = torch.randn(1, 1, 64)
        for t in range(25, 30):  # a decode batch of two: this sequence in slot 0, another in slot 1
            cache.spans = states.spans(1, [], torch.tensor([0, 1]), torch.tensor([0, 1]))
            meta = AttentionMetadata(positions=torch.tensor([[t], [3]]), cache=cache)
            outs.append(ours(torch.cat([x[:, t : t + 1], other]), meta)[:1])
    assert _rel(torch.cat(outs, dim=1), want) < 1e-5
    assert states.state[1].dtype == torch.float32 and states.conv[1].shape == (2, 48, 2)


def test_the_tiny_configs_window_shapes_its_logits():
    """The 40-token sequences of the logits tests pass the attention window of 8: a wider window changes transformers'
    logits, so that keel's agreement with them tests its window."""
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        narrow = build_hf_model("recurrent_gemma")(tokens).logits
        wide = build_hf_model("recurrent_gemma", attention_window_size=64)(tokens).logits
    assert torch.equal(narrow[:, :8], wide[:, :8]) and _rel(narrow, wide) > 1e-3


def test_recurrent_gemma_config_readings_and_refusals():
    hf = _hf_dict()
    config = ModelConfig.from_hf(hf)
    assert config.layer_types == ["rglru", "rglru", "sliding_attention"] and config.sliding_window == 8
    assert (config.lru_width, config.lru_conv_kernel, config.intermediate_size) == (48, 3, 64)
    assert config.rotary_dim == 8 and config.final_logit_softcapping == 5.0 and config.o_bias and config.mlp_bias
    # transformers' normalizer is a bfloat16 buffer: sqrt(2560) = 50.596 is 50.5
    release = ModelConfig.from_hf({**hf, "hidden_size": 2560, "num_attention_heads": 10, "lru_width": 2560})
    assert release.embedding_multiplier == 50.5 and release.head_dim == 256
    # transformers' alias of the window (its attribute_map)
    aliased = {k: v for k, v in hf.items() if k != "attention_window_size"}
    assert ModelConfig.from_hf({**aliased, "sliding_window": 4}).sliding_window == 4
    # the block types cycle over the layers
    assert ModelConfig.from_hf({**hf, "num_hidden_layers": 5}).layer_types[3:] == ["rglru", "rglru"]
    refused = [
        ({"embeddings_scale_by_sqrt_dim": False}, "embeddings_scale_by_sqrt_dim"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_type"),
        ({"block_types": ["recurrent", "mlp"]}, "block_types"),
        ({"logits_soft_cap": None}, "logits_soft_cap"),
        ({"lru_width": 50}, "lru_width"),
    ]
    for change, named in refused:
        with pytest.raises(ConfigError, match=named):
            ModelConfig.from_hf({**hf, **change})
    with pytest.raises(ConfigError, match="lru_conv_kernel"):
        dataclasses.replace(config, lru_conv_kernel=1).validate()


# google/recurrentgemma-2b's config.json (transformers 4.40's keys: the rotary share and base at the top level)
RELEASE_2B = {
    "architectures": ["RecurrentGemmaForCausalLM"],
    "attention_bias": False,
    "attention_window_size": 2048,
    "block_types": ["recurrent", "recurrent", "attention"],
    "bos_token_id": 2,
    "conv1d_width": 4,
    "embeddings_scale_by_sqrt_dim": True,
    "eos_token_id": 1,
    "final_w_init_variance_scale": 0.07692307692307693,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2560,
    "intermediate_size": 15360,
    "logits_soft_cap": 30.0,
    "lru_width": 2560,
    "model_type": "recurrent_gemma",
    "num_attention_heads": 10,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
    "vocab_size": 256000,
    "w_init_variance_scale": 0.01,
}


def test_the_2b_release_config_is_read_as_transformers_builds_it():
    """Half of each 256-wide head rotated, a window of 2048, 7680-wide MLPs, the embedding times 50.5; the parameter
    count of transformers' model built from the same file (on the meta device)."""
    transformers = pytest.importorskip("transformers")
    config = ModelConfig.from_hf(RELEASE_2B)
    assert (config.rotary_dim, config.sliding_window, config.intermediate_size) == (128, 2048, 7680)
    assert config.embedding_multiplier == 50.5 and config.eos_token_id == [1] and config.tie_word_embeddings
    kwargs = {k: v for k, v in RELEASE_2B.items() if k not in ("architectures", "model_type", "torch_dtype")}
    with torch.device("meta"):
        hf = transformers.RecurrentGemmaForCausalLM(transformers.RecurrentGemmaConfig(**kwargs))
    assert config.param_counts()["total"] == sum(p.numel() for p in hf.parameters()) == 2_682_862_080


@pytest.mark.slow
def test_a_recurrent_gemma_engine_refuses_what_recurrent_layers_do_not_run(tmp_path):
    """Speculative decoding and an int8 KV cache are refused by name; prefix caching is off, decode not compiled."""
    from keel.serve import LLM, EngineConfig
    from tiny_models import save_byte_tokenizer, save_hf_model

    save_hf_model("recurrent_gemma", tmp_path)
    save_byte_tokenizer(tmp_path)
    for option in (
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
        {"kv_cache_dtype": "int8"},
    ):
        with pytest.raises(KeelError, match="rglru"):
            LLM(str(tmp_path), EngineConfig.of(dtype="float32", compile=False, max_model_len=64, **option))
    llm = LLM(str(tmp_path), EngineConfig.of(dtype="float32", compile=True, max_model_len=64))
    assert not llm.engine.kv.enable_prefix_caching and llm.engine.runner.compiled is None
