"""Per-sample output state: incremental text, stop strings, logprobs, and what was already reported.

Owns :class:`SampleState` (one per sample of a request) and :func:`logprob_entry`. The engine
feeds each generated token once (:meth:`SampleState.add_token`), and asks for a snapshot whenever
it reports (:meth:`SampleState.take`). Invariants:

* work per token is one detokenizer step plus a search of the new text and the stop-string tail
  (the last ``max(len(stop)) - 1`` characters), never a pass over the whole text;
* a stop string is matched only from the first token past ``min_tokens``; the text is cut at its
  earliest match (before it, or after it with ``include_stop_str_in_output``), and the sample ends
  there;
* text that a later stop string could still cut (the tail) is never reported before the sample
  finishes, so a delta consumer never receives text that the final output does not have;
* the deltas of successive :meth:`take` calls concatenate to the cumulative text, token ids and
  logprobs.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

from .detokenizer import IncrementalDetokenizer
from .outputs import Logprob, PositionLogprobs
from .sampler import RowLogprobs
from .sampling_params import SamplingParams

__all__ = ["SampleState", "logprob_entry"]


def logprob_entry(entry: RowLogprobs, token: int,
                  decode: Callable[[int], Optional[str]]) -> PositionLogprobs:
    """``{token_id: Logprob}`` for one position: the top entries (ranks 1..k) and ``token``'s."""
    top_ids, top_lps, lp, rank = entry
    out: Dict[int, Logprob] = {int(token): Logprob(float(lp), int(rank), decode(int(token)))}
    for r, (tid, v) in enumerate(zip(top_ids, top_lps), start=1):
        if tid not in out:
            out[int(tid)] = Logprob(float(v), r, decode(int(tid)))
    return out


class SampleState:
    """The output side of one sample (see the module docs)."""

    __slots__ = ("detok", "params", "stops", "hold", "reported", "pending", "tail", "logprobs",
                 "cumulative_logprob", "num_tokens", "sent_tokens")

    def __init__(self, detok: Optional[IncrementalDetokenizer], params: SamplingParams) -> None:
        self.detok = detok
        self.params = params
        self.stops = params.stop_strings if detok is not None else ()
        longest = max((len(s) for s in self.stops), default=0)
        #: Characters held back while running: a stop string may still start in them.
        self.hold = longest - 1 if self.stops and not params.include_stop_str_in_output else 0
        #: Text already handed out, in pieces; and text not yet handed out.
        self.reported: List[str] = []
        self.pending = ""
        #: The last ``longest - 1`` characters of the whole text (where a match may start).
        self.tail = ""
        self.logprobs: Optional[List[PositionLogprobs]] = [] if params.logprobs is not None else None
        self.cumulative_logprob: Optional[float] = 0.0 if params.logprobs is not None else None
        self.num_tokens = 0
        self.sent_tokens = 0

    def add_logprobs(self, entry: RowLogprobs, token: int,
                     decode: Callable[[int], Optional[str]]) -> None:
        """Records the logprobs of the token just sampled."""
        if self.logprobs is None:
            return
        self.logprobs.append(logprob_entry(entry, token, decode))
        self.cumulative_logprob = (self.cumulative_logprob or 0.0) + float(entry[2])

    def add_token(self, token: int, stopped_by_token: bool) -> Optional[str]:
        """Feeds one generated token; returns the stop string it completed, if any.

        ``stopped_by_token``: the token is an end-of-sequence or ``stop_token_ids`` token, so
        the sample ends on it; its text is kept only with ``include_stop_str_in_output``.
        """
        self.num_tokens += 1
        if self.detok is None or (stopped_by_token and not self.params.include_stop_str_in_output):
            return None
        new = self.detok.push(token)
        if not new:
            return None
        matched: Optional[str] = None
        if self.stops and not stopped_by_token and self.num_tokens > self.params.min_tokens:
            window = self.tail + new
            best: Optional[Tuple[int, str]] = None
            for s in self.stops:
                # Only a match that ends in the new text: one inside the tail alone was either
                # found before or came before min_tokens.
                at = window.find(s, max(0, len(self.tail) - len(s) + 1))
                if at >= 0 and (best is None or at < best[0]):
                    best = (at, s)
            if best is not None:
                at, matched = best
                cut = at + (len(matched) if self.params.include_stop_str_in_output else 0)
                # The match starts in the tail or the new text, both still unreported
                # (the tail is held back whenever a match would be cut off).
                keep = cut - len(self.tail)
                if keep >= 0:
                    new = new[:keep]
                else:
                    self.pending = self.pending[:len(self.pending) + keep]
                    new = ""
        self.pending += new
        if self.stops:
            width = max(len(s) for s in self.stops) - 1
            self.tail = (self.tail + new)[-width:] if width else ""
        return matched

    def take(self, finished: bool, delta: bool) -> Tuple[str, int, Optional[List[PositionLogprobs]]]:
        """What to report now: ``(text, first token index, logprobs)``.

        Cumulative (``delta=False``): all text reportable so far, index 0, all logprobs. Delta:
        the text, token ids (from the index) and logprobs since the previous call.
        """
        pending = self.pending
        visible = len(pending) if finished or not self.hold else max(0, len(pending) - self.hold)
        if visible:
            self.reported.append(pending[:visible])
            self.pending = pending[visible:]
        start = self.sent_tokens if delta else 0
        self.sent_tokens = self.num_tokens
        if delta:
            text = self.reported[-1] if visible else ""
            lps = self.logprobs[start:] if self.logprobs is not None else None
        else:
            if len(self.reported) > 1:
                self.reported = ["".join(self.reported)]
            text = self.reported[0] if self.reported else ""
            lps = list(self.logprobs) if self.logprobs is not None else None
        return text, start, lps

