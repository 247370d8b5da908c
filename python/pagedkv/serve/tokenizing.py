"""Tokenization off the engine thread: the worker threads that tokenize prompts and render chats.

Owns :class:`_Tokenizers` (the worker pool, each thread with its own copy of the model's
tokenizer) and the functions the routes run on it (:func:`_encode_all`, :func:`_token_strs`,
:func:`_decode`, :func:`_render_chat`), each taking that thread's tokenizer first.

Invariants:

* a tokenizer is never shared across threads: each worker has its own deep copy, and the engine
  thread keeps the original (for detokenizing);
* nothing here runs on the event loop or the engine thread: a long prompt stalls no stream.
"""

from __future__ import annotations

import asyncio
import copy
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

T = TypeVar("T")


class _Tokenizers:
    """Worker threads that tokenize prompts and render chats, each with its own copy of the
    model's tokenizer (a tokenizer is not shared across threads: the engine thread keeps the
    original for detokenizing). ``run(fn, *args)`` calls ``fn(tokenizer, *args)`` on one of them.
    """

    def __init__(self, tokenizer: Any, workers: int) -> None:
        copies: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        for _ in range(workers):
            copies.put(copy.deepcopy(tokenizer))
        self._local = threading.local()

        def take() -> None:
            self._local.tokenizer = copies.get_nowait()

        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pagedkv-tokenize",
                                        initializer=take)

    def _call(self, fn: Callable[..., T], args: Tuple[Any, ...]) -> T:
        return fn(self._local.tokenizer, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._call, fn, args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _encode_all(tokenizer: Any, texts: List[str], add_special_tokens: bool) -> List[List[int]]:
    return [list(tokenizer(t, add_special_tokens=add_special_tokens)["input_ids"])
            for t in texts]


def _token_strs(tokenizer: Any, ids: List[int]) -> List[str]:
    return [str(t) for t in tokenizer.convert_ids_to_tokens(ids)]


def _decode(tokenizer: Any, ids: List[int]) -> str:
    return str(tokenizer.decode(ids))


def _render_chat(tokenizer: Any, messages: List[Dict[str, Any]], template: Optional[str],
                 add_generation_prompt: bool, continue_final_message: bool,
                 kwargs: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The conversation as a prompt (``{"prompt", "prompt_token_ids"}``), rendered as
    :meth:`pagedkv.LLM.chat` renders it."""
    from ..chat import render_conversations

    return render_conversations(tokenizer, messages, chat_template=template,
                                add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message,
                                chat_template_kwargs=kwargs)[0]
