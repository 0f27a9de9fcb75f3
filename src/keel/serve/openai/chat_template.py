"""`keel serve --chat-template`: the template that replaces the model's, read as vLLM reads the option."""

from __future__ import annotations

import codecs
from pathlib import Path

from keel.errors import KeelError
from keel.tokenizer import Tokenizer, check_chat_template

# vLLM's rule: a value that fails to open as a file and holds none of these is a path that is missing; one that
# holds them is the template itself, inline.
_JINJA_CHARS = "{}\n"


def load_chat_template(value: str | None) -> str | None:
    """The template text of --chat-template (a file, or the template inline), its syntax checked; None when
    not given."""
    if value is None:
        return None
    source = value  # what errors name: the file, or "inline"
    try:
        template = Path(value).read_text()
    except (OSError, ValueError) as e:  # ValueError: a NUL in the "path"
        if not any(c in value for c in _JINJA_CHARS):
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise KeelError(f"--chat-template {value}: cannot read the file ({reason})") from None
        # inline: escapes such as \n typed on a command line mean what they say, as vLLM decodes them
        template, source = codecs.decode(value, "unicode_escape"), "(inline)"
    try:
        check_chat_template(template)
    except KeelError as e:
        raise KeelError(f"--chat-template {source}: {e}") from None
    return template


def use_chat_template(tokenizer: Tokenizer | None, template: str) -> None:
    """Make `template` the tokenizer's chat template (KeelError on a syntax error, or without a tokenizer)."""
    if tokenizer is None:
        raise KeelError("--chat-template: this model has no tokenizer to apply a chat template with")
    try:
        tokenizer.set_chat_template(template)
    except KeelError as e:
        raise KeelError(f"--chat-template: {e}") from None
