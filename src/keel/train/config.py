"""The `keel train` TOML schema (pydantic, strict, unknown keys rejected) and the parallel layout.

`load_config` reads a TOML file plus `--set section.key=value` overrides and turns every problem into a
one-line `ConfigError` naming the file, the dotted field and the problem. `resolve_layout` checks the
parallel degrees and batch arithmetic against a world size; both are pure, so a launcher can reject a
bad run before any process group starts.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from keel.config import RECURRENT_LAYERS, ModelConfig
from keel.errors import ConfigError, KeelError
from keel.train.trackers import missing_package


class _Section(BaseModel):
    # strict: a TOML string "20" is not silently an int; forbid: a typo is an error, not a default.
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)


class RunSection(_Section):
    name: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    dir: str = "runs/{name}"  # {name} is replaced by run.name
    seed: int = Field(0, ge=0, lt=2**63)
    # KiB: allocations from this size get their own mapping, returned on free (keel.train.host_memory): less
    # resident memory, slower steps; 0: glibc's own policy.
    mmap_threshold_kib: int = Field(0, ge=0, le=32768)
    # glibc's free heap pages returned at each block's backward and after each step (keel.train.host_memory);
    # null: on for CPU runs of more than one rank where glibc has malloc_trim, off for one process.
    trim_heap: bool | None = None
    # Deterministic kernels only (torchtitan's debug.deterministic): on a GPU, attention's backward and
    # cuBLAS otherwise add in an order that varies from run to run, so a resumed run parts from the straight
    # one in the last bits; slower. An op with no deterministic kernel then fails naming itself.
    deterministic: bool = False
    # Where each rank trains: auto takes cuda:LOCAL_RANK wherever torch sees a GPU, else the CPU; cpu trains on
    # the CPU (gloo) on a GPU host too; cuda refuses to start without one.
    device: Literal["auto", "cpu", "cuda"] = "auto"

    @field_validator("dir")
    @classmethod
    def _placeholders(cls, value: str) -> str:
        try:
            value.format(name="x")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"only the placeholder {{name}} is allowed ({e})") from None
        return value


class ModelSection(_Section):
    source: str | None = None  # catalog name, HF directory or GGUF: weights are loaded
    config: dict[str, Any] | None = None  # HF config.json fields: a model trained from scratch
    tokenizer: str | None = None  # the model whose tokenizer to use (required with `config`)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # parameter dtype

    @field_validator("config")
    @classmethod
    def _buildable(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            model_config_from(value)
        return value

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if (self.source is None) == (self.config is None):
            raise ValueError("source: set exactly one of model.source (load weights) or model.config (from scratch)")
        if self.config is not None and self.tokenizer is None:
            raise ValueError("tokenizer: required with model.config (a model whose tokenizer to use)")
        return self

    @property
    def tokenizer_ref(self) -> str:
        """Where the tokenizer comes from: `tokenizer`, else the source checkpoint."""
        ref = self.tokenizer or self.source
        assert ref is not None  # guaranteed by _one_source
        return ref


class DataSection(_Section):
    path: str  # a token file written by `keel data prepare`
    seq_len: int = Field(512, ge=1)
    val_path: str | None = None
    # Tokens to evaluate: the first val_tokens of val_path (null: all of it); without val_path, the last
    # val_tokens of `path` are held out of training (see keel.train.data.open_datasets).
    val_tokens: int | None = Field(None, ge=1)


class TrainingSection(_Section):
    steps: int = Field(ge=1)
    global_batch_size: int = Field(ge=1)  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int = Field(1, ge=1)  # sequences per forward per rank
    precision: Literal["bf16", "fp16", "fp32"] = "fp32"
    max_norm: float = Field(1.0, ge=0)  # 0 disables clipping
    compile: bool = False  # torch.compile each decoder block (keel.train.parallel.apply_compile)
    # fp16 loss scaler (torch.amp.GradScaler's arguments)
    init_scale: float = Field(2.0**16, gt=0)
    growth_factor: float = Field(2.0, gt=1)
    backoff_factor: float = Field(0.5, gt=0, lt=1)
    growth_interval: int = Field(2000, ge=1)


class OptimizerSection(_Section):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(3e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    fused: bool | None = None  # null: the fused kernel where torch has one

    @field_validator("betas", mode="before")
    @classmethod
    def _list_to_tuple(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value  # TOML has arrays, not tuples

    @field_validator("betas")
    @classmethod
    def _betas_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError(f"each beta must be in [0, 1), got {list(value)}")
        return value


class ScheduleSection(_Section):
    warmup_steps: int = Field(0, ge=0)
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)


class ParallelSection(_Section):
    pp: int = Field(1, ge=1)
    dp_replicate: int = Field(1, ge=1)
    dp_shard: int = -1  # -1: whatever is left of the world size
    tp: int = Field(1, ge=1)
    # Expert parallelism: experts split over ep ranks taken from dp_shard (ep must divide dp_shard).
    ep: int = Field(1, ge=1)
    sequence_parallel: bool = True
    pp_schedule: Literal["gpipe", "1f1b", "interleaved1f1b", "zbv"] = "1f1b"
    pp_microbatches: int | None = Field(None, ge=1)  # null: pp
    pp_stages_per_rank: int = Field(1, ge=1)  # 2 (or more) for interleaved1f1b, exactly 2 for zbv
    reshard_after_forward: bool = True
    # Under tp > 1: vocab-sharded logits and cross-entropy (keel.train.parallel; under a pipeline
    # keel.train.vocab_parallel).
    loss_parallel: bool = True
    # How long a collective may wait for its peers before the process group fails it (torch's default is
    # 10 minutes for NCCL and 30 for gloo); an error then ends the rank, which torchrun can restart.
    timeout_s: float = Field(600.0, gt=0)
    # NCCL's flight recorder (keel.train.flight_recorder): entries kept a rank, dumped on a timeout; 0: off.
    flight_recorder_events: int = Field(20_000, ge=0)

    @field_validator("dp_shard")
    @classmethod
    def _dp_shard(cls, value: int) -> int:
        if value != -1 and value < 1:
            raise ValueError(f"must be -1 (the rest of the world) or >= 1, got {value}")
        return value


class MoESection(_Section):
    """Mixture-of-experts training (ignored by dense models); see keel.model.moe."""

    aux_loss_coef: float = Field(0.0, ge=0)  # Switch/Mixtral load-balancing loss (Mixtral trained with 0.02)
    z_loss_coef: float = Field(0.0, ge=0)  # router z-loss (ST-MoE: 1e-3)
    capacity_factor: float | None = Field(None, gt=0)  # null: dropless; else overflow dropped in token order
    # Aux-loss-free balancing (routers with a selection bias, e.g. DeepSeek-V3): the bias step per update.
    bias_update_rate: float = Field(0.0, ge=0)


class ActivationCheckpointSection(_Section):
    mode: Literal["none", "full", "selective"] = "none"
    every: int = Field(1, ge=1)  # selective: checkpoint every k-th block


class CheckpointSection(_Section):
    interval: int = Field(0, ge=0)  # steps; 0: only at the end and on SIGTERM
    keep: int = Field(3, ge=0)  # most recent checkpoints kept; 0 keeps all
    async_save: bool = True
    resume: str = Field("auto", min_length=1)  # "auto" (latest in the run dir), "none", or a checkpoint path
    # At the end of the run, the model as an HF safetensors directory RUN/hf, written shard-wise (keel.train.hf_export).
    export_hf: bool = False


class GuardSection(_Section):
    nan: Literal["skip", "rollback", "stop"] = "skip"
    spike: Literal["off", "skip", "rollback"] = "skip"
    spike_zscore: float = Field(6.0, gt=0)
    grad_norm_zscore: float = Field(6.0, gt=0)
    window: int = Field(50, ge=2)  # steps in the running mean/std
    warmup: int = Field(20, ge=0)  # steps before spike checks start
    # Steps' batches skipped after a rollback, or "window": those of every step from the checkpoint through
    # the one that triggered it, so a spike caused by its data is not replayed (PaLM's remedy).
    skip_batches_after_rollback: int | Literal["window"] = "window"
    max_rollbacks: int = Field(3, ge=0)
    # Skipped steps in a row before the guard escalates (first a rollback, then a stop); 0: never.
    escalate_after: int = Field(5, ge=0)

    @field_validator("skip_batches_after_rollback")
    @classmethod
    def _skip_not_negative(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError('must be >= 0 or "window"')
        return value


class WatchdogSection(_Section):
    timeout_s: float = Field(600.0, ge=0)  # 0 disables


class LogSection(_Section):
    interval: int = Field(1, ge=1)
    jsonl: str = Field("metrics.jsonl", min_length=1)  # relative to the run dir
    progress: bool = True
    # Measure one step's tensor memory by kind (torch's MemTracker; the step runs slower) and record
    # it beside the planner's prediction (keel.plan.run) in the metrics file.
    memory_breakdown: bool = False
    # TensorBoard event files of every logged record under RUN/<tensorboard_dir> (keel.train.trackers;
    # needs `pip install 'keel[tensorboard]'`), and a Weights & Biases run (needs wandb, not a keel dependency).
    tensorboard: bool = False
    tensorboard_dir: str = Field("tensorboard", min_length=1)  # relative to the run dir
    wandb: bool = False

    @field_validator("tensorboard", "wandb")
    @classmethod
    def _tracker_installed(cls, value: bool, info: ValidationInfo) -> bool:
        reason = missing_package(info.field_name) if value else None
        if reason:
            raise ValueError(reason)
        return value


class ProfileSection(_Section):
    """torch.profiler traces of chosen steps (and, on CUDA, memory snapshots), per rank, under the run dir."""

    steps: list[int] = Field(default_factory=list)  # the steps to trace, e.g. [5, 6]; none by default
    dir: str = Field("profile", min_length=1)  # relative to the run dir
    memory_snapshot: bool = True  # on CUDA: the allocator's history over the traced steps, for memory_viz

    @field_validator("steps")
    @classmethod
    def _steps_positive(cls, value: list[int]) -> list[int]:
        if any(step < 1 for step in value):
            raise ValueError("steps are numbered from 1")
        return sorted(set(value))


class TrainConfig(_Section):
    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection
    data: DataSection
    training: TrainingSection
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    schedule: ScheduleSection = Field(default_factory=ScheduleSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    activation_checkpoint: ActivationCheckpointSection = Field(default_factory=ActivationCheckpointSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    guard: GuardSection = Field(default_factory=GuardSection)
    moe: MoESection = Field(default_factory=MoESection)
    watchdog: WatchdogSection = Field(default_factory=WatchdogSection)
    log: LogSection = Field(default_factory=LogSection)
    profile: ProfileSection = Field(default_factory=ProfileSection)

    _source: str = PrivateAttr("config")  # the file it came from, for error messages

    @model_validator(mode="after")
    def _precision_fits_dtype(self) -> TrainConfig:
        dtype, precision = self.model.dtype, self.training.precision
        if dtype == "float16":
            # GradScaler cannot unscale fp16 gradients: fp16 training keeps fp32 parameters.
            raise ValueError('model.dtype: "float16" parameters cannot be trained; use precision = "fp16" with float32')
        if dtype == "bfloat16" and precision != "bf16":
            raise ValueError(f'training.precision: "{precision}" with bfloat16 parameters; use "bf16"')
        return self

    @property
    def source(self) -> str:
        return self._source

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir.format(name=self.run.name))

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / self.log.jsonl  # an absolute log.jsonl stays absolute


def model_config_from(hf: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of an inline `[model.config]` table, or ValueError (pydantic reports it)."""
    label = "model.config"
    try:
        return ModelConfig.from_hf(hf, source=label)
    except (KeelError, ValueError, TypeError) as e:
        message = str(e)
        raise ValueError(message.removeprefix(f"{label}: ")) from None


