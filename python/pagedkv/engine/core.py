"""The engine core: one scheduler step of one model through the paged KV cache.

Owns the parts a step runs through and their wiring: the block manager (built here from the
runner's pool and step buffers, which fix its shape; the runner only reads what it fills), the
preemption cost model, the :class:`~pagedkv.scheduler.Scheduler`, the KV-event publisher and the
tiers of the prefix cache below the GPU; and :meth:`EngineCore.step`: schedule, run the model,
sample, advance, fork.

Invariants:

* the manager's shape is the runner's (blocks, block size, blocks per sequence) and its step
  buffers are the runner's, so what :meth:`Scheduler.schedule` fills is what the model reads;
* a request with ``n > 1`` is queued as one sequence; when its prompt's prefill completes, the same
  logits seed all ``n`` samples and the other ``n - 1`` sequences are forked from it, sharing its
  KV blocks copy-on-write (the prompt is computed once); forks are made before any sample of the
  step finishes (a parent that ends on its first token must still be running to be forked);
* a preempted sequence keeps its tokens and is either swapped out to the host KV pool (its blocks
  copied back before it runs again) or recomputed, per the cost model (``preemption_mode``); since
  draws depend only on the sample's seed and position (:mod:`.sampler`), its output is what it
  would have been without preemption, whichever mode reclaimed it;
* with ``speculative_config``, each decode may carry up to ``k`` draft tokens from the proposer
  (:mod:`.spec_decode`), held by the manager as provisional tokens: the step computes them with
  the decode's known token, verification (:func:`~.spec_decode.verify.verify_batch`) keeps the
  longest acceptable prefix plus one target token, and the scheduler commits the kept drafts
  (the manager's ``commit_batch``) before the step returns, so between steps no sequence holds
  provisional tokens; drafts never push a sequence past ``max_tokens`` or the model's context;
  a draft model (:mod:`.spec_decode.draft`, ``draft=``) keeps its KV in a pool indexed by the
  manager's block ids and computes it, each step before the target's forward, at exactly the
  positions the target computes (its drafts drawn into the provisional slots);
* with ``async_scheduling``, step N + 1 may be scheduled and queued while step N runs: each of
  N's decodes gets one provisional token, fed on the device from N's sampled tokens and committed
  with their ids when N completes (before :meth:`EngineCore.step` returns N), so between steps
  still no sequence holds provisional tokens; a sequence that ends at N (seen only then) drops
  what N + 1 computed for it; what steps are queued ahead is :meth:`EngineCore._step_async`'s;
* the core knows requests only through their sequences (``seq.data == (request, sample index)``):
  which requests exist, and what they report, is the engine's and output processing's.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from ..errors import OutOfBlocksError
from ..manager import BlockManager, CostModel
from ..scheduler import Scheduler, SequenceStatus
from ..scheduler import Sequence as SchedulerSequence
from ..tiers.cache import build_tier_cache, manager_tier_args
from .config import EngineConfig
from .request import PromptLogprobStretch, Request, SampledToken
from .sampler import SamplerRow, pick_tokens, sample_batch
from .spec_decode import Proposer, build_proposer
from .spec_decode.policy import DraftPolicy
from .spec_decode.verify import VerifyRow, verify_batch

__all__ = ["EngineCore", "CoreStep", "build_block_manager"]


def build_block_manager(runner: Any, **kwargs: Any) -> BlockManager:
    """A :class:`pagedkv.BlockManager` shaped like ``runner``'s pool, its step buffers attached.

    ``kwargs`` go to the manager (``watermark_blocks``, ``enable_prefix_caching``, ...); a
    runner with several KV cache groups, or a windowed one (``runner.kv_groups``), gives it
    ``groups=``.
    """
    groups = getattr(runner, "kv_groups", ())
    if len(groups) > 1 or any(g.kind != "full" for g in groups):
        kwargs.setdefault("groups", list(groups))
    mgr = BlockManager(runner.num_blocks, runner.block_size,
                       max_blocks_per_seq=runner.max_blocks_per_seq, **kwargs)
    mgr.attach_buffers(runner.buffers)
    return mgr


def _set_cost_model(manager: Any, rates: Tuple[float, float, float], kv_bytes_per_token: int,
                    max_step_tokens: int) -> None:
    """Gives the manager's cost model its rates: ``(host link bytes/s, prefill tokens/s, step
    floor s)``, and the scheduler's token budget (a recompute is prefilled in chunks of it)."""
    manager.cost_model = CostModel(host_link_bytes_per_s=rates[0], prefill_tokens_per_s=rates[1],
                                   kv_bytes_per_token=float(kv_bytes_per_token),
                                   step_floor_s=rates[2], max_step_tokens=max_step_tokens)


