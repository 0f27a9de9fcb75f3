"""lm-evaluation-harness (the pinned `lm-eval`) against a live `keel serve`, through its
`local-completions` model: a multiple-choice task over a local JSONL file, scored by log-likelihood.

local-completions tokenizes each (context, continuation) pair itself (an HF tokenizer loaded from the
model directory), sends the token ids with echo, logprobs=1 and max_tokens=1, and sums the echoed
prompt's token_logprobs[ctxlen:-1] (the last entry is the generated token's). Its accuracies and its
per-choice log-likelihoods must equal keel's own scoring of the same items.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest

from keel.cli import main as keel_main
from keel.serve.openai.child import ServerProcess
from tiny_models import save_bpe_tokenizer, save_hf_model

# lm-eval through a keel server costs 1.5 minutes of set-up: in `make test-slow` (the default suite's budget);
# keel eval's own scoring is tests/test_eval_*.
pytestmark = pytest.mark.slow

TASK = "keel_tiny_mc"
CONTEXT = 256
WORDS = [
    "red",
    "blue",
    "green",
    "a cat",
    "the dog",
    "seven",
    "one hundred and two",
    "Paris",
    "yes",
    "no",
    "maybe later",
    "x",
    "a very long answer indeed",
    "tree",
    "the quick brown fox",
    "42",
]


def make_items(n: int = 20, seed: int = 0) -> list[dict]:
    """n four-way questions; choices of different lengths, so acc and acc_norm can disagree."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        choices = rng.sample(WORDS, 4)
        question = f"Item {i}: which of these is {rng.choice(['best', 'right', 'true', 'odd'])}?"
        items.append({"question": question, "choices": choices, "answer": rng.randrange(4)})
    return items


def doc_to_text(doc: dict) -> str:  # what the task's YAML renders
    return f"Question: {doc['question']}\nAnswer:"


TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


