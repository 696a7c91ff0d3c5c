"""Tokenizer and chat template from the model's own source (GGUF metadata or the
safetensors directory), through Hugging Face's tokenizer library."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from mooncaked.engine.types import InvalidRequest

from . import load_cache
from .errors import ModelLoadError

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback pieces


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable alphabet -> byte (GPT-2's bytes_to_unicode, inverted)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: PLC0415

    return {c: b for b, c in bytes_to_unicode().items()}


def _from_gguf(path: Path) -> Any:
    """The fast tokenizer of GGUF file `path`. Converting it from the file's metadata
    takes transformers 10-20 s on two cores, so the result is saved (save_pretrained:
    tokenizer.json, tokenizer_config.json with the chat template) in the load cache
    (load_cache.py), keyed by the file and transformers' version, and loaded from there
    next time (about 1 s); tests/test_model_load_cache.py checks both give the same ids,
    text, special tokens and chat template."""
    from transformers import AutoTokenizer, __version__  # noqa: PLC0415 - heavy import

    cached = load_cache.entry("tokenizers", load_cache.file_key(path, f"transformers {__version__}"))
    if (cached / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception as e:  # a damaged entry: rebuild it from the file
            load_cache.log.warning("load_cache_entry_corrupt", path=str(cached), error=str(e))
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    with load_cache.building_dir(cached) as build:
        if build is not None:
            tok.save_pretrained(str(build))
    return tok


class Tokenizer:
    """Text <-> token ids and chat formatting for one model.

    Wraps a transformers fast tokenizer built from the GGUF file's
    `tokenizer.ggml.*` metadata and `tokenizer.chat_template` (or the directory's
    tokenizer.json and tokenizer_config.json).
    """

    def __init__(self, path: Path, eos_token_ids: list[int]):
        from transformers import AutoTokenizer  # noqa: PLC0415 - heavy import

        try:
            if path.is_dir():
                self._tok = AutoTokenizer.from_pretrained(str(path))
            else:
                self._tok = _from_gguf(path)
        except Exception as e:  # transformers raises many types for bad files
            raise ModelLoadError(f"cannot load the tokenizer from {path}: {e}") from e
        self.vocab_size: int = len(self._tok)
        ids = set(eos_token_ids)
        if self._tok.eos_token_id is not None:
            ids.add(int(self._tok.eos_token_id))
        self.eos_token_ids: set[int] = ids
        template = getattr(self._tok, "chat_template", None)
        self.has_chat_template = bool(template)
        # A template that reads `tools` renders tool definitions and so defines a tool format.
        self.accepts_tools = isinstance(template, str) and "tools" in template

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added beyond the tokenizer's own rule)."""
        return list(self._tok.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """Text of one token on its own (for logprobs)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    @functools.cached_property
    def _byte_level(self) -> bool:
        decoder = getattr(getattr(self._tok, "backend_tokenizer", None), "decoder", None)
        return "ByteLevel" in repr(decoder)

    @functools.cached_property
    def _added_ids(self) -> set[int]:
        return set(getattr(self._tok, "added_tokens_decoder", {}) or {})

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for on its own (logprobs' `bytes`): a
        byte-level BPE piece mapped back through its byte alphabet, a SentencePiece
        byte-fallback piece `<0xNN>` as that byte, "▁" as a space; added and special
        tokens as their text's UTF-8. The bytes of a generated sequence's tokens
        concatenate to its text's UTF-8 (a token may hold part of a character)."""
        piece = self._tok.convert_ids_to_tokens([token_id])[0]
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return self.token_text(token_id).encode("utf-8")
        if self._byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return self.token_text(token_id).encode("utf-8")
        m = _BYTE_FALLBACK.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Vocabulary strings (byte-level BPE pieces) of `ids`, for incremental decoding."""
        return self._tok.convert_ids_to_tokens(ids)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """Text of vocabulary pieces."""
        return self._tok.convert_tokens_to_string(tokens)

    @property
    def hf(self) -> Any:
        """The underlying transformers tokenizer (for the grammar backend's vocabulary)."""
        return self._tok

    @property
    def all_special_ids(self) -> set[int]:
        """Ids of special tokens (skipped in output text)."""
        return set(self._tok.all_special_ids)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a chat rendered with the model's template.

        Args: messages: [{"role": str, "content": str}, ...] (content already flattened to text).
            tools: OpenAI tool definitions, passed to a template that accepts them
            (`accepts_tools`), else left out.
        Raises: InvalidRequest if messages are empty or the template rejects them.
        """
        if not messages:
            raise InvalidRequest("messages must not be empty", "messages")
        if not self.has_chat_template:
            raise InvalidRequest("this model has no chat template; use /v1/completions", "messages")
        try:
            extra = {"tools": tools} if tools and self.accepts_tools else {}
            text = self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=False, **extra)
        except Exception as e:  # jinja2 errors from the template
            raise InvalidRequest(f"chat template failed: {e}", "messages") from e
        return list(self._tok.encode(text, add_special_tokens=False))
