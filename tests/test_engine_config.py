"""The engine's configuration: one field is one option, by name in Python and on the command line."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from keel.cli import build_parser
from keel.cli.config_options import (
    add_dataclass_options,
    add_engine_options,
    dataclass_from_args,
    engine_config_from_args,
    field_docs,
)
from keel.errors import KeelError
from keel.serve.config import CacheConfig, EngineConfig, option_owners


def _serve_parser() -> argparse.ArgumentParser:
    sub = build_parser()._subparsers._group_actions[0]
    return sub.choices["serve"]


def test_option_names_are_unique_and_each_has_its_help():
    owners = option_owners()  # raises on a name in two parts
    assert owners["block_size"] == "cache" and owners["quantize"] == "quant"
    assert owners["tensor_parallel_size"] == "parallel" and owners["max_num_seqs"] == "scheduler"
    for part, kind in EngineConfig.parts().items():
        docs = field_docs(kind)
        missing = [f.name for f in dataclasses.fields(kind) if not docs.get(f.name)]
        assert missing == [], f"{part}: fields without a docstring (their --help): {missing}"


def test_every_field_is_a_serve_option_with_the_field_docstring_as_help():
    actions = {a.dest: a for a in _serve_parser()._actions}
    for kind in EngineConfig.parts().values():
        docs = field_docs(kind)
        for f in dataclasses.fields(kind):
            assert f.name in actions, f"--{f.name.replace('_', '-')} is not an option of keel serve"
            assert actions[f.name].help == docs[f.name].replace("%", "%%")
    assert "speculative_config" in actions


def test_types_give_choices_pairs_and_lists():
    args = _serve_parser().parse_args(
        [
            "m",
            "--kv-cache-dtype",
            "int8",
            "--no-enable-prefix-caching",
            "--quant-keep",
            "lm_head,*.experts",
            "--quantize",
            "int4",
            "-pp",
            "2",
            "--expert-cache",
            "50%",
            "--speculative-config",
            '{"method": "ngram"}',
        ]
    )
    config = engine_config_from_args(args)
    assert config.cache.kv_cache_dtype == "int8" and config.cache.enable_prefix_caching is False
    assert config.quant.quant_keep == ("lm_head", "*.experts") and config.quant.quantize == "int4"
    assert config.parallel.pipeline_parallel_size == 2 and config.offload.expert_cache == "50%"
    assert config.speculative.method == "ngram"
    defaults = engine_config_from_args(_serve_parser().parse_args(["m"]))
    assert defaults == EngineConfig()
    with pytest.raises(SystemExit):
        _serve_parser().parse_args(["m", "--kv-cache-dtype", "fp8"])  # Literal choices


def test_a_new_field_is_a_new_option():
    """What adding an engine option takes: a field with its docstring. No parser or copy code changes."""

    @dataclasses.dataclass
    class Extra:
        """Extra options"""

        window_budget: int = 7
        """tokens the example keeps"""

        eager: bool = False
        """an example switch"""

    parser = argparse.ArgumentParser()
    add_dataclass_options(parser, Extra)
    got = dataclass_from_args(Extra, parser.parse_args(["--window-budget", "9", "--eager"]))
    assert got == Extra(window_budget=9, eager=True)
    assert "tokens the example keeps" in parser.format_help()


def test_of_routes_names_to_their_part_and_refuses_unknown_ones():
    config = EngineConfig.of(block_size=8, max_num_seqs=3, quantize="int8", speculative_config={"method": "ngram"})
    assert config.cache == CacheConfig(block_size=8)
    assert config.scheduler.max_num_seqs == 3 and config.quant.quantize == "int8"
    assert config.speculative.num_speculative_tokens == 4
    with pytest.raises(KeelError, match="unknown engine option 'max_seqs'"):
        EngineConfig.of(max_seqs=3)
    changed = config.replace(max_num_seqs=5, tensor_parallel_size=2)
    assert changed.scheduler.max_num_seqs == 5 and changed.parallel.world_size == 2
    assert config.scheduler.max_num_seqs == 3  # a copy


def test_option_errors_come_before_any_model_loads():
    with pytest.raises(KeelError, match="--quant-keep-as needs a quantized model"):
        EngineConfig.of(quant_keep_as="int8", quantize="none")
    with pytest.raises(KeelError, match="--expert-cache"):
        EngineConfig.of(expert_cache="lots")
    with pytest.raises(KeelError, match="speculative config: unknown key"):
        EngineConfig.of(speculative_config={"method": "ngram", "k": 2})
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    with pytest.raises(KeelError, match="--speculative-config: not valid JSON"):
        engine_config_from_args(parser.parse_args(["--speculative-config", "{"]))


def test_a_max_model_len_past_the_models_context_is_refused_unless_allowed(tmp_path, monkeypatch):
    """As vLLM: the context is max_position_embeddings, stretched by a linear or YaRN factor (from YaRN's original
    context; not by dynamic NTK's, unlike vLLM); longer is a one-line error naming the variable that allows it."""
    from keel.config import ModelConfig, RopeScaling
    from keel.serve import LLM
    from keel.serve.model_len import ALLOW_ENV, check_model_len, derived_max_model_len
    from tiny_models import save_byte_tokenizer, save_hf_model

    base = dict(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2)
    plain = ModelConfig(**base, num_kv_heads=2, head_dim=16, max_position_embeddings=2048)
    yarn = dataclasses.replace(plain, rope_scaling=RopeScaling("yarn", 4.0, original_max_position_embeddings=1024))
    llama3 = dataclasses.replace(plain, rope_scaling=RopeScaling("llama3", 8.0, original_max_position_embeddings=1024))
    dynamic = dataclasses.replace(plain, rope_scaling=RopeScaling("dynamic", 4.0))  # not stretched (keel.config)
    assert [derived_max_model_len(c) for c in (plain, yarn, llama3, dynamic)] == [2048, 4096, 2048, 2048]
    check_model_len(4096, yarn)
    with pytest.raises(KeelError, match=f"--max-model-len 4097 .* context of 4096 tokens.*{ALLOW_ENV}=1"):
        check_model_len(4097, yarn)
    save_hf_model("llama", tmp_path)  # max_position_embeddings 2048
    save_byte_tokenizer(tmp_path)
    with pytest.raises(KeelError, match="--max-model-len 4096 is longer than the model's context of 2048"):
        LLM(str(tmp_path), EngineConfig.of(dtype="float32", compile=False, max_model_len=4096))
    monkeypatch.setenv(ALLOW_ENV, "1")
    assert (
        LLM(str(tmp_path), EngineConfig.of(dtype="float32", compile=False, max_model_len=4096)).engine.max_model_len
        == 4096
    )