@dataclass
class CoreStep:
    """What one :meth:`EngineCore.step` ran: the batch (``None``: nothing could run), every draw
    (forked samples' first draws first, then the batch's rows in order), and the prompt-logprob
    stretches with their logits."""

    batch: Any = None
    sampled: List[SampledToken] = field(default_factory=list)
    prompt_logprobs: List[PromptLogprobStretch] = field(default_factory=list)
    prompt_logits: Any = None
    #: With no batch: whether the step waited for blocks coming from a lower tier (so requests
    #: are left that will run, not one that never can).
    waited: bool = False


@dataclass
class _Launched:
    """A step whose forward is queued (and, deferred, its draws): what completing it needs."""

    batch: Any
    out: CoreStep
    #: Batch rows drawn plainly, and rows with drafts to verify.
    rows: List[int]
    spec_rows: List[int]
    #: The draws: one per plain row, then the forked samples' first draws.
    sampler_rows: List[SamplerRow]
    forks: List[Tuple[Request, int, Any]]
    logits: Any
    spec_logits: Any
    drawn: Any
    #: Batch rows whose prompt forked its other samples this step.
    fork_parents: Set[int]
    #: Deferred: the drawn tokens, still on the device (plain rows, then forks); on CUDA their
    #: pinned host copy and the event after it.
    picked: Any = None
    host_tokens: Any = None
    tokens_ready: Any = None


