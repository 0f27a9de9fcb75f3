"""Needle in a haystack: long-context retrieval, parameterised by context length.

Each item hides one sentence ("The secret number of the red door is 48213.") at a given depth of a
haystack of real text (Shakespeare's works by default, the same corpus as `keel eval ppl`), then
asks for it after the haystack. The prompt, chat template included, is built to about
`context_length` tokens; an item passes when the answer contains the number. Deterministic: the
numbers, door colours and haystack offsets come from a seeded generator, so two runs (and two
engine configurations) see the same prompts. Results are grouped by context length.
"""

from __future__ import annotations

import random

from keel.errors import KeelError
from keel.eval.suites import Suite, Template
from keel.tokenizer import Tokenizer

DEFAULT_LENGTHS = (512, 1024, 2048, 4096)
DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
_COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "white", "black", "silver", "golden")
_QUESTION = "What is the secret number of the {colour} door? Answer with the number only."
# Small models repeat the sentence before the number ("The secret number of the red door is 48213."):
# room for all of it.
ANSWER_TOKENS = 24


def needle_suite(
    tokenizer: Tokenizer,
    haystack: str,
    lengths: tuple[int, ...] = DEFAULT_LENGTHS,
    depths: tuple[float, ...] = DEFAULT_DEPTHS,
    seed: int = 0,
) -> Suite:
    """One item per (length, depth); `haystack` is the filler text (needs enough lines for the
    longest context)."""
    if not tokenizer.chat_template:
        raise KeelError("the needle suite asks through the chat template; this model has none")
    lines = [line for line in haystack.splitlines() if line.strip()]
    if not lines:
        raise KeelError("the needle suite's haystack text is empty")
    costs = [len(tokenizer.encode(line + "\n", add_special_tokens=False)) for line in lines]
    if len(set(lengths)) != len(lengths) or len(set(depths)) != len(depths):
        raise KeelError("--needle-lengths and --needle-depths must not repeat a value")
    items = []
    for length in lengths:
        for depth in depths:
            if not 0 <= depth <= 1:
                raise KeelError(f"--needle-depths: each depth must be in [0, 1], got {depth}")
            # One generator per item: an item's number and haystack do not depend on the other items.
            rng = random.Random(f"{seed}:{length}:{depth}")
            colour = rng.choice(_COLOURS)
            number = str(rng.randrange(10_000, 100_000))
            needle = f"The secret number of the {colour} door is {number}."
            question = _QUESTION.format(colour=colour)
            overhead = len(tokenizer.encode_chat([{"role": "user", "content": f"{needle}\n\n{question}"}]))
            budget = length - overhead
            if budget <= 0:
                raise KeelError(f"needle context length {length} is shorter than the question itself ({overhead})")
            start = rng.randrange(len(lines))
            chosen, used = [], 0
            for k in range(len(lines)):
                i = (start + k) % len(lines)
                if used + costs[i] > budget:
                    break
                chosen.append(i)
                used += costs[i]
            # The needle goes between lines: after the first lines holding `depth` of the haystack's tokens.
            cut, seen = 0, 0
            while cut < len(chosen) and seen + costs[chosen[cut]] <= depth * used:
                seen += costs[chosen[cut]]
                cut += 1
            chosen_lines = [lines[i] for i in chosen]
            while True:  # lines tokenise a little differently joined than alone: trim to the length
                text = "\n".join([*chosen_lines[:cut], needle, *chosen_lines[cut:]])
                prompt = f"{text}\n\n{question}"
                if len(tokenizer.encode_chat([{"role": "user", "content": prompt}])) <= length or not chosen_lines:
                    break
                if len(chosen_lines) > cut:
                    chosen_lines.pop()  # from the end, keeping the needle's depth
                else:
                    chosen_lines.pop(0)
                    cut -= 1
            items.append(
                {
                    "id": f"needle-{length}-{depth:g}",
                    "prompt": prompt,
                    "target": number,
                    "group": str(length),
                    "depth": depth,
                }
            )
    return Suite(
        name="needle",
        kind="needle",
        dimension="long_context_retrieval",
        items=items,
        template=Template(chat=True, prompt="{prompt}"),
        sampling={"temperature": 0.0, "max_tokens": ANSWER_TOKENS},
        match="contains",
        description="a number hidden at several depths of real text, asked for after it; by context length",
        source=f"generated: lengths {list(lengths)}, depths {list(depths)}, seed {seed}",
    )
