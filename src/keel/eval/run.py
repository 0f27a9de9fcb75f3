"""One eval run: suites, golden greedy outputs and perplexity, all through one engine, with the
version manifest; the result is one JSON document (`keel eval run --out`).

Golden outputs are the greedy continuations of fixed prompts (keel/eval/golden.jsonl); `keel eval
compare` measures how many of them a configuration changes and where they first diverge.
Perplexity here goes through the engine too (prompt logprobs of the same sliding windows as `keel
eval ppl`), so a KV-cache or kernel change under test is in the figure.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

from keel.atomic import write_json_atomic
from keel.errors import KeelError
from keel.eval.score import Evaluator, continuation_logprobs, dimensions
from keel.eval.suites import Suite
from keel.jsonl import iter_jsonl
from keel.model.perplexity import windows
from keel.serve.llm import LLM
from keel.serve.sampling import SamplingParams

FORMAT = "keel-eval/1"
GOLDEN_FILE = Path(__file__).parent / "golden.jsonl"


def golden_prompts(limit: int | None = None) -> list[dict[str, str]]:
    lines = GOLDEN_FILE.read_text(encoding="utf-8").split("\n")
    prompts = [prompt for _, prompt in iter_jsonl(lines, str(GOLDEN_FILE))]
    return prompts[:limit] if limit is not None else prompts


def golden_outputs(evaluator: Evaluator, prompts: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """Greedy continuations of the golden prompts (chat-rendered when the model has a template)."""
    tokenizer = evaluator.tokenizer
    if tokenizer.chat_template:
        ids = [tokenizer.encode_chat([{"role": "user", "content": p["prompt"]}]) for p in prompts]
    else:
        ids = [tokenizer.encode(p["prompt"]) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = evaluator.llm.generate(ids, params, use_tqdm=False)
    return {
        "max_tokens": max_tokens,
        "outputs": {
            p["id"]: {"token_ids": out.outputs[0].token_ids, "text": out.outputs[0].text}
            for p, out in zip(prompts, outputs, strict=True)
        },
    }


def engine_perplexity(llm: LLM, token_ids: list[int], context: int, stride: int) -> dict[str, Any]:
    """Sliding-window perplexity (keel.model.perplexity's windows) from the engine's prompt logprobs."""
    plan = windows(len(token_ids), context, stride)
    # Each window: the scored tokens are the continuation of the tokens before them.
    pairs = [(token_ids[begin : end - scored], token_ids[end - scored : end]) for begin, end, scored in plan]
    started = time.perf_counter()
    nll = -sum(continuation_logprobs(llm, pairs))
    seconds = time.perf_counter() - started
    scored_total = len(token_ids) - 1
    return {
        "tokens_scored": scored_total,
        "windows": len(plan),
        "context": context,
        "stride": stride,
        "nll_sum": nll,
        "perplexity": math.exp(nll / scored_total),
        "seconds": seconds,
    }


def _items_hash(items: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode("utf-8")).hexdigest()


def run_eval(
    llm: LLM,
    suites: list[Suite],
    *,
    golden: int | None = None,
    golden_tokens: int = 64,
    ppl_tokens: list[int] | None = None,
    ppl_context: int = 1024,
    ppl_stride: int = 512,
    ppl_corpus: str | None = None,
    manifest: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything `keel eval run` records. golden: how many golden prompts (None: all, 0: none);
    ppl_tokens: the corpus tokens to score (None: no perplexity)."""
    evaluator = Evaluator(llm)
    manifest = dict(manifest or {})
    # The prompt templates, sampling and items of every suite, as run (a changed item changes the hash).
    manifest["suites"] = {
        s.name: {**s.header(), "items": len(s.items), "items_sha256": _items_hash(s.items)} for s in suites
    }
    prompts = golden_prompts(golden) if golden != 0 else []
    if prompts:
        manifest["golden"] = {"max_tokens": golden_tokens, "sampling": "greedy", "prompts_sha256": _items_hash(prompts)}
    seconds: dict[str, float] = {}
    results: dict[str, Any] = {}
    for suite in suites:
        started = time.perf_counter()
        results[suite.name] = evaluator.run(suite)
        seconds[suite.name] = time.perf_counter() - started
    record: dict[str, Any] = {
        "format": FORMAT,
        "manifest": manifest,
        "suites": results,
        "dimensions": dimensions(results),
    }
    if prompts:
        started = time.perf_counter()
        record["golden"] = golden_outputs(evaluator, prompts, golden_tokens)
        seconds["golden"] = time.perf_counter() - started
    if ppl_tokens is not None:
        ppl = engine_perplexity(llm, ppl_tokens, ppl_context, ppl_stride)
        record["perplexity"] = {"corpus": ppl_corpus, **ppl}
        seconds["perplexity"] = ppl["seconds"]
    record["seconds"] = seconds
    return record


def write_json(path: str | Path, record: dict[str, Any]) -> None:
    """Atomically: a reader (or a crash) never leaves half a results file."""
    path = Path(path)
    try:
        write_json_atomic(path, record, indent=1)
    except OSError as e:
        raise KeelError(f"{path}: cannot write ({e.strerror})") from None


def read_results(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise KeelError(f"{path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KeelError(f"{path}: not a JSON results file ({e})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise KeelError(f"{path}: not a `keel eval run` results file (format {FORMAT!r} expected)")
    for name, suite in (record.get("suites") or {}).items():
        missing = [k for k in ("primary", "metrics", "items") if k not in suite]
        if missing:
            raise KeelError(f"{path}: suite {name} lacks {', '.join(missing)} (a damaged results file)")
    if "golden" in record and "outputs" not in record["golden"]:
        raise KeelError(f"{path}: golden lacks outputs (a damaged results file)")
    if "perplexity" in record and not {"perplexity", "tokens_scored", "context", "stride"} <= set(record["perplexity"]):
        raise KeelError(f"{path}: perplexity lacks fields (a damaged results file)")
    return record
