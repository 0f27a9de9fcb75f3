"""Expert offloading (keel.serve.offload): the slot-cache policy on its own, greedy outputs identical
to resident serving on tiny MoE models at 1-2 resident experts per layer, the metrics, the freed
expert weights, the CLI and the HTTP server."""

from __future__ import annotations

import gc
import weakref

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from keel.errors import KeelError
from keel.quant.loading import load_model
from keel.serve import EngineConfig, LLMEngine, SamplingParams
from keel.serve.offload import enable_expert_offload
from keel.serve.offload.budget import parse_expert_cache, slots_per_layer
from keel.serve.offload.slots import SlotCache
from tiny_models import save_byte_tokenizer, save_hf_model

GREEDY = dict(temperature=0.0, ignore_eos=True)
ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload")
    out = {}
    for name in (*ARCHS, "llama"):
        save_hf_model(name, root / name)
        save_byte_tokenizer(root / name)
        out[name] = root / name
    return out


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 254, (n,), generator=g).tolist() for n in (5, 17, 9, 2, 30)]


def serve(loaded, max_tokens: int = 10, **offload) -> tuple[list[list[int]], LLMEngine]:
    """All prompts at once, an 8-token step budget (prefill chunks mixed with decodes): the output
    token ids (the engine's `texts` attribute: the texts)."""
    config = EngineConfig.of(num_blocks=96, block_size=4, max_num_batched_tokens=8, max_model_len=64, **offload)
    engine = LLMEngine(loaded, config)
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, **GREEDY)) for p in prompts()]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    engine.texts = [done[i].text for i in ids]
    return [done[i].token_ids for i in ids], engine


@pytest.fixture(scope="module")
def resident(dirs):
    """Reference greedy outputs with every expert resident (offloading off)."""
    out = {}
    for name in ARCHS:
        ids, engine = serve(load_model(dirs[name], "float32"))
        out[name], out[name + ":text"] = ids, engine.texts
    return out


# ----------------------------------------------------------------------------- the policy alone
def test_lru_hits_and_evictions():
    cache = SlotCache(num_experts=4, num_slots=2, policy="lru")
    cache.assign(0, 0)
    cache.assign(1, 1)
    (only,) = cache.plan([0, 1])
    assert only.loads == [] and sorted(only.experts) == [0, 1]
    (only,) = cache.plan([1, 2])  # 0 is the one not needed: evicted
    assert only.loads == [(2, 0)] and cache.slot_of == {1: 1, 2: 0}
    cache.plan([1])
    (only,) = cache.plan([3])  # 2 was used before 1's last use: least recent
    assert only.loads == [(3, 0)] and cache.slot_of == {1: 1, 3: 0}


def test_lfu_keeps_the_frequent_expert():
    cache = SlotCache(num_experts=4, num_slots=2, policy="lfu")
    for _ in range(3):
        cache.plan([0])
    cache.plan([1])  # free slot first
    (only,) = cache.plan([2])  # 1 used once, 0 three times: 1 goes although 0 is older
    assert only.loads == [(2, 1)] and cache.slot_of == {0: 0, 2: 1}


def test_more_experts_than_slots_run_in_passes():
    cache = SlotCache(num_experts=8, num_slots=2)
    cache.assign(0, 0)
    cache.assign(1, 1)
    passes = cache.plan([3, 0, 5, 1, 6])
    assert [p.experts for p in passes] == [[0, 1], [3, 5], [6]]  # resident first: no load
    assert passes[0].loads == [] and passes[0].slots == [0, 1]
    assert passes[1].loads == [(3, 0), (5, 1)] and passes[1].slots == [0, 1]
    assert len(passes[2].loads) == 1 and passes[2].slots == [passes[2].loads[0][1]]
    assert sorted(e for p in passes for e in p.experts) == [0, 1, 3, 5, 6]


def test_prefetch_evicts_only_unpredicted_experts_and_is_not_a_use():
    cache = SlotCache(num_experts=8, num_slots=3)
    for e in range(3):
        cache.assign(e, e)
    cache.plan([0, 1, 2])
    loads = cache.plan_prefetch([2, 7, 6, 5])  # top 3 fit: 2 stays, 7 and 6 replace 0 and 1
    assert sorted(loads) == [(6, 1), (7, 0)] or sorted(loads) == [(6, 0), (7, 1)]
    assert set(cache.slot_of) == {2, 6, 7}
    (only,) = cache.plan([2, 4])  # 6 and 7 were never used: one of them goes, 2 stays
    assert only.loads[0][0] == 4 and 2 in cache.slot_of


