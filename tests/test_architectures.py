"""Every supported architecture against transformers: logits, greedy decoding, align, counts."""

from __future__ import annotations

import pytest
import torch

from keel.cli import main as keel_main
from keel.quant.loading import load_model
from keel.serve.sampling import SamplingParams
from reference_generate import stream_tokens
from tiny_models import TINY_CONFIGS, save_hf_model

ARCHS = list(TINY_CONFIGS)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    models = {}
    for name in ARCHS:
        models[name] = (root / name, save_hf_model(name, root / name))
    return models


def _max_rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("name", ARCHS)
def test_logits_match_transformers(tiny_dirs, name):
    directory, hf = tiny_dirs[name]
    keel = load_model(directory, "float32").model
    # Longer than twice the sliding window (8) of the windowed configs.
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, ours = hf(tokens).logits, keel(tokens)
    assert _max_rel(ours, ref) <= 1e-4
    # Declared widths are the weights' (a tied head's too): UpcastLinear, quantization and sharding read them.
    for module_name, m in keel.named_modules():
        if isinstance(m, torch.nn.Linear):
            assert tuple(m.weight.shape) == (m.out_features, m.in_features), module_name


@pytest.mark.parametrize("name", ARCHS)
def test_greedy_tokens_match_transformers_generate(tiny_dirs, name):
    directory, hf = tiny_dirs[name]
    keel = load_model(directory, "float32").model
    prompt = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    # No EOS on either side: 32 tokens come out whatever the random model predicts.
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=32, do_sample=False, pad_token_id=0)[0, 12:].tolist()
    ours = list(
        stream_tokens(keel, prompt[0].tolist(), SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    )
    assert len(ours) == 32
    assert ours == ref


@pytest.mark.parametrize("name", ARCHS)
def test_keel_align_passes(tiny_dirs, name, capsys):
    directory, _ = tiny_dirs[name]
    assert keel_main(["align", str(directory)]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "logits" in out


@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "qwen2_moe",
        "granite",
        "phi3",
        "stablelm",
        "stablelm-parallel",
        "stablelm-qk-norm",
        "cohere-qk-norm",
        "gpt_neox",
        "olmo2",
        "gemma3",
        "gemma2",
        "gpt_oss",
        "recurrent_gemma",
    ],
)
def test_align_bfloat16_passes(tiny_dirs, name, capsys):
    directory, _ = tiny_dirs[name]
    assert keel_main(["align", str(directory), "--dtype", "bfloat16"]) == 0
    assert "PASS (bfloat16" in capsys.readouterr().out


def test_align_names_first_divergent_layer(tiny_dirs, monkeypatch, capsys):
    """Break layer 1 of keel's model: align must fail and name layer 1."""
    import keel.tools.align as align_mod

    directory, _ = tiny_dirs["llama"]
    real_load = align_mod.load_model

    def broken_load(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        with torch.no_grad():
            loaded.model.layers["1"].mlp.down_proj.weight.mul_(1.5)
        return loaded

    monkeypatch.setattr(align_mod, "load_model", broken_load)
    assert keel_main(["align", str(directory)]) == 1
    assert "first divergence at 1" in capsys.readouterr().out


@pytest.mark.parametrize("name", ARCHS)
def test_parameter_counts_match_transformers(tiny_dirs, name):
    directory, hf = tiny_dirs[name]
    config = load_model(directory).config
    assert config.param_counts()["total"] == sum(p.numel() for p in hf.parameters())


def test_batched_decode_with_different_lengths_matches_single(tiny_dirs):
    """Rows at different positions in one contiguous cache give the same tokens as one by one."""
    from reference_generate import ContiguousKVCache

    directory, _ = tiny_dirs["qwen2-sliding"]
    model = load_model(directory).model
    prompts = [list(range(5, 25)), list(range(40, 51))]
    singles = [
        list(stream_tokens(model, p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))) for p in prompts
    ]

    cache = ContiguousKVCache(model.config, 2, 40, torch.float32)
    width = max(len(p) for p in prompts)
    tokens = torch.tensor([p + [0] * (width - len(p)) for p in prompts])  # right padding
    positions = torch.arange(width).expand(2, width)
    with torch.no_grad():
        logits = model(tokens, positions=positions, cache=cache)
        lengths = torch.tensor([len(p) for p in prompts])
        nxt = logits[torch.arange(2), lengths - 1].argmax(-1)
        out = [[t] for t in nxt.tolist()]
        for _ in range(9):
            logits = model(nxt[:, None], positions=lengths[:, None], cache=cache)
            nxt = logits[:, -1].argmax(-1)
            lengths = lengths + 1
            for row, t in zip(out, nxt.tolist(), strict=True):
                row.append(t)
    assert out == singles


