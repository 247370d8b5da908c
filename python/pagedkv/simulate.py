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

**Paged, groups** (a model with sliding-window or chunked layers, ``SimConfig.groups``) — the
paged run again, on a manager with the model's KV cache groups over the pages the same memory
holds (``SimConfig.group_num_blocks``, from :func:`pagedkv.config.size_groups`): windowed groups
release what their layers no longer read, so more sequences fit. The plain paged run is the same
model counted as full attention. The grouped run's KV utilization is the share of pages live
sequences hold; sharing is not measured there. With ``host_cache_blocks`` both paged runs have the
prefix cache's host tier (the grouped one the core's grouped tier, every group's pages, in the
same host memory); each reports prompt tokens served per tier, the blocks its admissions loaded
per tier and group, and a modelled TTFT that prices each loaded block at its group's bytes
(:mod:`pagedkv.tiers.model`).

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

This module drives the workload (:func:`simulate`) and is the simulator's public path; the parts
live in :mod:`pagedkv._sim_config` (configuration and results), :mod:`pagedkv._sim_exec` (the
simulated executor: the paged and contiguous runs), :mod:`pagedkv._sim_report` (JSON, text report,
timeline plot) and :mod:`pagedkv._sim_tiers` (the tier sweep), each re-exported here.
"""

from __future__ import annotations

from ._sim_config import PolicyResult, SimConfig, SimResult
from ._sim_exec import (
    _blocks_for,
    _check_capacity,
    _Group,
    _physical_tokens,
    _Progress,
    _Sample,
    _simulate_paged,
    simulate_contiguous,
)
from ._sim_report import _r, format_report, plot_timeline, result_dict, result_json
from ._sim_tiers import TierPoint, format_tier_sweep, plot_tier_sweep, simulate_tiers
from .errors import InvalidConfigError
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


# ------------------------------------------------------------------------------------ front end

def simulate(workload: WorkloadConfig, sim: SimConfig, *, progress: bool = False,
             record_timeline: bool = True) -> SimResult:
    """Run ``workload`` paged (through the real manager) and contiguous, in ``sim``'s pool; with
    ``sim.groups``, paged with KV cache groups too, in ``sim.group_num_blocks`` pages of the same
    memory.

    ``progress`` shows tqdm bars on stderr. ``record_timeline=False`` drops the per-step series
    from the result (they are always gathered; this only frees them).
    """
    if not isinstance(workload, WorkloadConfig) or not isinstance(sim, SimConfig):
        raise InvalidConfigError("simulate() takes a WorkloadConfig and a SimConfig")
    requests = generate(workload)
    paged, watermark = _simulate_paged(requests, workload, sim, progress)
    contiguous = simulate_contiguous(requests, workload, sim, progress)
    grouped = None
    if sim.groups is not None:
        grouped, _ = _simulate_paged(requests, workload, sim, progress, grouped=True)
    if not record_timeline:
        paged.timeline, contiguous.timeline = {}, {}
        if grouped is not None:
            grouped.timeline = {}
    return SimResult(workload=workload, sim=sim, watermark_blocks=watermark,
                     paged=paged, contiguous=contiguous, grouped=grouped)
