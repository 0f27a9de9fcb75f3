"""keel eval's suites, scoring, manifest and regression gate on a tiny model: multiple-choice scores
equal a direct log-likelihood computation, runs are deterministic, engine perplexity equals
`keel eval ppl`'s and transformers', and `keel eval compare` passes identical runs and flags changes."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from keel import platform
from keel.cli import main as keel_main
from keel.errors import KeelError
from keel.eval.compare import Thresholds, compare, greedy_stability, report
from keel.eval.needle import needle_suite
from keel.eval.run import engine_perplexity, run_eval
from keel.eval.score import Evaluator, encode_pair
from keel.eval.stats import mcnemar_p, wilson_interval
from keel.eval.suites import builtin_suite_paths, extract_option, load_suite, matches
from keel.model.perplexity import sliding_window_perplexity, windows
from keel.quant.loading import load_model
from keel.serve.llm import LLM
from tiny_models import save_byte_tokenizer, save_hf_model

MC_ITEMS = [
    {"id": "a", "question": "1+1?", "choices": ["2", "3", "four"], "answer": 0},
    {"id": "b", "question": "Sky colour?", "choices": ["blue", "red"], "answer": 1},
    {"id": "c", "question": "Opposite of up?", "choices": ["down", "sideways", "in", "out"], "answer": 0},
    {"id": "d", "question": "A cat says?", "choices": ["meow", "woof"], "answer": 0},
]


def _write_suite(path, header, items):
    path.write_text("\n".join(json.dumps(x) for x in [header, *items]) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    save_hf_model("llama", d)
    save_byte_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny), dtype="float32", num_blocks=256, compile=False)


def test_builtin_suites_load_and_cover_every_dimension():
    suites = [load_suite(p) for p in builtin_suite_paths()]
    assert sum(len(s.items) for s in suites) >= 200
    # The needle suite (generated) covers long-context retrieval; the files cover the rest.
    assert {s.dimension for s in suites} >= {
        "instruction_following",
        "factual_recall",
        "reasoning",
        "multi_turn_consistency",
    }
    assert {s.kind for s in suites} == {"multiple_choice", "generation", "multi_turn"}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"id": "x", "question": "q", "choices": ["a"], "answer": 0}, "at least two non-empty strings"),
        ({"id": "x", "question": "q", "choices": ["a", "b"], "answer": 2}, "not an index"),
        ({"id": "x", "choices": ["a", "b"], "answer": 0}, "needs field 'question'"),
        ({"question": "q", "choices": ["a", "b"], "answer": 0}, "field 'id'"),
        ({"id": "x", "question": "q", "choices": ["a", "b"], "answer": True}, "not an index"),
        ({"id": "x", "question": "q", "choices": ["a", ""], "answer": 0}, "non-empty strings"),
    ],
)
def test_bad_items_are_named_by_file_and_line(tmp_path, line, message):
    header = {"suite": "s", "kind": "multiple_choice", "dimension": "reasoning", "template": {"prompt": "{question}"}}
    path = _write_suite(tmp_path / "s.jsonl", header, [MC_ITEMS[0], line])
    with pytest.raises(KeelError, match=rf"s\.jsonl:3: .*{message}"):
        load_suite(path)


def test_suite_text_may_hold_unicode_line_separators(tmp_path):
    item = {**MC_ITEMS[0], "question": "one\u2028two\u0085three"}
    header = {"suite": "u", "kind": "multiple_choice", "dimension": "reasoning", "template": {"prompt": "{question}"}}
    path = tmp_path / "u.jsonl"
    path.write_text("\n".join(json.dumps(x, ensure_ascii=False) for x in [header, item]) + "\n", encoding="utf-8")
    assert load_suite(path).items[0]["question"] == "one\u2028two\u0085three"


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"template": 5}, "template must be an object"),
        ({"template": {"chat": "false"}}, "template.chat must be true or false"),
        ({"template": {"prompt": 5}}, "must be strings"),
        ({"sampling": [1]}, "sampling must be an object"),
        ({"sampling": {"max_tokens": 0}}, "sampling: max_tokens must be >= 1"),
        ({"sampling": {"nope": 1}}, "sampling: .*nope"),
        ({"template": {"prompt": "{question.x}"}}, "cannot be filled"),
        ({"template": {"prompt": "{question}", "choice": "{answer}"}}, "needs field 'answer'"),
        ({"primary": "match"}, "primary must be one of acc, acc_norm"),
    ],
)
def test_bad_header_fields_are_one_line_errors(tmp_path, header, message):
    base = {"suite": "h", "kind": "multiple_choice", "dimension": "reasoning", "template": {"prompt": "{question}"}}
    with pytest.raises(KeelError, match=rf"h\.jsonl:[12]: .*{message}"):
        load_suite(_write_suite(tmp_path / "h.jsonl", {**base, **header}, MC_ITEMS))


def test_bad_headers(tmp_path):
    with pytest.raises(KeelError, match="kind must be one of"):
        load_suite(_write_suite(tmp_path / "a.jsonl", {"suite": "a", "kind": "essay", "dimension": "reasoning"}, []))
    header = {"suite": "b", "kind": "generation", "dimension": "reasoning", "match": "regex"}
    with pytest.raises(KeelError, match=r"b\.jsonl:2: target '\(' is not a valid regex"):
        load_suite(_write_suite(tmp_path / "b.jsonl", header, [{"id": "1", "prompt": "p", "target": "("}]))
    with pytest.raises(KeelError, match="duplicate id 'a'"):
        header = {
            "suite": "c",
            "kind": "multiple_choice",
            "dimension": "reasoning",
            "template": {"prompt": "{question}"},
        }
        load_suite(_write_suite(tmp_path / "c.jsonl", header, [MC_ITEMS[0], MC_ITEMS[0]]))
    (tmp_path / "d.jsonl").write_text('{"id": "x"}\n')
    with pytest.raises(KeelError, match="first line must be the header"):
        load_suite(tmp_path / "d.jsonl")


def test_matching_and_option_extraction():
    assert matches("  Paris. ", "paris", "exact") and not matches("Paris is nice", "paris", "exact")
    assert matches("It is Paris!", ["Lyon", "paris"], "contains")
    assert matches("SKY IS BLUE", r"^[A-Z\s]+$", "regex") and not matches("Sky", r"^[A-Z\s]+$", "regex")
    options = ["York", "New York", "Paris"]
    assert extract_option("I think New York, not Paris", options) == "New York"  # longer option at the same place
    assert extract_option("Parisian food", options) is None  # whole words only
    assert extract_option("paris then york", options) == "Paris"
    assert extract_option("I love New\nYork", options) == "New York"  # a line break between the words


def test_statistics():
    assert wilson_interval(0, 10)[0] == 0 and wilson_interval(10, 10)[1] == pytest.approx(1)
    assert wilson_interval(0, 10)[1] == pytest.approx(0.2775, abs=1e-4)  # not the normal approximation's 0
    lo, hi = wilson_interval(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)
    assert mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(0, 6) == pytest.approx(2 / 64)  # six items lost, none gained
    assert mcnemar_p(3, 3) == 1.0


def _direct_loglikelihood(model, context_ids, continuation_ids) -> float:
    ids = torch.tensor([context_ids + continuation_ids])
    logprobs = F.log_softmax(model(ids)[0].float(), -1)
    n = len(context_ids)
    return sum(logprobs[n - 1 + i, t].item() for i, t in enumerate(continuation_ids))


def test_multiple_choice_equals_direct_loglikelihood_and_is_deterministic(tmp_path, tiny, llm):
    header = {
        "suite": "mc",
        "kind": "multiple_choice",
        "dimension": "factual_recall",
        "template": {"prompt": "Question: {question}\nAnswer: ", "choice": "{choice}"},
    }
    suite = load_suite(_write_suite(tmp_path / "mc.jsonl", header, MC_ITEMS))
    result = Evaluator(llm).run(suite)
    model = load_model(str(tiny), "float32")
    tokenizer = model.tokenizer
    for item in MC_ITEMS:
        record = result["items"][item["id"]]
        context = f"Question: {item['question']}\nAnswer: "
        expected = [_direct_loglikelihood(model.model, *encode_pair(tokenizer, context, c)) for c in item["choices"]]
        assert record["loglikelihoods"] == pytest.approx(expected, abs=1e-4)
        assert record["acc"] == int(max(range(len(expected)), key=expected.__getitem__) == item["answer"])
        # acc_norm divides by the choice's characters (as lm-eval), not the continuation's.
        norm = [ll / len(c) for ll, c in zip(expected, item["choices"], strict=True)]
        assert record["acc_norm"] == int(max(range(len(norm)), key=norm.__getitem__) == item["answer"])
    assert result["chance"] == pytest.approx((1 / 3 + 1 / 2 + 1 / 4 + 1 / 2) / 4)
    assert result["metrics"]["acc"]["n"] == 4
    assert Evaluator(llm).run(suite)["items"] == result["items"]


def test_generation_and_multi_turn_follow_the_model(tmp_path, llm):
    gen = load_suite(
        _write_suite(
            tmp_path / "g.jsonl",
            {
                "suite": "g",
                "kind": "generation",
                "dimension": "instruction_following",
                "template": {"chat": True},
                "sampling": {"max_tokens": 6},
                "match": "contains",
            },
            [
                {"id": "1", "prompt": "say hi", "target": "zzzz-never"},
                {"id": "2", "prompt": "x", "target": ".*", "match": "regex"},
            ],
        )
    )
    result = Evaluator(llm).run(gen)
    tokenizer = llm.engine.loaded.tokenizer
    from keel.serve.sampling import SamplingParams

    direct = (
        llm.generate(
            [tokenizer.encode_chat([{"role": "user", "content": "say hi"}])],
            SamplingParams(temperature=0, max_tokens=6),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .text
    )
    assert result["items"]["1"]["output"] == direct and result["items"]["1"]["match"] == 0
    assert result["items"]["2"]["match"] == 1 and result["metrics"]["match"]["value"] == 0.5

    # Byte-level outputs of a random model: the options are single bytes so that some are named.
    options = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    mt = load_suite(
        _write_suite(
            tmp_path / "m.jsonl",
            {"suite": "m", "kind": "multi_turn", "dimension": "multi_turn_consistency", "sampling": {"max_tokens": 8}},
            [
                {"id": str(i), "turns": [f"q{i}", "other", f"q{i} again"], "options": options, "answer": "a"}
                for i in range(4)
            ],
        )
    )
    result = Evaluator(llm).run(mt)
    for record in result["items"].values():
        assert len(record["answers"]) == 3
        assert record["first"] == extract_option(record["answers"][0], options)
        assert record["consistency"] == int(record["first"] is not None and record["first"] == record["last"])
        assert record["correct"] == int(record["first"] == "a")


def test_needle_prompts_reach_their_lengths(tiny):
    tokenizer = load_model(str(tiny), "float32").tokenizer
    haystack = "\n".join(f"Line {i} of a long and quiet text about nothing." for i in range(400))
    suite = needle_suite(tokenizer, haystack, lengths=(300, 600), depths=(0.0, 0.5, 1.0), seed=1)
    assert [item["group"] for item in suite.items] == ["300"] * 3 + ["600"] * 3
    for item in suite.items:
        ids = tokenizer.encode_chat([{"role": "user", "content": item["prompt"]}])
        length = int(item["group"])
        assert length - 60 <= len(ids) <= length  # filled to within one haystack line
        lines = item["prompt"].rsplit("\n\n", 1)[0].split("\n")
        at = next(i for i, line in enumerate(lines) if line.endswith(f"is {item['target']}."))
        assert abs(at - item["depth"] * (len(lines) - 1)) <= 1  # haystack lines before it: depth's share, +-1
    again = needle_suite(tokenizer, haystack, lengths=(300, 600), depths=(0.0, 0.5, 1.0), seed=1)
    assert again.items == suite.items
    with pytest.raises(KeelError, match="shorter than the question"):
        needle_suite(tokenizer, haystack, lengths=(50,))


def test_engine_perplexity_equals_keel_eval_ppl_and_transformers(tiny, llm):
    import transformers

    ids = torch.randint(0, 250, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    via_engine = engine_perplexity(llm, ids, context=128, stride=64)
    model = load_model(str(tiny), "float32").model
    direct = sliding_window_perplexity(model, ids, 128, 64)
    assert via_engine["nll_sum"] == pytest.approx(direct.nll_sum, rel=1e-5)
    # transformers, independently: the same windows, context tokens masked out of the labels.
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    nll = 0.0
    with torch.no_grad():
        for begin, end, scored in windows(len(ids), 128, 64):
            window = torch.tensor([ids[begin:end]])
            labels = window.clone()
            labels[0, : end - begin - scored] = -100
            nll += hf(window, labels=labels).loss.item() * scored
    assert via_engine["perplexity"] == pytest.approx(math.exp(nll / (len(ids) - 1)), rel=1e-4)


def test_run_records_manifest_and_compare_gates(tmp_path, tiny, llm):
    header = {
        "suite": "mc",
        "kind": "multiple_choice",
        "dimension": "factual_recall",
        "template": {"prompt": "Q: {question}\nA:"},
    }
    suite = load_suite(_write_suite(tmp_path / "mc.jsonl", header, MC_ITEMS))
    ids = list(range(40, 240))
    kwargs = dict(golden=4, golden_tokens=8, ppl_tokens=ids, ppl_context=64, ppl_stride=32, ppl_corpus="bytes")
    base = run_eval(llm, [suite], **kwargs)
    same = run_eval(llm, [suite], **kwargs)
    assert base["suites"] == same["suites"] and base["golden"] == same["golden"]
    assert base["manifest"]["suites"]["mc"]["items"] == 4
    assert compare(base, same).passed

    # A candidate that lost every item it had right, changed its greedy tokens and its perplexity.
    worse = json.loads(json.dumps(base))
    for record in worse["suites"]["mc"]["items"].values():
        record["acc"] = 0
    worse["suites"]["mc"]["metrics"]["acc"]["value"] = 0.0
    first = next(iter(worse["golden"]["outputs"].values()))
    first["token_ids"][3] += 1
    worse["perplexity"]["perplexity"] *= 1.03
    result = compare(base, worse, Thresholds(max_drop=0.0, alpha=1.01, min_greedy_stability=1.0))
    assert not result.passed
    assert result.greedy["stability"] == 0.75 and list(result.greedy["first_divergence"].values()) == [3]
    assert result.perplexity["relative"] == pytest.approx(0.03)
    assert len(result.failures) == 3
    # With the default thresholds four items cannot make a significant drop; perplexity still fails.
    assert compare(base, worse).failures == [result.failures[-1]]
    assert greedy_stability(base["golden"], base["golden"])["stability"] == 1.0

    # Checks that cannot be made fail rather than pass: a missing section, different items or prompts.
    no_sections = {k: v for k, v in base.items() if k not in ("golden", "perplexity")}
    failures = compare(base, no_sections).failures
    assert failures == [
        "golden: missing from the candidate; cannot be gated",
        "perplexity: missing from the candidate; cannot be gated",
    ]
    other_items = json.loads(json.dumps(base))
    other_items["manifest"]["suites"]["mc"]["items_sha256"] = "0" * 64
    other_items["golden"]["max_tokens"] = 16
    other_items["suites"]["extra"] = base["suites"]["mc"]
    result = compare(base, other_items)
    assert [f.split(":")[0] for f in result.failures] == ["suite mc", "golden"]
    assert result.ungated == ["extra"] and "not gated (only in the candidate): extra" in report(result)


def test_a_significant_drop_fails_at_the_default_thresholds():
    """Twelve items lost, none gained (p = 2^-11): past the 5-point drop and significant."""
    items = {str(i): {"acc": 1} for i in range(40)}
    worse = {str(i): {"acc": 0 if i < 12 else 1} for i in range(40)}

    def run(records):
        value = sum(r["acc"] for r in records.values()) / len(records)
        return {"suites": {"s": {"primary": "acc", "metrics": {"acc": {"value": value}}, "items": records}}}

    result = compare(run(items), run(worse))
    assert result.suites["s"]["metrics"]["acc"]["p_value"] == pytest.approx(2**-11)
    assert result.failures == ["suite s: acc 1.000 -> 0.700 (-0.300, p=0.000488; allowed drop 0.05)"]
    few = {str(i): {"acc": 0 if i < 2 else 1} for i in range(40)}  # two lost: 5 points, not significant
    assert compare(run(items), run(few)).passed


def test_cli_run_and_compare(tmp_path, tiny, capsys):
    header = {
        "suite": "mc",
        "kind": "multiple_choice",
        "dimension": "factual_recall",
        "template": {"prompt": "Q: {question}\nA:"},
    }
    suite = _write_suite(tmp_path / "mc.jsonl", header, MC_ITEMS)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 6)
    common = [
        str(tiny),
        "--dtype",
        "float32",
        "--suite",
        str(suite),
        "--golden",
        "3",
        "--golden-tokens",
        "6",
        "--ppl-corpus",
        str(corpus),
        "--ppl-context",
        "64",
        "--ppl-stride",
        "32",
        "--num-blocks",
        "128",
    ]
    assert keel_main(["eval", "run", *common, "--out", str(tmp_path / "a.json")]) == 0
    assert keel_main(["eval", "run", *common, "--kv-cache-dtype", "int8", "--out", str(tmp_path / "b.json")]) == 0
    a = json.loads((tmp_path / "a.json").read_text())
    m = a["manifest"]
    assert m["weights"]["files"]["model.safetensors"] and len(m["weights"]["sha256"]) == 64
    assert m["engine"]["dtype"] == "float32" and m["engine"]["kv_cache_dtype"] == "auto"
    assert m["tokenizer_sha256"] and m["chat_template_sha256"] and m["keel"]["version"]
    assert m["machine"]["isa"].startswith(f"{platform.host().arch} {platform.host().isa}")  # the fast paths taken
    assert m["suites"]["mc"]["template"]["prompt"] == "Q: {question}\nA:"
    capsys.readouterr()
    assert keel_main(["eval", "compare", str(tmp_path / "a.json"), str(tmp_path / "a.json")]) == 0
    assert "PASS" in capsys.readouterr().out
    # int8 KV moves perplexity: the gate's verdict follows the threshold around the measured change,
    # and the report names what changed between the runs.
    b = json.loads((tmp_path / "b.json").read_text())
    change = b["perplexity"]["perplexity"] / a["perplexity"]["perplexity"] - 1
    assert change != 0
    compare_ab = ["eval", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    assert keel_main([*compare_ab, "--max-ppl-increase", str(abs(change) * 1.01)]) == 0
    assert "engine.kv_cache_dtype: 'auto' -> 'int8'" in capsys.readouterr().out
    assert keel_main([*compare_ab, "--max-ppl-increase", str(change - abs(change) * 0.01)]) == 1
    assert "FAIL" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{}")
    assert keel_main(["eval", "compare", str(tmp_path / "a.json"), str(tmp_path / "bad.json")]) == 1
    assert "bad.json: not a `keel eval run` results file" in capsys.readouterr().err
    assert keel_main(["eval", "run", str(tiny), "--suite", "nope"]) == 1
    assert "--suite nope: not a built-in suite" in capsys.readouterr().err
    assert keel_main(["eval", "suites"]) == 0
    assert "factual_recall" in capsys.readouterr().out
    for bad, message in [
        (["--golden", "-1"], "--golden must be >= 0"),
        (["--golden-tokens", "0"], "--golden-tokens must be >= 1"),
        (["--needle-depths", "2"], "--needle-depths: each depth must be in [0, 1]"),
        (["--out", str(tmp_path / "no" / "r.json")], "is not a writable directory"),
        (["--suite", "needle", "--needle-lengths", "4096"], "exceed the model length 2048"),
        (["--ppl-context", "4096", "--ppl-stride", "8"], "--ppl-context 4096 exceeds"),
    ]:
        assert keel_main(["eval", "run", *common, *bad]) == 1, bad
        assert message in capsys.readouterr().err, bad