# ------------------------------------------------------------------ keel's side
def keel_eval_scores(model_dir, items: list[dict], root) -> list[list[float]]:
    """Each item's per-choice log-likelihood from `keel eval run` on the same items, written as a
    keel suite with the task's template (its own accuracies are checked against lm-eval's too)."""
    header = {
        "suite": TASK,
        "kind": "multiple_choice",
        "dimension": "reasoning",
        "template": {"prompt": "Question: {question}\nAnswer:", "choice": " {choice}"},
    }
    suite = root / f"{TASK}.jsonl"
    suite.write_text(
        "".join(json.dumps(x) + "\n" for x in [header, *({"id": str(i), **d} for i, d in enumerate(items))])
    )
    out = root / "keel-eval.json"
    assert (
        keel_main(
            [
                "eval",
                "run",
                str(model_dir),
                "--dtype",
                "float32",
                "--suite",
                str(suite),
                "--golden",
                "0",
                "--ppl-corpus",
                "none",
                "--num-blocks",
                "256",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())["suites"][TASK]
    records = [result["items"][str(i)] for i in range(len(items))]
    acc, acc_norm, pred, pred_norm = accuracies(items, [r["loglikelihoods"] for r in records])
    assert [r["pred"] for r in records] == pred and [r["pred_norm"] for r in records] == pred_norm
    assert result["metrics"]["acc"]["value"] == acc and result["metrics"]["acc_norm"]["value"] == acc_norm
    return [r["loglikelihoods"] for r in records]


def norm_choice(doc: dict, lls: list[float]) -> int:
    """acc_norm's choice: the largest log-likelihood per character of the choice (without the delimiter)."""
    return int(np.argmax(np.array(lls) / [len(c) for c in doc["choices"]]))


def accuracies(items: list[dict], lls: list[list[float]]) -> tuple[float, float, list[int], list[int]]:
    """acc (argmax of the sums) and acc_norm (argmax of sum / the choice's length in characters, as
    lm-eval divides it), with the predicted choices."""
    pred = [int(np.argmax(ll)) for ll in lls]
    pred_norm = [norm_choice(doc, ll) for doc, ll in zip(items, lls, strict=True)]
    acc = float(np.mean([p == doc["answer"] for p, doc in zip(pred, items, strict=True)]))
    acc_norm = float(np.mean([p == doc["answer"] for p, doc in zip(pred_norm, items, strict=True)]))
    return acc, acc_norm, pred, pred_norm


# ------------------------------------------------------------------ the test
# lm-eval's Python API in a child process: its own offline environment and caches, and one import
# for both runs. include_defaults=False: only the task here is indexed, not lm-eval's thousands.
DRIVER = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager

args = json.loads(sys.argv[1])
runs = {}
for batch_size in args["batch_sizes"]:
    out = lm_eval.simple_evaluate(model="local-completions", model_args=args["model_args"], tasks=[args["task"]],
                                  batch_size=batch_size, log_samples=True,
                                  task_manager=TaskManager(include_path=args["tasks"], include_defaults=False))
    samples = [{k: s[k] for k in ("doc_id", "filtered_resps", "acc", "acc_norm")} for s in out["samples"][args["task"]]]
    runs[batch_size] = {"results": out["results"][args["task"]], "samples": samples}
with open(args["out"], "w") as f:
    json.dump(runs, f, default=float)
"""


@pytest.fixture(scope="module")
def lm_eval_runs(tmp_path_factory):
    """lm-eval against `keel serve` with batch_size 1 and 8 (8: several prompts in one request):
    {batch_size: (results, samples by doc_id)}, with the items, the model directory and the seconds taken."""
    root = tmp_path_factory.mktemp("lmeval")
    model_dir = root / "model"
    items = make_items()
    texts = [doc_to_text(d) + " " + c for d in items for c in d["choices"]]
    vocab = save_bpe_tokenizer(model_dir, texts, vocab_size=320)
    save_hf_model("llama", model_dir, vocab_size=vocab, max_position_embeddings=CONTEXT)
    data = root / "items.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in items))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))

    server = ServerProcess(
        model_dir,
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--threads",
        "1",
        "--num-blocks",
        "256",
        log_path=root / "server.log",
    ).wait_ready()
    try:
        model_args = {
            "model": "tiny",
            "base_url": f"{server.base_url}/v1/completions",
            "tokenizer": str(model_dir),  # an HF tokenizer: lm-eval tokenizes, and sends token ids
            "tokenizer_backend": "huggingface",  # not "auto", which probes vLLM's /tokenizer_info first
            "max_length": CONTEXT,
            "max_retries": 1,
        }
        args = {
            "model_args": model_args,
            "task": TASK,
            "tasks": str(tasks),
            "batch_sizes": [1, 8],
            "out": str(root / "runs.json"),
        }
        cache = root / "hf"
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "HF_EVALUATE_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(cache),
            "HF_DATASETS_CACHE": str(cache / "datasets"),
            "TOKENIZERS_PARALLELISM": "false",
            "OPENAI_API_KEY": "none",
        }
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-c", DRIVER, json.dumps(args)], env=env, capture_output=True, text=True, timeout=300
        )
        seconds = time.monotonic() - started
    finally:
        code = server.terminate()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:] + server.tail(20)
    assert code == 0, server.tail(40)
    runs = {
        int(k): (v["results"], sorted(v["samples"], key=lambda s: s["doc_id"]))
        for k, v in json.loads((root / "runs.json").read_text()).items()
    }
    return runs, items, model_dir, seconds


@pytest.fixture(scope="module")
def keel_scores(lm_eval_runs):
    _, items, model_dir, _ = lm_eval_runs
    return keel_eval_scores(model_dir, items, model_dir.parent)


@pytest.mark.parametrize("batch_size", [1, 8])
def test_lm_eval_local_completions_matches_keel_scoring(lm_eval_runs, keel_scores, batch_size):
    runs, items, _, seconds = lm_eval_runs
    print(f"lm-eval, both runs: {seconds:.1f} s")
    results, samples = runs[batch_size]
    acc, acc_norm, pred, pred_norm = accuracies(items, keel_scores)
    assert [s["doc_id"] for s in samples] == list(range(len(items)))
    for sample, lls, choice, choice_norm in zip(samples, keel_scores, pred, pred_norm, strict=True):
        got = [resp[0] for resp in sample["filtered_resps"]]  # (log-likelihood, is_greedy) per choice
        assert got == pytest.approx(lls, abs=1e-4), sample["doc_id"]
        assert (np.argmax(got), norm_choice(items[sample["doc_id"]], got)) == (choice, choice_norm)  # per item
    assert [s["acc"] for s in samples] == [float(p == d["answer"]) for p, d in zip(pred, items, strict=True)]
    assert [s["acc_norm"] for s in samples] == [float(p == d["answer"]) for p, d in zip(pred_norm, items, strict=True)]
    assert results["acc,none"] == pytest.approx(acc, abs=1e-12)
    assert results["acc_norm,none"] == pytest.approx(acc_norm, abs=1e-12)
    assert pred != pred_norm  # the items are such that the two metrics differ somewhere
