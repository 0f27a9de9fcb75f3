"""Tokenizer (HF `tokenizers`), chat templates (jinja2, rendered as transformers renders them),
and incremental detokenization that only emits complete UTF-8 text."""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from keel.errors import KeelError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5 saves the template
# where multimodal releases' processors keep theirs ({"chat_template": ...}; transformers before 4.50 saved it there)
PROCESSOR_TEMPLATE_FILE = "chat_template.json"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte tokens
_SPM_SPACE = "\u2581"  # SentencePiece's visible space


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character standing for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: list[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        ids = list(eos_token_ids or [])
        if eos_token is not None and (eos_id := tokenizer.token_to_id(eos_token)) is not None and eos_id not in ids:
            ids.append(eos_id)
        self.eos_token_ids = ids
        self._template: jinja2.Template | None = None

    # ----------------------------------------------------------------- loading
    @classmethod
    def from_hf_dir(cls, directory: str | Path, eos_token_ids: list[int] | None = None) -> Tokenizer | None:
        """The tokenizer of an HF model directory, or None when it has no tokenizer.json."""
        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        if not path.exists():
            return None
        try:
            tokenizer = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise KeelError(f"{path}: not a valid tokenizer file ({e})") from None
        config: dict[str, Any] = {}
        config_path = directory / TOKENIZER_CONFIG_FILE
        if config_path.exists():
            try:
                config = json.loads(config_path.read_text())
            except json.JSONDecodeError as e:
                raise KeelError(f"{config_path}: not valid JSON ({e})") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        processor = directory / PROCESSOR_TEMPLATE_FILE
        if processor.exists() and not (directory / CHAT_TEMPLATE_FILE).exists():
            # the processor's template first, as vLLM resolves a multimodal model's: it renders text messages as the
            # tokenizer's does where both exist, and some releases (Qwen3-VL) ship it alone
            try:
                template = json.loads(processor.read_text()).get("chat_template") or template
            except (json.JSONDecodeError, AttributeError) as e:
                raise KeelError(f"{processor}: not a chat template file ({e})") from None
        if (directory / CHAT_TEMPLATE_FILE).exists():
            template = (directory / CHAT_TEMPLATE_FILE).read_text()
        return cls(
            tokenizer,
            chat_template=template,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            eos_token_ids=eos_token_ids,
        )

    def save_hf(self, directory: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (with the chat template) for transformers."""
        directory = Path(directory)
        self.tokenizer.save(str(directory / TOKENIZER_FILE))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1_000_000_000,
        }
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    # ---------------------------------------------------------------- encoding
    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def special_token_ids(self) -> set[int]:
        """Ids of the special tokens (BOS, EOS, chat markers): never part of a text's own characters."""
        return {i for i, token in self.tokenizer.get_added_tokens_decoder().items() if token.special}

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token: also for a token that is only part of a UTF-8 character
        (which `decode` would show as U+FFFD). Byte-level BPE and SentencePiece byte tokens."""
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        piece = self.tokenizer.id_to_token(token_id) or ""
        if "\ufffd" not in text:
            # A SentencePiece decoder strips the prefix space off a text's first token ("\u2581the" decodes
            # as "the" alone): the token itself still stands for " the".
            if piece.startswith(_SPM_SPACE) and piece.replace(_SPM_SPACE, " ") == " " + text:
                text = " " + text
            return text.encode("utf-8")
        if match := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        table = _byte_level_decoder()
        if piece and all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return text.encode("utf-8")

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render messages the way transformers' `apply_chat_template` does."""
        if not self.chat_template:
            raise KeelError("this model has no chat template; use a plain prompt (without --chat)")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.exceptions.TemplateError as e:
            raise KeelError(f"chat template: {e}") from None

    def set_chat_template(self, template: str) -> None:
        """Replace the chat template (`keel serve --chat-template`); compiled here, so a syntax error is a
        KeelError now rather than at the first request."""
        self._template = _compile_template(template)
        self.chat_template = template

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        # The template already writes any BOS token itself; transformers encodes it without extras.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def check_chat_template(source: str) -> None:
    """KeelError naming the line of a chat template's syntax error (`keel serve --chat-template` checks its
    template before the model loads)."""
    _compile_template(source)


def _compile_template(source: str) -> jinja2.Template:
    # transformers' environment: sandboxed, trim_blocks/lstrip_blocks, tojson that keeps unicode.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise KeelError(f"chat template: syntax error at line {e.lineno}: {e.message}") from None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding token by token splits multi-byte characters and breaks byte-level spaces, so each
    step decodes a short window of recent tokens and emits only the new suffix, holding back text
    while it ends in an incomplete UTF-8 sequence (decoded as U+FFFD). Same scheme as vLLM/TGI, run by
    tokenizers' own `DecodeStream` (one call a token, where decoding both windows in Python cost
    ~2 us a token: docs/BENCHMARKS.md); `flush` decodes what it still holds back.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the window `flush` decodes
        self.read_offset = 0  # tokens before this have been emitted
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        delta = self._stream.step(self.tokenizer.tokenizer, token_id)
        if not delta:
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return delta

    def flush(self) -> str:
        """Whatever is still held back at the end (an incomplete character decodes as U+FFFD)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]
