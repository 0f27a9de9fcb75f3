"""Token constraints in the engine: logit_bias, allowed_token_ids, bad_words and structured outputs
(xgrammar), on both samplers, greedy and sampled, with and without speculative decoding, on SmolLM2."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from keel.errors import KeelError
from keel.serve import LLM, SamplingParams
from keel.serve.constraints import apply_constraints, unpack_bitmask
from keel.serve.sampling import RowState, Sampler, _sample_on_kernels
from keel.serve.structured import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m-instruct", num_blocks=256, max_model_len=512, compile=False)


@pytest.fixture(scope="module")
def prompt(llm):
    chat = [{"role": "user", "content": "Describe a person and their pets as JSON."}]
    return llm.engine.tokenizer.apply_chat_template(chat)


def generate(llm, prompt, **sampling) -> list:
    params = [SamplingParams(**s) for s in sampling.pop("batch", [sampling])]
    return [o.outputs[0] for o in llm.generate([prompt] * len(params), params, use_tqdm=False)]


# ----------------------------------------------------------------- the sampler's constraints
def test_unpack_bitmask_matches_bits():
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32)
    allowed = unpack_bitmask(bitmask, 150)
    for row in range(3):
        for token in range(150):
            word = int(bitmask[row, token // 32]) & 0xFFFFFFFF
            assert allowed[row, token].item() == bool((word >> (token % 32)) & 1)


@pytest.mark.isa
@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 49152 + 17])
def test_bitmask_kernel_matches_torch(vocab):
    """keel::apply_token_bitmask against the torch reference: random, all-allowed and none-allowed words,
    a subset of rows, a vocabulary not a multiple of 32."""
    from keel import kernels
    from keel.serve.constraints import apply_token_bitmask

    if not kernels.active():
        pytest.skip("keel's kernels are not built on this machine")
    words = (vocab + 31) // 32
    torch.manual_seed(vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, words), dtype=torch.int32)
    bitmask[1] = -1
    bitmask[2] = 0
    bitmask[3, ::2] = -1
    logits = torch.randn(6, vocab)
    rows = [5, 0, 2, 3]
    expected = logits.clone()
    allowed = unpack_bitmask(bitmask, vocab)
    for m, row in enumerate(rows):
        expected[row] = expected[row].masked_fill(~allowed[m], float("-inf"))
    got = logits.clone()
    apply_token_bitmask(got, bitmask, rows)
    assert torch.equal(got, expected)
    assert torch.equal(got[[1, 4]], logits[[1, 4]])  # rows without a mask untouched


def test_constraints_apply_per_row_and_leave_other_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    bitmask = torch.zeros(4, dtype=torch.int32)  # row 3: only tokens 0-31 with odd ids
    bitmask[0] = int("AAAAAAAA", 16) - 2**32
    states = [
        RowState(SamplingParams(logit_bias={5: 10.0, 7: -100.0})),
        RowState(SamplingParams(allowed_token_ids=[3, 9, 42])),
        RowState(SamplingParams(bad_words_token_ids=[[11], [20, 21]]), output_ids=[1, 20]),
        RowState(SamplingParams(), token_bitmask=bitmask),
    ]
    out = apply_constraints(logits.clone(), states)
    assert out[0, 5] == logits[0, 5] + 10 and out[0, 7] == logits[0, 7] - 100
    assert torch.equal(out[0, :5], logits[0, :5])
    assert torch.isfinite(out[1]).sum() == 3 and torch.equal(out[1, [3, 9, 42]], logits[1, [3, 9, 42]])
    assert out[2, 11] == float("-inf") and out[2, 21] == float("-inf")  # output ends with 20: 21 banned
    assert torch.isfinite(out[2]).sum() == 98
    odd = torch.arange(32) % 2 == 1
    assert torch.equal(torch.isfinite(out[3, :32]), odd) and not torch.isfinite(out[3, 32:]).any()
    # a word whose prefix the output does not end with bans nothing
    out = apply_constraints(
        logits.clone(), [RowState(SamplingParams(bad_words_token_ids=[[20, 21]]), output_ids=[20, 3])]
    )
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("path", ["torch", "kernels"])
def test_both_samplers_never_draw_a_masked_token(path):
    from keel import kernels

    if path == "kernels" and not kernels.active():
        pytest.skip("keel's kernels are not built on this machine")
    torch.manual_seed(1)
    logits = torch.randn(6, 300) * 3
    allowed = [7, 100, 299]
    states = [
        RowState(SamplingParams(temperature=t, top_p=p, allowed_token_ids=allowed, seed=i))
        for i, (t, p) in enumerate([(0.0, 1.0), (1.0, 1.0), (1.5, 0.9), (0.7, 0.5), (2.0, 1.0), (1.0, 0.99)])
    ]
    for s in states:
        s.generator = torch.Generator().manual_seed(s.params.seed)
    for _ in range(20):
        if path == "torch":
            ids = Sampler()._sample_on_torch(logits, states)
        else:
            from keel.serve.sampling import apply_penalties

            ids = _sample_on_kernels(apply_penalties(logits, states), states)
        assert set(ids.tolist()) <= set(allowed)
    assert ids[0].item() == max(allowed, key=lambda t: logits[0, t].item())  # greedy: argmax of the allowed


# ----------------------------------------------------------------- on the engine
def test_logit_bias_allowed_and_bad_words(llm, prompt):
    tokenizer = llm.engine.tokenizer
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    out = generate(llm, prompt, max_tokens=4, temperature=0.0, logit_bias={forced: 100.0})[0]
    assert out.token_ids == [forced] * 4
    allowed = tokenizer.encode(" yes no maybe", add_special_tokens=False)
    for out in generate(
        llm, prompt, batch=[dict(max_tokens=8, temperature=1.0, seed=s, allowed_token_ids=allowed) for s in range(3)]
    ):
        assert set(out.token_ids) <= set(allowed)
    free = generate(llm, prompt, max_tokens=30, temperature=0.0)[0].text
    assert "JSON" in free or "json" in free
    word = "json" if "json" in free else "JSON"
    banned = generate(llm, prompt, max_tokens=30, temperature=0.0, bad_words=[word])[0].text
    assert word not in banned and banned != free


def test_out_of_vocabulary_ids_are_refused(llm, prompt):
    with pytest.raises(KeelError, match="allowed_token_ids"):
        llm.engine.add_request(prompt, SamplingParams(allowed_token_ids=[10**7]))
    with pytest.raises(KeelError, match="logit_bias"):
        llm.engine.add_request(prompt, SamplingParams(logit_bias={10**7: 1.0}))


def test_json_schema_regex_choice_and_grammar(llm, prompt):
    structured = {
        "schema": StructuredOutputsParams.of(json=SCHEMA),
        "regex": StructuredOutputsParams.of(regex=r"[A-Z][a-z]{2,8}-\d{2,4}"),
        "choice": StructuredOutputsParams.of(choice=["alpha", "beta", "gamma delta"]),
        "grammar": StructuredOutputsParams.of(grammar='root ::= "(" num ("," num)* ")"\nnum ::= [0-9]+'),
    }
    batch, names = [], []
    for name, s in structured.items():
        for seed in (None, 1, 2):
            temperature = 0.0 if seed is None else 1.0
            batch.append(dict(max_tokens=120, temperature=temperature, seed=seed, structured_outputs=s))
            names.append(name)
    outs = generate(llm, prompt, batch=batch)
    for name, out in zip(names, outs, strict=True):
        assert out.finish_reason == "stop", (name, out.text)
        text = out.text
        if name == "schema":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif name == "regex":
            assert re.fullmatch(r"[A-Z][a-z]{2,8}-\d{2,4}", text), text
        elif name == "choice":
            assert text in ("alpha", "beta", "gamma delta")
        else:
            assert re.fullmatch(r"\(\d+(,\d+)*\)", text), text


def test_json_object(llm):
    """Any JSON object (response_format json_object); a prompt whose greedy answer is short, since a small model
    may write an unconstrained object past max_tokens."""
    chat = [{"role": "user", "content": "Give a JSON object with the key ok set to true."}]
    prompt = llm.engine.tokenizer.apply_chat_template(chat)
    out = generate(
        llm, prompt, max_tokens=120, temperature=0.0, structured_outputs=StructuredOutputsParams.of(json_object=True)
    )
    assert out[0].finish_reason == "stop" and isinstance(json.loads(out[0].text), dict)
    free = generate(llm, prompt, max_tokens=120, temperature=0.0)[0].text
    assert not free.lstrip().startswith("{")  # unconstrained, the model does not answer with bare JSON


def test_bad_constraints_are_keel_errors(llm):
    backend = llm.engine.grammar_backend()
    for spec, what in [
        (StructuredOutputsParams.of(regex="[a-"), "regex"),
        (StructuredOutputsParams.of(json={"type": "bogus"}), "json"),
        (StructuredOutputsParams.of(grammar='root ::= "a" |'), "grammar"),
    ]:
        with pytest.raises(KeelError, match=f"the {what} does not compile"):
            backend.compile(spec)
    with pytest.raises(KeelError, match="exactly one"):
        StructuredOutputsParams.of(regex="a", choice=["a"])


def test_ignore_eos_ends_when_the_grammar_is_complete(llm, prompt):
    spec = StructuredOutputsParams.of(choice=["yes", "no"])
    out = generate(llm, prompt, max_tokens=20, temperature=0.0, ignore_eos=True, structured_outputs=spec)[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop" and len(out.token_ids) <= 3


def test_speculative_decoding_keeps_the_grammar(llm):
    """n-gram drafts are checked against the grammar: greedy tokens equal the plain engine's, and sampled
    outputs still match the schema (a draft the grammar refuses gets probability 0 and is rejected)."""
    spec = LLM(
        "smollm2-135m-instruct",
        num_blocks=256,
        max_model_len=512,
        compile=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    )
    chat = [{"role": "user", "content": 'Repeat exactly: {"name": "Ann", "age": 7, "pets": ["cat", "cat"]}'}]
    prompt = llm.engine.tokenizer.apply_chat_template(chat)
    s = StructuredOutputsParams.of(json=SCHEMA)
    greedy = dict(max_tokens=60, temperature=0.0, structured_outputs=s)
    a, b = generate(llm, prompt, **greedy)[0], generate(spec, prompt, **greedy)[0]
    assert a.token_ids == b.token_ids
    assert spec.engine.stats()["spec_decode_num_accepted_tokens"] > 0
    for seed in range(2):
        out = generate(spec, prompt, max_tokens=60, temperature=1.0, seed=seed, structured_outputs=s)[0]
        jsonschema.validate(json.loads(out.text), SCHEMA)