def test_budget_spellings():
    assert parse_expert_cache("2").experts == 2 and parse_expert_cache(3).experts == 3
    assert parse_expert_cache("25%").fraction == 0.25
    assert parse_expert_cache("1MiB").bytes == 2**20
    assert slots_per_layer(parse_expert_cache("25%"), 8, 3, 100) == 2
    assert slots_per_layer(parse_expert_cache("12"), 8, 3, 100) == 8  # capped: all resident
    assert slots_per_layer(parse_expert_cache("1000B"), 8, 3, 100) == 3  # 1000 // (3 layers x 100 bytes)
    for bad in ("lots", "0", "-1", "0%", "150%", "x%", "0MiB"):
        with pytest.raises(KeelError, match="--expert-cache"):
            parse_expert_cache(bad)
    with pytest.raises(KeelError, match="less than one expert per MoE layer"):
        slots_per_layer(parse_expert_cache("200B"), 8, 3, 100)


# ------------------------------------------------------------------ identical outputs, metrics
CASES = {
    "mixtral": dict(expert_cache=1),  # 1 of 4 experts: several passes in almost every forward
    "qwen2_moe": dict(expert_cache="25%", expert_prefetch=False),  # 2 of 8, no prefetch
    "qwen3_moe": dict(expert_cache="2", expert_cache_policy="lfu"),
    "deepseek_v3": dict(expert_cache=2, expert_storage="disk"),  # read from the safetensors file
}


@pytest.mark.parametrize("arch", list(CASES))
def test_greedy_outputs_equal_resident_serving(dirs, resident, arch):
    outputs, engine = serve(load_model(dirs[arch], "float32"), **CASES[arch])
    assert outputs == resident[arch]
    s = engine.stats()
    assert 0 < s["expert_cache_hit_rate"] < 1
    assert s["expert_cache_hits"] < s["expert_cache_queries"]
    assert s["expert_bytes_loaded_total"] > 0 and s["expert_load_stall_seconds_total"] > 0
    assert s["expert_extra_passes_total"] > 0  # batched steps need more experts than the slots
    layer = next(iter(engine.offload.layers.values()))
    assert s["expert_bytes_loaded_total"] == s["expert_loads_total"] * layer.expert_bytes
    if CASES[arch].get("expert_prefetch", True):
        assert s["expert_prefetch_loads_total"] > 0 and 0 < s["expert_prefetch_accuracy"] <= 1
    else:
        assert s["expert_prefetch_loads_total"] == 0 and engine.offload.prefetcher is None


def test_full_budget_never_loads(dirs, resident):
    outputs, engine = serve(load_model(dirs["mixtral"], "float32"), expert_cache="100%")
    assert outputs == resident["mixtral"]
    s = engine.stats()
    assert s["expert_cache_hit_rate"] == 1.0 and s["expert_cache_queries"] > 0
    assert s["expert_bytes_loaded_total"] == 0 and s["expert_loads_total"] == 0
    plain = LLMEngine(load_model(dirs["mixtral"]), EngineConfig.of(num_blocks=8, max_model_len=64))
    assert "expert_cache_hit_rate" not in plain.stats() and plain.offload is None


def test_stacked_checkpoint_read_from_disk(dirs, resident, tmp_path):
    """transformers-5 layout (experts.gate_up_proj [E, 2I, H] in the file): one row per expert load."""
    src = dirs["mixtral"]
    tensors = load_file(src / "model.safetensors")
    for layer in range(3):
        prefix = f"model.layers.{layer}.block_sparse_moe.experts"
        gate_up, down = [], []
        for e in range(4):
            gate_up.append(torch.cat([tensors.pop(f"{prefix}.{e}.w1.weight"), tensors.pop(f"{prefix}.{e}.w3.weight")]))
            down.append(tensors.pop(f"{prefix}.{e}.w2.weight"))
        tensors[f"{prefix}.gate_up_proj"], tensors[f"{prefix}.down_proj"] = torch.stack(gate_up), torch.stack(down)
    save_file(tensors, tmp_path / "model.safetensors")
    for f in src.iterdir():
        if f.suffix == ".json":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    outputs, engine = serve(load_model(tmp_path, "float32"), expert_cache=2, expert_storage="disk")
    assert outputs == resident["mixtral"] and engine.stats()["expert_bytes_loaded_total"] > 0


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_stacked_expert_weights_are_freed(dirs):
    loaded = load_model(dirs["qwen3_moe"], "float32")
    before = param_bytes(loaded.model)
    old = [weakref.ref(layer.mlp.experts.gate_up_proj) for layer in loaded.model.layers.values()]
    offload = enable_expert_offload(loaded, 2, storage="disk")
    gc.collect()
    assert all(ref() is None for ref in old)  # nothing holds the stacked weights any more
    experts = loaded.model.layers["0"].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (2, 2 * 48, 64) and tuple(experts.down_proj.shape) == (2, 64, 48)
    expert = 3 * 64 * 48 * 4
    assert before - param_bytes(loaded.model) == 3 * (8 - 2) * expert  # 3 MoE layers, 6 experts each gone
    assert offload.resident_bytes == 3 * 2 * expert
    with pytest.raises(KeelError, match="already on"):
        enable_expert_offload(loaded, 2)
    offload.close()


