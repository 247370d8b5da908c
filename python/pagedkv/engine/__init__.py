"""The reference engine: a real model served through the paged KV cache.

Layout (who owns what):

* :mod:`.config` — :class:`EngineConfig`, every setting of the engine, validated once;
* :mod:`.sampling_params` — :class:`SamplingParams` and :class:`RequestOutputKind`, validated on
  construction;
* :mod:`.outputs` — :class:`RequestOutput` / :class:`CompletionOutput` snapshots, :class:`Logprob`;
* :mod:`.sampler` — logits to tokens (greedy, temperature / min-p / top-k / top-p, reproducible
  seeding) and logprobs; :mod:`.penalties` — the batched logits processing it applies first;
* :mod:`.detokenizer`, :mod:`.output_state` — incremental text per sample, stop strings, and what
  each output reports (cumulative, delta, final only);
* :mod:`.request` — :class:`~.request.Request`, the engine's record of one request (shared by the
  three units below, which do not import each other);
* :mod:`.input_processor` — prompts, validation, tokenization, request objects;
* :mod:`.core` — :class:`~.core.EngineCore`: the scheduler (:mod:`pagedkv.scheduler`), the block
  manager (built there), the model runner and the tiers, one ``step``;
* :mod:`.output_processor` — detokenization, stop strings, logprobs, :class:`RequestOutput`;
* :mod:`.stats` — :class:`EngineStats` and the counters behind it;
* :mod:`.builder` — one :class:`EngineConfig` (and a model) into the parts above;
* :mod:`.llm_engine` — :class:`LLMEngine` (add_request / step), which composes them;
* :mod:`.llm` — :class:`LLM` (``generate`` / ``chat``), the offline API over one engine
  (conversations are rendered by :mod:`pagedkv.chat`);
* :mod:`.async_llm` — :class:`AsyncLLM`: the engine stepped by one thread behind asyncio streams;
* :mod:`.loader`, :mod:`.model_runner`, :mod:`.attention` — loading a transformers model and running
  one scheduler step through it with pagedkv's attention.

Names resolve lazily (like :mod:`pagedkv`): ``import pagedkv.engine`` imports neither torch nor
transformers until a class is touched.

Importing this package sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment already sets it: every
engine module (and so torch, through them) is imported after this line. OpenMP threads that spin
while waiting for work take the cores other processes need; on a busy 2-core machine that made each
CPU matmul several times slower. The OpenMP runtime reads the variable once, when torch first
initialises it: in a process that used torch before touching ``pagedkv.LLM``, set it yourself
before importing torch (``OMP_WAIT_POLICY=ACTIVE`` keeps spinning).
"""

from __future__ import annotations

import importlib
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .config import EngineConfig
    from .async_llm import AsyncLLM
    from .llm import LLM
    from .llm_engine import LLMEngine
    from .stats import EngineStats
    from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
    from .sampling_params import RequestOutputKind, SamplingParams

_EXPORTS = {
    "LLM": "llm",
    "LLMEngine": "llm_engine",
    "EngineStats": "stats",
    "EngineConfig": "config",
    "AsyncLLM": "async_llm",
    "SamplingParams": "sampling_params",
    "RequestOutputKind": "sampling_params",
    "RequestOutput": "outputs",
    "Logprob": "outputs",
    "CompletionOutput": "outputs",
    "RequestMetrics": "outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> "Any":
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedkv.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> "list[str]":
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__")})
