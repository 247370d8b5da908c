"""Starting ``pagedkv serve``: the listening socket first, then the engine.

Owns :func:`bind_socket` (the server's address, taken before anything slow, so that a port in use
is reported in a second rather than after the model has loaded) and :func:`build_async_llm` (the
engine behind the server, from one :class:`~pagedkv.engine.config.EngineConfig` plus what says
which model runs: the path, device, dtype, and the serving caps ``max_model_len`` and
``tokenizer``).

Invariants: :func:`bind_socket` either returns a bound socket or raises
:class:`~pagedkv.errors.InvalidConfigError` naming the address and the reason, leaving nothing
open; the socket is bound, not listening, until uvicorn serves on it, so a client that connects
while the model loads is refused rather than left waiting. Nothing is loaded before a setting that
can be checked without the model has been checked (``gpu_memory_utilization`` off CUDA).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from typing import Any, Optional

from ..errors import ConfigArgumentError, InvalidConfigError, ModelLoadError

__all__ = ["bind_socket", "build_async_llm"]

logger = logging.getLogger("pagedkv.serve")


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port`` 0: a free one; read it from
    ``getsockname()``), as uvicorn would bind it (IPv6 when ``host`` has a colon, else IPv4;
    ``SO_REUSEADDR``).

    Raises:
        InvalidConfigError: The address does not resolve, is in use, or cannot be bound here.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise InvalidConfigError(
                f"cannot listen on {host}:{port}: address already in use (another process "
                f"listens there; pick another --port)", field="port", value=port,
                reason="address in use") from None
        raise InvalidConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                                 field="host", value=host, reason="cannot bind") from None
    return sock


def _check_device(config: Any, device: Optional[str]) -> str:
    """The device the engine will use (``None``: cuda if available), refusing settings that need
    another before anything loads."""
    import torch

    resolved = device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if config.gpu_memory_utilization is not None and not str(resolved).startswith("cuda"):
        u = config.gpu_memory_utilization
        raise ConfigArgumentError(
            f"invalid config: gpu_memory_utilization = {u!r}: a share of free CUDA memory, and "
            f"the device is {resolved}; size the CPU pool with --kv-cache-memory or --num-blocks",
            field="gpu_memory_utilization", value=u, reason="CUDA only")
    return str(resolved)


def _load_tokenizer(path: str) -> Any:
    """A tokenizer from a model directory, a tokenizer directory or a ``.gguf`` file, offline."""
    from transformers import AutoTokenizer

    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or directory (--tokenizer)", path=path,
                             reason="not found")
    kwargs: dict[str, Any] = {}
    directory = path
    if os.path.isfile(path):
        directory, name = os.path.split(os.path.abspath(path))
        kwargs["gguf_file"] = name
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"{path}: cannot load the tokenizer: {exc}", path=path,
                             reason=type(exc).__name__) from None


def build_async_llm(model: Optional[str], *, config: Any, max_queue_size: Optional[int] = None,
                    device: Optional[str] = None, dtype: Any = None,
                    max_model_len: Optional[int] = None,
                    tokenizer: Optional[str] = None) -> Any:
    """The :class:`~pagedkv.AsyncLLM` ``pagedkv serve`` runs: ``model`` (``None``: the embedded
    one) under ``config`` (an :class:`~pagedkv.engine.config.EngineConfig`).

    ``max_model_len`` caps the longest sequence below the model's own context (vLLM's
    ``--max-model-len``; above it is an error); ``tokenizer`` loads the tokenizer from another
    directory or ``.gguf`` file than the weights. Either loads the model here and hands it to the
    engine, which a tensor-parallel engine cannot take (its ranks load the model themselves).

    Raises:
        ConfigArgumentError: ``max_model_len`` above the model's context, or with
            ``tensor_parallel_size > 1`` (so is ``tokenizer``); ``gpu_memory_utilization`` off CUDA.
        ModelLoadError: The model or the tokenizer cannot be loaded.
    """
    from ..engine.async_llm import AsyncLLM
    from ..engine.llm import LLMEngine

    device = _check_device(config, device)
    if (max_model_len is not None or tokenizer is not None) and config.tensor_parallel_size > 1:
        name = "max_model_len" if max_model_len is not None else "tokenizer"
        raise ConfigArgumentError(
            f"invalid config: {name} with tensor_parallel_size = {config.tensor_parallel_size}: "
            f"the spawned ranks load the model from its path, unchanged",
            field=name, value=max_model_len if tokenizer is None else tokenizer,
            reason="tensor_parallel_size 1 only")
    logger.info("loading %s on %s", model or "the embedded SmolLM2-135M-Instruct", device)
    if max_model_len is None and tokenizer is None:
        engine = LLMEngine.from_config(config, model, device=device, dtype=dtype)
    else:
        from ..engine.loader import default_model_path, load_model

        path = default_model_path() if model is None else model
        loaded = load_model(path, device=device, dtype=dtype, load_tokenizer=tokenizer is None)
        if max_model_len is not None:
            if max_model_len > loaded.max_model_len:
                raise ConfigArgumentError(
                    f"invalid config: max_model_len = {max_model_len}: above the model's context "
                    f"of {loaded.max_model_len}", field="max_model_len", value=max_model_len,
                    reason=f"must be <= {loaded.max_model_len}")
            loaded.max_model_len = max_model_len
        if tokenizer is not None:
            loaded.tokenizer = _load_tokenizer(tokenizer)
            eos = getattr(loaded.tokenizer, "eos_token_id", None)
            if eos is not None and int(eos) not in loaded.eos_token_ids:
                loaded.eos_token_ids.append(int(eos))
        engine = LLMEngine.from_config(config, loaded)
    return AsyncLLM.from_engine(engine, max_queue_size=max_queue_size)
