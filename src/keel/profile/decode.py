"""Where a decode step's time goes: `keel profile decode MODEL [--batch B] [--dtype D] [--quantize Q]`.

Three passes over as many engine steps (keel's LLMEngine: scheduler, paged KV cache, runner, sampler;
decode steps eager, since the split needs the model's modules: the compiled step is timed by
bench/decode.py and bench/decode_batch.py):
1. timing, nothing attached: the wall time per step, the figure that counts;
2. torch.profiler with a `record_function` scope around sampling and around scheduling only: the
   time of the model's top-level operators (the profiler adds about a microsecond to each) and of
   those two host-side parts, whole (their Python included);
3. the same with a scope around each part of the model too (forward hooks on the embedding, the
   norms, attention's projections, attention itself, the MLP or experts, the LM head): how the
   operators' time divides, the paged cache's writes (`_write`) scoped apart as KV writes. Each
   top-level operator goes to its innermost scope. (The hooks slow this pass down;
   only its proportions are used.)

The step time that the parts do not account for is Python and dispatch overhead (the engine's
bookkeeping, packing the step's tensors, module calls, the dispatcher between operators). Bytes per step: the
weights a step reads once (whatever the batch) plus the KV cache every sequence reads; against the
measured copy bandwidth that gives the roofline tok/s and the fraction reached. A prefill chunk is
profiled the same way (one request's prompt of `prefill` tokens in one step).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.autograd.profiler import record_function

from keel.atomic import write_through
from keel.errors import KeelError
from keel.model.fused_layer import modules_only
from keel.model.kv_size import kv_cache_bytes
from keel.model.layers import RMSNorm
from keel.profile.roofline import copy_bandwidth, streamed_weight_bytes
from keel.quant.loading import loaded_scheme

PARTS = (
    "embedding",
    "norms",
    "attention projections",
    "attention",
    "KV writes",
    "MLP / experts",
    "LM head",
    "sampling",
    "scheduling",
    "other operators",
)
SCOPE = "keel.part::"  # not "keel::": that is the namespace of keel's operators (keel.kernels)
DECODE_WARMUP = 4  # decode steps before the timed ones
PREFILL_STEPS = 3  # prefills timed (and as many profiled): one alone is too noisy on a busy CPU


@dataclass
class StepProfile:
    """One kind of step (decode or prefill): wall time and its split, in milliseconds per step."""

    kind: str
    batch: int
    tokens_per_step: int
    step_ms: float
    parts_ms: dict[str, float] = field(default_factory=dict)
    overhead_ms: float = 0.0
    weight_bytes: float = 0.0
    kv_bytes: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step * 1000 / self.step_ms

    @property
    def bytes_per_step(self) -> float:
        return self.weight_bytes + self.kv_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s, "bytes_per_step": self.bytes_per_step}


@dataclass
class DecodeProfile:
    model: str
    dtype: str
    quantize: str | None  # the scheme the model ran in (None: float)
    threads: int
    device: str
    copy_bandwidth: float  # bytes/s
    decode: StepProfile
    prefill: StepProfile | None

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "decode": self.decode.as_dict(),
            "prefill": self.prefill.as_dict() if self.prefill is not None else None,
        }


def _part_of(name: str, module: torch.nn.Module) -> str | None:
    if isinstance(module, RMSNorm):
        return "norms"
    if name == "embed_tokens":
        return "embedding"
    if name == "lm_head":
        return "LM head"
    if name == "rotary" or name.endswith(".self_attn"):
        return "attention"
    if ".self_attn." in name and name.rsplit(".", 1)[-1].endswith("_proj"):
        return "attention projections"
    if name.endswith(".mlp"):
        return "MLP / experts"
    return None


@contextmanager
def _scopes(model: torch.nn.Module) -> Iterator[None]:
    """A profiler scope around every forward of the model's parts (hooks removed on exit)."""
    handles, stack = [], []

    def enter(part: str) -> Callable:
        def hook(_module, _args) -> None:
            scope = record_function(SCOPE + part)
            scope.__enter__()
            stack.append(scope)

        return hook

    def leave(_module, _args, _out) -> None:
        stack.pop().__exit__(None, None, None)

    for name, module in model.named_modules():
        part = _part_of(name, module)
        if part is not None:
            handles.append(module.register_forward_pre_hook(enter(part)))
            handles.append(module.register_forward_hook(leave))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _wrapped(obj: object, attr: str, part: str) -> Iterator[None]:
    """Run obj.attr (a method or callable attribute) inside a profiler scope."""
    original = getattr(obj, attr)

    def call(*args, **kwargs):
        with record_function(SCOPE + part):
            return original(*args, **kwargs)

    setattr(obj, attr, call)
    try:
        yield
    finally:
        setattr(obj, attr, original)


