"""Output processing: from sampled tokens to :class:`~.outputs.RequestOutput`.

Owns what a request's samples report: each sample's output state (:mod:`.output_state`:
incremental detokenization, stop strings, logprobs), prompt logprobs, the finish decision of
every generated token, and the :class:`RequestOutput` snapshots a step returns.

Invariants: every generated token is fed once (a speculative step's several tokens of one
sample in order, those after a finish dropped) to its sample's output state, so a step's work per
sample does not grow with the text; a sample finishes with ``"stop"`` on an end-of-sequence token
(unless ``ignore_eos``; no ``stop_reason`` then), a ``stop_token_ids`` entry or a stop string in
its text (neither before ``min_tokens``, whose banned tokens are set here), and with ``"length"``
at ``max_tokens`` or when the sequence fills ``max_model_len``; what an output carries follows
the request's ``output_kind`` (cumulative, delta since the last output, or final only); prompt
logprobs go out once in delta mode. It imports neither input processing nor the engine core.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple, Union

from .outputs import CompletionOutput, RequestOutput
from .request import PromptLogprobStretch, Request, SampledToken
from .sampling_params import RequestOutputKind

__all__ = ["OutputProcessor"]


class OutputProcessor:
    """Turns one model's draws into finishes and outputs.

    Args:
        tokenizer: The model's tokenizer (``None``: no text, token ids only).
        eos_token_ids: The model's end-of-sequence tokens.
        max_model_len: The longest sequence served (a sample reaching it ends with ``"length"``).
        on_first_token: Called with a request when its first token is processed (its time to
            first token and prefix hits are known then): the engine's counters.
    """

    def __init__(self, tokenizer: Any, *, eos_token_ids: FrozenSet[int], max_model_len: int,
                 on_first_token: Callable[[Request], None]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._on_first_token = on_first_token
        self._token_text: Dict[int, str] = {}
        #: Draws the latest :meth:`process_tokens` fed to a sample (a speculative step's tokens
        #: past a sample's finish are not fed, and not counted).
        self.num_processed = 0

    def add_request(self, req: Request) -> None:
        """Gives a new request its per-sample output states (and its ``min_tokens`` bans)."""
        from .detokenizer import IncrementalDetokenizer
        from .output_state import SampleState

        params = req.params
        tok = self.tokenizer
        req.states = [SampleState(None if tok is None else IncrementalDetokenizer(
            tok, req.prompt_token_ids, params.skip_special_tokens), params)
            for _ in range(params.n)]
        if params.min_tokens:
            eos = frozenset() if params.ignore_eos else self.eos_token_ids
            req.banned = frozenset(params._stop_set) | eos
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]

    def decode_token(self, token_id: int) -> Optional[str]:
        """One token's text on its own (for :class:`Logprob`), cached per id."""
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False)
            self._token_text[token_id] = text
        return text

    def record_prompt_logprobs(self, stretches: Sequence[PromptLogprobStretch],
                               logits: Any) -> None:
        """Appends the prompt logprobs of ``stretches`` (their logits packed in ``logits``, in
        order) to their requests."""
        import torch

        from .output_state import logprob_entry
        from .sampler import compute_logprobs

        row = 0
        for req, lo, hi, _ in stretches:
            targets = req.prompt_token_ids[lo + 1:hi + 1]
            chosen = torch.tensor(targets, dtype=torch.int64, device=logits.device)
            k = int(req.params.prompt_logprobs or 0)
            entries = compute_logprobs(logits[row:row + hi - lo], chosen, k)
            assert req.prompt_logprobs is not None
            req.prompt_logprobs.extend(logprob_entry(e, t, self.decode_token)
                                       for e, t in zip(entries, targets))
            req.prompt_lp_next = hi
            row += hi - lo

    def process_tokens(self, sampled: Sequence[SampledToken], now: float
                       ) -> Tuple[Dict[str, Request], List[Any]]:
        """Feeds each draw to its sample's state; returns the requests touched (by id, in first
        draw order) and the sequences that finished."""
        touched: Dict[str, Request] = {}
        done: List[Any] = []
        # A speculative step gives a sequence several draws, in order, all already in its
        # token ids: the j-th of c is fed as if the c - 1 - j after it were not there yet, and a
        # finish before the last drops those (from the ids too; they are never reported).
        counts: Dict[int, int] = {}
        for d in sampled:
            counts[id(d[2])] = counts.get(id(d[2]), 0) + 1
        seen: Dict[int, int] = {}
        processed = 0
        for req, index, seq, token, logprobs in sampled:
            touched[req.request_id] = req
            c = counts[id(seq)]
            behind = 0
            if c > 1:
                j = seen.get(id(seq), 0)
                seen[id(seq)] = j + 1
                if req.finish[index] is not None:
                    continue
                behind = c - 1 - j
            processed += 1
            if self._after_token(req, index, seq, token, now, logprobs, behind):
                if behind:
                    del seq.token_ids[len(seq.token_ids) - behind:]
                done.append(seq)
        self.num_processed = processed
        return touched, done

    def _after_token(self, req: Request, index: int, seq: Any, token: int, now: float,
                     logprobs: Any, behind: int = 0) -> bool:
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
            req.metrics.num_cached_tokens = int(getattr(req.seqs[0], "num_cached_tokens", 0) or 0)
            self._on_first_token(req)
        params = req.params
        state = req.states[index]
        if logprobs is not None:
            state.add_logprobs(logprobs, token, self.decode_token)
        eos = not params.ignore_eos and token in self.eos_token_ids
        stop_token = eos or token in params._stop_set
        matched = state.add_token(token, stop_token)
        reason: Optional[Tuple[str, Union[int, str, None]]] = None
        if stop_token:
            # An end-of-sequence token is no stop_reason (as in vLLM); a stop_token_ids entry is.
            reason = ("stop", None if eos else token)
        elif matched is not None:
            reason = ("stop", matched)
        elif len(seq.token_ids) - behind - seq.num_prompt_tokens >= params.max_tokens:
            reason = ("length", None)
        elif len(seq.token_ids) - behind >= self.max_model_len:
            reason = ("length", None)
        if reason is None:
            return False
        req.set_finish(index, reason)
        return True

    def outputs(self, touched: Dict[str, Request], now: float
                ) -> Tuple[List[RequestOutput], List[Request]]:
        """The step's outputs (as each request's ``output_kind`` asks) and the requests that
        finished this step (their ``finished_time`` set)."""
        outputs = []
        finished_reqs = []
        for req in touched.values():
            finished = req.finished
            if finished or req.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(self.make_output(req))
            if finished:
                req.metrics.finished_time = now
                finished_reqs.append(req)
        return outputs, finished_reqs

    def make_output(self, req: Request) -> RequestOutput:
        """``req``'s :class:`RequestOutput` now (a delta since the last one in delta mode)."""
        delta = req.params.output_kind is RequestOutputKind.DELTA
        completions = []
        for i, seq in enumerate(req.seqs):
            state = req.states[i]
            if seq is None:
                completions.append(CompletionOutput(i, "", [], None, None))
                continue
            fin = req.finish[i]
            reason, stop = (fin if fin is not None else (None, None))
            text, start, lps = state.take(fin is not None, delta)
            ids = list(seq.token_ids[seq.num_prompt_tokens + start:])
            completions.append(CompletionOutput(i, text, ids, reason, stop, lps,
                                                state.cumulative_logprob))
        prompt_lps = req.prompt_logprobs
        if prompt_lps is not None:
            if delta and req.prompt_lp_sent:
                prompt_lps = None
            else:
                req.prompt_lp_sent = True
                prompt_lps = list(prompt_lps)
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), completions,
                             finished=req.finished, metrics=req.metrics,
                             prompt_logprobs=prompt_lps)