# --------------------------------------------------------------------------- loading


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a TOML config, apply `section.key=value` overrides (values parsed as TOML, else a plain
    string) and validate it. Every problem is a one-line ConfigError."""
    path = Path(path)
    label = str(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{label}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{label}: cannot read ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{label}: invalid TOML: {e}") from None
    applied = apply_overrides(data, overrides, label)
    try:
        cfg = TrainConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e, label, applied)) from None
    cfg._source = label
    return cfg


def parse_override(raw: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value); the value is a TOML value, else the raw string."""
    key, sep, text = raw.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(re.fullmatch(r"[A-Za-z0-9_-]+", p) for p in parts):
        raise ConfigError(f"--set {raw}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # e.g. model.source=smollm2-135m-instruct: a bare word is a string
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str], label: str) -> dict[str, str]:
    """Apply overrides to the parsed TOML in place; returns dotted key -> the raw override."""
    applied: dict[str, str] = {}
    for raw in overrides:
        parts, value = parse_override(raw)
        table = data
        for i, part in enumerate(parts[:-1]):
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise ConfigError(f"{label}: {'.'.join(parts[: i + 1])} is not a table (from --set {raw})")
        table[parts[-1]] = value
        dotted = ".".join(parts)
        # source and config are alternatives: choosing one on the command line drops the file's other one
        # (and the tokenizer that went with a from-scratch config, unless that is overridden too).
        model = data.get("model")
        if isinstance(model, dict) and dotted == "model.source":
            model.pop("config", None)
            if "model.tokenizer" not in applied:
                model.pop("tokenizer", None)
        elif isinstance(model, dict) and dotted == "model.config":
            model.pop("source", None)
        applied[dotted] = raw
    return applied


