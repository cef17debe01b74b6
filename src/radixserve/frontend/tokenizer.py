"""The frontend's tokenizer: encoding, chat templates, and per-token strings/bytes for logprobs.

Wraps a transformers tokenizer. Encoding follows the offline ``LLM`` exactly (text ->
``encode(text, add_special_tokens=False)``; chat -> template text -> the same encode), so a
prompt gives the same token ids offline and over HTTP. Long texts are encoded in a worker thread
so a 1 MB prompt does not stall every other stream on the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

#: Texts longer than this (characters) are encoded in a worker thread.
THREAD_ENCODE_CHARS = 8192


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (byte-level BPE vocabularies)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


_BYTE_DECODER = {c: b for b, c in bytes_to_unicode().items()}


class FrontendTokenizer:
    """Tokenizer operations the HTTP frontend needs.

    Args:
        tokenizer: a transformers tokenizer (fast or slow).

    Attributes:
        hf: the wrapped transformers tokenizer (``IncrementalDetokenizer`` takes it).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.hf = tokenizer
        # prompts longer than the model are rejected by the engine core, not with a warning
        tokenizer.model_max_length = 1 << 62
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None) if backend is not None else None
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._str_cache: dict[int, str] = {}
        self._bytes_cache: dict[int, list[int]] = {}

    # -- encoding ----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens added (like ``LLM.generate``)."""
        return list(self.hf.encode(text, add_special_tokens=False))

    async def encode_async(self, text: str) -> list[int]:
        """``encode``, in a worker thread when ``text`` is long."""
        if len(text) > THREAD_ENCODE_CHARS:
            return await asyncio.to_thread(self.encode, text)
        return self.encode(text)

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    **template_args: Any) -> str:
        """The chat template applied to ``messages`` (list of ``{"role", "content"}``).

        Args:
            template_args: transformers' ``apply_chat_template`` arguments: ``tools``,
                ``documents``, ``chat_template`` (a template of the request's own),
                ``continue_final_message``.

        Raises:
            ValueError: the tokenizer has no chat template (and none is given), or the template
                rejects the messages (the template's own message).
        """
        if not (template_args.get("chat_template") or getattr(self.hf, "chat_template", None)):
            raise ValueError("the model has no chat template; use /v1/completions instead")
        args = {k: v for k, v in template_args.items() if v is not None}
        try:
            return self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                **{**(chat_template_kwargs or {}), **args})
        except Exception as e:  # jinja2 TemplateError, TypeError from bad kwargs, ...
            raise ValueError(f"the chat template rejected the messages: {e}") from e

    # -- decoding ----------------------------------------------------------------------------

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_str(self, token_id: int) -> str:
        """One token's text as shown in logprobs (special tokens included; a partial UTF-8
        character shows as U+FFFD, as ``decode`` gives it)."""
        s = self._str_cache.get(token_id)
        if s is None:
            s = self.hf.decode([token_id], skip_special_tokens=False)
            self._str_cache[token_id] = s
        return s

    def token_bytes(self, token_id: int) -> list[int]:
        """One token's raw UTF-8 bytes (exact for byte-level BPE, even for a partial
        character; else the UTF-8 encoding of ``token_str``)."""
        b = self._bytes_cache.get(token_id)
        if b is None:
            b = None
            if self._byte_level:
                piece = self.hf.convert_ids_to_tokens(token_id)
                if isinstance(piece, str) and all(c in _BYTE_DECODER for c in piece):
                    b = [_BYTE_DECODER[c] for c in piece]
            if b is None:
                b = list(self.token_str(token_id).encode("utf-8"))
            self._bytes_cache[token_id] = b
        return b
