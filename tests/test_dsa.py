"""DeepSeek Sparse Attention (keel.model.dsa: DeepSeek-V3.2, GLM-5): the indexer's top-k selection against
transformers (where it matters: index_topk below the prompts' lengths), dense latent attention where no query sees
more than index_topk keys, the paged cache's index keys through prefix caching and chunked prefill, training with
the indexer frozen, and what is refused by name. Logits, greedy tokens, align, counts and convert of the two tiny
families are in tests/test_architectures.py and tests/test_convert.py with every tiny family."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from keel.config import ModelConfig
from keel.errors import ConfigError, KeelError
from keel.model.dsa import top_k_mask
from keel.model.kv_size import kv_cache_bytes
from keel.quant.loading import load_model
from keel.serve.engine import EngineConfig
from keel.serve.kv_quant import make_paged_kv_cache
from keel.serve.llm import LLM
from keel.serve.sampling import SamplingParams
from tiny_models import save_byte_tokenizer, save_hf_model

FAMILIES = ["deepseek_v32", "glm_moe_dsa"]


def _dense(hf: torch.nn.Module) -> None:
    """transformers' model with an index_topk no prompt reaches: dense latent attention."""
    for module in hf.modules():
        if hasattr(module, "index_topk"):
            module.index_topk = 10**6


def test_top_k_keeps_the_best_visible_keys_and_every_key_of_a_short_context():
    scores = torch.tensor([[[5.0, 1.0, 3.0, 9.0], [5.0, 1.0, 3.0, 9.0], [5.0, 1.0, 3.0, 9.0]]])
    allowed = torch.ones(3, 4, dtype=torch.bool).tril()[None]  # query i sees keys 0..i
    keep = top_k_mask(scores, allowed, 2)
    assert keep[0].tolist() == [[True, False, False, False], [True, True, False, False], [True, False, True, False]]
    assert top_k_mask(scores, allowed, 4).equal(allowed)


def test_the_configs_are_read_and_written_as_their_config_classes_define_them(tmp_path):
    save_hf_model("glm_moe_dsa", tmp_path)
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    assert (config.index_topk, config.index_n_heads, config.index_head_dim) == (5, 16, 12)
    assert config.index_rope_interleave and config.rope_interleave
    assert config.indexer_types == ["full", "shared", "shared", "full"]
    assert [config.index_source(i) for i in range(4)] == [0, 0, 0, 3] and config.dsa_index_layers() == [0, 3]
    assert config.to_hf()["indexer_types"] == ["full", "shared", "shared", "full"]
    save_hf_model("deepseek_v32", tmp_path / "v32")
    v32 = ModelConfig.from_json_file(tmp_path / "v32/config.json")
    assert not v32.index_rope_interleave and v32.indexer_types == [] and v32.mlp_only_layers == [0]
    assert "rope_interleave" not in v32.to_hf()
    # GLM-5's pattern keys, as GlmMoeDsaConfig derives indexer_types from them
    hf = {**config.to_hf(), "indexer_types": None, "index_topk_pattern": "FSFS"}
    assert ModelConfig.from_hf(hf).indexer_types == ["full", "shared", "full", "shared"]
    hf = {**hf, "index_topk_pattern": None, "index_topk_freq": 2, "index_skip_topk_offset": 1}
    assert ModelConfig.from_hf(hf).indexer_types == ["full", "shared", "full", "shared"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"index_topk_pattern": "SFFF", "indexer_types": None}, "the first full"),
        ({"q_lora_rank": None}, "q_lora_rank null"),
        ({"index_topk": 0}, "index_topk must be positive"),
        ({"index_head_dim": 4}, "index_head_dim (4) must be at least qk_rope_head_dim (8)"),
        ({"layer_types": ["full_attention"] * 4}, "layer_types must be indexed_attention"),
    ],
)
def test_what_the_families_cannot_run_is_refused_by_name(tmp_path, edit, message):
    save_hf_model("glm_moe_dsa", tmp_path)
    hf = {**ModelConfig.from_json_file(tmp_path / "config.json").to_hf(), **edit}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_hf(hf)


def test_layer_types_of_the_wrong_length_are_one_line_beside_an_indexer(tmp_path):
    save_hf_model("glm_moe_dsa", tmp_path)
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    with pytest.raises(ConfigError, match="layer_types must have one entry per layer"):  # not an IndexError
        dataclasses.replace(config, layer_types=config.layer_types[:-1]).validate()


def test_what_a_familys_config_cannot_hold_is_refused_on_export(tmp_path):
    """DeepSeek-V3.2's indexer rotates halves and every layer has one; GLM-5's rotates pairs: a config otherwise
    is refused by name when written, not written as another model."""
    save_hf_model("glm_moe_dsa", tmp_path / "glm")
    glm = ModelConfig.from_json_file(tmp_path / "glm" / "config.json")
    v32 = dataclasses.replace(glm, architecture="deepseek_v32", index_rope_interleave=False)
    with pytest.raises(ConfigError, match="indexer_types with shared layers"):
        v32.to_hf()
    assert ModelConfig.from_hf(dataclasses.replace(v32, indexer_types=[]).to_hf()).indexer_types == []
    for config in (
        dataclasses.replace(v32, indexer_types=[], index_rope_interleave=True),
        dataclasses.replace(glm, index_rope_interleave=False),
    ):
        with pytest.raises(ConfigError, match="index_rope_interleave"):
            config.to_hf()