# Host-side parts: their scope's whole duration (Python included), not only the operators inside.
HOST_PARTS = ("sampling", "scheduling")


def _attribute(events, cuda: bool) -> dict[str, float]:
    """Microseconds per part: each top-level operator (no operator above it) to its innermost scope;
    the host-side parts by their scopes' durations."""
    totals: dict[str, float] = defaultdict(float)
    for ev in events:
        if ev.name.startswith(SCOPE) and ev.name[len(SCOPE) :] in HOST_PARTS:
            totals[ev.name[len(SCOPE) :]] += ev.cpu_time_total
            continue
        if ev.name.startswith(SCOPE) or ev.name.startswith("ProfilerStep"):
            continue
        scope, parent, nested = None, ev.cpu_parent, False
        while parent is not None:
            if parent.name.startswith(SCOPE):
                scope = scope or parent.name[len(SCOPE) :]
            elif not parent.name.startswith("ProfilerStep"):
                nested = True  # inside another operator: counted there
                break
            parent = parent.cpu_parent
        if nested:
            continue
        part = scope or "other operators"
        if part in HOST_PARTS:
            continue  # inside a host-side scope: its duration already counts it
        totals[part] += ev.device_time_total if cuda else ev.cpu_time_total
    return totals


def _steps(engine, n: int, sync: Callable[[], None]) -> float:
    """Seconds for n engine steps."""
    sync()
    start = time.perf_counter()
    for _ in range(n):
        engine.step()
    sync()
    return time.perf_counter() - start


def _profile_steps(engine, n: int, kind: str, batch: int, tokens_per_step: int, trace: str | None) -> StepProfile:
    """Three passes of n steps: timed; profiled with only the host-side scopes (the operators' time,
    barely inflated); profiled with every model-part scope too (how that time divides)."""
    device = engine.model.device
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])

    def profiled(with_parts: bool) -> dict[str, float]:
        with contextlib.ExitStack() as stack:
            if with_parts:
                # Parts are the modules' scopes, so layers run their modules in this pass (not one
                # in keel::decoder_layers calls); the step time above is measured as served.
                stack.enter_context(modules_only())
                stack.enter_context(_scopes(engine.model))
                stack.enter_context(_wrapped(engine.cache, "_write", "KV writes"))
            stack.enter_context(_wrapped(engine.runner, "sampler", "sampling"))
            stack.enter_context(_wrapped(engine.scheduler, "schedule", "scheduling"))
            prof = stack.enter_context(torch.profiler.profile(activities=activities))
            _steps(engine, n, sync)
        if trace and with_parts:
            write_through(Path(trace), prof.export_chrome_trace)
        return {part: us / 1000 / n for part, us in _attribute(prof.events(), cuda).items()}

    step_ms = 1000 * _steps(engine, n, sync) / n
    plain = profiled(with_parts=False)  # model operators all under "other operators"
    split = profiled(with_parts=True)
    model_ms = plain.get("other operators", 0.0)
    split_model = sum(v for k, v in split.items() if k not in HOST_PARTS) or 1.0
    parts_ms = {
        p: (plain.get(p, 0.0) if p in HOST_PARTS else model_ms * split.get(p, 0.0) / split_model) for p in PARTS
    }
    return StepProfile(kind, batch, tokens_per_step, step_ms, parts_ms, max(0.0, step_ms - sum(parts_ms.values())))


