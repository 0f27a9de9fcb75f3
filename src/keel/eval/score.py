"""Running suites through the serving engine and scoring them.

Everything runs on `keel.LLM`, the engine `keel serve` uses, with the configuration under test
(quantization, compiled decode, speculative decoding, KV dtype): the eval measures what is served.
All requests of a suite (or of one turn of the multi-turn suite) are submitted at once and batched
by the engine.

Multiple choice is scored as lm-eval scores it: the context and context + continuation are
tokenised without special tokens (as lm-eval's API models do), the continuation is the extra
tokens (trailing whitespace of the context moves to the continuation first), and its
log-likelihood is the sum of the prompt logprobs of those tokens (computed in float32 from the
model's logits). "acc" picks the highest sum, "acc_norm" the highest sum per character of the
choice text (lm-eval divides by the choice's length, not the continuation's). With these rules
`keel eval` and lm-eval's `local-completions` against `keel serve` score the same (tested).
"""

from __future__ import annotations

from typing import Any

from keel.errors import KeelError
from keel.eval.stats import wilson_interval
from keel.eval.suites import METRICS, Suite, extract_option, matches, sampling_params
from keel.serve.llm import LLM
from keel.serve.sampling import SamplingParams
from keel.tokenizer import Tokenizer


def _messages(system: str | None, user: str) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def split_continuation(context: str, continuation: str) -> tuple[str, str]:
    """lm-eval's rule: trailing whitespace of the context belongs to the continuation."""
    stripped = context.rstrip()
    return stripped, context[len(stripped) :] + continuation


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval makes them: the continuation is what encoding
    context + continuation holds past the context's own token count."""
    context, continuation = split_continuation(context, continuation)
    # No special tokens: lm-eval's default, and a rendered chat template already holds its own.
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    if not ctx:  # the first token has no logprob: with no context the continuation's first would be lost
        raise KeelError(f"continuation {continuation!r} has an empty context; give the prompt some text")
    if len(whole) <= len(ctx):
        raise KeelError(f"continuation {continuation!r} adds no tokens to its context")
    return ctx, whole[len(ctx) :]


