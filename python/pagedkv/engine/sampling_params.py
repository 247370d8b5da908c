"""Sampling parameters of one request, shaped like vLLM's ``SamplingParams``.

Owns :class:`SamplingParams`, :class:`RequestOutputKind` and their validation. Invariants: an
instance that exists is valid (every field was checked in ``__post_init__``, and the fields are
frozen, so it stays valid); a bad value raises :class:`pagedkv.errors.InvalidArgumentError` (a
``ValueError``) naming the field, the value and the rule it broke, and an unknown keyword raises
it too, naming the supported set (a misspelt option must not be silently dropped). ``bool`` is
rejected where an ``int`` or ``float`` is expected (``n=True`` is a mistake, not ``n=1``).
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Sequence, Tuple, Union

from ..errors import InvalidArgumentError

__all__ = ["SamplingParams", "RequestOutputKind"]


class RequestOutputKind(enum.Enum):
    """What :meth:`LLMEngine.step <pagedkv.engine.LLMEngine.step>` reports for a request.

    ``CUMULATIVE``: every output holds everything generated so far. ``DELTA``: each output holds
    only what is new since the request's previous output (text, token ids, logprobs; the
    concatenation of the deltas is the cumulative output). ``FINAL_ONLY``: one output, when the
    request finishes, holding everything.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2

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
        stop: A string or strings that end a completion when they appear in its detokenized text
            (finish reason ``"stop"``, ``stop_reason`` the string). The text is cut before the
            string (after it with ``include_stop_str_in_output``); the token ids keep the token
            that completed it.
        include_stop_str_in_output: Keep the matched stop string (or the stop token's text) in
            the output text.
        min_tokens: End-of-sequence and ``stop_token_ids`` tokens cannot be sampled, and stop
            strings are not matched, before a completion has this many tokens (``<= max_tokens``).
        logprobs: Return the log-probabilities of the ``logprobs`` most likely tokens at every
            generated position, plus the sampled token's (so up to ``logprobs + 1`` entries);
            ``0``: the sampled token's only. ``None``: none. They are the model's raw
            distribution (``log_softmax`` of its logits, before penalties, temperature or any
            filter).
        prompt_logprobs: Likewise for every prompt token (the prompt token's own log-probability
            plus the ``prompt_logprobs`` most likely at that position); the first prompt token
            has none. The prompt is then computed in full (no prefix-cache hit).
        presence_penalty: Subtracted from the logit of every token the completion has generated
            at least once; in ``[-2, 2]``, ``> 0`` favours new tokens.
        frequency_penalty: Subtracted once per occurrence of a token in the completion; in
            ``[-2, 2]``.
        repetition_penalty: For every token in the prompt or the completion, a positive logit is
            divided by it and a negative one multiplied; ``> 0``, ``1`` is off, ``> 1`` discourages
            repetition.
        min_p: Drop tokens whose probability (after temperature) is below ``min_p`` times the most
            likely token's; in ``[0, 1]``, ``0`` is off.
        output_kind: What the engine's ``step`` reports (:class:`RequestOutputKind`, or its name):
            cumulative snapshots, deltas, or the final output only. ``LLM.generate`` returns final
            outputs whatever the kind.

    Penalties, ``min_tokens`` and ``min_p`` act on the logits before the pick, greedy
    (``temperature == 0``) included; the order is ``min_tokens`` suppression, repetition,
    frequency and presence penalties, temperature, ``min_p``, ``top_k``, ``top_p``.

    Raises:
        InvalidArgumentError: A value is of the wrong type or out of range, or a keyword is not
            one of the supported options.
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
    stop: Union[str, Sequence[str], None] = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
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

        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "must be a bool")

        stop = self.stop
        if stop is not None:
            strings = (stop,) if isinstance(stop, str) else stop
            if isinstance(strings, (bytes, bytearray)) or not hasattr(strings, "__iter__"):
                raise _bad("stop", stop, "must be a string or a sequence of strings")
            strings = tuple(strings)
            for s in strings:
                if not isinstance(s, str) or not s:
                    raise _bad("stop", s, "stop strings must be non-empty strings")
            set_(self, "stop", strings or None)

        min_tokens = _int("min_tokens", self.min_tokens)
        if not 0 <= min_tokens <= max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"must be in [0, max_tokens = {max_tokens}]")
        set_(self, "min_tokens", min_tokens)

        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                k = _int(name, value)
                if k < 0:
                    raise _bad(name, value, "must be None or >= 0 (0: the chosen token's only)")
                set_(self, name, k)

        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise _bad(name, getattr(self, name), "must be in [-2, 2]")
            set_(self, name, value)

        repetition = _float("repetition_penalty", self.repetition_penalty)
        if not 0.0 < repetition < math.inf:
            raise _bad("repetition_penalty", self.repetition_penalty, "must be > 0 and finite")
        set_(self, "repetition_penalty", repetition)

        min_p = _float("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise _bad("min_p", self.min_p, "must be in [0, 1]")
        set_(self, "min_p", min_p)

        kind = self.output_kind
        if isinstance(kind, str) and kind.upper() in RequestOutputKind.__members__:
            kind = RequestOutputKind[kind.upper()]
        if not isinstance(kind, RequestOutputKind):
            names = ", ".join(k.name for k in RequestOutputKind)
            raise _bad("output_kind", self.output_kind, f"must be a RequestOutputKind ({names})")
        set_(self, "output_kind", kind)

    @property
    def stop_strings(self) -> Tuple[str, ...]:
        """The stop strings (empty when none)."""
        return tuple(self.stop) if self.stop is not None else ()

    @property
    def has_penalties(self) -> bool:
        """Whether any of the three penalties changes the logits."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        """Whether tokens are picked by argmax (``temperature == 0``)."""
        return self.temperature == 0.0

    @classmethod
    def greedy_params(cls, max_tokens: int = 16, **kwargs: Any) -> "SamplingParams":
        """Greedy decoding (``temperature=0``), the setting comparable with transformers' default
        ``generate``."""
        return cls(temperature=0.0, max_tokens=max_tokens, **kwargs)


#: The keywords :class:`SamplingParams` accepts.
SUPPORTED_OPTIONS: Tuple[str, ...] = tuple(f.name for f in fields(SamplingParams) if f.init)


def _checked_init(init: Any) -> Any:
    # The dataclass's own __init__ raises a bare TypeError on an unknown keyword; name the
    # supported set instead. Wrapping keeps the generated signature for type checkers and help().
    @functools.wraps(init)
    def __init__(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(SUPPORTED_OPTIONS))
        if unknown:
            raise _bad(unknown[0], kwargs[unknown[0]],
                       f"not a SamplingParams option; supported: {', '.join(SUPPORTED_OPTIONS)}")
        if len(args) > len(SUPPORTED_OPTIONS):
            raise _bad("args", len(args), f"at most {len(SUPPORTED_OPTIONS)} positional values")
        init(self, *args, **kwargs)

    return __init__


setattr(SamplingParams, "__init__", _checked_init(SamplingParams.__init__))
