"""The simulator's inputs and results: :class:`SimConfig` (the pool and the scheduler's limits,
validated on construction), :class:`PolicyResult` (what one policy achieved) and :class:`SimResult`
(both policies on one workload).

Invariants: a constructed :class:`SimConfig` holds only valid values (bad ones raise
:class:`pagedkv.errors.InvalidConfigError` naming the field); the results are plain data, filled by
:mod:`pagedkv._sim_exec` and read by the reports. Imported through :mod:`pagedkv.simulate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

import numpy as np

from ._checks import DEFAULT_BLOCK_SIZE, check_block_size
from .errors import InvalidConfigError
from .workload import WorkloadConfig


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
    #: Host KV blocks for swapped-out sequences (0: every preemption recomputes). With
    #: ``groups`` the grouped run gets the same host memory in pages
    #: (``num_host_blocks * group_num_blocks // num_blocks``).
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
    #: Host blocks of the prefix cache's host tier (0: none); added to ``num_host_blocks``. With
    #: ``groups`` the grouped run's host tier keeps every group's pages (the core's grouped
    #: host tier) in the same host memory.
    host_cache_blocks: int = 0
    #: Blocks of the modelled disk tier under the host tier (0: none; needs a host tier; not
    #: with ``groups``).
    disk_cache_blocks: int = 0
    #: The disk tier's read rate for the modelled TTFT.
    disk_bytes_per_s: float = 3e9
    #: KV cache groups of a model with sliding-window or chunked layers, ``(kind, size)`` each,
    #: group 0 full (:attr:`pagedkv.config.GroupSizing.groups`); with :attr:`group_num_blocks`,
    #: :func:`pagedkv.simulate.simulate` adds a paged run with these groups in a pool of that many
    #: pages (the same memory as ``num_blocks`` full-attention blocks). ``None``: no such run.
    groups: Optional[Tuple[Tuple[str, int], ...]] = None
    #: Pages of the grouped pool (0 without :attr:`groups`).
    group_num_blocks: int = 0
    #: KV bytes one block of each group moves between tiers, group 0 first (the modelled TTFT
    #: prices each loaded block at its group's size; the CLI gives the page's,
    #: :attr:`pagedkv.config.GroupSizing.page_bytes`). ``None``: :meth:`group_page_bytes`.
    group_block_bytes: Optional[Tuple[int, ...]] = None

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
        self._check_groups()
        self._check_group_tiers()
        wm = self.watermark_blocks
        if wm is not None and (isinstance(wm, bool) or not isinstance(wm, int) or wm < 0):
            raise InvalidConfigError(
                f"invalid simulation config: watermark_blocks = {wm!r}: must be an integer >= 0",
                field="watermark_blocks", value=wm, reason="must be an integer >= 0",
            )


    def _check_groups(self) -> None:
        g, n = self.groups, self.group_num_blocks
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidConfigError(
                f"invalid simulation config: group_num_blocks = {n!r}: must be an integer >= 0",
                field="group_num_blocks", value=n, reason="must be an integer >= 0")
        if g is None:
            if n:
                raise InvalidConfigError(
                    f"invalid simulation config: group_num_blocks = {n}: needs groups",
                    field="group_num_blocks", value=n, reason="needs groups")
            return
        from ._config_model import normalize_layer_kinds

        if not isinstance(g, (tuple, list)) or not g:
            raise InvalidConfigError(
                f"invalid simulation config: groups = {g!r}: must list (kind, size) pairs",
                field="groups", value=g, reason="must list (kind, size) pairs")
        object.__setattr__(self, "groups", normalize_layer_kinds(g, len(g)))
        assert self.groups is not None
        if self.groups[0][0] != "full" and any(k == "full" for k, _ in self.groups):
            raise InvalidConfigError(
                f"invalid simulation config: groups[0] = {self.groups[0]!r}: group 0 must be full "
                "when some group is", field="groups", value=g,
                reason="group 0 must be full when some group is")
        if n < 1:
            raise InvalidConfigError(
                f"invalid simulation config: group_num_blocks = {n}: groups need a pool of >= 1 "
                "page", field="group_num_blocks", value=n, reason="must be >= 1 with groups")

    def _check_group_tiers(self) -> None:
        """The tiers with groups: the host tier indexes every group's blocks (the core's), the
        modelled disk one group's chain only; ``group_block_bytes`` one size per group."""
        sizes, g = self.group_block_bytes, self.groups
        if sizes is not None:
            ok = (g is not None and isinstance(sizes, (tuple, list)) and len(sizes) == len(g)
                  and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1
                          for b in sizes))
            if not ok:
                want = f"{len(g)} sizes" if g is not None else "groups"
                raise InvalidConfigError(
                    f"invalid simulation config: group_block_bytes = {sizes!r}: must give one "
                    f"integer >= 1 per KV cache group (needs {want})", field="group_block_bytes",
                    value=sizes, reason="one size >= 1 per group")
            object.__setattr__(self, "group_block_bytes", tuple(sizes))
        if g is not None and self.disk_cache_blocks:
            raise InvalidConfigError(
                f"invalid simulation config: disk_cache_blocks = {self.disk_cache_blocks} with "
                f"{len(g)} KV cache groups: the modelled disk tier holds one group's blocks, as "
                "the engine's (host_cache_blocks and num_host_blocks work with groups)",
                field="disk_cache_blocks", value=self.disk_cache_blocks,
                reason="no disk tier with groups")

    def group_page_bytes(self) -> Tuple[int, ...]:
        """Bytes one block of each group moves between tiers: :attr:`group_block_bytes`, else
        every group's a page of the same memory (``kv_bytes_per_token × block_size ×
        num_blocks // group_num_blocks``). Empty without groups."""
        if self.groups is None:
            return ()
        if self.group_block_bytes is not None:
            return self.group_block_bytes
        page = self.kv_bytes_per_token * self.block_size * self.num_blocks // self.group_num_blocks
        return (max(1, page),) * len(self.groups)


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
    #: Blocks the admissions loaded from each tier (``"host"``, ``"disk"``), one count per KV
    #: cache group (one entry without groups), and the bytes they moved (each group's blocks at
    #: their size): what the modelled TTFT prices.
    tier_loaded_blocks: dict[str, list[int]] = field(default_factory=dict)
    tier_loaded_bytes: dict[str, int] = field(default_factory=dict)
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
    #: The paged run with KV cache groups (``sim.groups``) in the same memory, else ``None``.
    grouped: Optional[PolicyResult] = None