def continuation_logprobs(llm: LLM, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """Sum of log p(continuation | context) for each (context ids, continuation ids), from the
    engine's prompt logprobs of context + continuation (all pairs batched by the engine)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([ctx + cont for ctx, cont in pairs], params, use_tqdm=False)
    sums = []
    for (ctx, cont), out in zip(pairs, outputs, strict=True):
        entries = (out.prompt_logprobs or [])[len(ctx) :]
        if len(entries) != len(cont) or any(e is None for e in entries):
            raise KeelError("the engine returned incomplete prompt logprobs")
        sums.append(sum(e.logprob for e in entries))
    return sums


def _metric(passed: list[int]) -> dict[str, Any]:
    n = len(passed)
    lo, hi = wilson_interval(sum(passed), n)
    return {"value": sum(passed) / n if n else 0.0, "n": n, "ci95": [lo, hi]}


class Evaluator:
    """Scores suites with one engine (keel.LLM)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        tokenizer = llm.engine.loaded.tokenizer
        if tokenizer is None:
            raise KeelError("the model has no tokenizer: suites need one")
        self.tokenizer = tokenizer

    def context_text(self, suite: Suite, user: str) -> str:
        if suite.template.chat:
            return self.tokenizer.apply_chat_template(_messages(suite.template.system, user))
        return user if suite.template.system is None else f"{suite.template.system}\n\n{user}"

    def encode_prompt(self, suite: Suite, user: str) -> list[int]:
        text = self.context_text(suite, user)
        return self.tokenizer.encode(text, add_special_tokens=not suite.template.chat)

    def run(self, suite: Suite) -> dict[str, Any]:
        if suite.kind == "multiple_choice":
            items = self.multiple_choice(suite)
        elif suite.kind in ("generation", "needle"):
            items = self.generation(suite)
        else:
            items = self.multi_turn(suite)
        return summarise(suite, items)

    def multiple_choice(self, suite: Suite) -> dict[str, dict[str, Any]]:
        pairs = []
        for item in suite.items:
            context = self.context_text(suite, suite.template.prompt.format(**item))
            for choice in item["choices"]:
                continuation = suite.template.choice.format(choice=choice)
                try:
                    pairs.append(encode_pair(self.tokenizer, context, continuation))
                except KeelError as e:
                    raise KeelError(f"suite {suite.name}, item {item['id']}: {e}") from None
        sums = continuation_logprobs(self.llm, pairs)
        results: dict[str, dict[str, Any]] = {}
        position = 0
        for item in suite.items:
            k = len(item["choices"])
            ll = sums[position : position + k]
            chars = [len(choice) for choice in item["choices"]]
            position += k
            pred = max(range(k), key=lambda i: ll[i])
            pred_norm = max(range(k), key=lambda i: ll[i] / max(chars[i], 1))
            results[item["id"]] = {
                "acc": int(pred == item["answer"]),
                "acc_norm": int(pred_norm == item["answer"]),
                "pred": pred,
                "pred_norm": pred_norm,
                "loglikelihoods": ll,
            }
        return results

    def generation(self, suite: Suite) -> dict[str, dict[str, Any]]:
        prompts = [self.encode_prompt(suite, suite.template.prompt.format(**item)) for item in suite.items]
        outputs = self.llm.generate(prompts, sampling_params(suite.sampling, f"suite {suite.name}"), use_tqdm=False)
        results = {}
        for item, out in zip(suite.items, outputs, strict=True):
            text = out.outputs[0].text
            passed = matches(text, item["target"], item.get("match", suite.match))
            results[item["id"]] = {"match": int(passed), "output": text, "prompt_tokens": len(out.prompt_token_ids)}
            if "group" in item:
                results[item["id"]]["group"] = item["group"]
        return results

    def multi_turn(self, suite: Suite) -> dict[str, dict[str, Any]]:
        params = sampling_params(suite.sampling, f"suite {suite.name}")
        histories = [_messages(suite.template.system, item["turns"][0])[:-1] for item in suite.items]
        answers: list[list[str]] = [[] for _ in suite.items]
        for turn in range(max(len(item["turns"]) for item in suite.items)):
            active = [i for i, item in enumerate(suite.items) if turn < len(item["turns"])]
            for i in active:
                histories[i].append({"role": "user", "content": suite.items[i]["turns"][turn]})
            prompts = [self.tokenizer.encode_chat(histories[i]) for i in active]
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
            for i, out in zip(active, outputs, strict=True):
                text = out.outputs[0].text
                answers[i].append(text)
                histories[i].append({"role": "assistant", "content": text})
        results = {}
        for item, said in zip(suite.items, answers, strict=True):
            first, last = extract_option(said[0], item["options"]), extract_option(said[-1], item["options"])
            record = {
                "consistency": int(first is not None and first == last),
                "first": first,
                "last": last,
                "answers": said,
            }
            if "answer" in item:
                record["correct"] = int(first == item["answer"])
            results[item["id"]] = record
        return results


def summarise(suite: Suite, items: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A suite's metrics with 95% intervals, its chance level, and the per-item records."""
    metrics = {}
    primary = suite.header()["primary"]
    for name in METRICS[suite.kind]:
        passed = [record[name] for record in items.values() if name in record]
        if passed:
            metrics[name] = _metric(passed)
    chance = None
    if suite.kind == "multiple_choice":
        chance = sum(1 / len(item["choices"]) for item in suite.items) / len(suite.items)
    groups: dict[str, list[int]] = {}
    for record in items.values():
        if "group" in record:
            groups.setdefault(str(record["group"]), []).append(record[primary])
    result = {**suite.header(), "n": len(items), "metrics": metrics, "chance": chance, "items": items}
    if groups:
        result["groups"] = {name: _metric(passed) for name, passed in groups.items()}
    return result


def dimensions(suites: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each capability dimension's pass rate over the items of all its suites (primary metrics)."""
    pooled: dict[str, list[int]] = {}
    for result in suites.values():
        primary = result["primary"]
        pooled.setdefault(result["dimension"], []).extend(r[primary] for r in result["items"].values() if primary in r)
    return {name: _metric(passed) for name, passed in sorted(pooled.items())}
