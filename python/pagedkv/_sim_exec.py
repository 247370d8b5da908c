"""The simulator's two policies over one request list: the paged run (the engine's
:class:`pagedkv.scheduler.Scheduler` over the real :class:`pagedkv.BlockManager`, with a simulated
executor that "samples" each sequence's predetermined output) and the contiguous max-length
reservation, plus their bookkeeping (samples, forked groups, progress bars, the capacity check).

Invariants: both runs are deterministic for a given (requests, workload, sim); the paged run checks
the manager's invariants at the end (and every ``check_every`` steps), frees every sequence and
raises :class:`pagedkv.errors.InvariantViolationError` if a block is left allocated. The extension
is imported when a run starts, not on import. Imported through :mod:`pagedkv.simulate`.
"""

from __future__ import annotations

import heapq
import sys
from collections import deque
from typing import Any, Optional

import numpy as np

from ._sim_config import PolicyResult, SimConfig
from .config import CapacityError
from .errors import InvalidConfigError, InvariantViolationError
from .workload import Request, WorkloadConfig



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


def _group_need(workload: WorkloadConfig, sim: SimConfig) -> int:
    """Pages one sample may hold at once in the grouped pool: every full group's whole table;
    every windowed group's decode peak plus one prefill chunk's blocks (a step computing a chunk
    holds its blocks until it is built), at most the whole table."""
    from .groups import peak_decode_blocks

    assert sim.groups is not None
    B, mml = sim.block_size, workload.max_model_len
    table = _blocks_for(mml, B)
    chunk = _blocks_for(min(sim.max_prefill_tokens, mml), B)
    return sum(table if kind == "full" else
               min(table, peak_decode_blocks((kind, size), mml, B) + chunk)
               for kind, size in sim.groups)


