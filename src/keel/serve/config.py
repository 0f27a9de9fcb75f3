"""The engine's configuration: one small dataclass per concern, composed by `EngineConfig`.

As vLLM's `CacheConfig` / `SchedulerConfig` / `ParallelConfig` / `SpeculativeConfig`: each part goes
where it is used (the scheduler takes `SchedulerConfig`, a parallel worker takes the load, quant,
cache and parallel parts) and nothing copies fields. A field is an engine option in one place: its
type (with `Literal` for choices), default and docstring are the command-line option, its choices
and its help (keel.cli.config_options), and `EngineConfig.of(**options)` / `keel.LLM(model, **options)`
take it by name. Field names are unique over the parts (a test checks it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from keel.dtype_names import DTYPE_ALIASES, DTYPE_CHOICES, canonical_dtype
from keel.errors import KeelError
from keel.quant.config import QuantConfig
from keel.serve.speculative import SpeculativeConfig
from keel.serve.units import AUTO_LENGTH, human_readable_int, model_length


@dataclass
class LoadConfig:
    """How the model is loaded and prepared to run"""

    device: str = "auto"
    """where the model runs: auto (the first CUDA device where one is visible, else the CPU), cpu, cuda, cuda:N"""

    dtype: str = field(default="auto", metadata={"choices": (*DTYPE_CHOICES, *DTYPE_ALIASES), "type": canonical_dtype})
    """compute dtype (auto: the fastest correct one here: bf16 on CPUs with native bf16 matmul and for quantized
    weights, float32 on other CPUs, the checkpoint's dtype on CUDA; half and float: vLLM's names of float16 and
    float32)"""

    fuse_projections: bool = True
    """q/k/v and gate/up as one matmul each (keel.model.fuse): fewer, larger calls, identical outputs"""

    prepack_weights: bool = True
    """weights pre-packed for the kernels that run them: bf16 linears for oneDNN on CPU (keel.model.prepack), block
    weights in panels of 16 rows from keel's AVX2 kernel level (keel.quant.panels); identical outputs, less work a
    call"""

    compile: bool | None = field(default=None, metadata={"negative_aliases": ("--enforce-eager",)})
    """decode steps through one torch.compile'd graph (default: on for dense models of 50M+ parameters, where the
    compile time pays back, unless keel's fused CPU layers run every layer (float32 or block weights); --no-compile,
    or vLLM's --enforce-eager: eager)"""

    def __post_init__(self) -> None:
        self.dtype = canonical_dtype(self.dtype)  # keel.LLM(model, dtype="half") as vLLM's LLM takes it


@dataclass
class CacheConfig:
    """The paged KV cache (keel.serve.kv_cache)"""

    block_size: int = 16
    """tokens per KV-cache block"""

    kv_cache_memory: str | int | None = field(default=None, metadata={"metavar": "SIZE"})
    """KV-cache budget, e.g. 2GiB (bytes or a size); unset: 2GiB on CPU, on CUDA what --gpu-memory-utilization
    leaves"""

    gpu_memory_utilization: float = 0.9
    """on CUDA without --kv-cache-memory: the share of the device's memory the engine holds (weights,
    activations measured by a dummy step, KV cache), as vLLM's"""

    num_blocks: int | None = None
    """KV blocks (overrides --kv-cache-memory)"""

    enable_prefix_caching: bool = True
    """reuse the KV blocks of a shared prompt prefix"""

    kv_cache_dtype: Literal["auto", "bfloat16", "int8"] = "auto"
    """KV-cache storage: the model's dtype, bfloat16 (half a float32 model's bytes; attention still computes
    in the model's dtype), or int8 with a scale per token and head"""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise KeelError(f"--block-size must be at least 1, got {self.block_size}")


@dataclass
class SchedulerConfig:
    """Continuous batching (keel.serve.scheduler)"""

    max_num_batched_tokens: int | None = field(default=None, metadata={"type": human_readable_int})
    """tokens one step may compute (prefill chunks and decodes together; default: 2048 on GPUs, on CPUs 64 per
    compute thread: a CPU step costs about its tokens, so a chunk of 2048 stalls every running decode)"""

    max_num_seqs: int = 256
    """requests running at once"""

    max_model_len: int | None = field(default=None, metadata={"type": model_length})
    """longest sequence, prompt and output (default: the model's context); vLLM's 32k = 32000, 32K = 32768; auto
    (or -1): the model's context or, where the KV cache holds fewer tokens, as many as it holds"""

    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """which waiting request runs first: arrival order, or the request's priority"""

    enable_chunked_prefill: bool = True
    """split a long prompt's prefill over steps, beside running decodes; off: a prompt is prefilled in one step
    (it waits for a step with room for all of it; --max-num-batched-tokens must hold --max-model-len)"""

    async_scheduling: bool | None = None
    """schedule and queue step N+1 while step N runs on the device, and read step N's tokens after (vLLM's
    --async-scheduling: the host's share of a step hides behind the device's). Default: on with CUDA, off on
    CPUs (no device runs while the host works). Steps wait for the previous one while a request's sampling
    reads its own last tokens (penalties, min_tokens, bad words, structured outputs, prompt logprobs); not
    with speculative decoding or parallel workers"""

    def __post_init__(self) -> None:
        if isinstance(self.max_model_len, str):  # keel.LLM(model, max_model_len="auto"), as the flag takes it
            self.max_model_len = model_length(self.max_model_len)
        if self.max_model_len is not None and self.max_model_len < 1 and self.max_model_len != AUTO_LENGTH:
            raise KeelError(f"--max-model-len must be >= 1 or auto, got {self.max_model_len}")

    def model_len(self, context: int) -> int:
        """The length asked for, or the model's `context` (unset, or auto before the KV cache is sized)."""
        return context if self.max_model_len in (None, AUTO_LENGTH) else self.max_model_len


