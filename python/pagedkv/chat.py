"""Chat conversations to prompts, through the tokenizer's chat template.

Owns :func:`render_conversations`, which :meth:`pagedkv.LLM.chat`, the server's chat route and the
router use (a neutral module: the router renders chats without importing the engine).

Invariants: every conversation is checked and rendered before any is handed on, so a bad one
leaves the engine untouched; a rendered prompt is tokenized with ``add_special_tokens=False``
(the template already placed BOS and the role markers), so its ids are exactly what
``apply_chat_template`` would give; the prompt handed on carries both the rendered text and
those ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, List, Optional

from .errors import InvalidArgumentError

__all__ = ["render_conversations"]


def _bad(what: str, value: Any, reason: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"invalid argument: {what} = {value!r}: {reason}", what=what,
                                value=value, reason=reason)


def _is_message(m: Any) -> bool:
    return isinstance(m, Mapping) and "role" in m


def _check_conversation(conv: Any, i: int) -> List[Dict[str, Any]]:
    if isinstance(conv, (str, bytes, Mapping)) or not hasattr(conv, "__iter__"):
        raise _bad("messages", type(conv).__name__,
                   "a conversation is a list of {'role': ..., 'content': ...} dicts")
    msgs = list(conv)
    if not msgs:
        raise _bad("messages", [], f"conversation {i} is empty")
    for m in msgs:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise _bad("messages", m if not isinstance(m, Mapping) else dict(m),
                       f"conversation {i}: each message is a dict with a string 'role'")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise _bad("messages", dict(m), f"conversation {i}: 'content' must be a string or a "
                                            f"list of content parts")
    return [dict(m) for m in msgs]


def render_conversations(tokenizer: Any, messages: Any, *, chat_template: Optional[str],
                         add_generation_prompt: bool, continue_final_message: bool,
                         chat_template_kwargs: Optional[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``{"prompt": text, "prompt_token_ids": ids}`` for one conversation or each of a list.

    Raises:
        InvalidArgumentError: No tokenizer, no chat template, a malformed conversation, or the
            template failed to render.
    """
    if tokenizer is None:
        raise _bad("messages", "<conversation>", "the model has no tokenizer (no chat template)")
    if chat_template is not None and not isinstance(chat_template, str):
        raise _bad("chat_template", type(chat_template).__name__, "must be a Jinja template string")
    if add_generation_prompt and continue_final_message:
        raise _bad("continue_final_message", True, "exclusive with add_generation_prompt")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise _bad("chat_template_kwargs", type(chat_template_kwargs).__name__, "must be a dict")
    if isinstance(messages, (str, bytes, Mapping)) or not hasattr(messages, "__iter__"):
        raise _bad("messages", type(messages).__name__,
                   "one conversation (a list of message dicts) or a list of conversations")
    items = list(messages)
    if not items:
        raise _bad("messages", [], "no conversation given")
    conversations = [items] if _is_message(items[0]) else items
    checked = [_check_conversation(c, i) for i, c in enumerate(conversations)]
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise _bad("chat_template", None,
                   "the tokenizer has no chat template: pass chat_template=<Jinja template>")
    extra = dict(chat_template_kwargs or {})
    out = []
    for conv in checked:
        try:
            text = tokenizer.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template,
                **extra)
        except Exception as exc:  # jinja2's errors, and the tokenizer's ValueErrors
            raise _bad("chat_template", "<template>", f"rendering failed: {exc}") from exc
        if not isinstance(text, str):
            raise _bad("chat_template", type(text).__name__, "rendered to something not a string")
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        out.append({"prompt": text, "prompt_token_ids": ids})
    return out