def profile_decode(
    model: str,
    batch: int = 1,
    dtype: str = "auto",
    quantize: str = "auto",
    steps: int = 32,
    prompt_tokens: int = 32,
    prefill: int | None = 256,
    trace: str | None = None,
    seed: int = 0,
    kv_cache_dtype: str = "auto",
) -> DecodeProfile:
    """Profile `steps` decode steps of `batch` sequences (each `prompt_tokens` long at the start), and
    one prefill of `prefill` tokens."""
    from keel.serve.config import EngineConfig
    from keel.serve.engine import LLMEngine

    for option, value in (("--batch", batch), ("--steps", steps), ("--prompt-tokens", prompt_tokens)):
        if value < 1:
            raise KeelError(f"{option} must be >= 1, got {value}")
    if prefill is not None and prefill < 0:
        raise KeelError(f"--prefill must be >= 0, got {prefill}")
    max_tokens = 3 * steps + DECODE_WARMUP + 2  # the timed pass and the two profiled ones
    per_sequence = -(-(prompt_tokens + max_tokens) // 16) + 1
    blocks = max(batch * per_sequence, 2 * (-(-(prefill or 0) // 16) + 1)) + 4
    max_len = max(prompt_tokens + max_tokens, prefill or 0) + 16
    config = EngineConfig.of(
        dtype=dtype,
        quantize=quantize,
        enable_prefix_caching=False,
        num_blocks=blocks,
        kv_cache_dtype=kv_cache_dtype,
        compile=False,  # the split needs eager modules
        max_model_len=max_len,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch * prompt_tokens),
    )
    engine = LLMEngine(model, config)
    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    decode = _profile_decode_pass(engine, batch, steps, prompt_tokens, max_tokens, prompt, trace)
    weights = streamed_weight_bytes(engine.model)
    # What the engine's cache holds per token slot, int8 scales included (a float: the byte counts below are).
    per_token = float(kv_cache_bytes(engine.model.config, engine.model.dtype, config.cache.kv_cache_dtype))
    # Each step reads every sequence's cached tokens: the mean over the three passes.
    decode.weight_bytes = weights
    decode.kv_bytes = per_token * batch * (prompt_tokens + DECODE_WARMUP + 1.5 * steps)

    prefill_profile = None
    if prefill:
        # The loaded (and already quantized) model, one request per step.
        engine = LLMEngine(
            engine.loaded,
            config.replace(quantize="none", max_num_seqs=1, max_num_batched_tokens=max(2048, prefill)),
        )
        prefill_profile = _profile_prefill_pass(engine, prefill, prompt)
        prefill_profile.weight_bytes = weights
        prefill_profile.kv_bytes = per_token * prefill  # written once
    return DecodeProfile(
        model=model,
        dtype=str(engine.model.dtype).removeprefix("torch."),
        quantize=loaded_scheme(engine.model),  # what auto chose
        threads=torch.get_num_threads(),
        device=str(engine.model.device),
        copy_bandwidth=copy_bandwidth(device=engine.model.device),
        decode=decode,
        prefill=prefill_profile,
    )


def _profile_decode_pass(
    engine,
    batch: int,
    steps: int,
    prompt_tokens: int,
    max_tokens: int,
    prompt: Callable[[int], list[int]],
    trace: str | None,
) -> StepProfile:
    """Every sequence prefilled, a few steps to warm up, then the timed and profiled decode steps."""
    from keel.serve.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(prompt(prompt_tokens), params)
    for _ in range(DECODE_WARMUP + 1):  # one step prefills every prompt (the token budget holds them)
        engine.step()
    return _profile_steps(engine, steps, "decode", batch, batch, trace)


def _profile_prefill_pass(engine, prefill: int, prompt: Callable[[int], list[int]]) -> StepProfile:
    """Two warm-up prefills, then one request per step: the first PREFILL_STEPS prompts are prefilled
    under the timer, the next ones in the two profiled passes."""
    from keel.serve.sampling import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for _ in range(2):  # warm-up
        engine.add_request(prompt(prefill), one)
        while engine.has_unfinished_requests():
            engine.step()
    for _ in range(3 * PREFILL_STEPS):  # one request per step of each pass
        engine.add_request(prompt(prefill), one)
    return _profile_steps(engine, PREFILL_STEPS, "prefill", 1, prefill, None)