@dataclass
class ParallelConfig:
    """Tensor/pipeline-parallel worker processes (keel.serve.parallel), vLLM's and torchrun's option names"""

    tensor_parallel_size: int = field(default=1, metadata={"aliases": ("-tp",), "metavar": "N"})
    """shard every layer over N worker processes (one per GPU)"""

    pipeline_parallel_size: int = field(default=1, metadata={"aliases": ("-pp",), "metavar": "M"})
    """split the layers into M stages, each its own worker processes"""

    enable_expert_parallel: bool = False
    """MoE: split the experts over the tensor-parallel ranks, not each one by width"""

    nnodes: int = 1
    """nodes the N x M workers span (torchrun's term)"""

    node_rank: int = 0
    """this node's index: node 0 runs the engine and server, the others only workers"""

    master_addr: str = "127.0.0.1"
    """node 0's address for the workers' rendezvous"""

    master_port: int | None = None
    """rendezvous port (default: a free one, 1 node)"""

    distributed_timeout: float = 60.0
    """seconds a collective or the rendezvous may wait for a peer before the workers fail"""

    startup_timeout: float = 600.0
    """seconds for every worker to load its shard and report ready"""

    worker_threads: int | None = None
    """torch threads per CPU worker (default: the cores shared out)"""

    distributed_executor_backend: Literal["mp", "uni"] | None = None
    """where the model runs (vLLM's option): mp, worker processes (the default for tp x pp > 1); uni, the engine's
    own process (the default for one rank); mp with one rank runs it in a worker too, its NCCL/gloo path
    on a single GPU"""

    def __post_init__(self) -> None:
        for flag, value in (
            ("--tensor-parallel-size", self.tensor_parallel_size),
            ("--pipeline-parallel-size", self.pipeline_parallel_size),
            ("--nnodes", self.nnodes),
            ("--worker-threads", 1 if self.worker_threads is None else self.worker_threads),
        ):
            if value < 1:
                raise KeelError(f"{flag} must be at least 1, got {value}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def uses_workers(self) -> bool:
        """Whether the model runs in worker processes (keel.serve.parallel) rather than the engine's."""
        return self.world_size > 1 or self.distributed_executor_backend == "mp"


@dataclass
class OffloadConfig:
    """Expert offloading, MoE models (keel.serve.offload)"""

    expert_cache: str | int | None = field(default=None, metadata={"metavar": "N|P%|SIZE"})
    """offload experts: N experts per MoE layer stay resident, or P% of them, or SIZE bytes over all MoE layers
    (e.g. 512MiB); default: all resident"""

    expert_cache_policy: Literal["lru", "lfu"] = "lru"
    """which expert to evict"""

    expert_storage: Literal["host", "disk"] = "host"
    """where non-resident experts live: host memory, or the safetensors file (mmap)"""

    expert_prefetch: bool = True
    """load the next MoE layer's predicted experts in the background"""

    def __post_init__(self) -> None:
        if self.expert_cache is not None:  # a bad budget fails here, before the model loads
            from keel.serve.offload.budget import parse_expert_cache

            parse_expert_cache(self.expert_cache)

    @property
    def enabled(self) -> bool:
        return self.expert_cache is not None


def _json_option(name: str) -> dict:
    return {"json": True, "flag": f"--{name.replace('_', '-')}", "dest": name, "metavar": "JSON"}


@dataclass
class EngineConfig:
    """Every engine option, by concern. `EngineConfig.of(max_num_seqs=8, quantize="int8")` takes them by name."""

    load: LoadConfig = field(default_factory=LoadConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    speculative: SpeculativeConfig | None = field(default=None, metadata=_json_option("speculative_config"))
    """speculative decoding, vLLM's keys, e.g. '{"method": "ngram", "num_speculative_tokens": 4}' or
    '{"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 3}'; keys: method, num_speculative_tokens,
    prompt_lookup_min, prompt_lookup_max, model, quantization, disable_by_batch_size"""

    def __post_init__(self) -> None:
        if isinstance(self.speculative, dict):
            self.speculative = SpeculativeConfig.from_dict(self.speculative)
        elif self.speculative is not None:
            self.speculative.validate()

    @classmethod
    def parts(cls) -> dict[str, type]:
        """The sub-config classes by field name (not the speculative config, a single JSON option)."""
        fields = dataclasses.fields(cls)
        return {f.name: f.default_factory for f in fields if f.default_factory is not dataclasses.MISSING}

    @classmethod
    def of(cls, **options: Any) -> EngineConfig:
        """An EngineConfig from option names (`block_size=8`, `quantize="int4"`, `speculative_config={...}`),
        each routed to the part that has it; an unknown name is an error."""
        return cls().replace(**options)

    def replace(self, **options: Any) -> EngineConfig:
        """A copy with some options changed, by name as in `of`."""
        owners = option_owners()
        parts = {part: getattr(self, part) for part in self.parts()}
        speculative = options.pop("speculative_config", self.speculative)
        changed: dict[str, dict[str, Any]] = {}
        for name, value in options.items():
            if name not in owners:
                raise KeelError(f"unknown engine option {name!r}")
            changed.setdefault(owners[name], {})[name] = value
        for part, values in changed.items():
            parts[part] = dataclasses.replace(parts[part], **values)
        return EngineConfig(**parts, speculative=speculative)


def option_owners() -> dict[str, str]:
    """Each option name -> the EngineConfig part that holds it."""
    owners: dict[str, str] = {}
    for part, kind in EngineConfig.parts().items():
        for f in dataclasses.fields(kind):
            if f.name in owners:
                raise TypeError(f"engine option {f.name!r} is in both {owners[f.name]} and {part}")
            owners[f.name] = part
    return owners