def test_a_failed_load_leaves_no_stale_slot(dirs):
    """A read error mid-forward (a multi-pass plan had already counted on later loads): the error
    propagates, and the next forward recomputes exactly, with no slot trusted wrongly."""
    reference = load_model(dirs["mixtral"], "float32").model
    loaded = load_model(dirs["mixtral"], "float32")
    offload = enable_expert_offload(loaded, 1, prefetch=False)
    tokens = torch.randint(0, 254, (1, 12), generator=torch.Generator().manual_seed(5))
    real, calls = offload.store.copy_into, []

    def flaky(*args):
        calls.append(args)
        if len(calls) == 2:
            raise OSError("read failed")
        real(*args)

    offload.store.copy_into = flaky
    with torch.no_grad():
        with pytest.raises(OSError, match="read failed"):
            loaded.model(tokens)
        offload.store.copy_into = real
        assert torch.equal(loaded.model(tokens), reference(tokens))


# ------------------------------------------------------------------------------------ CLI
def one_error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("keel: error:"), text
    return lines[0]


def test_bad_expert_cache_is_a_one_line_error(dirs, capsys, monkeypatch):
    # In-process (the CLI's own main; `keel serve`'s one-line errors in a process of its own:
    # tests/test_serve_tenants.py): refused before the model loads, never serving.
    from keel.cli import main
    from keel.serve.openai import server

    def no_server():
        raise AssertionError("keel serve got past its checks and would start serving")

    monkeypatch.setattr(server, "_server_class", no_server)
    capsys.readouterr()
    assert main(["serve", str(dirs["mixtral"]), "--expert-cache", "lots"]) == 1
    assert "--expert-cache 'lots'" in one_error_line(capsys.readouterr().err)

    def error(*args: str) -> str:
        assert main(["generate", "--prompt", "hi", "--max-tokens", "2", *args]) == 1
        return one_error_line(capsys.readouterr().err)

    assert "less than one expert per MoE layer" in error(str(dirs["mixtral"]), "--expert-cache", "1KiB")
    assert "no mixture-of-experts layers" in error(str(dirs["llama"]), "--expert-cache", "2")
    config = EngineConfig.of(num_blocks=8, max_model_len=64, expert_cache=1, expert_cache_policy="fifo")
    with pytest.raises(KeelError, match="--expert-cache-policy"):
        LLMEngine(load_model(dirs["mixtral"]), config)


def test_keel_generate_with_offloading_prints_the_same_text(dirs, capsys):
    from keel.cli import main

    args = ["generate", str(dirs["qwen3_moe"]), "--prompt", "Hello", "--max-tokens", "8", "--ignore-eos"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--expert-cache", "1", "--expert-storage", "disk"]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain and "[keel] experts: 1 resident per MoE layer" in captured.err


# ----------------------------------------------------------------------------------- HTTP
# In `make test-slow` (the default suite's budget): the engine and CLI tests above serve through the expert cache.
@pytest.mark.slow
def test_keel_serve_expert_cache_over_http(dirs, resident):
    from keel.serve.openai.child import ServerProcess

    server = ServerProcess(
        dirs["qwen3_moe"],
        "--served-model-name",
        "tiny",
        "--threads",
        "1",
        "--num-blocks",
        "64",
        "--max-model-len",
        "64",
        "--expert-cache",
        "2",
    ).wait_ready()
    try:
        got = []
        for prompt in prompts():
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            reply = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()
            got.append(reply["choices"][0]["text"])
        text = httpx.get(server.base_url + "/metrics").text
    finally:
        assert server.terminate() == 0, server.tail(20)
    assert got == resident["qwen3_moe:text"]
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert 0 < samples["keel:expert_cache_hit_rate"] < 1
    assert samples["keel:expert_bytes_loaded_total"] > 0
    assert samples["keel:expert_load_stall_seconds_total"] > 0
    assert 0 < samples["keel:expert_prefetch_accuracy"] <= 1
