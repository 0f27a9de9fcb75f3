"""Command-line options derived from configuration dataclasses: one field, one option.

A field's name is its option (`max_num_seqs` -> `--max-num-seqs`), its type the parsing (`Literal`
gives the choices, `bool` a `--x/--no-x` pair, `tuple[str, ...]` a comma-separated list, `list[str]`
a repeatable option), its default the default, and the string literal under it (an attribute
docstring, as vLLM's config classes have) its help. `metadata` adds what a type cannot say: short
aliases, a metavar, choices held in a constant (keel.dtypes.DTYPE_CHOICES), `json` (one option holding a
whole JSON object), `nargs` / `const` (a `list[str]` field with `nargs` takes its values after one flag,
as vLLM's `--served-model-name A B`), `type` (a parser of the text, e.g. vLLM's `32k`), and
`negative_aliases` (flags that turn a bool field off: vLLM's `--enforce-eager` for `--no-compile`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import textwrap
import types
import typing
from typing import Any, Literal

from keel.errors import KeelError
from keel.serve.config import EngineConfig

_NONE = type(None)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (the string literal right under it), whitespace folded."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def comma_list(text: str) -> tuple[str, ...]:
    """A comma-separated option's names, empty entries dropped ('' is the empty tuple)."""
    return tuple(name for name in text.split(",") if name)


def _argument(f: dataclasses.Field, hint: Any, doc: str) -> tuple[list[str], dict[str, Any]]:
    """argparse's flags and keywords for one field."""
    meta = f.metadata
    names = [_flag(f), *meta.get("aliases", ())]
    kwargs: dict[str, Any] = {"dest": meta.get("dest", f.name), "help": doc.replace("%", "%%")}
    kwargs["default"] = f.default if f.default is not dataclasses.MISSING else None
    for key in ("metavar", "nargs", "const", "choices"):
        if key in meta:
            kwargs[key] = meta[key]
    if meta.get("json"):
        return names, {**kwargs, "type": str, "default": None}
    options = [a for a in typing.get_args(hint) if a is not _NONE] if _is_union(hint) else [hint]
    kind = options[0]
    if str in options:
        kind = str
    origin = typing.get_origin(kind)
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif origin is Literal:
        kwargs["choices"] = list(typing.get_args(kind))
        kwargs["type"] = type(kwargs["choices"][0])
    elif origin is tuple:
        kwargs["type"] = comma_list
    elif origin is list:
        default = list(f.default_factory()) if callable(f.default_factory) else []
        if "nargs" in meta:  # all values after one flag; a repeated flag replaces them
            kwargs.update(type=typing.get_args(kind)[0], default=default)
        else:
            kwargs.update(action="append", default=default)
    else:
        kwargs["type"] = kind
    if "type" in meta:
        kwargs["type"] = _option_parser(meta["type"])
    return names, kwargs


def _option_parser(parse: Any) -> Any:
    """`parse` with its ValueError's message shown as the option's error (argparse shows only its own)."""

    def parse_option(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse_option


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def add_dataclass_options(parser: argparse.ArgumentParser, cls: type, title: str | None = None) -> None:
    """One option per field of `cls`, in an argument group titled by its docstring's first line."""
    group = parser.add_argument_group(title or (cls.__doc__ or cls.__name__).splitlines()[0])
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        names, kwargs = _argument(f, hints[f.name], docs.get(f.name, ""))
        for flag in f.metadata.get("negative_aliases", ()):
            # SUPPRESS: the field's own option (added last, so it is the dest's last action) sets the default
            off = dict(action="store_const", const=False, default=argparse.SUPPRESS)
            group.add_argument(flag, dest=kwargs["dest"], help=f"the same as --no-{names[0][2:]}", **off)
        group.add_argument(*names, **kwargs)


def add_engine_options(parser: argparse.ArgumentParser, parts: tuple[str, ...] | None = None) -> None:
    """The EngineConfig options (every part, or the named ones; "speculative" is the --speculative-config JSON)."""
    for part, kind in EngineConfig.parts().items():
        if parts is None or part in parts:
            add_dataclass_options(parser, kind)
    if parts is None or "speculative" in parts:
        spec = next(f for f in dataclasses.fields(EngineConfig) if f.name == "speculative")
        group = parser.add_argument_group("Speculative decoding (keel.serve.speculative)")
        names, kwargs = _argument(spec, None, field_docs(EngineConfig)["speculative"])
        group.add_argument(*names, **kwargs)


def dataclass_from_args(cls: type, args: argparse.Namespace) -> Any:
    """`cls` from the options `add_dataclass_options` added (fields the parser lacks keep their defaults)."""
    values = {}
    for f in dataclasses.fields(cls):
        dest = f.metadata.get("dest", f.name)
        if hasattr(args, dest) and not f.metadata.get("json"):
            values[f.name] = getattr(args, dest)
    return cls(**values)


def speculative_from_args(args: argparse.Namespace) -> dict | None:
    """--speculative-config's JSON object, or None."""
    text = getattr(args, "speculative_config", None)
    if text is None:
        return None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise KeelError(f"--speculative-config: not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(values, dict):
        raise KeelError("--speculative-config: expected a JSON object")
    return values


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the parsed options (parts whose options the parser lacks keep their defaults)."""
    parts = {part: dataclass_from_args(kind, args) for part, kind in EngineConfig.parts().items()}
    return EngineConfig(**parts, speculative=speculative_from_args(args))