class EngineCore:
    """The scheduler, the block manager, the model runner and the tiers, stepped together.

    Use :meth:`create` to build one from a config and a runner.
    """

    def __init__(self, config: EngineConfig, runner: Any, manager: Any, scheduler: Scheduler, *,
                 tp: Any = None, kv_events: Any = None, tiers: Any = None,
                 cost_rates: Optional[Tuple[float, float, float]] = None,
                 spec_rates: Optional[Tuple[float, float]] = None,
                 draft_rates: Optional[Tuple[float, float]] = None,
                 draft: Any = None) -> None:
        self.config = config
        self.runner = runner
        self.manager = manager
        self.scheduler = scheduler
        #: Rank 0's handle on the tensor-parallel group (None without TP).
        self.tp = tp
        #: The step's KV-event publisher (None without ``kv_events_endpoint``); a lower tier
        #: adds its events to ``kv_events.sink``.
        self.kv_events = kv_events
        #: The tiers below the GPU (:mod:`pagedkv.tiers`); None without a host tier.
        self.tiers = tiers
        #: ``(host link bytes/s, prefill tokens/s, step floor s)`` of the cost model, or None.
        self.cost_rates = cost_rates
        #: Called with ``(number of sequences preempted, how many by swap)`` and with the prefill
        #: tokens of each step (the engine's counters); set by the engine.
        self.on_preempt: Any = None
        self.on_prefill: Any = None
        self._seq_ids = itertools.count()
        #: The speculative proposer (None without ``speculative_config``) and its counters:
        #: sequences drafted for, draft tokens, accepted drafts, and accepted drafts by position.
        self.proposer: Optional[Proposer] = None
        #: The longest sequence served (the engine sets it; drafts stop short of it).
        self.max_model_len = int(getattr(runner, "max_model_len", 0) or 0)
        self.spec_counts: Dict[str, int] = {"num_drafts": 0, "num_draft_tokens": 0,
                                            "num_accepted_tokens": 0}
        self.spec_accepted_by_pos: List[int] = []
        #: A draft model's runner (:mod:`.spec_decode.draft`), or None.
        self.draft = draft
        spec = config.speculative
        if spec is not None:
            self.proposer = build_proposer(spec, int(runner.config.vocab_size),
                                           **({"draft": draft} if draft is not None else {}))
            self.spec_accepted_by_pos = [0] * spec.num_speculative_tokens
            scheduler.propose = self._propose
        #: The per-step draft-length cap from the cost model (None: every step drafts in full).
        self.spec_policy: Optional[DraftPolicy] = None
        if spec is not None and spec_rates is not None:
            self.spec_policy = DraftPolicy(spec.num_speculative_tokens, *spec_rates,
                                           draft_rates=draft_rates)
        self.spec_counts["num_steps_skipped"] = 0
        #: Asynchronous scheduling (``async_scheduling``): the step queued ahead of the one being
        #: completed (None: none in flight), how many steps were queued ahead, and the live
        #: requests that keep steps synchronous (:meth:`async_ok`).
        self.async_scheduling = config.async_scheduling
        self._inflight: Optional[_Launched] = None
        self.num_async_steps = 0
        self._sync_requests: Dict[str, Request] = {}
        self._token_bufs: List[Any] = [None, None]
        self._token_turn = 0

    @classmethod
    def create(cls, config: EngineConfig, runner: Any, model_path: str,
               tp: Any = None, draft: Any = None) -> "EngineCore":
        """Builds the manager (with the host pool and the cost model the config asks for), the
        scheduler, the KV-event publisher and the tiers around ``runner`` (and ``draft``, a draft
        model's runner whose pool shares the block ids: it gets a host pool too)."""
        # A draft model's pool shares the block ids, so each host block holds both models' KV.
        bpb = runner.spec.bytes_per_block + (draft.spec.bytes_per_block if draft is not None else 0)
        host_blocks = config.host_blocks(bpb)
        extra: Dict[str, Any] = {}
        cost_rates: Optional[Tuple[float, float, float]] = None
        spec_rates: Optional[Tuple[float, float]] = None
        draft_rates: Optional[Tuple[float, float]] = None
        measured: Any = None

        def measure() -> Any:  # once, and only if something needs a rate the config lacks
            nonlocal measured
            if measured is None:
                measured = runner.measure_rates()
            return measured

        if host_blocks:
            runner.enable_swap(host_blocks)
            if draft is not None:
                draft.enable_swap(host_blocks)
            extra["num_host_blocks"] = host_blocks
            if config.preemption_mode == "auto":
                link = config.host_link_bytes_per_s
                tps, floor = config.prefill_tokens_per_s, config.step_floor_s
                if link is None or tps is None:
                    link = link if link is not None else measure().host_link_bytes_per_s
                    tps = tps if tps is not None else measure().prefill_tokens_per_s
                    floor = floor if floor is not None else measure().step_floor_s
                cost_rates = (float(link), float(tps), float(floor or 0.0))
        if config.speculative is not None:
            # Whether a step's drafts pay: the same cost model (spec_decode/policy.py).
            tps, floor = config.prefill_tokens_per_s, config.step_floor_s
            tps = tps if tps is not None else measure().prefill_tokens_per_s
            floor = floor if floor is not None else measure().step_floor_s
            spec_rates = (float(tps), float(floor))
            if draft is not None:
                # The draft model's forwards are priced with its own measured rates.
                dr = draft.measure_rates()
                draft_rates = (float(dr.prefill_tokens_per_s), float(dr.step_floor_s))
        extra.update(manager_tier_args(config))
        # KV events need the optional extra (msgspec, pyzmq): imported only when asked for.
        events = config.kv_events_endpoint is not None or config.kv_events_bind is not None
        if events:
            from ..events.engine import KV_EVENT_CAPACITY

            extra["kv_event_capacity"] = KV_EVENT_CAPACITY
        if config.speculative is not None:
            extra["max_provisional"] = config.speculative.num_speculative_tokens
        elif config.async_scheduling:
            extra["max_provisional"] = 1  # the token a step scheduled ahead computes
        manager = build_block_manager(runner, watermark_blocks=config.watermark_blocks,
                                      enable_prefix_caching=config.enable_prefix_caching, **extra)
        if cost_rates is not None:
            kv_token = runner.spec.bytes_per_token + (draft.spec.bytes_per_token if draft else 0)
            _set_cost_model(manager, cost_rates, kv_token,
                            config.max_num_batched_tokens if config.enable_chunked_prefill else 0)
        kv_events: Any = None
        if events:
            from ..events.engine import StepEventPublisher

            kv_events = StepEventPublisher.from_config(manager, config)
        # The tiers below the GPU, and the scheduler's admission gate on them.
        tiers = build_tier_cache(
            config, runner, manager, model_path,
            cost_rates[1] if cost_rates else None,
            events=kv_events.sink if kv_events is not None else None)
        scheduler = Scheduler(
            manager, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            preemption_mode=config.preemption_mode, admission_gate=tiers,
            # A host pool that is the host tier's alone: preemption recomputes, as without it.
            can_swap=False if config.host_blocks(bpb) == config.host_cache_blocks(bpb) else None,
        )
        return cls(config, runner, manager, scheduler, tp=tp, kv_events=kv_events, tiers=tiers,
                   cost_rates=cost_rates, spec_rates=spec_rates, draft_rates=draft_rates,
                   draft=draft)

    # ---------------------------------------------------------------------------- requests

    def add_request(self, req: Request) -> None:
        """Queues ``req`` as one sequence (its samples are forked when its prefill completes)."""
        seq = self._new_sequence(req, 0, list(req.prompt_token_ids))
        # Admission keeps room under max_num_seqs for the samples forked from this sequence.
        seq.n = req.params.n
        self.scheduler.add(seq)
        if self.async_scheduling and not self.async_ok(req):
            self._sync_requests[req.request_id] = req

    def _new_sequence(self, req: Request, index: int, token_ids: List[int]) -> Any:
        # `token_ids` is always a fresh copy of checked ids: the sequence takes it as is.
        seq = SchedulerSequence(next(self._seq_ids), token_ids, request_id=req.request_id,
                                cache_salt=req.cache_salt, arrival=req.metrics.arrival_time,
                                _own=True)
        seq.data = (req, index)
        req.seqs[index] = seq
        return seq

    def abort_request(self, req: Request) -> None:
        """Stops ``req``'s unfinished samples and frees their blocks (cached ones stay cached)."""
        live = [seq for i, seq in enumerate(req.seqs) if seq is not None and req.finish[i] is None]
        self.scheduler.finish_many(live)
        self._sync_requests.pop(req.request_id, None)

    def finish(self, seqs: Sequence[Any]) -> None:
        """Ends sequences whose samples finished (their blocks freed, full ones cached)."""
        self.scheduler.finish_many(seqs)
        if self._sync_requests:
            for seq in seqs:
                req = seq.data[0]
                if req.finished:
                    self._sync_requests.pop(req.request_id, None)

    def out_of_blocks(self, req: Request) -> OutOfBlocksError:
        """The error for a request that cannot be scheduled even in an empty pool."""
        needed = math.ceil(len(req.seqs[0].token_ids) / self.runner.block_size)
        return OutOfBlocksError(
            f"request {req.request_id!r} needs {needed} KV blocks and cannot be scheduled in a "
            f"pool of {self.manager.num_blocks} blocks ({self.manager.watermark_blocks} held "
            f"back); it was dropped",
            needed=needed, available=self.manager.num_blocks - self.manager.watermark_blocks,
        )

    # -------------------------------------------------------------------------------- step

    def step(self) -> CoreStep:
        """Schedules a batch, runs it, samples its rows and forks the samples of prompts whose
        prefill completed. ``batch`` is ``None`` when nothing ran (after waiting for blocks still
        coming from a lower tier, if that is all that is left).

        With ``async_scheduling``, the step returned may be the previous call's batch, completed
        now, while the batch scheduled ahead of it runs on the device (:meth:`_step_async`)."""
        if self.async_scheduling:
            return self._step_async()
        batch = self._schedule()
        if not batch.seqs:
            return self._nothing_ran()
        return self._complete(self._launch(batch, defer=False))

    def _schedule(self, ahead: Optional[Dict[int, int]] = None) -> Any:
        if ahead is None:
            batch = self.scheduler.schedule()
        else:
            batch = self.scheduler.schedule_ahead(ahead)
            if batch is None:
                return None
        if self.tiers is not None:
            self.tiers.after_schedule()  # before the step's swap-outs overwrite demoted slots
        if batch.preempted:
            swapped = sum(seq.status is SequenceStatus.SWAPPED for seq in batch.preempted)
            for seq in batch.preempted:
                seq.data[0].metrics.num_preemptions += 1
            if self.on_preempt is not None:
                self.on_preempt(len(batch.preempted), swapped)
        return batch

    def _nothing_ran(self) -> CoreStep:
        if self.kv_events is not None:
            self.kv_events.flush()
        if self.tiers is not None and self.tiers.num_fetching:
            # Only requests whose blocks are still coming from a lower tier are left.
            self.tiers.wait()
            return CoreStep(waited=True)
        return CoreStep()

    # ------------------------------------------------------------------ asynchronous scheduling

    def _step_async(self) -> CoreStep:
        """Asynchronous scheduling: while step N runs on the device, step N + 1 is scheduled and
        queued behind it, each of N's decodes given one provisional token whose id the device
        feeds from N's sampled tokens; then N's tokens are read, N + 1's provisional tokens
        committed with them, and N is returned. The host's work for a step (scheduling, building
        the tables, output processing) then overlaps the previous step's forward.

        A step is queued ahead only when nothing in it needs the host to know the previous
        step's tokens first: no request with penalties (they read the history), logprobs or
        prompt logprobs (:meth:`async_ok`), no swapped-out sequence, and room in the pool for
        the provisional tokens (a step scheduled ahead never preempts). Otherwise the previous
        step completes and the next is scheduled as without it. A sequence whose previous token
        ends it (a stop token or string, seen only once that token is read) has computed one
        token more, which is dropped; its output is what it would have been without it."""
        prev = self._inflight
        self._inflight = None
        if prev is None:
            batch = self._schedule()
            if not batch.seqs:
                return self._nothing_ran()
            prev = self._launch(batch, defer=self._deferrable(batch))
            if prev.picked is None:
                return self._complete(prev)
        nxt = None
        ahead = self._ahead_of(prev)
        if ahead is not None:
            batch = self._schedule(ahead)
            if batch is not None and batch.seqs:
                nxt = self._launch(batch, defer=True, prev=prev)
                self.num_async_steps += 1
        out = self._complete(prev, nxt)
        self._inflight = nxt
        return out

    @staticmethod
    def async_ok(req: Request) -> bool:
        """Whether ``req``'s draws need nothing the host learns only when the previous step's
        token is read: no penalties (they count the history), no logprobs, no prompt logprobs."""
        p = req.params
        return not p.has_penalties and p.logprobs is None and p.prompt_logprobs is None

    def _deferrable(self, batch: Any) -> bool:
        return not batch.drafts and all(self.async_ok(s.data[0]) for s in batch.seqs)

    def _ahead_of(self, prev: "_Launched") -> Optional[Dict[int, int]]:
        """The sequences of ``prev`` (a deferred step) that decode in the step scheduled ahead
        of its completion, each mapped to its token's index in ``prev.picked``; None when no
        step can be scheduled ahead (see :meth:`_step_async`)."""
        if prev.picked is None or self._sync_requests or self.scheduler.swapped:
            return None
        ahead: Dict[int, int] = {}
        seqs = prev.batch.seqs
        max_len = self.max_model_len
        for r, i in enumerate(prev.rows):
            seq = seqs[i]
            if seq.status is not SequenceStatus.RUNNING or i in prev.fork_parents:
                continue
            req = seq.data[0]
            n = len(seq.token_ids)  # prev's token not yet among them
            if n + 1 - seq.num_prompt_tokens >= req.params.max_tokens or n + 2 > max_len:
                continue  # prev's token is its last: it ends there
            ahead[seq.seq_id] = r
        return ahead

    # ------------------------------------------------------------------------ one step

    def _launch(self, batch: Any, defer: bool, prev: Optional["_Launched"] = None) -> "_Launched":
        """Queues ``batch``'s forward (and with ``defer`` its draws, the tokens left on the
        device, and advances its sequences); ``prev``: the step it was scheduled ahead of, whose
        tokens feed its provisional rows."""
        mask = batch.sample_mask()
        drafts = batch.drafts
        drawn = None
        if self.proposer is not None and self.proposer.drafts_in_step:
            # A draft model: its KV for the step's positions, and the drafts drawn into the
            # provisional slots (batch.drafts filled in place).
            drawn = self.proposer.draft_step(batch, [
                self._sampler_row(s) if drafts and drafts[i] else None
                for i, s in enumerate(batch.seqs)])
        rows = [i for i, m in enumerate(mask) if m and not (drafts and drafts[i])]
        spec_rows = [i for i, m in enumerate(mask) if m and drafts and drafts[i]]
        out = CoreStep(batch)
        # Positions: the runner reads the step's own from what the manager wrote. A drafted
        # sequence's logits come at all its positions (its known token's and each draft's).
        extra: List[int] = []
        starts: List[int] = []
        if spec_rows or batch.ahead:
            starts = list(itertools.accumulate(batch.num_new_tokens, initial=0))
        for i in spec_rows:
            extra.extend(range(starts[i], starts[i + 1]))
        num_spec = len(extra)
        prompt_lp = self._prompt_logprob_rows(batch)
        if prompt_lp:
            extra += [t for _, lo, hi, at in prompt_lp for t in range(at, at + hi - lo)]
        kwargs: Dict[str, Any] = {}
        if extra:
            kwargs["extra_logit_indices"] = extra
        if batch.ahead:
            assert prev is not None and prev.picked is not None
            at = np.array([starts[k] for k in batch.ahead], dtype=np.int64)
            src = torch.tensor(list(batch.ahead.values()), dtype=torch.int64)
            kwargs["ids_from"] = (at, prev.picked.index_select(
                0, src.to(prev.picked.device, non_blocking=True)))
        logits = self.runner.execute(batch.input_ids(), None, batch.step, rows, **kwargs)
        if prompt_lp:
            out.prompt_logprobs = prompt_lp
            out.prompt_logits = logits[len(rows) + num_spec:]
        spec_logits = logits[len(rows):len(rows) + num_spec]
        logits = logits[:len(rows)]
        prefill = 0
        for seq, n_new in zip(batch.seqs, batch.num_new_tokens):
            # A sequence that is not sampling (prefill chunks) or whose step covers more than the
            # one decode token is computing prompt (or recomputed) tokens.
            if seq.num_computed_tokens < seq.num_prompt_tokens or (
                    n_new > 1 and seq.num_computed_tokens + n_new <= len(seq.token_ids)):
                prefill += n_new
        if prefill and self.on_prefill is not None:
            self.on_prefill(prefill)

        # One draw per sampled row; a prompt whose n > 1 samples are not yet forked also draws
        # its other samples' first tokens from the same logits row (appended after the rows).
        sampler_rows: List[SamplerRow] = []
        forks: List[Tuple[Request, int, Any]] = []
        fork_rows: List[int] = []
        ahead = batch.ahead
        for r, i in enumerate(rows):
            seq = batch.seqs[i]
            req, index = seq.data
            # A row scheduled ahead draws the token after the one still being read.
            sampler_rows.append(self._sampler_row(seq, 1 if i in ahead else 0))
            if not req.forked:
                req.forked = True
                for child in range(1, req.params.n):
                    forks.append((req, child, seq))
                    fork_rows.append(r)
        for (req, child, parent) in forks:
            sampler_rows.append(SamplerRow(req.params, req.seq_seeds[child], 0, parent.token_ids,
                                           parent.num_prompt_tokens, req.banned))
        if forks:
            logits = logits[list(range(len(rows))) + fork_rows]
        launched = _Launched(batch, out, rows, spec_rows, sampler_rows, forks, logits,
                             spec_logits, drawn, {rows[r] for r in fork_rows})
        if defer:
            launched.picked = picked = pick_tokens(logits, sampler_rows)
            if picked.is_cuda:
                # Read back through pinned memory behind an event: reading ``picked`` itself
                # would wait for the step queued after this one too.
                launched.host_tokens = self._token_buffer(picked.shape[0])
                launched.host_tokens.copy_(picked, non_blocking=True)
                launched.tokens_ready = torch.cuda.Event()
                launched.tokens_ready.record()
            self.scheduler.advance(batch)
        return launched

    def _token_buffer(self, n: int) -> Any:
        """One of two pinned host buffers for a deferred step's tokens, in turns (at most two
        deferred steps are ever pending: the one completing and the one queued ahead)."""
        self._token_turn ^= 1
        buf = self._token_bufs[self._token_turn]
        if buf is None or buf.shape[0] < n:
            buf = torch.empty(max(n, 2 * self.config.max_num_seqs), dtype=torch.int64,
                              pin_memory=True)
            self._token_bufs[self._token_turn] = buf
        return buf[:n]

    def _complete(self, step: "_Launched", nxt: Optional["_Launched"] = None) -> CoreStep:
        """Reads (or draws) ``step``'s tokens, verifies its drafts, commits the provisional rows
        of ``nxt`` (scheduled ahead of it) with them, records them and makes its forks."""
        batch, rows, drafts = step.batch, step.rows, step.batch.drafts
        out = step.out
        if step.tokens_ready is not None:
            step.tokens_ready.synchronize()
            tokens = step.host_tokens.tolist()
            row_logprobs: List[Any] = [None] * len(tokens)
        elif step.picked is not None:
            tokens = step.picked.tolist()
            row_logprobs = [None] * len(tokens)
        else:
            result = sample_batch(step.logits, step.sampler_rows)
            tokens, row_logprobs = result.token_ids, result.logprobs

        sampled: List[Optional[int]] = [None] * len(batch.seqs)
        for r, i in enumerate(rows):
            sampled[i] = tokens[r]
        accepted: Optional[List[List[int]]] = None
        verified: Dict[int, Tuple[List[int], List[Any]]] = {}
        spec_rows = step.spec_rows
        if spec_rows:
            accepted = [[] for _ in batch.seqs]
            drawn = step.drawn
            ver = verify_batch(step.spec_logits, [
                VerifyRow(self._sampler_row(batch.seqs[i]), drafts[i],
                          drawn.probs_of(i) if drawn is not None else None)
                for i in spec_rows])
            for j, i in enumerate(spec_rows):
                toks = ver.tokens[j]
                accepted[i] = toks[:-1]
                sampled[i] = toks[-1]
                verified[i] = (toks, ver.logprobs[j])
            self._count_spec([len(drafts[i]) for i in spec_rows], ver.num_accepted)
            if self.proposer is not None:
                self.proposer.accepted([batch.seqs[i].seq_id for i in spec_rows],
                                       ver.num_accepted)
        if nxt is not None and nxt.batch.ahead:
            # The tokens the step scheduled ahead is computing are known now: commit them.
            ahead = nxt.batch.ahead
            seqs = nxt.batch.seqs
            self.manager.commit_batch([seqs[k].seq_id for k in ahead], [1] * len(ahead),
                                      [tokens[src] for src in ahead.values()])
        self.scheduler.postprocess(batch, sampled, accepted)

        draws = out.sampled
        # Forks first: a parent that finishes on its first token must still be running to be
        # forked.
        for j, ((req, child, parent), tok) in enumerate(zip(step.forks, tokens[len(rows):])):
            if parent.status is not SequenceStatus.RUNNING:
                continue  # aborted while its step was in flight
            child_seq = self._new_sequence(req, child, list(req.prompt_token_ids))
            self.scheduler.fork(parent, child_seq)
            child_seq.append_token(tok)
            draws.append((req, child, child_seq, tok, row_logprobs[len(rows) + j]))
        plain = dict(zip(rows, range(len(rows))))
        finished = SequenceStatus.FINISHED
        for i, seq in enumerate(batch.seqs):
            if seq.status is finished:
                continue  # ended while its step was in flight: the token is not its
            if i in plain:
                req, index = seq.data
                r = plain[i]
                draws.append((req, index, seq, tokens[r], row_logprobs[r]))
            elif i in verified:
                req, index = seq.data
                toks, lps = verified[i]
                for tok, lp in zip(toks, lps):
                    draws.append((req, index, seq, tok, lp))
        return out

    def _sampler_row(self, seq: Any, pending: int = 0) -> SamplerRow:
        req, index = seq.data
        return SamplerRow(req.params, req.seq_seeds[index],
                          len(seq.token_ids) + pending - seq.num_prompt_tokens,
                          seq.token_ids, seq.num_prompt_tokens, req.banned)

    # ------------------------------------------------------------------------- speculation

    def _propose(self, decodes: List[Any], budget: int) -> Optional[List[List[int]]]:
        """The scheduler's hook: each decode's drafts, within ``max_tokens``, the model's
        context and the step's token budget (``None``: no speculation this step)."""
        spec = self.config.speculative
        proposer = self.proposer
        if spec is None or proposer is None:
            return None
        if spec.disable_by_batch_size is not None and len(decodes) > spec.disable_by_batch_size:
            return None
        max_len = self.max_model_len
        limits = []
        for seq in decodes:
            req, _ = seq.data
            if not req.forked:
                limits.append(0)
                continue
            generated = len(seq.token_ids) - seq.num_prompt_tokens
            limits.append(max(0, min(req.params.max_tokens - generated - 1,
                                     max_len - len(seq.token_ids) - 1)))
        if not any(limits):
            return None
        drafts = proposer.propose([seq.token_ids for seq in decodes], limits).tokens
        if self.spec_policy is not None:
            cap = self.spec_policy.cap(len(decodes), [len(d) for d in drafts if len(d)])
            if cap == 0:
                if any(len(d) for d in drafts):
                    self.spec_counts["num_steps_skipped"] += 1
                return None
            drafts = [d[:cap] for d in drafts]
        out: List[List[int]] = []
        for d in drafts:
            d = list(d[:max(0, budget)])
            budget -= len(d)
            out.append(d)
        return out

    def _count_spec(self, drafted: List[int], num_accepted: List[int]) -> None:
        if self.spec_policy is not None:
            self.spec_policy.observe(drafted, num_accepted)
        c = self.spec_counts
        c["num_drafts"] += len(drafted)
        c["num_draft_tokens"] += sum(drafted)
        c["num_accepted_tokens"] += sum(num_accepted)
        by_pos = self.spec_accepted_by_pos
        for m in num_accepted:
            for p in range(min(m, len(by_pos))):
                by_pos[p] += 1

    def _prompt_logprob_rows(self, batch: Any) -> List[PromptLogprobStretch]:
        """``(request, first position, end position, packed index of the first)`` of every
        prompt stretch this step computes whose logits give prompt logprobs not yet collected.
        The logits at position ``j`` are the distribution of prompt token ``j + 1``."""
        out: List[PromptLogprobStretch] = []
        at = 0
        for seq, n_new in zip(batch.seqs, batch.num_new_tokens):
            req = seq.data[0]
            if req.prompt_logprobs is not None and seq is req.seqs[0]:
                start = seq.num_computed_tokens
                lo = max(start, req.prompt_lp_next)
                hi = min(start + n_new, len(req.prompt_token_ids) - 1)
                if lo < hi:
                    out.append((req, lo, hi, at + lo - start))
            at += n_new
        return out

    def end_step(self) -> None:
        """Publishes the step's KV events (one batch per step: what it cached and evicted)."""
        if self.kv_events is not None:
            self.kv_events.flush()

    def shutdown(self) -> None:
        """Closes the tiers below the host (pending fetches released, writes flushed) and the
        KV-event publisher. Idempotent. (The tensor-parallel ranks are the engine's to stop.)"""
        self._inflight = None
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None
        if self.kv_events is not None:
            self.kv_events.close()