def test_an_indexer_needs_latent_attention():
    with pytest.raises(ConfigError, match="needs multi-head latent attention"):
        ModelConfig(
            architecture="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
            num_kv_heads=2, head_dim=8, index_topk=4,
        )  # fmt: skip


@pytest.mark.parametrize("name", FAMILIES)
def test_short_contexts_are_dense_latent_attention_and_longer_ones_are_not(tmp_path, name):
    """No query of a 5-token prompt sees more than index_topk (4 or 5) keys: the selection keeps every key. Over 24
    tokens it keeps index_topk of them, and the logits are transformers' sparse ones, not its dense ones."""
    hf = save_hf_model(name, tmp_path)
    keel = load_model(tmp_path, "float32").model
    short = torch.randint(0, 256, (1, 4), generator=torch.Generator().manual_seed(3))
    long = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        sparse_short, sparse_long, ours_long = hf(short).logits, hf(long).logits, keel(long)
        ours_short = keel(short)
        _dense(hf)
        dense_short, dense_long = hf(short).logits, hf(long).logits
    torch.testing.assert_close(sparse_short, dense_short)
    torch.testing.assert_close(ours_short, dense_short, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_long, sparse_long, rtol=1e-5, atol=1e-5)
    assert (dense_long - sparse_long).abs().max() > 1e-2


def test_the_cache_keeps_an_index_key_per_indexing_layer_and_refuses_int8(tmp_path):
    save_hf_model("glm_moe_dsa", tmp_path)
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    dense = dataclasses.replace(config, index_topk=0, index_n_heads=0, index_head_dim=0, indexer_types=[])
    row = (config.kv_lora_rank + config.qk_rope_head_dim) * 4 * config.num_layers
    assert kv_cache_bytes(dense, torch.float32) == row
    assert kv_cache_bytes(config, torch.float32) == row + 2 * config.index_head_dim * 4  # layers 0 and 3 index
    cache = make_paged_kv_cache(config, 4, 8, torch.float32)
    assert [tuple(k.shape) for k in cache.index_keys] == [(1, 32, 12), (1, 0, 12), (1, 0, 12), (1, 32, 12)]
    assert cache.nbytes() == kv_cache_bytes(config, torch.float32, tokens=32)
    with pytest.raises(KeelError, match="int8 does not run with DeepSeek Sparse Attention"):
        make_paged_kv_cache(config, 4, 8, torch.float32, kv_cache_dtype="int8")


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_the_engine_gives_transformers_sparse_greedy_tokens(tmp_path, name):
    """Through the engine: blocks of 4 tokens, chunks of at most 8 scheduled tokens a step (prefill chunks and
    decodes in one step), a prompt's prefix from the prefix cache (its index keys with it); the prompts are longer
    than index_topk, and transformers' dense tokens differ from its sparse ones."""
    hf = save_hf_model(name, tmp_path)
    save_byte_tokenizer(tmp_path)
    hf.generation_config.eos_token_id = None
    shared = list(range(40, 60))  # five blocks of 4
    prompts = [shared + [7, 9, 11], shared + [100, 3], list(range(5, 16))]

    def generate() -> list[list[int]]:
        with torch.no_grad():
            return [
                hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=0)[
                    0, len(ids) :
                ].tolist()
                for ids in prompts
            ]

    expected = generate()
    _dense(hf)
    assert generate() != expected
    config = EngineConfig.of(
        dtype="float32",
        compile=False,
        num_blocks=64,
        max_model_len=128,
        block_size=4,
        enable_prefix_caching=True,
        max_num_batched_tokens=8,
        max_num_seqs=4,
    )
    llm = LLM(str(tmp_path), config)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts[0], greedy, use_tqdm=False)[0]
    rest = llm.generate(prompts[1:], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in [first, *rest]] == expected
    assert rest[0].num_cached_tokens >= 16  # the shared blocks (and their index keys) came from the prefix cache


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 3},
        {"method": "draft_model", "num_speculative_tokens": 3, "model": "DRAFT"},
    ],
    ids=["ngram", "draft-model"],
)
def test_speculative_decoding_gives_the_plain_greedy_tokens(tmp_path, spec):
    """Drafts verified as multi-token chunks, each query masked to its own selection; rejected drafts' index keys
    overwritten; few blocks, so requests are preempted and recomputed."""
    import random

    from keel.serve.engine import LLMEngine
    from test_speculative import copying_prompts, run

    save_hf_model("glm_moe_dsa", tmp_path / "target")
    save_byte_tokenizer(tmp_path / "target")
    if spec.get("model") == "DRAFT":
        save_hf_model("glm_moe_dsa", tmp_path / "draft", seed=1)  # another random model: drafts rejected
        save_byte_tokenizer(tmp_path / "draft")
        spec = {**spec, "model": str(tmp_path / "draft")}
    target = load_model(tmp_path / "target", "float32")
    prompts = copying_prompts(8)
    rng = random.Random(1)
    params = [SamplingParams(max_tokens=rng.randrange(1, 30), temperature=0.0, ignore_eos=True) for _ in prompts]
    config = dict(num_blocks=30, block_size=4, max_num_batched_tokens=64, max_model_len=96, dtype="float32")
    plain = run(LLMEngine(target, EngineConfig.of(**config)), prompts, params)
    engine = LLMEngine(target, EngineConfig.of(**config, speculative_config={**spec, "disable_by_batch_size": 64}))
    fast = run(engine, prompts, params, check_blocks=True)
    assert {r: o.outputs[0].token_ids for r, o in fast.items()} == {r: o.outputs[0].token_ids for r, o in plain.items()}
    stats = engine.stats()
    assert stats["num_preemptions_total"] > 0 and stats["spec_decode_num_draft_tokens"] > 0
    if spec["method"] == "ngram":
        assert stats["spec_decode_num_accepted_tokens"] > 0


