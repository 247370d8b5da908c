"""Sampling parameters of one request, shaped like vLLM's ``SamplingParams``.

Owns :class:`SamplingParams` and its validation. Invariants: an instance that exists is valid (every
field was checked in ``__post_init__``, and the fields are frozen, so it stays valid); a bad value
raises :class:`pagedkv.errors.InvalidArgumentError` (a ``ValueError``) naming the field, the value
and the rule it broke. ``bool`` is rejected where an ``int`` or ``float`` is expected (``n=True`` is
a mistake, not ``n=1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

from ..errors import InvalidArgumentError

__all__ = ["SamplingParams"]

# Seeds are mixed into a 64-bit generator seed; keep them in a range every torch generator accepts.
_SEED_LIMIT = 2**63


def _bad(what: str, value: Any, reason: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"invalid argument: {what} = {value!r}: {reason}", what=what, value=value, reason=reason
    )


def _int(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        # numpy integers are ints to a user; accept them, but never bools.
        try:
            import numpy as np

            if isinstance(value, np.integer):
                return int(value)
        except ImportError:  # pragma: no cover - numpy is a dependency
            pass
        raise _bad(what, value, f"must be an int, got {type(value).__name__}")
    return int(value)


def _float(what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            import numpy as np

            if isinstance(value, (np.integer, np.floating)):
                value = float(value)
            else:
                raise TypeError
        except (ImportError, TypeError):
            raise _bad(what, value, f"must be a number, got {type(value).__name__}") from None
    value = float(value)
    if math.isnan(value):
        raise _bad(what, value, "must not be NaN")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the completions of one request.

    Args:
        n: Completions to generate from the prompt (``>= 1``). With ``n > 1`` the prompt is prefilled
            once and then forked: the samples share its KV blocks copy-on-write.
        temperature: ``0`` is greedy (argmax); ``> 0`` divides the logits before sampling.
        top_p: Nucleus sampling: keep the smallest set of most likely tokens whose probability reaches
            ``top_p``; in ``(0, 1]``, ``1`` keeps all.
        top_k: Keep the ``top_k`` most likely tokens; ``-1`` keeps all, otherwise ``>= 1``.
        max_tokens: Most tokens to generate per completion (``>= 1``). Generation also stops at the
            model's context length (finish reason ``"length"`` either way).
        seed: Seeds this request's sampling (``0 <= seed < 2**63``). A seeded request produces the
            same tokens whatever else is in the batch, and when it is preempted and recomputed.
            ``None``: the engine draws a seed when the request is added.
        stop_token_ids: Token ids that end a completion (finish reason ``"stop"``); the stop token is
            the completion's last token id, and is not in its text.
        ignore_eos: Keep generating past the model's end-of-sequence tokens.
        skip_special_tokens: Leave special tokens (EOS and the like) out of the detokenized text.

    Raises:
        InvalidArgumentError: A value is of the wrong type or out of range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: Optional[int] = None
    stop_token_ids: Optional[Tuple[int, ...]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # The normalised stop set, for the per-token check.
    _stop_set: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        n = _int("n", self.n)
        if n < 1:
            raise _bad("n", self.n, "must be >= 1")
        set_(self, "n", n)

        temperature = _float("temperature", self.temperature)
        if temperature < 0 or math.isinf(temperature):
            raise _bad("temperature", self.temperature, "must be >= 0 and finite (0 is greedy)")
        set_(self, "temperature", temperature)

        top_p = _float("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise _bad("top_p", self.top_p, "must be in (0, 1]")
        set_(self, "top_p", top_p)

        top_k = _int("top_k", self.top_k)
        if top_k == 0 or top_k < -1:
            raise _bad("top_k", self.top_k, "must be -1 (all tokens) or >= 1")
        set_(self, "top_k", top_k)

        max_tokens = _int("max_tokens", self.max_tokens)
        if max_tokens < 1:
            raise _bad("max_tokens", self.max_tokens, "must be >= 1")
        set_(self, "max_tokens", max_tokens)

        if self.seed is not None:
            seed = _int("seed", self.seed)
            if not 0 <= seed < _SEED_LIMIT:
                raise _bad("seed", self.seed, "must be in [0, 2**63)")
            set_(self, "seed", seed)

        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
                raise _bad("stop_token_ids", self.stop_token_ids, "must be a sequence of token ids")
            ids = tuple(_int("stop_token_ids", t) for t in self.stop_token_ids)
            for t in ids:
                if t < 0:
                    raise _bad("stop_token_ids", t, "token ids must be >= 0")
            set_(self, "stop_token_ids", ids)
            set_(self, "_stop_set", frozenset(ids))

        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "must be a bool")

    @property
    def greedy(self) -> bool:
        """Whether tokens are picked by argmax (``temperature == 0``)."""
        return self.temperature == 0.0

    @classmethod
    def greedy_params(cls, max_tokens: int = 16, **kwargs: Any) -> "SamplingParams":
        """Greedy decoding (``temperature=0``), the setting comparable with transformers' default
        ``generate``."""
        return cls(temperature=0.0, max_tokens=max_tokens, **kwargs)
