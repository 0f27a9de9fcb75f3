"""xgrammar over keel's tokenizers: the vocabulary as the grammar engine sees it, and a compile cache.

Compiling checks a constraint (a bad schema, regex or grammar is a KeelError naming it) and builds
its token-mask tables; the compiler caches by constraint, so the server can compile in a worker
thread at admission (the 400 comes before the request is queued) and the engine thread finds the
result cached.
"""

from __future__ import annotations

from keel.errors import KeelError
from keel.serve.structured.params import StructuredOutputsParams
from keel.serve.structured.state import GrammarState
from keel.tokenizer import Tokenizer

# response_format json_object: any JSON object (xgrammar's built-in JSON grammar would also accept a
# top-level array or scalar).
_JSON_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarBackend:
    """One per engine: the model's vocabulary as xgrammar's TokenizerInfo, and its GrammarCompiler."""

    def __init__(
        self, tokenizer: Tokenizer | None, vocab_size: int, stop_token_ids: list[int], threads: int = 2
    ) -> None:
        if tokenizer is None:
            raise KeelError("structured outputs need the model's tokenizer, and this model has none")
        import xgrammar as xgr  # imported on first use: ~1.5 s, and only structured requests need it

        self._xgr = xgr
        self.vocab_size = vocab_size
        special = tokenizer.special_token_ids()
        # Special tokens as empty strings: xgrammar then treats them as special (never text inside a
        # string), and the stop tokens are what ends a finished grammar.
        vocab = [
            b"" if i in special else tokenizer.token_bytes(i) for i in range(min(vocab_size, tokenizer.vocab_size))
        ]
        vocab += [b""] * (vocab_size - len(vocab))  # a head padded past the tokenizer's vocabulary
        self.info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads)

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar (cached); KeelError naming the constraint when it does not compile."""
        kind = params.kind
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(params.json, any_whitespace=not params.disable_any_whitespace)
            if kind == "json_object":
                return self.compiler.compile_json_schema(
                    _JSON_OBJECT_SCHEMA, any_whitespace=not params.disable_any_whitespace
                )
            if kind == "regex":
                return self.compiler.compile_regex(params.regex)
            if kind == "choice":
                return self.compiler.compile_grammar(_choice_grammar(params.choice))
            return self.compiler.compile_grammar(params.grammar)
        except RuntimeError as e:
            raise KeelError(f"structured outputs: the {kind} does not compile: {_message(e)}") from None

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        return GrammarState(self._xgr.GrammarMatcher(self.compile(params)), self.vocab_size)


def _choice_grammar(choices: tuple[str, ...]) -> str:
    """GBNF accepting exactly one of the strings."""
    import json

    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _message(error: RuntimeError) -> str:
    """xgrammar's message without its source location prefix ("[time] file.cc:line: ")."""
    text = str(error).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
    return text.splitlines()[0] if text else "unknown error"