def test_moe_grouped_experts_equal_naive_per_token():
    from keel.config import ModelConfig
    from keel.model.moe import MoE

    config = ModelConfig(
        architecture="qwen2_moe",
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        head_dim=8,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=12,
        shared_expert_intermediate_size=20,
        norm_topk_prob=False,
    )
    torch.manual_seed(0)
    moe = MoE(config)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        got = moe(x)
        flat = x.reshape(-1, 16)
        probs = torch.softmax(flat @ moe.router.weight.T, dim=-1)
        expected = []
        for t in range(flat.shape[0]):
            weights, ids = torch.topk(probs[t], 2)
            acc = torch.zeros(16)
            for w, e in zip(weights, ids, strict=True):
                gate, up = (moe.experts.gate_up_proj[e] @ flat[t]).chunk(2)
                acc += w * (moe.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
            shared = moe.shared_expert(flat[t])
            acc += torch.sigmoid(moe.shared_expert_gate(flat[t])) * shared
            expected.append(acc)
    torch.testing.assert_close(got.reshape(-1, 16), torch.stack(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "act"),
    [
        ("mixtral", "gelu_pytorch_tanh"),  # the routed experts take hidden_act too, not SiLU always
        ("qwen2_moe", "gelu"),  # ... and the shared expert
        ("llama", "relu"),
        ("llama", "quick_gelu"),
        ("llama", "gelu_fast"),
        ("starcoder2", "gelu"),  # its own default is the tanh GELU; a named one is read
    ],
)
def test_every_mlp_takes_the_configs_activation(tmp_path, name, act):
    hf = save_hf_model(name, tmp_path, hidden_act=act)
    loaded = load_model(tmp_path, "float32")
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert _max_rel(loaded.model(tokens), hf(tokens).logits) < 1e-5


@pytest.mark.parametrize("rope_type", ["llama3", "yarn"])
def test_a_top_level_pretraining_context_wins_over_the_rope_parameters(tmp_path, rope_type):
    """transformers moves a config's top-level original_max_position_embeddings into its llama3 / yarn / longrope
    parameters over theirs: keel reads the same context (16 against 64 here moves every rotated frequency)."""
    import json

    import transformers

    rope = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
    if rope_type == "llama3":
        rope.update(low_freq_factor=1.0, high_freq_factor=4.0)
    save_hf_model("llama", tmp_path, max_position_embeddings=256, rope_parameters=rope)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "original_max_position_embeddings": 64}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["original_max_position_embeddings"] == 64
    loaded = load_model(tmp_path, "float32")
    assert loaded.model.config.rope_scaling.original_max_position_embeddings == 64
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert _max_rel(loaded.model(tokens), hf(tokens).logits) < 1e-5


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemma_2_and_3_read_their_gelu_as_named(tmp_path, name):
    """hidden_activation "gelu" is the exact (erf) GELU in Gemma 2 and 3 (Gemma 1 reads it as the tanh one)."""
    hf = save_hf_model(name, tmp_path, hidden_activation="gelu")
    loaded = load_model(tmp_path, "float32")
    assert loaded.model.config.hidden_act == "gelu"
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert _max_rel(loaded.model(tokens), hf(tokens).logits) < 1e-5


def test_olmo3s_older_rope_scaling_scales_its_global_layers_only(tmp_path):
    """An OLMo 3 config.json in transformers 4's form (a top-level rope_theta and rope_scaling): Olmo3Config gives
    the scaling to the global layers and plain RoPE to the sliding ones; keel reads it so, and exports it in the
    per-kind form transformers reads back the same."""
    import json

    import transformers

    from keel.weights.convert import convert

    save_hf_model("olmo3", tmp_path / "hf", max_position_embeddings=64)
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    config.pop("rope_parameters")
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "attention_factor": 1.2}
    path.write_text(json.dumps({**config, "rope_theta": 500000.0, "rope_scaling": yarn}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.rope_parameters["sliding_attention"]["rope_type"] == "default"
    loaded = load_model(tmp_path / "hf", "float32")
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits
        assert _max_rel(loaded.model(tokens), want) < 1e-5
        convert(tmp_path / "hf", tmp_path / "out")
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
        assert _max_rel(again(tokens).logits, want) < 1e-5


@pytest.mark.parametrize("tie", [True, False])
def test_ernie_moes_biases_reach_its_head(tmp_path, tie):
    """Ernie4_5_MoeForCausalLM's head has a bias where `use_bias` (its dense sibling's has none)."""
    hf = save_hf_model("ernie4_5_moe", tmp_path, use_bias=True, tie_word_embeddings=tie)
    loaded = load_model(tmp_path, "float32")
    assert loaded.model.config.lm_head_bias
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert _max_rel(loaded.model(tokens), hf(tokens).logits) < 1e-5


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("minimax_m2", dict(sliding_window=8, attention_bias=True)),  # transformers' MiniMaxM2 reads neither
        # a null pattern beside the file's layer_types: those decide
        ("exaone_moe", dict(sliding_window_pattern=None, layer_types=["sliding_attention"] * 3 + ["full_attention"])),
        ("exaone4", dict(sliding_window_pattern=None)),
        ("gptj", dict(rope_theta=500.0, rope_parameters={"rope_type": "linear", "factor": 4.0})),  # fixed sinusoids
        ("codegen", dict(rope_theta=500.0, rope_parameters={"rope_type": "linear", "factor": 4.0})),
        ("opt", dict(rms_norm_eps=0.5)),  # torch's LayerNorm eps, which OPT never sets
        ("opt", dict(_remove_final_layer_norm=True)),  # the pre-norm block without its final norm
        ("opt-350m", dict(_remove_final_layer_norm=True)),  # which OPT-350m's post-norm block has none of anyway
        # attention_types and window_size decide, not a sliding_window or layer_types beside them
        ("gpt_neo", dict(sliding_window=3, layer_types=["sliding_attention"] * 3)),
        ("biogpt", dict(layer_norm_eps=0.5)),  # a key BioGPT's model never reads (its norms keep torch's 1e-5)
    ],
)
def test_config_fields_a_family_ignores_or_defers_are_read_as_transformers_reads_them(tmp_path, name, overrides):
    hf = save_hf_model(name, tmp_path, **overrides)
    loaded = load_model(tmp_path, "float32")
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert _max_rel(loaded.model(tokens), hf(tokens).logits) < 1e-5
