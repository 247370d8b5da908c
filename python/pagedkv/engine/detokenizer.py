"""Incremental detokenization: one generated token in, the text it adds out.

Owns :class:`IncrementalDetokenizer`. Each sample of a request has its own; a step costs one
token's decode, whatever the text's length so far. With a fast tokenizer it drives the
``tokenizers`` library's ``DecodeStream`` over the backend tokenizer; otherwise (a slow tokenizer,
or a ``tokenizers`` without ``DecodeStream``) it decodes a sliding window of the last few ids and
emits what the newest id added. Invariants:

* the stream is primed with the end of the prompt, so the text is the prompt's continuation (a
  leading space a word-initial token carries is kept) and the pieces concatenate to the text of
  the whole generated sequence;
* a token that ends inside a multi-byte character adds nothing until the character is complete
  (no replacement character is ever emitted mid-sequence);
* special tokens are dropped or kept per ``skip_special_tokens``.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

__all__ = ["IncrementalDetokenizer", "prompt_context"]

#: At most this many prompt tokens prime a detokenizer (enough for any merge across the boundary).
_CONTEXT = 6


def _decode(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool) -> str:
    # No clean-up pass: it strips spaces before punctuation, which corrupts BPE text.
    return str(tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                clean_up_tokenization_spaces=False))


def prompt_context(tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool) -> List[int]:
    """The last few prompt ids that decode cleanly on their own (no partial character at the
    front), to prime a detokenizer with."""
    tail = list(prompt_ids[-_CONTEXT:])
    while tail and "\ufffd" in _decode(tokenizer, tail, skip_special_tokens):
        tail = tail[1:]
    return tail


def _backend(tokenizer: Any) -> Any:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401
    except ImportError:  # pragma: no cover - tokenizers without DecodeStream
        return None
    return backend if isinstance(backend, Tokenizer) else None


class IncrementalDetokenizer:
    """The text of one sample, token by token.

    Args:
        tokenizer: A transformers tokenizer.
        prompt_ids: The request's prompt (its tail primes the stream).
        skip_special_tokens: Drop special tokens from the text.
    """

    __slots__ = ("_tok", "_skip", "_stream", "_backend", "_ids", "_prefix", "_read")

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = prompt_context(tokenizer, prompt_ids, skip_special_tokens)
        self._backend = _backend(tokenizer)
        self._stream: Any = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(context, skip_special_tokens=skip_special_tokens)
        # The window fallback: ids[prefix:read] were emitted, ids[read:] not yet.
        self._ids: List[int] = context
        self._prefix = 0
        self._read = len(context)

    def push(self, token_id: int) -> str:
        """Adds one token; returns the text it completes (``""`` while a character is partial)."""
        if self._stream is not None:
            try:
                piece = self._stream.step(self._backend, int(token_id))
            except Exception:
                # A stream that cannot take this id (its prefix no longer decodes) continues with
                # the window decoder from here; the text emitted so far stands.
                self._stream = None
                self._ids, self._prefix, self._read = [], 0, 0
            else:
                return piece or ""
        self._ids.append(int(token_id))
        before = _decode(self._tok, self._ids[self._prefix:self._read], self._skip)
        after = _decode(self._tok, self._ids[self._prefix:], self._skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._ids = self._ids[self._read:]
        self._prefix, self._read = 0, len(self._ids)
        return after[len(before):]
