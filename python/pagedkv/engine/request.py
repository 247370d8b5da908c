"""The engine's record of one request, shared by input processing, the engine core and output
processing (none of which imports another for it).

Owns :class:`Request` (a request's samples, their sequences, per-sample output state and how each
sample ended) and the :data:`Prompt` type. Invariants: ``seqs`` and ``finish`` hold one entry per
sample (``params.n``); a sample's ``finish`` entry is set once, and ``num_finished`` counts the
entries set, so :attr:`Request.finished` is true exactly when every sample has ended; sample ``i``
draws with ``seq_seeds[i]`` (a function of the request's seed and ``i`` only), so a preempted
sample resumes with the draws it would have made.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from .outputs import RequestMetrics
from .sampler import sample_seed
from .sampling_params import SamplingParams

__all__ = ["Prompt", "Request", "SampledToken", "PromptLogprobStretch"]

#: What a prompt may be: text, token ids, or ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``.
Prompt = Union[str, Sequence[int], Dict[str, Any]]


class Request:
    """Engine-side state of one request: its samples' sequences and how each ended."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "cache_salt", "seed", "seqs",
                 "finish", "num_finished", "metrics", "forked", "seq_seeds", "states", "banned",
                 "prompt_logprobs", "prompt_lp_next", "prompt_lp_sent")

    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: List[int],
                 params: SamplingParams, cache_salt: Optional[bytes], seed: int,
                 arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.cache_salt = cache_salt
        self.seed = seed
        #: One slot per sample; samples 1.. are filled when sample 0's prefill completes.
        self.seqs: List[Any] = [None] * params.n
        #: (finish_reason, stop_reason) per sample, ``None`` while running.
        self.finish: List[Optional[Tuple[str, Union[int, str, None]]]] = [None] * params.n
        #: Entries of ``finish`` set (each is set once: a finished sample runs no more).
        self.num_finished = 0
        #: Per sample: text, stop strings, logprobs, what was reported (set by output processing).
        self.states: List[Any] = []
        #: Tokens that cannot be sampled before ``min_tokens`` (set by output processing).
        self.banned: frozenset = frozenset()
        #: Prompt logprobs collected so far (first entry None), and the next prompt position
        #: whose logits give one; whether a delta output has carried them yet.
        self.prompt_logprobs: Optional[List[Any]] = None
        self.prompt_lp_next = 0
        self.prompt_lp_sent = False
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        #: Whether samples 1.. exist (always for ``n == 1``): they are forked at the first draw.
        self.forked = params.n == 1
        self.seq_seeds = [sample_seed(seed, i) for i in range(params.n)]

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.finish)

    def set_finish(self, index: int, reason: Tuple[str, Union[int, str, None]]) -> None:
        """Records how sample ``index`` ended (counted once, however often it is set)."""
        if self.finish[index] is None:
            self.num_finished += 1
        self.finish[index] = reason


#: ``(request, sample index, sequence, token id, its logprobs or None)`` of one draw of a step.
SampledToken = Tuple[Request, int, Any, int, Any]
#: ``(request, first prompt position, end position, packed index of the first)``: a stretch of
#: prompt positions whose logits a step computed for prompt logprobs.
PromptLogprobStretch = Tuple[Request, int, int, int]
