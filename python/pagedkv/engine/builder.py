"""The builder: one :class:`~.config.EngineConfig` (and a model) in, an engine's parts out.

Owns start-up: loading the model (or taking a loaded one), starting tensor parallelism, the model
runner, the :class:`~.core.EngineCore` (which builds the manager, scheduler and tiers around the
runner), ``max_model_len``, and the input and output processors and stats sized for them.

Owns :func:`sequence_blocks` too: the most blocks one sequence holds over every KV cache group.

Invariants: ``max_model_len`` is the model's context, or what the KV pool holds for one sequence
above the watermark when that is less (logged at start-up; with KV cache groups, the longest
sequence whose blocks over every group fit, :func:`sequence_blocks`), so a preempted sequence can
always be re-admitted into an otherwise empty pool; what several KV cache groups cannot do yet
is refused before tensor parallelism starts; a draft model (``speculative_config`` with a
``model``) is loaded and checked before the target's pool is sized, which counts both models'
bytes per block; a failure after tensor parallelism started stops its ranks before it
propagates; nothing here runs a step.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import textwrap
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional, Union

import torch
from tqdm.auto import tqdm

from ..distributed.launch import start_tp
from ..errors import InvalidArgumentError
from .config import EngineConfig
from .core import EngineCore
from .input_processor import InputProcessor
from .loader import LoadedModel, default_model_path, load_model
from .model_runner import ModelRunner, build_rank_runner
from .output_processor import OutputProcessor
from .stats import StatsTracker

__all__ = ["EngineParts", "build_engine", "config_from_kwargs", "keyword_signature",
           "settings_doc", "sequence_blocks"]

logger = logging.getLogger("pagedkv")


@dataclass
class EngineParts:
    """What :func:`build_engine` made, for :class:`~.llm_engine.LLMEngine` to compose."""

    config: EngineConfig
    loaded: LoadedModel
    model_path: str
    device: torch.device
    core: EngineCore
    inputs: InputProcessor
    outputs: OutputProcessor
    stats: StatsTracker
    #: The model's own context (``max_position_embeddings``).
    model_context_len: int
    #: The longest sequence (prompt and completion) served.
    max_model_len: int


def _stage_bar(enabled: bool, total: int, desc: str) -> Any:
    return tqdm(total=total, desc=desc, disable=not enabled or None, leave=False,
                bar_format="{desc}: {n}/{total} stages [{elapsed}]")


def build_engine(config: EngineConfig, model: Union[str, LoadedModel, None],
                 device: Optional[str], dtype: Any) -> EngineParts:
    """Loads ``model`` (a path, ``None`` for the embedded default, or a :class:`LoadedModel`
    used as it is, with its own device) and builds every part of an engine serving it with
    ``config``."""
    preloaded = model if isinstance(model, LoadedModel) else None
    if preloaded is not None:
        device = preloaded.device
        path = preloaded.path
    else:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        path = default_model_path() if model is None else model

    tp: Any = None
    bar = _stage_bar(config.progress, total=3, desc="loading model")
    try:
        loaded = preloaded or load_model(path, device=device, dtype=dtype)
        draft: Any = None
        spec = config.speculative
        if spec is not None and spec.model is not None:
            # A draft model: loaded (and checked) before the pool is sized for both models.
            from .spec_decode.draft import load_draft

            loaded, draft = load_draft(config, loaded)
        bar.update(1)
        if config.tensor_parallel_size > 1:
            tp = start_tp(loaded, preloaded=preloaded is not None, path=str(path),
                          config=config, build=build_rank_runner)
            runner = ModelRunner(loaded, config, tensor_parallel=tp.group)
            tp.runner = runner
        elif draft is not None:
            from .spec_decode.draft import build_draft_runner, draft_spec

            runner = ModelRunner(loaded, config, extra_bytes_per_block=draft_spec(
                draft, config.block_size).bytes_per_block)
            draft = build_draft_runner(draft, runner, config)
        else:
            runner = ModelRunner(loaded, config)
        bar.update(1)
        core = EngineCore.create(config, runner, str(path), tp, draft=draft)
        bar.update(1)
    except BaseException:
        if tp is not None:
            tp.close()
        raise
    finally:
        bar.close()

    context = int(loaded.max_model_len)
    max_model_len = _max_model_len(context, core.manager, config.block_size,
                                   _group_need(runner, config))
    stats = StatsTracker(core)
    tokenizer = loaded.tokenizer
    inputs = InputProcessor(
        tokenizer, vocab_size=int(getattr(loaded.config, "vocab_size", 0) or 0),
        max_model_len=max_model_len, model_context_len=context,
        max_num_seqs=core.scheduler.max_num_seqs, tensor_parallel=tp is not None,
        seed=config.seed)
    outputs = OutputProcessor(
        tokenizer, eos_token_ids=frozenset(int(t) for t in (loaded.eos_token_ids or ())),
        max_model_len=max_model_len, on_first_token=stats.on_first_token)
    return EngineParts(config, loaded, str(path), torch.device(device), core, inputs, outputs,
                       stats, context, max_model_len)


def sequence_blocks(kv_groups: Any, length: int, block_size: int, chunk: int) -> int:
    """Most blocks one sequence of ``length`` tokens holds at once over every KV cache group,
    prefilled in chunks of at most ``chunk`` tokens: a full group holds all
    ``ceil(length / B)``; a sliding (chunked) group of window (chunk) ``S`` holds at most
    ``floor((2 * chunk + S - 1) / B) + 2`` — a step's blocks are appended before the step
    releases what its first position no longer reads, so the previous chunk's window is still
    held — and never more than the full count."""
    blocks = -(-length // block_size)
    return sum(blocks if g.kind == "full"
               else min(blocks, (2 * min(chunk, length) + g.size - 1) // block_size + 2)
               for g in kv_groups)


def _group_need(runner: Any, config: EngineConfig) -> Optional[Any]:
    """With a windowed KV cache group: a sequence's block need as a function of its length
    (:func:`sequence_blocks`); None with full groups only (a sequence holds ``ceil(len / B)``
    per group)."""
    groups = getattr(runner, "kv_groups", ())
    if all(g.kind == "full" for g in groups):
        return None
    chunk = config.max_num_batched_tokens if config.enable_chunked_prefill else 1 << 62
    return lambda length: sequence_blocks(groups, length, runner.block_size, chunk)


def _max_model_len(context: int, manager: Any, block_size: int, need: Any = None) -> int:
    """The model's context, or less when the pool cannot hold that much for one sequence.
    ``need``: with KV cache groups, the blocks a sequence of a given length holds."""
    # What the pool can hold for one sequence above the watermark (so a preempted sequence can
    # always be re-admitted into an otherwise empty pool).
    room = (manager.num_blocks - manager.watermark_blocks) * block_size
    if need is not None:
        # The longest length whose need fits (the need grows with the length).
        lo, hi = 0, min(context, manager.max_blocks_per_seq * block_size)
        free = manager.num_blocks - manager.watermark_blocks
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if need(mid) <= free else (lo, mid - 1)
        room = lo
    max_model_len = min(context, room, manager.max_blocks_per_seq * block_size)
    if max_model_len < context:
        logger.warning(
            "the KV pool holds at most %d tokens for one sequence (%d blocks of %d, %d held "
            "back): max_model_len is %d, below the model's context of %d; longer requests "
            "are refused", room, manager.num_blocks, block_size, manager.watermark_blocks,
            max_model_len, context)
    return max_model_len


def config_from_kwargs(engine_args: Dict[str, Any]) -> EngineConfig:
    """The :class:`EngineConfig` of a constructor's keyword arguments (each one of its fields).

    Raises:
        InvalidArgumentError: A keyword is no :class:`EngineConfig` field (named, with the
            closest field when there is one).
        ConfigArgumentError: A value is out of its field's domain.
    """
    names = [f.name for f in fields(EngineConfig)]
    for key in engine_args:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            reason = f"not an engine setting{hint}; the settings are EngineConfig's fields"
            raise InvalidArgumentError(f"invalid argument: unknown keyword {key!r}: {reason}",
                                       what=key, value=engine_args[key], reason=reason)
    return EngineConfig(**engine_args)


def keyword_signature(func: Any, **defaults: Any) -> inspect.Signature:
    """``func``'s signature with its ``**engine_args`` spelled out as one keyword per
    :class:`EngineConfig` field, each with the field's default (or the one in ``defaults``), so
    help and introspection list every knob without a second list to keep in step."""
    sig = inspect.signature(func)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    named = {p.name for p in params}
    for f in fields(EngineConfig):
        if f.name not in named:
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                            default=defaults.get(f.name, f.default),
                                            annotation=f.type))
    return sig.replace(parameters=params)


def settings_doc(indent: int = 4) -> str:
    """A docstring section listing every :class:`EngineConfig` field with its default and its
    help (``field.metadata["help"]``), wrapped to 100 columns."""
    pad = " " * indent
    lines = ["", pad + "Settings (EngineConfig's fields, keywords of the constructor):", ""]
    for f in fields(EngineConfig):
        head = f"{pad}    {f.name} (default {f.default!r}): "
        lines.extend(textwrap.wrap(head + f.metadata.get("help", ""), width=100,
                                   subsequent_indent=pad + "        "))
    return "\n".join(lines) + "\n"