def test_training_leaves_the_indexer_frozen_and_trains_the_rest(tmp_path):
    """The selection is computed without gradients (as transformers and DeepSeek compute it): a backward pass gives
    the indexer's weights none and the attention's their own."""
    save_hf_model("deepseek_v32", tmp_path)
    model = load_model(tmp_path, "float32").model
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    model.train()
    model(tokens).float().logsumexp(-1).mean().backward()
    attention = model.layers["1"].self_attn
    assert all(p.grad is None for p in attention.indexer.parameters())
    assert attention.q_b_proj.weight.grad is not None and attention.q_a_proj.weight.grad.abs().sum() > 0


def test_pipelines_of_shared_selections_and_tensor_parallel_training_are_refused_by_name(tmp_path):
    """Tensor-parallel serving replicates the indexer (tests/test_serve_parallel_engine.py); a pipeline stage may not
    hold the layer whose selection a GLM-5 layer shares, and keel's training plan does not place the indexer."""
    from types import SimpleNamespace

    from keel.serve.parallel.load import check_parallel_model
    from keel.train import config as train_config
    from keel.weights.shard import TensorParallelLayout

    save_hf_model("glm_moe_dsa", tmp_path)
    config = ModelConfig.from_json_file(tmp_path / "config.json")
    with pytest.raises(KeelError, match="pipeline-parallel serving does not run DSA layers sharing"):
        check_parallel_model(config, tmp_path, 1, 2)
    check_parallel_model(config, tmp_path, 2, 1)
    assert TensorParallelLayout(config, 2, 0).shard_of("layers.0.self_attn.indexer.wq_b.weight") is None
    check_parallel_model(dataclasses.replace(config, indexer_types=[]), tmp_path, 1, 2)

    def check(**parallel: int) -> None:
        cfg = SimpleNamespace(parallel=train_config.ParallelSection(**parallel), moe=train_config.MoESection())
        train_config._check_model_fits(cfg, config, 1, lambda message: ConfigError(message))

    with pytest.raises(ConfigError, match="tp > 1 is not supported for DeepSeek Sparse Attention"):
        check(tp=2)
    with pytest.raises(ConfigError, match="pp > 1 is not supported for DSA layers sharing"):
        check(pp=2)


def test_the_multi_token_prediction_layer_after_the_last_is_not_read(tmp_path):
    """DeepSeek-V3.2 stores its MTP layer as model.layers.61 (GLM-5: 78), which transformers ignores on load: so
    does keel."""
    from safetensors.torch import load_file, save_file

    save_hf_model("deepseek_v32", tmp_path)
    file = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(file)
    mtp = {k.replace("layers.2.", "layers.3."): v.clone() for k, v in tensors.items() if ".layers.2." in k}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **mtp}, file, metadata={"format": "pt"})
    assert load_model(tmp_path, "float32").config.num_layers == 3


def test_steps_whose_queries_see_at_most_index_topk_keys_attend_densely(tmp_path, monkeypatch):
    """With index_topk 64 and prompts and outputs within it, every step takes the dense path (any backend; the
    indexed one is never called) and gives transformers' tokens; the index keys are still stored for later steps."""
    from keel.serve.kv_cache import PagedKVCache

    hf = save_hf_model("deepseek_v32", tmp_path, index_topk=64)
    save_byte_tokenizer(tmp_path)
    hf.generation_config.eos_token_id = None
    prompt = list(range(40, 60))
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    monkeypatch.setattr(PagedKVCache, "_attend_indexed", lambda *args: pytest.fail("the indexed path ran"))
    config = EngineConfig.of(dtype="float32", compile=False, num_blocks=32, max_model_len=64, block_size=8)
    llm = LLM(str(tmp_path), config)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == expected[0, 20:].tolist()
    assert llm.engine.cache.index_keys[0].abs().sum() > 0