def _check_capacity(workload: WorkloadConfig, sim: SimConfig, watermark: int,
                    grouped: bool = False) -> None:
    """Refuse pools that cannot finish every request; a livelock is worse than an error."""
    if grouped:
        per_seq, pool, what = _group_need(workload, sim), sim.group_num_blocks, "pages"
        how = (f"its {len(sim.groups or ())} groups' peak (full tables, windows plus a prefill "
               "chunk)")
    else:
        per_seq, pool, what = _blocks_for(workload.max_model_len, sim.block_size), sim.num_blocks, "blocks"
        how = f"ceil(max_model_len {workload.max_model_len} / block_size {sim.block_size})"
    need = workload.n_samples * per_seq + watermark
    if need > pool:
        raise CapacityError(
            f"pool of {pool} {what} cannot guarantee progress: a request needs up to "
            f"n_samples {workload.n_samples} × {how} = {workload.n_samples * per_seq} {what}, "
            f"plus the watermark reserve of {watermark}; lower --max-model-len or enlarge the pool"
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
                    progress: bool, *, model_ttft: bool = False,
                    grouped: bool = False) -> tuple[PolicyResult, int]:
    """The paged run: the engine's scheduler with a simulated executor in place of a model.

    The executor "samples" each sequence's next token from the workload's predetermined outputs;
    a request with ``n_samples > 1`` forks its other samples once its prompt is computed, exactly
    as the engine does.

    ``grouped``: the manager has ``sim.groups`` over ``sim.group_num_blocks`` pages; KV
    utilization is then the share of pages held by live sequences (a page holds one group's
    layers, so token slots are not comparable across groups), and sharing is not measured.
    """
    from .buffers import StepBuffers
    from .manager import BlockManager
    from .scheduler import Scheduler, Sequence

    B = sim.block_size
    max_blocks = _blocks_for(workload.max_model_len, B)
    host_blocks = sim.num_host_blocks + sim.host_cache_blocks
    if grouped and host_blocks:
        # The same host memory in pages (a page holds one group's layers, not every layer).
        host_blocks = host_blocks * sim.group_num_blocks // sim.num_blocks
    extra: dict[str, Any] = {"num_host_blocks": host_blocks} if host_blocks else {}
    if sim.host_cache_blocks:
        extra["host_cache"] = True
    num_blocks = sim.group_num_blocks if grouped else sim.num_blocks
    num_groups = len(sim.groups or ()) if grouped else 1
    if grouped:
        extra["groups"] = sim.groups
    mgr = BlockManager(
        num_blocks, B,
        watermark_blocks=sim.watermark_blocks,
        max_blocks_per_seq=max_blocks,
        enable_prefix_caching=sim.enable_prefix_caching,
        **extra,
    )
    if sim.num_host_blocks and sim.preemption_mode == "auto":
        from .manager import CostModel

        # A swap moves pages: with groups, a page's bytes per token (the same memory over
        # `group_num_blocks` pages instead of `num_blocks` blocks).
        per_token = float(sim.kv_bytes_per_token)
        if grouped:
            per_token *= sim.num_blocks / sim.group_num_blocks
        mgr.cost_model = CostModel(host_link_bytes_per_s=sim.host_link_bytes_per_s,
                                   prefill_tokens_per_s=sim.prefill_tokens_per_s,
                                   kv_bytes_per_token=per_token,
                                   step_floor_s=float(sim.step_floor_s),
                                   max_step_tokens=sim.max_prefill_tokens)
    _check_capacity(workload, sim, mgr.watermark_blocks, grouped)
    # Prompt tokens of one step, plus one decode for every sequence the batch can hold: the same
    # prefill budget the contiguous run gets, with decodes never crowding it out.
    budget = sim.max_prefill_tokens + sim.max_num_seqs
    # The step buffers a real engine would hand to its kernels. Building each step is what offers
    # newly full blocks to the prefix cache and drains the copy-on-write queue.
    # Swap lists as long as the pool, as the engine's: every device block may move in one step.
    bufs = StepBuffers(sim.max_num_seqs, max(budget, workload.max_model_len), max_blocks,
                       max_copies=sim.max_num_seqs * num_groups, device="cpu",
                       backend="numpy", max_swaps=max(2 * max_blocks, num_blocks),
                       num_groups=num_groups)
    mgr.attach_buffers(bufs)
    tiers = None
    if sim.host_cache_blocks or model_ttft:
        from .tiers.model import ModelledDiskTier

        # With groups each loaded block is priced at its group's bytes (a page), not a whole
        # model's block.
        tiers = ModelledDiskTier(mgr, sim.disk_cache_blocks, host_cache=bool(sim.host_cache_blocks),
                                 block_size=B,
                                 block_bytes=sim.kv_bytes_per_token * B,
                                 group_block_bytes=sim.group_page_bytes() if grouped else None,
                                 prefill_tokens_per_s=sim.prefill_tokens_per_s,
                                 host_bytes_per_s=sim.host_link_bytes_per_s,
                                 disk_bytes_per_s=sim.disk_bytes_per_s)
    # A host tier alone does not make preemption swap.
    sched = Scheduler(mgr, max_num_seqs=sim.max_num_seqs, max_num_batched_tokens=budget,
                      preemption_mode=sim.preemption_mode, admission_gate=tiers,
                      can_swap=None if sim.num_host_blocks else False)
    capacity = num_blocks * B
    sharing = workload.sharing and not grouped
    n_req = len(requests)

    next_arrival = 0
    next_seq_id = 0
    finished = 0
    step = 0

    res = PolicyResult(policy="paged, groups" if grouped else "paged",
                       max_concurrency_limit=sim.max_num_seqs)
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
                # The loads this step's admissions queued: their modelled TTFT.
                tiers.step_built(bufs.views(batch.step, on_device=False).swap_in)
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
        used_blocks = num_blocks - mgr.num_free_blocks
        if grouped:
            physical_tokens = used_blocks * B  # pages held: the grouped pool's occupancy
            logical_blocks = used_blocks
        elif sharing:
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
        tiers.flush()
        ts = tiers.stats
        res.prefix_hits_by_tier = dict(ts.hit_tokens)
        res.tier_loaded_blocks = {k: list(v) for k, v in ts.loaded_blocks.items()}
        res.tier_loaded_bytes = dict(ts.loaded_bytes)
        priced = sum(map(sum, ts.loaded_blocks.values()))
        if priced != int(stats.host_loaded_blocks):
            raise InvariantViolationError(
                f"the modelled TTFT priced {priced} loaded blocks but the manager loaded "
                f"{stats.host_loaded_blocks} from its host tier", detail="tier loads")
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
    if len(mgr) != 0 or mgr.num_free_blocks != num_blocks:
        raise InvariantViolationError(
            f"simulation ended with {len(mgr)} live sequences and {mgr.num_free_blocks} of "
            f"{num_blocks} blocks free: blocks leaked",
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
