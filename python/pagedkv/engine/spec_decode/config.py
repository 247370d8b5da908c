"""The speculative-decoding settings: :class:`SpeculativeConfig`, parsed once from vLLM's
``speculative_config`` dict (or its JSON text, as ``pagedkv serve --speculative-config`` gives it).

A draft ``model`` path is checked for its type here and for existence when the engine loads it
(:func:`.draft.load_draft`, which also checks its vocabulary and layers against the target's).

Invariants: a constructed config is valid and immutable (every key checked here, a bad one raised
as :class:`~pagedkv.errors.ConfigArgumentError` naming ``speculative_config.<key>``); unknown keys
are refused rather than ignored, since a misspelt one would silently change what runs. Importing it
imports neither torch nor the extension.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping, Optional, Union

from ...errors import ConfigArgumentError

__all__ = ["SpeculativeConfig", "parse_speculative_config", "METHODS"]

#: The proposer methods a config may name (``"draft_model"`` is implied by ``"model"``).
METHODS = ("ngram", "draft_model")
#: Keys that only the n-gram proposer reads (refused beside a draft model).
NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
#: Longest draft a step may verify per sequence.
MAX_SPECULATIVE_TOKENS = 16


def _bad(key: str, value: Any, reason: str) -> ConfigArgumentError:
    name = f"speculative_config.{key}" if key else "speculative_config"
    return ConfigArgumentError(f"invalid config: {name} = {value!r}: {reason}", field=name,
                               value=value, reason=reason)


def _int(key: str, value: Any, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (
            hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise _bad(key, value, f"must be an int {bound}")
    return int(value)


@dataclass(frozen=True)
class SpeculativeConfig:
    """How an engine speculates (vLLM's ``speculative_config`` keys).

    * ``method``: ``"ngram"`` (prompt lookup: the tokens that followed the latest earlier
      occurrence of the sequence's last ``n`` tokens, ``n`` from ``prompt_lookup_max`` down to
      ``prompt_lookup_min``) or ``"draft_model"`` (a smaller model of the same vocabulary,
      :mod:`.draft`; implied by ``model``).
    * ``model``: the draft model's path (a Hugging Face directory or a ``.gguf`` file), for
      ``"draft_model"`` only.
    * ``num_speculative_tokens``: draft tokens per sequence and step, ``k`` in ``[1, 16]``.
    * ``prompt_lookup_min`` / ``prompt_lookup_max``: the n-gram lengths tried (n-gram only).
    * ``disable_by_batch_size``: a step with more running decodes than this speculates for none
      of them (a large batch is compute-bound, so a wasted draft costs real time); ``None``:
      always speculate.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    disable_by_batch_size: Optional[int] = None
    model: Optional[str] = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise _bad("method", self.method,
                       f"unknown method; supported: {', '.join(map(repr, METHODS))}")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise _bad("model", self.model, "method 'draft_model' needs the draft model's "
                           "path (a directory or a .gguf file)")
        elif self.model is not None:
            raise _bad("model", self.model, f"a draft model is for method 'draft_model', not "
                       f"{self.method!r}")
        _int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _int("prompt_lookup_min", self.prompt_lookup_min, 1)
        _int("prompt_lookup_max", self.prompt_lookup_max, 1)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise _bad("prompt_lookup_max", self.prompt_lookup_max,
                       f"must be >= prompt_lookup_min ({self.prompt_lookup_min})")
        if self.disable_by_batch_size is not None:
            _int("disable_by_batch_size", self.disable_by_batch_size, 1)

    def as_dict(self) -> Dict[str, Any]:
        """The settings as vLLM's dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def parse_speculative_config(value: Union[None, str, Mapping[str, Any], SpeculativeConfig]
                             ) -> Optional[SpeculativeConfig]:
    """A :class:`SpeculativeConfig` from a dict, its JSON text or a config; ``None`` for none.

    ``prompt_lookup_min`` alone sets ``prompt_lookup_max`` to it when that is smaller (and the
    other way round), as vLLM does.

    Raises:
        ConfigArgumentError: Not JSON, not an object, an unknown key, or a value out of range
            (``num_speculative_tokens <= 0``, an unknown method, ``"draft_model"`` without a
            ``model`` path, a ``model`` with another method, n-gram keys beside a draft model).
    """
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise _bad("", value, f"not valid JSON ({exc})") from None
    if not isinstance(value, Mapping):
        raise _bad("", value, "must be a dict (or its JSON text)")
    d = dict(value)
    if d.get("model") is not None and "method" not in d:
        d["method"] = "draft_model"  # vLLM's rule: a draft model path names the method
    if d.get("method") == "draft_model":
        for key in NGRAM_KEYS:
            if key in d:
                raise _bad(key, d[key], "an n-gram setting; method 'draft_model' does not read it")
    names = {f.name for f in fields(SpeculativeConfig)}
    for key in d:
        if key not in names:
            raise _bad(str(key), d[key], f"unknown key; the keys are {', '.join(sorted(names))}")
    if "num_speculative_tokens" not in d:
        raise _bad("num_speculative_tokens", None, "required")
    lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
    if hi is None and isinstance(lo, int) and not isinstance(lo, bool):
        d["prompt_lookup_max"] = max(lo, SpeculativeConfig.prompt_lookup_max)
    return SpeculativeConfig(**d)
