"""The serving simulator behind ``pagedkv simulate``: paged blocks against contiguous reservation.

Owns :func:`simulate`, which replays one seeded workload (:mod:`pagedkv.workload`) twice in the
same KV memory. Time is counted in scheduler steps; in each step every running sequence produces
one token, and a newly admitted one produces its first token from its prefill.

**Paged** — through the real :class:`pagedkv.BlockManager` and the engine's own
:class:`pagedkv.scheduler.Scheduler` (continuous batching, decodes first, chunked prefill, preemption
of the most recently admitted sequence or forked group, reclaimed by recompute or — with
``num_host_blocks`` — by swap, as ``preemption_mode`` and the manager's cost model decide; the
cost model's rates are given, not measured, here), with a simulated executor in place of the model:
each sequence whose known tokens a step completes "samples" the next token of its predetermined
output. The step's token budget is ``max_prefill_tokens`` plus one decode per sequence the batch can
hold (``max_num_seqs``), so decodes never crowd prompts out. A request with ``n_samples > 1`` is
admitted once and forks its other samples when its prompt is computed (copy-on-write), as the
engine does. Every step is built with ``BlockManager.step`` into CPU step buffers, as an engine
would before running the model: that emits the copy-on-write list and offers newly full blocks to
the prefix cache. ``preemptions`` counts preempted sequences (a forked group is preempted together,
unless it is all that runs: then its newest sample alone), split by mode into
``preemptions_swap`` and ``preemptions_recompute``. The simulated executor moves no bytes, so a
swap costs nothing here but host blocks.

**Contiguous** — the same arrivals, lengths, timing and scheduler limits, but each sequence
reserves ``max_model_len`` token slots at admission, so at most ``floor(num_blocks × block_size /
max_model_len)`` run at once; nothing is shared and nothing is preempted.

Measurements, taken every step after the step is built (before finished sequences are freed) and
averaged over every step of the run:

- concurrency: live sequences;
- KV utilization: token slots holding live KV / pool slots (``num_blocks × block_size``), a shared
  block counted once (the manager's own ``Stats.kv_utilization`` counts it once per holder);
- waste per sequence: allocated-but-unused slots — ``ceil(len / B)·B − len`` paged (internal
  fragmentation), ``max_model_len − len`` contiguous; waste fraction: unused / allocated slots;
- blocks saved by sharing: ``Σ ceil(len / B)`` over live sequences (the blocks they would hold
  without sharing) minus the blocks actually held; reported as the mean over steps and the peak;
- prefix hit ratio: the manager's ``prefix_hit_tokens / prefix_query_tokens`` over all admissions,
  re-admissions after preemption included;
- completion: steps until the last request finishes, output tokens and requests per step, mean
  queueing delay (arrival to first admission) and latency (arrival to last token), in steps.

Invariants: :func:`simulate` is deterministic for a given (workload, sim) pair; it checks the
manager's invariants at the end (and every ``check_every`` steps), frees every sequence, and
raises :class:`pagedkv.errors.InvariantViolationError` if any block is left allocated. The
extension is imported when a simulation starts, not on import; torch never is (the step buffers
are numpy arrays on the host).
"""

from __future__ import annotations

import heapq
import json
import sys
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np

from ._checks import DEFAULT_BLOCK_SIZE, check_block_size
from .config import CacheSpec, CapacityError, MemoryBudget, format_bytes
from .errors import InvalidConfigError, InvariantViolationError, OutOfBlocksError
from .workload import Request, WorkloadConfig, generate

__all__ = [
    "SimConfig",
    "PolicyResult",
    "SimResult",
    "simulate",
    "simulate_contiguous",
    "format_report",
    "result_dict",
    "result_json",
    "plot_timeline",
    "TierPoint",
    "simulate_tiers",
    "format_tier_sweep",
    "plot_tier_sweep",
]


