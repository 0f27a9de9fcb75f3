"""keel.train.config: the TOML schema, --set overrides, one-line errors, dumping and the parallel layout."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from keel.config import ModelConfig
from keel.errors import ConfigError, KeelError
from keel.train.config import (
    TrainConfig,
    config_json,
    dump_config,
    load_config,
    model_config_from,
    resolve_layout,
)

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "tiny-shakespeare.toml"

BASE = """
[model]
config = {architectures = ["LlamaForCausalLM"], hidden_size = 64, num_attention_heads = 4, num_key_value_heads = 2, \
num_hidden_layers = 4, vocab_size = 256, intermediate_size = 128}
tokenizer = "smollm2-135m-instruct"

[data]
path = "data/x.bin"
seq_len = 16

[training]
steps = 10
global_batch_size = 16
micro_batch_size = 2
"""


def write(tmp_path: Path, text: str = BASE, name: str = "tiny.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(path: Path, overrides: tuple[str, ...] | list[str] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path))
    assert cfg.run.name == "run" and cfg.run_dir == Path("runs/run") and cfg.run.seed == 0
    assert cfg.metrics_path == Path("runs/run/metrics.jsonl")
    assert cfg.training.precision == "fp32" and cfg.training.max_norm == 1.0
    assert cfg.training.init_scale == 2.0**16 and cfg.training.growth_interval == 2000
    assert cfg.optimizer.betas == (0.9, 0.95) and cfg.optimizer.fused is None
    assert cfg.schedule.decay == "cosine" and cfg.schedule.min_lr_ratio == 0.1
    assert cfg.parallel.dp_shard == -1 and cfg.parallel.pp_schedule == "1f1b" and cfg.parallel.pp_microbatches is None
    assert cfg.activation_checkpoint.mode == "none"
    assert cfg.checkpoint.resume == "auto" and cfg.checkpoint.keep == 3 and cfg.checkpoint.async_save
    assert (cfg.guard.nan, cfg.guard.spike, cfg.guard.window, cfg.guard.warmup) == ("skip", "skip", 50, 20)
    assert cfg.watchdog.timeout_s == 600 and cfg.log.progress
    assert cfg.model.tokenizer_ref == "smollm2-135m-instruct"


def test_recipe_loads() -> None:
    cfg = load_config(RECIPE)
    assert cfg.data.path == "data/shakespeare-smollm2.bin" and cfg.data.seq_len == 256
    assert (cfg.training.steps, cfg.training.global_batch_size, cfg.training.micro_batch_size) == (300, 16, 8)
    assert cfg.optimizer.lr == 1e-3 and cfg.schedule.warmup_steps == 20 and cfg.checkpoint.interval == 100
    model = model_config_from(cfg.model.config)
    assert model.vocab_size == 49152 and model.tie_word_embeddings
    counts = model.param_counts()  # as the recipe's comment says: 7.1M, 6.3M of it the tied embedding
    assert round(counts["total"] / 1e5) == 71 and round(counts["embedding"] / 1e5) == 63
    layout = resolve_layout(cfg, 1)
    assert layout.grad_accum == 2 and layout.dp == 1
    assert resolve_layout(cfg, 2).grad_accum == 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (BASE.replace("steps = 10", "stpes = 10"), "training.stpes: unknown key; valid keys: steps, global_batch_size"),
        (BASE + "\n[optimiser]\nlr = 1\n", "optimiser: unknown key; valid keys: run, model, data, training, optimizer"),
        (BASE + "\n[parallel]\ntp_degree = 2\n", "parallel.tp_degree: unknown key; valid keys: pp, dp_replicate,"),
        (BASE.replace('tokenizer = "', 'tokeniser = "'), "model.tokeniser: unknown key; valid keys: source, config,"),
    ],
)
def test_unknown_keys(tmp_path: Path, text: str, expected: str) -> None:
    message = error_of(write(tmp_path, text))
    assert message.startswith(f"{tmp_path / 'tiny.toml'}: {expected}")


def test_unknown_key_lists_every_valid_key(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, BASE + "\n[watchdog]\ntimeout = 5\n"))
    assert message.endswith("watchdog.timeout: unknown key; valid keys: timeout_s")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (BASE.replace("[data]", "[dat]"), "dat: unknown key"),
        (BASE.replace("steps = 10\n", ""), "training.steps: missing required key"),
        (BASE.replace("steps = 10", 'steps = "10"'), "training.steps: input should be a valid integer, got '10'"),
        (BASE.replace("steps = 10", "steps = 0"), "training.steps: input should be greater than or equal to 1"),
        (BASE + '\n[guard]\nnan = "ignore"\n', "guard.nan: input should be 'skip', 'rollback' or 'stop'"),
        (BASE + "\n[optimizer]\nbetas = [0.9]\n", "optimizer.betas"),
        (BASE + "\n[optimizer]\nbetas = [0.9, 1.0]\n", "optimizer.betas: each beta must be in [0, 1)"),
        (BASE + "\n[parallel]\ndp_shard = 0\n", "parallel.dp_shard: must be -1"),
        (BASE + '\n[run]\ndir = "runs/{nme}"\n', "run.dir: only the placeholder {name} is allowed"),
        (BASE.replace('tokenizer = "smollm2-135m-instruct"', 'source = "x"'), "model.source: set exactly one"),
        (BASE.replace('tokenizer = "smollm2-135m-instruct"', ""), "model.tokenizer: required with model.config"),
        (BASE.replace("LlamaForCausalLM", "DiffLlamaForCausalLM"), "model.config: unsupported architecture DiffLlama"),
        (BASE.replace("hidden_size = 64, ", ""), "model.config: missing required field 'hidden_size'"),
        (BASE.replace("[model]", '[model]\ndtype = "bfloat16"'), 'training.precision: "fp32" with bfloat16'),
        (BASE.replace("[model]", '[model]\ndtype = "float16"'), 'model.dtype: "float16" parameters cannot be'),
        ("training = 3\n" + BASE.split("[training]")[0], "training: expected a table, got 3"),
    ],
)
def test_invalid_values(tmp_path: Path, text: str, expected: str) -> None:
    message = error_of(write(tmp_path, text))
    assert message.startswith(f"{tmp_path / 'tiny.toml'}: {expected}"), message


def test_bad_file(tmp_path: Path) -> None:
    assert error_of(tmp_path / "missing.toml").endswith("missing.toml: no such file")
    assert "tiny.toml: invalid TOML" in error_of(write(tmp_path, "[training\nsteps = 1"))
    assert isinstance(ConfigError("x"), KeelError)  # the CLI prints it as one line, exit 1


def test_overrides(tmp_path: Path) -> None:
    cfg = load_config(
        write(tmp_path),
        [
            "training.steps=20",
            "parallel.pp_schedule=gpipe",
            "optimizer.betas=[0.8, 0.9]",
            "optimizer.lr=1e-2",
            "training.max_norm=0",  # an int where a float is expected is fine
            "checkpoint.async_save=false",
            "run.name=exp-1",
            "model.config.hidden_size=128",
        ],
    )
    assert cfg.training.steps == 20 and cfg.parallel.pp_schedule == "gpipe"
    assert cfg.optimizer.betas == (0.8, 0.9) and cfg.optimizer.lr == 1e-2 and cfg.training.max_norm == 0
    assert cfg.checkpoint.async_save is False and cfg.run_dir == Path("runs/exp-1")
    assert cfg.model.config is not None and cfg.model.config["hidden_size"] == 128


def test_source_override_replaces_an_inline_config(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path), ["model.source=smollm2-135m-instruct"])
    assert cfg.model.source == "smollm2-135m-instruct" and cfg.model.config is None and cfg.model.tokenizer is None
    cfg = load_config(write(tmp_path), ["model.tokenizer=other", "model.source=some/dir"])
    assert cfg.model.tokenizer_ref == "other"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("training.steps=abc", "training.steps: input should be a valid integer, got 'abc' (from --set training.ste"),
        ("training.stpes=3", "training.stpes: unknown key; valid keys: steps, "),
        ("trainin.steps=3", "trainin: unknown key; valid keys: run, model, "),
        ("parallel.pp_schedule=zb", "parallel.pp_schedule: input should be 'gpipe', '1f1b', 'interleaved1f1b' or"),
        ("log.progress=yes", "log.progress: input should be a valid boolean, got 'yes'"),
        ("training.steps.x=1", "training.steps is not a table (from --set training.steps.x=1)"),
    ],
)
def test_override_errors(tmp_path: Path, override: str, expected: str) -> None:
    message = error_of(write(tmp_path), [override])
    assert message.startswith(f"{tmp_path / 'tiny.toml'}: {expected}"), message
    assert f"--set {override}" in message


@pytest.mark.parametrize("override", ["steps", "=3", "training..steps=1", "training.st eps=1"])
def test_malformed_overrides(tmp_path: Path, override: str) -> None:
    assert error_of(write(tmp_path), [override]) == f"--set {override}: expected section.key=value"


@pytest.mark.parametrize(
    ("source", "overrides"),
    [(None, ["run.name=a_b", "data.val_tokens=7"]), (RECIPE, ["model.source=smollm2-135m-instruct"])],
)
def test_dump_round_trips(tmp_path: Path, source: Path | None, overrides: list[str]) -> None:
    cfg = load_config(source or write(tmp_path), overrides)
    text = dump_config(cfg)
    assert TrainConfig.model_validate(tomllib.loads(text)).model_dump() == cfg.model_dump()
    assert TrainConfig.model_validate(json.loads(config_json(cfg))).model_dump() == cfg.model_dump()
    assert load_config(write(tmp_path, text, "resolved.toml")).model_dump() == cfg.model_dump()


# --------------------------------------------------------------------------- layout


def layout_error(tmp_path: Path, overrides: list[str], world_size: int) -> str:
    cfg = load_config(write(tmp_path), overrides)
    with pytest.raises(ConfigError) as info:
        resolve_layout(cfg, world_size)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'tiny.toml'}: ")
    return message.removeprefix(f"{tmp_path / 'tiny.toml'}: ")


def test_layout_dp_shard_takes_the_rest(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path), ["parallel.tp=2"])
    layout = resolve_layout(cfg, 8)
    assert (layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp, layout.dp) == (1, 1, 4, 2, 4)
    assert layout.grad_accum == 2  # 16 / (2 * 4)
    cfg = load_config(write(tmp_path), ["parallel.dp_replicate=2", "parallel.dp_shard=2"])
    layout = resolve_layout(cfg, 4)
    assert layout.dp == 4 and layout.grad_accum == 2 and layout.world_size == 4


def test_layout_pipeline(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path), ["parallel.pp=2"])
    layout = resolve_layout(cfg, 4)
    assert (layout.pp, layout.dp, layout.pp_microbatches, layout.pp_stages_per_rank) == (2, 2, 2, 1)
    over = ["parallel.pp=2", "parallel.pp_schedule=interleaved1f1b", "parallel.pp_stages_per_rank=2"]
    layout = resolve_layout(load_config(write(tmp_path), over), 2)
    assert layout.pp_stages == 4 and layout.pp_microbatches == 2
    over = ["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_stages_per_rank=2"]
    assert resolve_layout(load_config(write(tmp_path), over), 2).pp_stages_per_rank == 2
    # Without a pipeline, the schedule settings do not apply.
    over = ["parallel.pp_schedule=zbv", "parallel.pp_microbatches=3"]
    layout = resolve_layout(load_config(write(tmp_path), over), 1)
    assert (layout.pp_microbatches, layout.pp_stages_per_rank) == (1, 1)


PP2 = ["parallel.pp=2"]
INTERLEAVED = [*PP2, "parallel.pp_schedule=interleaved1f1b", "parallel.pp_stages_per_rank=2"]
LAYOUT_ERRORS = [
    (
        [*PP2, "parallel.dp_shard=1"],
        4,
        "parallel: pp*dp_replicate*dp_shard*tp = 2*1*1*1 = 2, but the world size is 4",
    ),
    (["parallel.tp=4"], 6, "parallel: the world size 6 is not divisible by pp*dp_replicate*tp = 1*1*4 = 4"),
    ([], 3, "training: global_batch_size = 16 is not divisible by micro_batch_size * dp = 2 * 3 = 6"),
    ([], 16, "training: global_batch_size = 16 is not divisible by micro_batch_size * dp = 2 * 16 = 32"),
    (
        [*PP2, "parallel.pp_microbatches=4"],
        2,
        "parallel: pp_microbatches = 4 does not divide training.micro_batch_size = 2",
    ),
    (INTERLEAVED[:-1], 2, "parallel: pp_schedule 'interleaved1f1b' needs pp_stages_per_rank >= 2"),
    (
        [*PP2, "parallel.pp_schedule=zbv", "parallel.pp_stages_per_rank=3"],
        2,
        "parallel: pp_schedule 'zbv' needs pp_stages_per_rank = 2, got 3",
    ),
    ([*PP2, "parallel.pp_stages_per_rank=2"], 2, "parallel: pp_schedule '1f1b' runs one stage per rank"),
    (
        [*PP2, "parallel.pp_schedule=gpipe", "parallel.pp_stages_per_rank=2"],
        2,
        "parallel: pp_schedule 'gpipe' runs one stage per rank",
    ),
    ([*PP2, "parallel.pp_microbatches=1"], 2, "parallel: pp_schedule '1f1b' needs pp_microbatches >= pp = 2, got 1"),
    (
        # 6 microbatches on 2 ranks: 3 rounds of 2, fine; 5 would be 2 rounds of 2.5
        [*INTERLEAVED, "training.micro_batch_size=5", "training.global_batch_size=10", "parallel.pp_microbatches=5"],
        2,
        "parallel: pp_schedule 'interleaved1f1b' needs pp_microbatches (5) to be a multiple of its rounds",
    ),
    (["parallel.tp=2", "data.seq_len=15"], 2, "data: seq_len = 15 is not divisible by tp = 2 (sequence parallelism)"),
    (
        ["parallel.pp=4", *INTERLEAVED[1:], "parallel.pp_microbatches=2"],
        4,
        "parallel: 8 pipeline stages but the model has 4 layers",
    ),
    (["parallel.tp=4"], 4, "parallel: tp = 4 does not divide the model's num_key_value_heads = 2"),
    ([], 0, "the world size must be >= 1, got 0"),
]


@pytest.mark.parametrize(("overrides", "world", "expected"), LAYOUT_ERRORS)
def test_layout_errors(tmp_path: Path, overrides: list[str], world: int, expected: str) -> None:
    assert layout_error(tmp_path, overrides, world).startswith(expected)


def test_sequence_parallel_off_allows_any_seq_len(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path), ["parallel.tp=2", "data.seq_len=15", "parallel.sequence_parallel=false"])
    assert resolve_layout(cfg, 2).tp == 2


def test_layout_model_checks_need_the_model(tmp_path: Path) -> None:
    """With `source`, the model shape is unknown until the checkpoint opens: pass it in to check."""
    cfg = load_config(write(tmp_path), ["model.source=x", "parallel.tp=4"])
    assert resolve_layout(cfg, 4).tp == 4
    model = model_config_from(load_config(write(tmp_path)).model.config or {})
    with pytest.raises(ConfigError, match="num_key_value_heads = 2"):
        resolve_layout(cfg, 4, model)


def test_training_zamba2s_shared_blocks_is_refused(tmp_path: Path) -> None:
    """keel holds a copy of Zamba 2's shared block in each hybrid layer: trained, the copies would part."""
    cfg = load_config(write(tmp_path), ["model.source=x"])
    model = ModelConfig(
        architecture="zamba2",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        head_dim=32,
        layer_types=["mamba", "hybrid"],
        mlp_layers=[False, True],
        mamba_n_heads=2,
        mamba_d_head=32,
        mamba_d_state=8,
        hybrid_block="shared",
        shared_blocks=1,
        adapter_rank=4,
    )
    with pytest.raises(ConfigError, match="shared transformer blocks is not supported"):
        resolve_layout(cfg, 1, model)