def _dotted(loc: Sequence[str | int]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _section_class(loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The model class that holds the last element of `loc`."""
    cls: Any = TrainConfig
    for part in loc:
        fields = getattr(cls, "model_fields", None)
        if not isinstance(part, str) or fields is None or part not in fields:
            return None
        cls = fields[part].annotation
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


def _describe(error: ValidationError, label: str, applied: dict[str, str]) -> str:
    """The first validation error as `file: dotted.field: problem`, on one line."""
    # An unknown key first: a misspelt key also shows up as the missing required one.
    errors = sorted(error.errors(include_url=False), key=lambda e: e["type"] != "extra_forbidden")
    err = errors[0]
    loc = [p for p in err["loc"] if isinstance(p, str | int)]
    kind, message = err["type"], err["msg"]
    if kind == "extra_forbidden":
        holder = _section_class(loc[:-1])
        valid = ", ".join(holder.model_fields) if holder else "none"
        problem = f"unknown key; valid keys: {valid}"
    elif kind == "missing":
        problem = "missing required key"
    elif kind in ("model_type", "dict_type"):
        problem = f"expected a table, got {err.get('input')!r}"
    elif kind == "value_error":
        problem = message.removeprefix("Value error, ")
        # A section's own checks name the field first ("tokenizer: required ..."): move it into loc.
        match = re.match(r"^([a-z_]+(?:\.[a-z_]+)*): (.*)$", problem)
        if match:
            field, problem = match.groups()
            holder = _section_class(loc)
            if holder is not None and field in holder.model_fields:
                loc = [*loc, field]
            else:
                loc = field.split(".")
    else:
        problem = message[:1].lower() + message[1:]
        if "input" in err and not isinstance(err["input"], dict):
            problem += f", got {err['input']!r}"
    dotted = _dotted(loc)
    origin = ""
    for key, raw in applied.items():
        if dotted == key or dotted.startswith((key + ".", key + "[")) or key.startswith(dotted + "."):
            origin = f" (from --set {raw})"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    where = f"{dotted}: " if dotted else ""
    return f"{label}: {where}{problem}{origin}{more}"


# --------------------------------------------------------------------------- dumping


def dump_config(cfg: TrainConfig) -> str:
    """The config as TOML text (null fields are left out: null is every optional field's default)."""
    data = cfg.model_dump(mode="python")
    lines = ["# keel train config, as resolved (defaults filled in)"]
    _dump_table(data, [], lines)
    return "\n".join(lines) + "\n"


def _dump_table(table: dict[str, Any], prefix: list[str], lines: list[str]) -> None:
    scalars = {k: v for k, v in table.items() if v is not None and not isinstance(v, dict)}
    tables = {k: v for k, v in table.items() if isinstance(v, dict)}
    if prefix and (scalars or not tables):
        lines.append("")
        lines.append(f"[{'.'.join(_toml_key(p) for p in prefix)}]")
    for key, value in scalars.items():
        lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, value in tables.items():
        _dump_table(value, [*prefix, key], lines)


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_string(key)


def _toml_string(text: str) -> str:
    escapes = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    out = []
    for ch in text:
        if ch in escapes:
            out.append(escapes[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value)  # "1e-08", "inf" and "-inf" are TOML floats too
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value if v is not None) + "]"
    if isinstance(value, dict):  # a dict inside an array: an inline table
        items = ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items() if v is not None)
        return "{" + items + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")  # a schema field of a new type: a bug


def config_json(cfg: TrainConfig) -> str:
    """The config as JSON (e.g. for a checkpoint's metadata)."""
    return json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=False) + "\n"


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """The parallel degrees and batch arithmetic of one run. Mesh order: pp, dp_replicate, dp_shard, tp."""

    world_size: int
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    dp: int  # dp_replicate * dp_shard: the ranks that see different data
    micro_batch_size: int  # sequences per forward (per pipeline step with pp > 1) per rank
    grad_accum: int  # micro-batches per optimizer step per rank
    pp_microbatches: int  # each micro-batch is split into this many pipeline microbatches (1 without pp)
    pp_stages_per_rank: int  # 1 without pp
    ep: int = 1  # experts split over ep of the dp_shard ranks

    @property
    def pp_stages(self) -> int:
        return self.pp * self.pp_stages_per_rank


def resolve_layout(cfg: TrainConfig, world_size: int, model: ModelConfig | None = None) -> Layout:
    """Check the parallel layout against `world_size` and resolve dp_shard = -1 and pp_microbatches.

    `model` (default: built from an inline `[model.config]`) adds the checks that need the model shape:
    enough layers for the pipeline stages, heads divisible by tp. Raises a one-line ConfigError.
    """
    label = cfg.source
    par, train = cfg.parallel, cfg.training

    def fail(message: str) -> ConfigError:
        return ConfigError(f"{label}: {message}")

    if world_size < 1:
        raise fail(f"the world size must be >= 1, got {world_size}")
    dp_shard = _dp_shard(par, world_size, fail)
    dp = par.dp_replicate * dp_shard
    micro = train.micro_batch_size
    if train.global_batch_size % (micro * dp):
        raise fail(
            f"training: global_batch_size = {train.global_batch_size} is not divisible by "
            f"micro_batch_size * dp = {micro} * {dp} = {micro * dp}"
        )
    grad_accum = train.global_batch_size // (micro * dp)
    microbatches, stages_per_rank = _pipeline_schedule(cfg, fail)
    _check_expert_and_sequence_parallel(cfg, dp_shard, fail)
    if model is None and cfg.model.config is not None:
        model = model_config_from(cfg.model.config)
    if model is not None:
        _check_model_fits(cfg, model, stages_per_rank, fail)

    return Layout(
        world_size=world_size,
        pp=par.pp,
        dp_replicate=par.dp_replicate,
        dp_shard=dp_shard,
        tp=par.tp,
        dp=dp,
        micro_batch_size=micro,
        grad_accum=grad_accum,
        pp_microbatches=microbatches,
        pp_stages_per_rank=stages_per_rank,
        ep=par.ep,
    )


def _dp_shard(par: ParallelSection, world_size: int, fail: Callable[[str], ConfigError]) -> int:
    """dp_shard, with -1 resolved to the ranks pp * dp_replicate * tp leave; the product checked against the world."""
    dp_shard = par.dp_shard
    if dp_shard == -1:
        fixed = par.pp * par.dp_replicate * par.tp
        if world_size % fixed:
            raise fail(
                f"parallel: the world size {world_size} is not divisible by pp*dp_replicate*tp = "
                f"{par.pp}*{par.dp_replicate}*{par.tp} = {fixed} (dp_shard = -1 takes the rest)"
            )
        dp_shard = world_size // fixed
    product = par.pp * par.dp_replicate * dp_shard * par.tp
    if product != world_size:
        raise fail(
            f"parallel: pp*dp_replicate*dp_shard*tp = {par.pp}*{par.dp_replicate}*{dp_shard}*{par.tp} = {product}, "
            f"but the world size is {world_size}"
        )
    return dp_shard


def _pipeline_schedule(cfg: TrainConfig, fail: Callable[[str], ConfigError]) -> tuple[int, int]:
    """(pp_microbatches, pp_stages_per_rank), checked against the schedule; (1, 1) without a pipeline."""
    par, micro = cfg.parallel, cfg.training.micro_batch_size
    if par.pp <= 1:  # without a pipeline the schedule settings do not apply (so --set parallel.pp=1 just works)
        return 1, 1
    microbatches = par.pp_microbatches or par.pp
    stages_per_rank = par.pp_stages_per_rank
    schedule = par.pp_schedule
    if schedule in ("gpipe", "1f1b") and stages_per_rank != 1:
        raise fail(
            f"parallel: pp_schedule {schedule!r} runs one stage per rank, but pp_stages_per_rank = "
            f"{stages_per_rank} (use interleaved1f1b or zbv)"
        )
    if schedule == "interleaved1f1b" and stages_per_rank < 2:
        raise fail("parallel: pp_schedule 'interleaved1f1b' needs pp_stages_per_rank >= 2")
    if schedule == "zbv" and stages_per_rank != 2:
        raise fail(f"parallel: pp_schedule 'zbv' needs pp_stages_per_rank = 2, got {stages_per_rank}")
    if cfg.log.memory_breakdown:
        raise fail(
            "log.memory_breakdown: not available with pipeline parallelism (a schedule runs each stage "
            "several times per step, which torch's MemTracker does not follow)"
        )
    if micro % microbatches:
        raise fail(
            f"parallel: pp_microbatches = {microbatches} does not divide training.micro_batch_size = {micro} "
            "(each pipeline step splits one micro-batch into pp_microbatches pieces)"
        )
    if schedule == "1f1b" and microbatches < par.pp:
        raise fail(f"parallel: pp_schedule '1f1b' needs pp_microbatches >= pp = {par.pp}, got {microbatches}")
    rounds = max(1, microbatches // par.pp)
    if schedule == "interleaved1f1b" and microbatches % rounds:
        raise fail(
            f"parallel: pp_schedule 'interleaved1f1b' needs pp_microbatches ({microbatches}) to be a multiple "
            f"of its rounds (pp_microbatches // pp = {rounds})"
        )
    return microbatches, stages_per_rank


def _check_expert_and_sequence_parallel(cfg: TrainConfig, dp_shard: int, fail: Callable[[str], ConfigError]) -> None:
    """Expert parallelism takes data-parallel ranks; sequence parallelism splits seq_len over tp."""
    par = cfg.parallel
    if par.ep > 1:
        if dp_shard % par.ep:
            raise fail(f"parallel: ep = {par.ep} must divide dp_shard = {dp_shard} (experts take data-parallel ranks)")
        if par.tp > 1:
            raise fail("parallel: ep > 1 with tp > 1 is not supported (MoE blocks are not tensor-parallel)")
    if par.tp > 1 and par.sequence_parallel and cfg.data.seq_len % par.tp:
        raise fail(f"data: seq_len = {cfg.data.seq_len} is not divisible by tp = {par.tp} (sequence parallelism)")


def _check_model_fits(
    cfg: TrainConfig, model: ModelConfig, stages_per_rank: int, fail: Callable[[str], ConfigError]
) -> None:
    """The checks that need the model's shape: layers per pipeline stage, heads over tp, experts over ep."""
    if model.altup_num_inputs:
        raise fail(
            "model: training with AltUp (altup_num_inputs: Gemma 3n) is not supported: transformers clips its "
            "coefficients while training (altup_coef_clip), which keel does not"
        )
    par = cfg.parallel
    stages = par.pp * stages_per_rank
    if model.num_layers < stages:
        raise fail(f"parallel: {stages} pipeline stages but the model has {model.num_layers} layers")
    for name, count in (("num_attention_heads", model.num_heads), ("num_key_value_heads", model.num_kv_heads)):
        if count % par.tp:
            raise fail(f"parallel: tp = {par.tp} does not divide the model's {name} = {count}")
    if par.tp > 1 and model.qk_norm and model.qk_norm_scope == "all":
        raise fail("parallel: tp > 1 is not supported for q/k norms over the whole projection (OLMo 2) yet")
    if par.tp > 1 and model.qk_norm and model.qk_norm_scope == "each_head":
        raise fail(
            "parallel: tp > 1 is not supported for q/k norms with a weight per head (qk_norm_scope each_head) yet"
        )
    if par.tp > 1 and not model.uniform_attention:
        raise fail("parallel: tp > 1 is not supported for full-attention layers of their own geometry (Gemma 4) yet")
    if par.tp > 1 and model.kv_shared_layers:
        raise fail("parallel: tp > 1 is not supported for layers sharing K/V (kv_shared_layers: Gemma 4) yet")
    if par.tp > 1 and model.per_layer_input_size:
        raise fail("parallel: tp > 1 is not supported for per-layer inputs (Gemma 4) yet")
    if par.tp > 1 and model.laurel_rank:
        raise fail("parallel: tp > 1 is not supported for LAuReL (laurel_rank: Gemma 3n) yet")
    if (
        par.tp > 1
        and par.sequence_parallel
        and (model.embedding_size or model.norm_placement == "post_residual" or not model.final_norm)
    ):  # plain modules between the sequence-sharded residual and the parallel styles (keel.train.parallel)
        raise fail(
            "parallel: sequence_parallel is not supported for OPT-350m's block (embedding_size, norm_placement "
            "'post_residual' or no final norm); set sequence_parallel = false"
        )
    if par.tp > 1 and par.sequence_parallel and model.gated_norm_rank:
        # SequenceParallel replicates a norm's own parameters only: the gate's fc1/fc2 are a submodule's
        raise fail(
            "parallel: sequence_parallel is not supported for A.X-K2's gated norms (gated_norm_rank); "
            "set sequence_parallel = false"
        )
    if par.tp > 1 and any(model.activation_sparsity):  # the gate's mean and spread over its whole width
        raise fail("parallel: tp > 1 is not supported for the MLP gate's activation sparsity (Gemma 3n) yet")
    if par.tp > 1 and model.moe_branch_norms:
        raise fail("parallel: tp > 1 is not supported for the MoE block's branch norms (Gemma 4) yet")
    if par.tp > 1 and model.is_dsa:
        raise fail("parallel: tp > 1 is not supported for DeepSeek Sparse Attention's indexer (index_topk) yet")
    if par.pp > 1 and model.is_dsa and "shared" in model.indexer_types:
        raise fail("parallel: pp > 1 is not supported for DSA layers sharing another's selection (indexer_types) yet")
    if (par.tp > 1 or par.ep > 1) and (model.mixture_of_attention or model.moe_output_bias):
        raise fail(
            "parallel: tp > 1 and ep > 1 are not supported for JetMoE's attention experts and output biases "
            "(mixture_of_attention, moe_output_bias) yet"
        )
    if par.tp > 1 and model.moe_output_norm:
        raise fail("parallel: tp > 1 is not supported for the MoE block's output norm (A.X-K1) yet")
    if model.hybrid_block == "shared":  # keel.families.zamba2
        raise fail(
            "model: training Zamba 2's shared transformer blocks is not supported: keel holds a copy in each hybrid "
            "layer, and the copies would train apart"
        )
    if par.tp > 1 and model.has_recurrent_layers:
        raise fail(f"parallel: tp > 1 is not supported for {RECURRENT_LAYERS} yet")
    if par.tp > 1 and model.has_partial_layers:
        raise fail("parallel: tp > 1 is not supported for layers without a token mixer or an MLP yet")
    if par.ep > 1 and not model.is_moe:
        raise fail(f"parallel: ep = {par.ep} needs a mixture-of-experts model")
    if par.ep > 1 and model.num_experts % par.ep:
        raise fail(f"parallel: ep = {par.ep} does not divide the model's {model.num_experts} experts")
    if cfg.moe.bias_update_rate and not (model.is_moe and model.router_bias):
        raise fail("moe: bias_update_rate needs routers with a selection bias (DeepSeek-V3's router_bias)")
