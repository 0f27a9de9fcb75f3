"""Structured outputs: requests whose output must match a JSON schema, a regex, a choice or a grammar.

`StructuredOutputsParams` (params.py) says what a request asks for, with vLLM's field names;
`GrammarBackend` (backend.py) compiles it with xgrammar, vLLM's default grammar engine, against the
model's vocabulary; `GrammarState` (state.py) follows one request's output and gives, before each
sampled position, the bitmask of the tokens the grammar allows there (the sampler sets the others to
-inf, keel.serve.constraints).
"""

from keel.serve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
