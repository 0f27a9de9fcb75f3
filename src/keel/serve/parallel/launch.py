"""From the engine's options to the workers of parallel serving: checks, the rendezvous, headless nodes.

One node: `--tensor-parallel-size N [--pipeline-parallel-size M]` spawns N x M workers on a free
local port. Several nodes (torchrun's rendezvous terms): every node runs the same `keel serve`
command with `--nnodes K --node-rank R --master-addr HOST --master-port P`; node R runs global
ranks [R * N * M / K, (R + 1) * N * M / K), node 0 also runs the engine and the HTTP server, and the
others only their workers (`run_headless`), until node 0 stops them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from keel.errors import KeelError
from keel.net import free_port
from keel.quant.config import AUTO
from keel.quant.loading import stores_integer_blocks
from keel.serve.kv_budget import DummyStep
from keel.serve.parallel.executor import ParallelExecutor, node_ranks
from keel.serve.parallel.load import check_parallel_model
from keel.serve.parallel.worker import WorkerSpec
from keel.serve.scheduler import step_budget
from keel.weights.checkpoint import Checkpoint
from keel.weights.compute_dtype import resolve_dtype
from keel.weights.loader import open_checkpoint
from keel.weights.shard import TensorParallelLayout

if TYPE_CHECKING:
    from keel.serve.config import EngineConfig

log = logging.getLogger("keel.serve")


def worker_spec(model: str | Path, config: EngineConfig, device: str) -> tuple[WorkerSpec, range, Checkpoint]:
    """The workers' spec, this node's ranks and the opened checkpoint; one-line errors for what cannot run."""
    par = config.parallel
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    if tp < 1 or pp < 1:
        raise KeelError(f"--tensor-parallel-size and --pipeline-parallel-size must be >= 1, got {tp} and {pp}")
    if par.distributed_executor_backend == "uni" and par.world_size > 1:
        raise KeelError(f"--distributed-executor-backend uni runs one rank in the engine process; tp x pp = {tp * pp}")
    cuda = str(device).startswith("cuda")
    spec_method = getattr(config.speculative, "method", None)
    unsupported = [
        (config.quant.quantize == "gguf", "--quantize gguf (int8 and int4 work)"),
        (config.offload.enabled, "--expert-cache"),
        (spec_method == "draft_model", "speculative decoding with a draft model (ngram works)"),
    ]
    for bad, what in unsupported:
        if bad:
            raise KeelError(f"tensor/pipeline-parallel serving does not support {what} yet")
    checkpoint = open_checkpoint(model)
    check_parallel_model(checkpoint.config, model, tp, pp, par.enable_expert_parallel)
    if config.quant.quantize == AUTO and stores_integer_blocks(checkpoint):
        log.info("%s: the workers load the checkpoint's integer blocks as float (run as stored in one process)", model)
    ranks = node_ranks(par.world_size, par.nnodes, par.node_rank)
    if par.nnodes > 1 and par.master_port is None:
        raise KeelError("--master-port is required with --nnodes > 1 (the same on every node)")
    port = par.master_port or free_port(par.master_addr)
    dtype = resolve_dtype(checkpoint, config.load.dtype, device, config.quant.scheme)
    sched = config.scheduler
    max_model_len = sched.model_len(checkpoint.config.max_position_embeddings)
    tokens = step_budget(sched, "cuda" if cuda else "cpu", torch.get_num_threads(), max_model_len)
    spec = WorkerSpec(
        model=str(model),
        dtype=str(dtype).removeprefix("torch."),
        init_method=f"tcp://{par.master_addr}:{port}",
        local_world=len(ranks),
        load=config.load,
        quant=config.quant,
        cache=config.cache,
        parallel=par,
        device="cuda" if cuda else "cpu",
        dummy_step=DummyStep.of(tokens, max_model_len, sched.max_num_seqs),
        max_model_len=max_model_len,
    )
    mc = checkpoint.config
    if tp > 1 and TensorParallelLayout(mc, tp, 0).kv_replicas > 1:
        log.info(
            "tensor parallel %d over %d KV heads: each KV head is replicated on %d ranks (as vLLM does)",
            tp,
            mc.num_kv_heads,
            tp // mc.num_kv_heads,
        )
    log.info(
        "node %d of %d: starting ranks %d-%d of %d (tensor parallel %d x pipeline parallel %d) at %s",
        par.node_rank,
        par.nnodes,
        ranks[0],
        ranks[-1],
        par.world_size,
        tp,
        pp,
        spec.init_method,
    )
    return spec, ranks, checkpoint


def run_headless(model: str | Path, config: EngineConfig, device: str = "cpu") -> int:
    """A node other than 0: run this node's workers until they exit; their worst exit code."""
    spec, ranks, _ = worker_spec(model, config, device)
    if 0 in ranks:
        raise KeelError("node 0 runs the engine: --node-rank must be > 0 for a workers-only node")
    executor = ParallelExecutor(spec, ranks, None, startup_timeout=config.parallel.startup_timeout)
    log.info("node %d: %d workers ready; serving until node 0 stops", config.parallel.node_rank, len(ranks))
    return executor.wait()


# --------------------------------------------------------------------------------------- planner hook
_WEIGHTS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "auto": "bf16"}


def local_cluster():
    """This machine's CUDA GPUs as a planner Cluster (the GPU found in the planner's table by name)."""
    import torch

    from keel.plan.hardware import GPUS, Cluster, get_gpu

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise KeelError("--auto-parallel plans for GPUs and found none: give the cluster, e.g. --auto-parallel 8xH200")
    name = torch.cuda.get_device_name(0)
    key = next((k for k in GPUS if k.split("-")[0] in name.lower()), None)  # "NVIDIA H200" -> "h200"
    if key is None:
        raise KeelError(f"--auto-parallel: GPU {name!r} is not in the planner's table: give it, e.g. 8xH100")
    return Cluster(get_gpu(key), torch.cuda.device_count())


def auto_parallel(config, gpus: str | None, context: int, dtype: str = "auto") -> tuple[int, int, str]:
    """(tp, pp, why): the `keel plan serve` layout ranked first for `gpus` ("COUNTxTYPE"; None: this
    machine's GPUs) among those keel can run (heads and widths divide by tp). A plan with several
    replicas is served one replica per `keel serve`."""
    from keel.plan.hardware import parse_cluster
    from keel.plan.serve import plan_serving

    cluster = parse_cluster(gpus) if gpus else local_cluster()
    runnable = []
    for layout in plan_serving(config, cluster, context, _WEIGHTS.get(dtype, "bf16")):
        if not layout.fits or layout.pp > config.num_layers:
            continue
        try:
            check_parallel_model(config, "the model", layout.tp, layout.pp)
        except KeelError:
            continue
        runnable.append(layout)
    if not runnable:
        raise KeelError(
            f"--auto-parallel: no layout of {cluster.count} {cluster.gpu.name} holds the model's weights "
            f"and a {context}-token sequence"
        )
    best = runnable[0]
    why = (
        f"planned for {cluster.count} x {cluster.gpu.name} at {context} tokens: tp {best.tp} x pp {best.pp}, "
        f"{best.weights_gb:.1f} GB of weights and {best.kv_gb:.1f} GB of KV cache per GPU, "
        f"~{best.tokens_per_s:,.0f} tok/s over {best.replicas} replica(s)"
    )
    if best.replicas > 1:
        why += f"; this server is one replica: run {best.replicas - 1} more for the rest of the GPUs"
    return best.tp, best.pp, why
