"""MiniMax's lightning attention (keel.model.lightning) against transformers' MiniMaxLightningAttention, its state
continued across calls, and the MiniMax config's refusals."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from keel.config import ModelConfig
from keel.errors import ConfigError
from keel.model.lightning import LightningAttention, lightning_chunked, lightning_steps, slopes
from tiny_models import COMMON, TINY_CONFIGS


def _hf_config(**overrides):
    transformers = pytest.importorskip("transformers")
    _, _, extra = TINY_CONFIGS["minimax"]
    return transformers.MiniMaxConfig(**{**COMMON, **extra, **overrides}, architectures=["MiniMaxForCausalLM"])


@pytest.mark.parametrize("length", [1, 5, 64, 150])
@pytest.mark.parametrize("layer", [1, 2])
def test_lightning_layer_matches_transformers(length, layer):
    """The whole layer (SiLU'd qkv, the decayed recurrence, the norm over all heads, the sigmoid gate, out_proj) from
    an empty state; transformers runs it in blocks of 16, keel in chunks of 64: neither's blocking shows."""
    modeling = pytest.importorskip("transformers.models.minimax.modeling_minimax")
    hf_config = _hf_config(block_size=16)
    torch.manual_seed(0)
    hf = modeling.MiniMaxLightningAttention(hf_config, layer)
    with torch.no_grad():
        hf.norm.weight.uniform_(0.5, 1.5)
    config = ModelConfig.from_hf(hf_config.to_dict())
    ours = LightningAttention(config, layer)
    ours.load_state_dict({k: v for k, v in hf.state_dict().items() if k.endswith("weight")})
    x = torch.randn(2, length, hf_config.hidden_size)
    with torch.no_grad():
        want, _ = hf(x, None, None)
        got = ours(x, SimpleNamespace(cache=None))
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    torch.testing.assert_close(ours.slopes, hf.slope_rate.flatten())


def test_a_sequence_continues_from_its_state_across_calls():
    """A prefill split anywhere equals one prefill; token-by-token steps equal the chunked form."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 150, 8, generator=g) for _ in range(3))
    s = slopes(4, 1, 4)
    state = torch.randn(2, 4, 8, 8, generator=g) * 0.1
    whole, whole_state = lightning_chunked(q, k, v, s, state)
    first, mid = lightning_chunked(q[:, :, :37], k[:, :, :37], v[:, :, :37], s, state)
    rest, end = lightning_chunked(q[:, :, 37:], k[:, :, 37:], v[:, :, 37:], s, mid)
    steps, steps_state = lightning_steps(q, k, v, s, state)
    pairs = [(torch.cat([first, rest], dim=2), whole), (end, whole_state), (steps, whole), (steps_state, whole_state)]
    for got, want in pairs:  # relative to the largest entry: sums of ~150 unit products
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def test_minimax_config_refusals():
    hf = _hf_config().to_dict()
    config = ModelConfig.from_hf(hf)
    assert config.layer_types == ["full_attention", "lightning", "lightning", "full_attention"]
    assert config.normed_residual and config.lightning_residual_beta == 0.8 and config.mlp_residual_alpha == 0.7
    with pytest.raises(ConfigError, match="sliding_window"):
        ModelConfig.from_hf({**hf, "sliding_window": 8})
    with pytest.raises(ConfigError, match="normed_residual"):
        dataclasses.replace(config, normed_residual=False).validate()
    with pytest.raises(ConfigError, match="normed_residual"):
        dataclasses.replace(config, parallel_residual=True).validate()


def test_a_minimax_engine_refuses_what_recurrent_layers_do_not_run(tmp_path):
    """Speculative decoding is refused by name; prefix caching is turned off and decode is not compiled."""
    from keel.errors import KeelError
    from keel.serve import LLM, EngineConfig
    from tiny_models import save_byte_tokenizer, save_hf_model

    save_hf_model("minimax", tmp_path)
    save_byte_tokenizer(tmp_path)
    speculative = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(KeelError, match="lightning"):
        LLM(str(tmp_path), EngineConfig.of(dtype="float32", compile=False, speculative_config=speculative))
    llm = LLM(str(tmp_path), EngineConfig.of(dtype="float32", compile=True, max_model_len=64))
    assert not llm.engine.kv.enable_prefix_caching and llm.engine.runner.compiled is None