@dataclass(frozen=True)
class SimConfig:
    """The pool and the scheduler's limits.

    ``watermark_blocks=None`` takes the manager's default reserve.
    """

    num_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    watermark_blocks: Optional[int] = None
    max_num_seqs: int = 512
    max_prefill_tokens: int = 16384
    enable_prefix_caching: bool = True
    check_every: int = 0
    #: Host KV blocks for swapped-out sequences (0: every preemption recomputes).
    num_host_blocks: int = 0
    #: ``"auto"`` (the manager's cost model per victim), ``"swap"`` or ``"recompute"``.
    preemption_mode: str = "auto"
    #: The cost model's rates (``"auto"`` with a host pool): assumed, not measured, in a simulation.
    host_link_bytes_per_s: float = 50e9
    prefill_tokens_per_s: float = 20_000.0
    #: Seconds a step costs however few tokens it carries (the cost model's step floor; 0: linear).
    step_floor_s: float = 0.0
    #: KV bytes per token, for the cost model (the model's ``CacheSpec.bytes_per_token``).
    kv_bytes_per_token: int = 131_072
    #: Host blocks of the prefix cache's host tier (0: none); added to ``num_host_blocks``.
    host_cache_blocks: int = 0
    #: Blocks of the modelled disk tier under the host tier (0: none; needs a host tier).
    disk_cache_blocks: int = 0
    #: The disk tier's read rate for the modelled TTFT.
    disk_bytes_per_s: float = 3e9

    def __post_init__(self) -> None:
        # The simulation drives the block manager only: its block-size rule, not the pool's.
        check_block_size(self.block_size, pool=False)
        for name, minimum in (("num_blocks", 1), ("max_num_seqs", 1),
                              ("max_prefill_tokens", 1), ("check_every", 0),
                              ("num_host_blocks", 0), ("kv_bytes_per_token", 1),
                              ("host_cache_blocks", 0), ("disk_cache_blocks", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise InvalidConfigError(
                    f"invalid simulation config: {name} = {value!r}: must be an integer >= {minimum}",
                    field=name, value=value, reason=f"must be an integer >= {minimum}",
                )
        if not isinstance(self.enable_prefix_caching, bool):
            raise InvalidConfigError(
                f"invalid simulation config: enable_prefix_caching = {self.enable_prefix_caching!r}: "
                "must be a bool",
                field="enable_prefix_caching", value=self.enable_prefix_caching,
                reason="must be a bool",
            )
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise InvalidConfigError(
                f"invalid simulation config: preemption_mode = {self.preemption_mode!r}: must be "
                "'auto', 'swap' or 'recompute'", field="preemption_mode",
                value=self.preemption_mode, reason="unknown mode")
        if self.disk_cache_blocks and not self.host_cache_blocks:
            raise InvalidConfigError(
                f"invalid simulation config: disk_cache_blocks = {self.disk_cache_blocks}: needs "
                "host_cache_blocks (the disk tier is filled from the host tier)",
                field="disk_cache_blocks", value=self.disk_cache_blocks,
                reason="needs host_cache_blocks")
        if self.host_cache_blocks and not self.enable_prefix_caching:
            raise InvalidConfigError(
                f"invalid simulation config: host_cache_blocks = {self.host_cache_blocks}: needs "
                "enable_prefix_caching", field="host_cache_blocks",
                value=self.host_cache_blocks, reason="needs enable_prefix_caching")
        for name in ("host_link_bytes_per_s", "prefill_tokens_per_s", "disk_bytes_per_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise InvalidConfigError(
                    f"invalid simulation config: {name} = {v!r}: must be a positive number",
                    field=name, value=v, reason="must be > 0")
        f = self.step_floor_s
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < float("inf"):
            raise InvalidConfigError(
                f"invalid simulation config: step_floor_s = {f!r}: must be a number >= 0",
                field="step_floor_s", value=f, reason="must be >= 0")
        wm = self.watermark_blocks
        if wm is not None and (isinstance(wm, bool) or not isinstance(wm, int) or wm < 0):
            raise InvalidConfigError(
                f"invalid simulation config: watermark_blocks = {wm!r}: must be an integer >= 0",
                field="watermark_blocks", value=wm, reason="must be an integer >= 0",
            )


@dataclass
class PolicyResult:
    """What one policy (paged or contiguous) achieved on the workload."""

    policy: str
    steps: int = 0
    requests_served: int = 0
    output_tokens: int = 0
    peak_concurrency: int = 0
    mean_concurrency: float = 0.0
    kv_utilization_mean: float = 0.0
    kv_utilization_peak: float = 0.0
    waste_tokens_per_seq: float = 0.0
    waste_fraction: float = 0.0
    mean_queue_steps: float = 0.0
    mean_latency_steps: float = 0.0
    preemptions: int = 0
    #: Of ``preemptions``: sequences swapped out to the host pool / freed and recomputed.
    preemptions_swap: int = 0
    preemptions_recompute: int = 0
    #: Sequences swapped back in.
    swap_ins: int = 0
    recomputed_prompt_tokens: int = 0
    prefix_hit_ratio: float = 0.0
    blocks_saved_by_sharing_mean: float = 0.0
    blocks_saved_by_sharing_peak: int = 0
    cow_copies: int = 0
    evictions: int = 0
    max_concurrency_limit: int = 0
    #: Prompt tokens served at admission by each tier (``"gpu"``, ``"host"``, ``"disk"``; paged
    #: runs with a host tier only) over the prompt tokens admitted.
    prefix_hits_by_tier: dict[str, int] = field(default_factory=dict)
    admitted_prompt_tokens: int = 0
    #: Modelled time to first token per admission (prefill of the uncached tokens plus loads
    #: from the host and disk tiers at their rates; queueing excluded): mean and p90, seconds.
    modelled_ttft_mean_s: float = 0.0
    modelled_ttft_p90_s: float = 0.0
    #: Per-step series for plots: "concurrency", "utilization", "waiting".
    timeline: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def tokens_per_step(self) -> float:
        return self.output_tokens / self.steps if self.steps else 0.0

    @property
    def requests_per_step(self) -> float:
        return self.requests_served / self.steps if self.steps else 0.0


@dataclass
class SimResult:
    workload: WorkloadConfig
    sim: SimConfig
    watermark_blocks: int
    paged: PolicyResult
    contiguous: PolicyResult


# --------------------------------------------------------------------------------- bookkeeping

class _Sample:
    """The simulated executor's view of one sample: its request and the output it will produce."""

    __slots__ = ("group", "index", "out")

    def __init__(self, group: "_Group", index: int, out: list[int]) -> None:
        self.group = group
        self.index = index
        self.out = out


class _Group:
    """A request in flight: how many of its samples are still running."""

    __slots__ = ("req", "remaining", "first_admit")

    def __init__(self, req: Request) -> None:
        self.req = req
        self.remaining = len(req.outputs)
        self.first_admit = -1


class _Progress:
    """A tqdm bar on stderr, or nothing."""

    def __init__(self, enabled: bool, total: int, desc: str) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr,
                            dynamic_ncols=True, mininterval=0.25, disable=None)

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def _check_capacity(workload: WorkloadConfig, sim: SimConfig, watermark: int) -> None:
    """Refuse pools that cannot finish every request; a livelock is worse than an error."""
    per_seq = _blocks_for(workload.max_model_len, sim.block_size)
    need = workload.n_samples * per_seq + watermark
    if need > sim.num_blocks:
        raise CapacityError(
            f"pool of {sim.num_blocks} blocks cannot guarantee progress: a request needs up to "
            f"n_samples {workload.n_samples} × ceil(max_model_len {workload.max_model_len} / "
            f"block_size {sim.block_size}) = {workload.n_samples * per_seq} blocks, plus the "
            f"watermark reserve of {watermark}; lower --max-model-len or enlarge the pool"
        )
    if sim.max_num_seqs < workload.n_samples:
        raise InvalidConfigError(
            f"invalid simulation config: max_num_seqs = {sim.max_num_seqs}: must be >= n_samples "
            f"({workload.n_samples}) so one request fits in a batch",
            field="max_num_seqs", value=sim.max_num_seqs, reason="must be >= n_samples",
        )


def _physical_tokens(mgr: Any, seqs: list[tuple[int, int]], used_blocks: int) -> int:
    """Token slots holding live KV, each block counted once however many sequences share it.

    ``seqs`` lists every live ``(seq_id, length)`` and ``used_blocks`` is the number of blocks they
    hold. Every held block is full except a sequence's tail; a partly filled tail can still be
    shared after a fork, so the unused slots are subtracted once per distinct tail block.
    """
    B = mgr.block_size
    tails: dict[int, int] = {}
    for seq_id, length in seqs:
        rem = length % B
        if rem:
            tails[mgr.block_table(seq_id)[-1]] = rem
    return used_blocks * B - sum(B - rem for rem in tails.values())


# ---------------------------------------------------------------------------------------- paged

def _simulate_paged(requests: list[Request], workload: WorkloadConfig, sim: SimConfig,
                    progress: bool, *, model_ttft: bool = False) -> tuple[PolicyResult, int]:
    """The paged run: the engine's scheduler with a simulated executor in place of a model.

    The executor "samples" each sequence's next token from the workload's predetermined outputs;
    a request with ``n_samples > 1`` forks its other samples once its prompt is computed, exactly
    as the engine does.
    """
    from .buffers import StepBuffers
    from .manager import BlockManager
    from .scheduler import Scheduler, Sequence

    B = sim.block_size
    max_blocks = _blocks_for(workload.max_model_len, B)
    host_blocks = sim.num_host_blocks + sim.host_cache_blocks
    extra: dict[str, Any] = {"num_host_blocks": host_blocks} if host_blocks else {}
    if sim.host_cache_blocks:
        extra["host_cache"] = True
    mgr = BlockManager(
        sim.num_blocks, B,
        watermark_blocks=sim.watermark_blocks,
        max_blocks_per_seq=max_blocks,
        enable_prefix_caching=sim.enable_prefix_caching,
        **extra,
    )
    if sim.num_host_blocks and sim.preemption_mode == "auto":
        from .manager import CostModel

        mgr.cost_model = CostModel(host_link_bytes_per_s=sim.host_link_bytes_per_s,
                                   prefill_tokens_per_s=sim.prefill_tokens_per_s,
                                   kv_bytes_per_token=float(sim.kv_bytes_per_token),
                                   step_floor_s=float(sim.step_floor_s),
                                   max_step_tokens=sim.max_prefill_tokens)
    _check_capacity(workload, sim, mgr.watermark_blocks)
    # Prompt tokens of one step, plus one decode for every sequence the batch can hold: the same
    # prefill budget the contiguous run gets, with decodes never crowding it out.
    budget = sim.max_prefill_tokens + sim.max_num_seqs
    # The step buffers a real engine would hand to its kernels. Building each step is what offers
    # newly full blocks to the prefix cache and drains the copy-on-write queue.
    # Swap lists as long as the pool, as the engine's: every device block may move in one step.
    mgr.attach_buffers(StepBuffers(sim.max_num_seqs, max(budget, workload.max_model_len), max_blocks,
                                   max_copies=sim.max_num_seqs, device="cpu", backend="numpy",
                                   max_swaps=max(2 * max_blocks, sim.num_blocks)))
    tiers = None
    if sim.host_cache_blocks or model_ttft:
        from .tiers.model import ModelledDiskTier

        tiers = ModelledDiskTier(mgr, sim.disk_cache_blocks, host_cache=bool(sim.host_cache_blocks),
                                 block_size=B,
                                 block_bytes=sim.kv_bytes_per_token * B,
                                 prefill_tokens_per_s=sim.prefill_tokens_per_s,
                                 host_bytes_per_s=sim.host_link_bytes_per_s,
                                 disk_bytes_per_s=sim.disk_bytes_per_s)
    # A host tier alone does not make preemption swap.
    sched = Scheduler(mgr, max_num_seqs=sim.max_num_seqs, max_num_batched_tokens=budget,
                      preemption_mode=sim.preemption_mode, admission_gate=tiers,
                      can_swap=None if sim.num_host_blocks else False)
    capacity = sim.num_blocks * B
    sharing = workload.sharing
    n_req = len(requests)

    next_arrival = 0
    next_seq_id = 0
    finished = 0
    step = 0

    res = PolicyResult(policy="paged", max_concurrency_limit=sim.max_num_seqs)
    conc_series: list[int] = []
    util_series: list[float] = []
    wait_series: list[int] = []
    sum_util = 0.0
    seq_steps = 0
    sum_waste = 0
    sum_alloc_slots = 0
    sum_saved = 0
    sum_queue = 0
    sum_latency = 0
    step_copies = 0
    bar = _Progress(progress, n_req, "paged")

    while finished < n_req:
        while next_arrival < n_req and requests[next_arrival].arrival_step <= step:
            req = requests[next_arrival]
            g = _Group(req)
            seq = Sequence(next_seq_id, req.prompt.tolist(), request_id=str(req.req_id))
            seq.n = len(req.outputs)
            seq.data = _Sample(g, 0, req.outputs[0])
            next_seq_id += 1
            sched.add(seq)
            next_arrival += 1

        batch = sched.schedule()
        if tiers is not None:
            tiers.drain()
        if batch.step is not None:
            step_copies += batch.step.num_copies
        # The simulated executor: each sequence whose known tokens are all computed now emits the
        # next token of its predetermined output.
        sampled: list[Optional[int]] = []
        forks: list[Sequence] = []
        for s, done in zip(batch.seqs, batch.sample_mask()):
            smp = s.data
            if smp.group.first_admit < 0:
                smp.group.first_admit = step
                sum_queue += step - smp.group.req.arrival_step
            if not done:
                sampled.append(None)
                continue
            sampled.append(smp.out[s.num_output_tokens])
            if smp.index == 0 and s.num_output_tokens == 0 and len(smp.group.req.outputs) > 1:
                forks.append(s)
        sched.postprocess(batch, sampled)
        children: list[Sequence] = []
        for parent in forks:
            g = parent.data.group
            for i in range(1, len(g.req.outputs)):
                child = Sequence(next_seq_id, [0])
                next_seq_id += 1
                child.data = _Sample(g, i, g.req.outputs[i])
                sched.fork(parent, child)
                child.append_token(g.req.outputs[i][0])
                children.append(child)

        # Measure: every running sequence's manager length is its computed token count.
        n_seqs = 0
        logical_tokens = 0
        logical_blocks = 0
        waste = 0
        for s in sched.running:
            length = s.num_computed_tokens
            nb = -(-length // B)
            logical_tokens += length
            logical_blocks += nb
            waste += nb * B - length
            n_seqs += 1
        used_blocks = sim.num_blocks - mgr.num_free_blocks
        if sharing:
            physical_tokens = _physical_tokens(
                mgr, [(s.seq_id, s.num_computed_tokens) for s in sched.running], used_blocks)
        else:
            physical_tokens = logical_tokens
        util = physical_tokens / capacity
        conc_series.append(n_seqs)
        util_series.append(util)
        wait_series.append(sched.num_waiting)
        sum_util += util
        seq_steps += n_seqs
        sum_waste += waste
        sum_alloc_slots += used_blocks * B
        saved = logical_blocks - used_blocks
        sum_saved += saved
        if saved > res.blocks_saved_by_sharing_peak:
            res.blocks_saved_by_sharing_peak = saved
        if util > res.kv_utilization_peak:
            res.kv_utilization_peak = util
        if n_seqs > res.peak_concurrency:
            res.peak_concurrency = n_seqs

        # Retire sequences that produced their last token (only a sampled or forked one can have).
        done = [s for s, t in zip(batch.seqs, sampled)
                if t is not None and s.num_output_tokens >= len(s.data.out)]
        done += [c for c in children if c.num_output_tokens >= len(c.data.out)]
        if done:
            sched.finish_many(done)
            for s in done:
                g = s.data.group
                g.remaining -= 1
                res.output_tokens += len(s.data.out)
                if g.remaining == 0:
                    finished += 1
                    res.requests_served += 1
                    sum_latency += step + 1 - g.req.arrival_step
                    bar.update()

        step += 1
        if sim.check_every and step % sim.check_every == 0:
            mgr.check_invariants()

    bar.close()
    mgr.check_invariants()
    stats = mgr.stats()
    res.steps = step
    res.preemptions = sched.num_preemptions
    res.preemptions_swap = sched.num_preemptions_by_mode["swap"]
    res.preemptions_recompute = sched.num_preemptions_by_mode["recompute"]
    res.swap_ins = sched.num_swap_ins
    res.recomputed_prompt_tokens = sched.num_recomputed_tokens
    res.mean_concurrency = seq_steps / step
    res.kv_utilization_mean = sum_util / step
    res.waste_tokens_per_seq = sum_waste / seq_steps if seq_steps else 0.0
    res.waste_fraction = 1.0 - (sum_util * capacity) / sum_alloc_slots if sum_alloc_slots else 0.0
    res.blocks_saved_by_sharing_mean = sum_saved / step
    res.mean_queue_steps = sum_queue / n_req
    res.mean_latency_steps = sum_latency / n_req
    res.prefix_hit_ratio = float(stats.prefix_hit_ratio)
    res.cow_copies = step_copies
    res.evictions = int(stats.evictions)
    if tiers is not None:
        ts = tiers.stats
        res.prefix_hits_by_tier = dict(ts.hit_tokens)
        res.admitted_prompt_tokens = ts.prompt_tokens
        if ts.ttft_s:
            ordered = sorted(ts.ttft_s)
            res.modelled_ttft_mean_s = float(np.mean(ordered))
            res.modelled_ttft_p90_s = ordered[int(0.9 * (len(ordered) - 1))]
    res.timeline = {
        "concurrency": np.asarray(conc_series, dtype=np.int32),
        "utilization": np.asarray(util_series, dtype=np.float32),
        "waiting": np.asarray(wait_series, dtype=np.int32),
    }
    if len(mgr) != 0 or mgr.num_free_blocks != sim.num_blocks:
        raise InvariantViolationError(
            f"simulation ended with {len(mgr)} live sequences and {mgr.num_free_blocks} of "
            f"{sim.num_blocks} blocks free: blocks leaked",
            detail="leak",
        )
    return res, mgr.watermark_blocks


# ----------------------------------------------------------------------------------- contiguous

def simulate_contiguous(requests: list[Request], workload: WorkloadConfig, sim: SimConfig,
                        progress: bool = False) -> PolicyResult:
    """The same workload under contiguous max-length reservation in the same memory.

    Every sequence reserves ``max_model_len`` slots at admission, so ``floor(num_blocks ×
    block_size / max_model_len)`` run at once (and at most ``max_num_seqs``). Same FCFS order and
    prompt budget as the paged run; no sharing, no preemption.
    """
    capacity = sim.num_blocks * sim.block_size
    mml = workload.max_model_len
    slots = min(capacity // mml, sim.max_num_seqs)
    res = PolicyResult(policy="contiguous", max_concurrency_limit=slots)
    n_req = len(requests)
    if slots < workload.n_samples:
        raise CapacityError(
            f"contiguous reservation of max_model_len {mml} tokens per sequence fits {slots} "
            f"sequences in {capacity} token slots; a request needs {workload.n_samples}"
        )
    waiting: deque[Request] = deque()
    # Heap of (last step, req_id, sample's length term): the sample runs on steps
    # [admit, admit + out_len) — prefill, then decodes — and holds prompt + t − admit tokens after
    # step t, so the batch's total length is base + count × t with base = Σ (prompt − admit).
    finishing: list[tuple[int, int, int]] = []
    remaining = {}
    base = 0
    count = 0
    next_arrival = 0
    finished = 0
    step = 0
    conc_series: list[int] = []
    util_series: list[float] = []
    wait_series: list[int] = []
    sum_util = 0.0
    seq_steps = 0
    sum_tokens = 0
    sum_queue = 0
    sum_latency = 0
    bar = _Progress(progress, n_req, "contiguous")
    while finished < n_req:
        while next_arrival < n_req and requests[next_arrival].arrival_step <= step:
            waiting.append(requests[next_arrival])
            next_arrival += 1
        budget = sim.max_prefill_tokens
        admitted_any = False
        while waiting:
            req = waiting[0]
            n = len(req.outputs)
            if count + n > slots or (admitted_any and req.prompt_len > budget):
                break
            waiting.popleft()
            budget -= req.prompt_len
            admitted_any = True
            sum_queue += step - req.arrival_step
            remaining[req.req_id] = (n, req.arrival_step)
            for out in req.outputs:
                heapq.heappush(finishing, (step + len(out) - 1, req.req_id, req.prompt_len - step))
                base += req.prompt_len - step
                count += 1
                res.output_tokens += len(out)
        tokens = base + count * step
        util = tokens / capacity
        conc_series.append(count)
        util_series.append(util)
        wait_series.append(len(waiting))
        sum_util += util
        seq_steps += count
        sum_tokens += tokens
        res.peak_concurrency = max(res.peak_concurrency, count)
        res.kv_utilization_peak = max(res.kv_utilization_peak, util)
        while finishing and finishing[0][0] == step:
            _, req_id, term = heapq.heappop(finishing)
            base -= term
            count -= 1
            left, arrival = remaining[req_id]
            if left == 1:
                del remaining[req_id]
                finished += 1
                res.requests_served += 1
                sum_latency += step + 1 - arrival
                bar.update()
            else:
                remaining[req_id] = (left - 1, arrival)
        step += 1
    bar.close()
    res.steps = step
    res.mean_concurrency = seq_steps / step
    res.kv_utilization_mean = sum_util / step
    reserved = seq_steps * mml
    res.waste_tokens_per_seq = (reserved - sum_tokens) / seq_steps if seq_steps else 0.0
    res.waste_fraction = (reserved - sum_tokens) / reserved if reserved else 0.0
    res.mean_queue_steps = sum_queue / n_req
    res.mean_latency_steps = sum_latency / n_req
    res.timeline = {
        "concurrency": np.asarray(conc_series, dtype=np.int32),
        "utilization": np.asarray(util_series, dtype=np.float32),
        "waiting": np.asarray(wait_series, dtype=np.int32),
    }
    return res


# ------------------------------------------------------------------------------------ front end

def simulate(workload: WorkloadConfig, sim: SimConfig, *, progress: bool = False,
             record_timeline: bool = True) -> SimResult:
    """Run ``workload`` paged (through the real manager) and contiguous, in ``sim``'s pool.

    ``progress`` shows tqdm bars on stderr. ``record_timeline=False`` drops the per-step series
    from the result (they are always gathered; this only frees them).
    """
    if not isinstance(workload, WorkloadConfig) or not isinstance(sim, SimConfig):
        raise InvalidConfigError("simulate() takes a WorkloadConfig and a SimConfig")
    requests = generate(workload)
    paged, watermark = _simulate_paged(requests, workload, sim, progress)
    contiguous = simulate_contiguous(requests, workload, sim, progress)
    if not record_timeline:
        paged.timeline, contiguous.timeline = {}, {}
    return SimResult(workload=workload, sim=sim, watermark_blocks=watermark,
                     paged=paged, contiguous=contiguous)


def _r(x: float) -> float:
    return round(float(x), 6)


def result_dict(result: SimResult, *, model: Optional[str] = None, spec: Optional[CacheSpec] = None,
                memory: Optional[MemoryBudget] = None) -> dict[str, Any]:
    """A flat JSON-ready dict: headline keys first, then each policy's figures, then the config."""
    p, c = result.paged, result.contiguous
    out: dict[str, Any] = {
        "requests": result.workload.num_requests,
        "num_blocks": result.sim.num_blocks,
        "block_size": result.sim.block_size,
        "token_capacity": result.sim.num_blocks * result.sim.block_size,
        "watermark_blocks": result.watermark_blocks,
        "max_model_len": result.workload.max_model_len,
        "contiguous_slots": c.max_concurrency_limit,
        "peak_concurrency_paged": p.peak_concurrency,
        "peak_concurrency_contiguous": c.peak_concurrency,
        "mean_concurrency_paged": _r(p.mean_concurrency),
        "mean_concurrency_contiguous": _r(c.mean_concurrency),
        "kv_utilization_mean": _r(p.kv_utilization_mean),
        "kv_utilization_peak": _r(p.kv_utilization_peak),
        "kv_utilization_mean_contiguous": _r(c.kv_utilization_mean),
        "kv_utilization_peak_contiguous": _r(c.kv_utilization_peak),
        "waste_tokens_per_seq_paged": _r(p.waste_tokens_per_seq),
        "waste_tokens_per_seq_contiguous": _r(c.waste_tokens_per_seq),
        "waste_fraction_paged": _r(p.waste_fraction),
        "waste_fraction_contiguous": _r(c.waste_fraction),
        "preemptions": p.preemptions,
        "preemptions_swap": p.preemptions_swap,
        "preemptions_recompute": p.preemptions_recompute,
        "swap_ins": p.swap_ins,
        "recomputed_prompt_tokens": p.recomputed_prompt_tokens,
        "prefix_hit_ratio": _r(p.prefix_hit_ratio),
        "blocks_saved_by_sharing": _r(p.blocks_saved_by_sharing_mean),
        "blocks_saved_by_sharing_peak": p.blocks_saved_by_sharing_peak,
        "cow_copies": p.cow_copies,
        "evictions": p.evictions,
        "steps_paged": p.steps,
        "steps_contiguous": c.steps,
        "output_tokens": p.output_tokens,
        "tokens_per_step_paged": _r(p.tokens_per_step),
        "tokens_per_step_contiguous": _r(c.tokens_per_step),
        "requests_per_step_paged": _r(p.requests_per_step),
        "requests_per_step_contiguous": _r(c.requests_per_step),
        "mean_queue_steps_paged": _r(p.mean_queue_steps),
        "mean_queue_steps_contiguous": _r(c.mean_queue_steps),
        "mean_latency_steps_paged": _r(p.mean_latency_steps),
        "mean_latency_steps_contiguous": _r(c.mean_latency_steps),
        "workload": asdict(result.workload),
        "sim": asdict(result.sim),
    }
    if model is not None:
        out["model"] = model
    if spec is not None:
        out["spec"] = asdict(spec)
        out["bytes_per_block"] = spec.bytes_per_block
    if memory is not None:
        out["memory"] = asdict(memory)
    return out


def result_json(result: SimResult, **kwargs: Any) -> str:
    """:func:`result_dict` as one JSON object."""
    return json.dumps(result_dict(result, **kwargs), indent=2)


def format_report(result: SimResult, *, model: Optional[str] = None, spec: Optional[CacheSpec] = None,
                  memory: Optional[MemoryBudget] = None) -> str:
    """The human-readable report: the setup, then paged and contiguous side by side."""
    w, s, p, c = result.workload, result.sim, result.paged, result.contiguous
    lines = []
    if model is not None and spec is not None:
        pool = f"{format_bytes(s.num_blocks * spec.bytes_per_block)}, "
        lines.append(f"model      {model}: {format_bytes(spec.bytes_per_token)}/token, "
                     f"{format_bytes(spec.bytes_per_block)}/block ({spec.dtype})")
    else:
        pool = ""
    if memory is not None:
        lines.append(f"memory     {format_bytes(memory.total_bytes)} × {memory.utilization} − weights "
                     f"{format_bytes(memory.weights_bytes)} − activations "
                     f"{format_bytes(memory.activation_peak_bytes)} − graphs "
                     f"{format_bytes(memory.graph_reserve_bytes)}")
    lines.append(f"pool       {s.num_blocks:,} blocks × {s.block_size} = {s.num_blocks * s.block_size:,} "
                 f"token slots ({pool}watermark {result.watermark_blocks} blocks)")
    shape = (f"prompts log-normal median {w.prompt_median:g} σ {w.prompt_sigma:g}, outputs median "
             f"{w.output_median:g} σ {w.output_sigma:g}, max_model_len {w.max_model_len}")
    lines.append(f"workload   {w.num_requests} requests, Poisson {w.arrival_rate:g}/step, seed {w.seed}")
    lines.append(f"           {shape}")
    if w.num_prefixes:
        lines.append(f"           {w.num_prefixes} shared prefixes × {w.prefix_len} tokens on "
                     f"{w.prefix_fraction:.0%} of requests")
    if w.n_samples > 1:
        lines.append(f"           {w.n_samples} parallel samples per request")
    lines.append("")
    rows = [
        ("", "paged", "contiguous"),
        ("concurrency limit", f"{p.max_concurrency_limit} (max_num_seqs)", f"{c.max_concurrency_limit}"),
        ("peak concurrency", f"{p.peak_concurrency}", f"{c.peak_concurrency}"),
        ("mean concurrency", f"{p.mean_concurrency:.1f}", f"{c.mean_concurrency:.1f}"),
        ("KV utilization mean", f"{p.kv_utilization_mean:.1%}", f"{c.kv_utilization_mean:.1%}"),
        ("KV utilization peak", f"{p.kv_utilization_peak:.1%}", f"{c.kv_utilization_peak:.1%}"),
        ("waste slots / seq", f"{p.waste_tokens_per_seq:.1f}", f"{c.waste_tokens_per_seq:.1f}"),
        ("waste fraction", f"{p.waste_fraction:.1%}", f"{c.waste_fraction:.1%}"),
        ("preemptions", f"{p.preemptions} (swap {p.preemptions_swap}, recompute "
                        f"{p.preemptions_recompute})", "0"),
        ("steps to finish", f"{p.steps:,}", f"{c.steps:,}"),
        ("tokens / step", f"{p.tokens_per_step:.2f}", f"{c.tokens_per_step:.2f}"),
        ("requests / step", f"{p.requests_per_step:.4f}", f"{c.requests_per_step:.4f}"),
        ("mean queueing (steps)", f"{p.mean_queue_steps:.0f}", f"{c.mean_queue_steps:.0f}"),
        ("mean latency (steps)", f"{p.mean_latency_steps:.0f}", f"{c.mean_latency_steps:.0f}"),
    ]
    if w.sharing or p.prefix_hit_ratio:
        rows.append(("prefix hit ratio", f"{p.prefix_hit_ratio:.1%}", "—"))
    if w.sharing:
        rows += [
            ("blocks saved by sharing", f"{p.blocks_saved_by_sharing_mean:.1f} mean, "
                                        f"{p.blocks_saved_by_sharing_peak} peak", "—"),
            ("copy-on-write copies", f"{p.cow_copies}", "—"),
        ]
    if p.recomputed_prompt_tokens:
        rows.append(("recomputed prompt tokens", f"{p.recomputed_prompt_tokens:,}", "—"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for i, r in enumerate(rows):
        lines.append(f"{r[0].ljust(widths[0])}  {r[1].rjust(widths[1])}  {r[2].rjust(widths[2])}")
        if i == 0:
            lines.append("  ".join("-" * wd for wd in widths))
    if c.steps and p.steps:
        lines.append("")
        lines.append(f"paged finishes in {p.steps / c.steps:.2f}× the contiguous steps "
                     f"({c.steps / p.steps:.1f}× the throughput) in the same memory")
    return "\n".join(lines)


def plot_timeline(result: SimResult, path: str) -> None:
    """Write a PNG of KV utilization and concurrency over time for both policies."""
    p, c = result.paged, result.contiguous
    if not p.timeline or not c.timeline:
        raise InvalidConfigError("this result holds no timeline; run simulate(record_timeline=True)")
    from ._optional import require

    require("matplotlib", "plot_timeline")  # one-line error naming pagedkv[plot] when absent
    # The object-oriented API with an Agg canvas: no pyplot, no global backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 6.5))
    FigureCanvasAgg(fig)
    ax_u, ax_c = fig.subplots(2, 1, sharex=True)
    for res, color in ((p, "tab:blue"), (c, "tab:orange")):
        steps = np.arange(len(res.timeline["utilization"]))
        ax_u.plot(steps, 100 * res.timeline["utilization"], color=color, lw=0.8, label=res.policy)
        ax_c.plot(steps, res.timeline["concurrency"], color=color, lw=0.8, label=res.policy)
    reserved = c.timeline["concurrency"] * result.workload.max_model_len
    capacity = result.sim.num_blocks * result.sim.block_size
    ax_u.plot(np.arange(len(reserved)), 100 * reserved / capacity, color="tab:orange", lw=0.8,
              ls="--", label="contiguous, reserved")
    ax_u.set_ylabel("KV utilization (%)")
    ax_u.set_ylim(0, 105)
    ax_c.set_ylabel("running sequences")
    ax_c.set_xlabel("scheduler step")
    ax_u.legend(loc="center right")
    ax_u.set_title(f"{result.workload.num_requests} requests, {result.sim.num_blocks} blocks × "
                   f"{result.sim.block_size} tokens, max_model_len {result.workload.max_model_len}")
    for ax in (ax_u, ax_c):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise InvalidConfigError(f"cannot write plot {path}: {exc}") from None


# ------------------------------------------------------------------------------------ tier sweep

@dataclass
class TierPoint:
    """One paged run of a tier sweep: the tier sizes and what they served."""

    host_cache_blocks: int
    disk_cache_blocks: int
    prefix_hit_ratio: float
    hits_by_tier: dict[str, float]
    modelled_ttft_mean_s: float
    modelled_ttft_p90_s: float
    steps: int
    evictions: int


def simulate_tiers(workload: WorkloadConfig, sim: SimConfig, host_blocks: list[int],
                   disk_blocks: list[int], *, progress: bool = False) -> list[TierPoint]:
    """The paged run of ``workload`` for every (host, disk) tier size pair, the same requests
    each time: hit ratio by tier (fraction of admitted prompt tokens) and modelled TTFT. A host size
    of 0 runs without tiers (its TTFT modelled as the prefill of what the GPU pool missed)."""
    from dataclasses import replace

    if not isinstance(workload, WorkloadConfig) or not isinstance(sim, SimConfig):
        raise InvalidConfigError("simulate_tiers() takes a WorkloadConfig and a SimConfig")
    requests = generate(workload)
    points: list[TierPoint] = []
    for h in host_blocks:
        for d in disk_blocks:
            if d and not h:
                continue
            # A host size of 0 is the plain pool; the gate still models its TTFT.
            cfg = replace(sim, host_cache_blocks=h, disk_cache_blocks=d)
            res, _ = _simulate_paged(requests, workload, cfg, progress, model_ttft=True)
            total = res.admitted_prompt_tokens
            hits = {k: v / total if total else 0.0 for k, v in res.prefix_hits_by_tier.items()}
            points.append(TierPoint(h, d, sum(hits.values()), hits, res.modelled_ttft_mean_s,
                                    res.modelled_ttft_p90_s, res.steps, res.evictions))
    return points


def format_tier_sweep(points: list[TierPoint], sim: SimConfig) -> str:
    """A table of a tier sweep: sizes, hit ratio by tier, modelled TTFT."""
    block_bytes = sim.kv_bytes_per_token * sim.block_size
    lines = [f"tier sweep: GPU pool {sim.num_blocks} blocks ({format_bytes(sim.num_blocks * block_bytes)}); "
             f"TTFT modelled at {sim.prefill_tokens_per_s:g} prefill tok/s, host link "
             f"{sim.host_link_bytes_per_s / 1e9:g} GB/s, disk {sim.disk_bytes_per_s / 1e9:g} GB/s",
             f"{'host':>10} {'disk':>10} {'hit ratio':>9} {'gpu':>6} {'host':>6} {'disk':>6} "
             f"{'TTFT mean':>10} {'TTFT p90':>10}"]
    for p in points:
        hb = format_bytes(p.host_cache_blocks * block_bytes) if p.host_cache_blocks else "-"
        db = format_bytes(p.disk_cache_blocks * block_bytes) if p.disk_cache_blocks else "-"
        t = p.hits_by_tier
        p90 = f"{p.modelled_ttft_p90_s * 1e3:8.1f}ms"
        lines.append(f"{hb:>10} {db:>10} {p.prefix_hit_ratio:9.1%} {t.get('gpu', 0):6.1%} "
                     f"{t.get('host', 0):6.1%} {t.get('disk', 0):6.1%} "
                     f"{p.modelled_ttft_mean_s * 1e3:8.1f}ms {p90:>10}")
    return "\n".join(lines)


def plot_tier_sweep(points: list[TierPoint], sim: SimConfig, path: str) -> None:
    """Hit ratio (stacked by tier) and modelled mean TTFT for each tier configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    block_bytes = sim.kv_bytes_per_token * sim.block_size
    labels = [(f"host {format_bytes(p.host_cache_blocks * block_bytes)}"
               if p.host_cache_blocks else "no tier")
              + (f"\ndisk {format_bytes(p.disk_cache_blocks * block_bytes)}"
                 if p.disk_cache_blocks else "") for p in points]
    x = np.arange(len(points))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(8, 1.4 * len(points) * 2), 4.5))
    bottom = np.zeros(len(points))
    for tier, color in (("gpu", "#4c72b0"), ("host", "#55a868"), ("disk", "#c44e52")):
        vals = np.array([p.hits_by_tier.get(tier, 0.0) for p in points])
        a1.bar(x, vals, bottom=bottom, label=tier, color=color)
        bottom += vals
    a1.set_xticks(x, labels, fontsize=8)
    a1.set_ylabel("prompt tokens served from cache")
    a1.set_ylim(0, 1)
    a1.legend()
    a1.set_title("prefix hit ratio by tier")
    a2.bar(x, [p.modelled_ttft_mean_s * 1e3 for p in points], color="#8172b2")
    a2.set_xticks(x, labels, fontsize=8)
    a2.set_ylabel("ms")
    a2.set_title("modelled mean TTFT (queueing excluded)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
