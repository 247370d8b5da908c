"""Pool sizing and byte sizes: how much of a device's memory the KV pool gets, in blocks.

Owns :class:`CapacityError`, :class:`MemoryBudget` / :func:`num_blocks_for` (``floor((total ×
utilization − weights − activation peak − graph reserve) / bytes_per_block)``), the group-aware
sizing :class:`GroupSizing` / :func:`size_groups`, and :func:`parse_bytes` / :func:`format_bytes`
(``"80GiB"``-style sizes for the CLI). Re-exported by :mod:`pagedkv.config`.

**Group-aware sizing.** A model whose layers mix attention kinds (Gemma 3: five sliding layers of
window 1024 per full one; gpt-oss: sliding 128 and full alternating) runs with KV cache groups
(``docs/architecture.md``, "KV cache groups"): the layers are cut by
:func:`pagedkv.layer_groups.group_layers` into groups of :attr:`LayerGrouping.slots` layers, and
one pool of uniform pages serves every group, a page holding one group's ``slots`` layers for
``block_size`` tokens. So:

- page bytes = ``slots × layer_bytes_per_token × block_size`` (``layer_bytes_per_token`` = one
  layer's K and V for one token); pool pages = ``floor(kv_bytes / page_bytes)``;
- a sequence of ``L`` tokens needs ``Σ_g peak_decode_blocks(g, L)`` pages (the core's exact
  per-group peak: ``ceil(L / B)`` full, ``min(ceil(L / B), ceil((W - 1) / B) + 1)`` sliding);
  concurrency is ``floor(pages / need)``;
- the analytic optimum gives every layer exactly its own blocks: ``kv_bytes / (Σ_layers
  peak(kind, L) × layer_bytes_per_token × B)`` sequences (block-exact); the token-exact bound
  (``L`` tokens a full layer, ``min(L, W)`` a sliding one, no block rounding) is reported beside;
- full-attention accounting (the same model with every layer kept whole) fits
  ``floor(kv_bytes / (layers × layer_bytes_per_token × B)) / ceil(L / B)``.

**Invariants.** A :class:`MemoryBudget` and a :class:`GroupSizing` are immutable and validated on
construction; a budget that leaves no room for one block (page) raises :class:`CapacityError`,
bad input :class:`pagedkv.errors.InvalidConfigError`. Sizes are exact (``Fraction``), rounded
down. The extension is imported only when a group sizing is computed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple, Union

from ._config_spec import CacheSpec, _check_int
from .errors import InvalidConfigError, PagedKVError

if TYPE_CHECKING:
    from .groups import KVCacheGroup
    from .layer_groups import LayerGrouping


class CapacityError(PagedKVError, ValueError):
    """The memory budget leaves no room for even one KV block."""


@dataclass(frozen=True)
class MemoryBudget:
    """How a device's memory splits between weights, activations, graphs and the KV pool.

    ``utilization`` is the fraction of ``total_bytes`` the server may use at all (the rest is left
    to the CUDA context, fragmentation and other processes). The KV pool gets what remains:
    ``floor(total × utilization) − weights − activation peak − graph reserve``.
    """

    total_bytes: int
    weights_bytes: int = 0
    activation_peak_bytes: int = 0
    graph_reserve_bytes: int = 0
    utilization: float = 0.9

    def __post_init__(self) -> None:
        _check_int("total_bytes", self.total_bytes, 1)
        _check_int("weights_bytes", self.weights_bytes, 0)
        _check_int("activation_peak_bytes", self.activation_peak_bytes, 0)
        _check_int("graph_reserve_bytes", self.graph_reserve_bytes, 0)
        u = self.utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not math.isfinite(u) or not 0 < u <= 1:
            raise InvalidConfigError(f"utilization must be in (0, 1], got {u!r}")

    @property
    def usable_bytes(self) -> int:
        """``floor(total × utilization)``, exact (no float rounding at the byte level)."""
        return math.floor(self.total_bytes * Fraction(str(self.utilization)))

    @property
    def kv_bytes(self) -> int:
        """Bytes left for the KV pool; negative when the other terms do not fit."""
        return self.usable_bytes - self.weights_bytes - self.activation_peak_bytes - self.graph_reserve_bytes

    def num_blocks(self, spec: CacheSpec) -> int:
        """Blocks of ``spec`` that fit in :attr:`kv_bytes`; :class:`CapacityError` when none do."""
        if not isinstance(spec, CacheSpec):
            raise InvalidConfigError(f"spec must be a CacheSpec, got {type(spec).__name__}")
        kv = self.kv_bytes
        blocks = kv // spec.bytes_per_block if kv > 0 else 0
        if blocks < 1:
            raise CapacityError(
                "no room for a KV block: "
                f"total {format_bytes(self.total_bytes)} × utilization {self.utilization} = "
                f"{format_bytes(self.usable_bytes)}, − weights {format_bytes(self.weights_bytes)}"
                f" − activation peak {format_bytes(self.activation_peak_bytes)}"
                f" − graph reserve {format_bytes(self.graph_reserve_bytes)}"
                f" = {format_bytes(kv)} for the KV pool, "
                f"but one block needs {format_bytes(spec.bytes_per_block)}"
            )
        # The core addresses blocks with u32 ids and reserves u32::MAX.
        if blocks >= 2**32 - 1:
            raise CapacityError(f"{blocks} blocks exceed the core's u32 block ids; use a larger block_size")
        return blocks


def num_blocks_for(
    spec: CacheSpec,
    total_bytes: int,
    weights_bytes: int = 0,
    activation_peak_bytes: int = 0,
    graph_reserve_bytes: int = 0,
    utilization: float = 0.9,
) -> int:
    """``floor((total × utilization − weights − activation peak − graph reserve) / bytes_per_block)``.

    Raises :class:`CapacityError` naming every term when the result would be zero or less.
    """
    budget = MemoryBudget(
        total_bytes=total_bytes,
        weights_bytes=weights_bytes,
        activation_peak_bytes=activation_peak_bytes,
        graph_reserve_bytes=graph_reserve_bytes,
        utilization=utilization,
    )
    return budget.num_blocks(spec)


def _peak(kind: Tuple[str, int], context: int, block_size: int) -> int:
    """The core's per-sequence need of one group (or layer) of ``kind`` at ``context`` tokens."""
    from .groups import peak_decode_blocks

    return peak_decode_blocks(kind, context, block_size)


def _token_need(kind: Tuple[str, int], context: int) -> int:
    """Tokens a layer of ``kind`` must keep at ``context``: no block rounding (the lower bound)."""
    name, size = kind
    # A sliding layer reads its last `size` tokens; a chunked one at most one whole chunk.
    return context if name == "full" else min(context, size)


@dataclass(frozen=True)
class GroupSizing:
    """One pool of uniform pages shared by a model's KV cache groups, and what it holds.

    Build with :func:`size_groups`. The figures for a sequence length ``L`` are methods
    (:meth:`blocks_per_seq`, :meth:`max_seqs`, :meth:`optimum_seqs`, :meth:`efficiency`,
    :meth:`full_max_seqs`); the module docstring gives the arithmetic.

    Attributes:
        spec: The whole model's cache spec (every layer; its ``bytes_per_block`` is what
            full-attention accounting takes per block).
        layer_kinds: Each layer's attention kind, ``(kind, size)``.
        grouping: The layers cut into groups (:func:`pagedkv.layer_groups.group_layers`), chosen
            for :attr:`context`.
        context: The sequence length the grouping was chosen for (the deployment's longest).
        kv_bytes: Bytes of the KV pool.
        num_blocks: Pages in the pool: ``floor(kv_bytes / page_bytes)``.
    """

    spec: CacheSpec
    layer_kinds: Tuple[Tuple[str, int], ...]
    grouping: "LayerGrouping"
    context: int
    kv_bytes: int
    num_blocks: int

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def groups(self) -> Tuple["KVCacheGroup", ...]:
        """The groups, group 0 full unless no layer is: what ``BlockManager(groups=)`` takes."""
        return self.grouping.groups

    @property
    def num_groups(self) -> int:
        return self.grouping.num_groups

    @property
    def layer_bytes_per_token(self) -> int:
        """One layer's KV bytes per token."""
        return self.spec.bytes_per_token // self.spec.num_layers

    @property
    def page_spec(self) -> CacheSpec:
        """A page as a cache spec: :attr:`LayerGrouping.slots` layers for ``block_size`` tokens."""
        from dataclasses import replace

        return replace(self.spec, num_layers=self.grouping.slots)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: ``slots × layer_bytes_per_token × block_size``."""
        return self.page_spec.bytes_per_block

    @property
    def group_bytes_per_token(self) -> Tuple[int, ...]:
        """Each group's KV bytes per token, its layers only (padding slots not counted)."""
        return tuple(len(ls) * self.layer_bytes_per_token for ls in self.grouping.group_layers)

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.page_bytes

    @property
    def full_num_blocks(self) -> int:
        """Blocks of the same memory counted as full attention (every layer in one block)."""
        return self.kv_bytes // self.spec.bytes_per_block

    def blocks_per_seq(self, seq_len: int) -> int:
        """Pages one sequence of ``seq_len`` tokens holds at its peak, over every group."""
        _check_int("seq_len", seq_len, 1)
        return sum(_peak(g.as_tuple(), seq_len, self.block_size) for g in self.groups)

    def max_seqs(self, seq_len: int) -> int:
        """Sequences of ``seq_len`` tokens the pool holds at once (watermark and sharing aside)."""
        return self.num_blocks // self.blocks_per_seq(seq_len)

    def full_max_seqs(self, seq_len: int) -> int:
        """The same under full-attention accounting: ``full_num_blocks // ceil(seq_len / B)``."""
        return self.full_num_blocks // self.spec.blocks_for_tokens(seq_len)

    def optimum_seqs(self, seq_len: int) -> float:
        """The analytic optimum: every layer holds exactly its own blocks (block-exact)."""
        layer_blocks = sum(_peak(k, seq_len, self.block_size) for k in self.layer_kinds)
        return self.kv_bytes / (layer_blocks * self.layer_bytes_per_token * self.block_size)

    def token_bound_seqs(self, seq_len: int) -> float:
        """The token-exact bound: every layer keeps exactly the tokens it reads, no rounding."""
        tokens = sum(_token_need(k, seq_len) for k in self.layer_kinds)
        return self.kv_bytes / (tokens * self.layer_bytes_per_token)

    def efficiency(self, seq_len: int) -> float:
        """The pool's capacity (``num_blocks / blocks_per_seq``, unrounded) over the optimum's."""
        return (self.num_blocks / self.blocks_per_seq(seq_len)) / self.optimum_seqs(seq_len)

    def token_efficiency(self, seq_len: int) -> float:
        """The pool's capacity over the token-exact bound's."""
        return (self.num_blocks / self.blocks_per_seq(seq_len)) / self.token_bound_seqs(seq_len)

    def smallest_kind_page_efficiency(self, seq_len: int) -> float:
        """The efficiency of the grouping whose page holds as many layers as the model's least
        numerous kind (every kind cut into groups of that size, the last one padded): the
        grouping vLLM's hybrid allocator uses, for comparison."""
        counts: Dict[Tuple[str, int], int] = {}
        for k in self.layer_kinds:
            counts[k] = counts.get(k, 0) + 1
        m = min(counts.values())
        need = sum(-(-n // m) * _peak(k, seq_len, self.block_size) for k, n in counts.items())
        pages = self.kv_bytes // (m * self.layer_bytes_per_token * self.block_size)
        return (pages / need) / self.optimum_seqs(seq_len)

    def as_dict(self, seq_lens: Sequence[int] = ()) -> Dict[str, Any]:
        """JSON-ready figures: the pool, the grouping, and one row per length in ``seq_lens``."""
        return {
            "context": self.context,
            "kv_bytes": self.kv_bytes,
            "num_groups": self.num_groups,
            "slots": self.grouping.slots,
            "padding": self.grouping.padding,
            "groups": [list(g.as_tuple()) for g in self.groups],
            "group_layers": [list(ls) for ls in self.grouping.group_layers],
            "layer_bytes_per_token": self.layer_bytes_per_token,
            "group_bytes_per_token": list(self.group_bytes_per_token),
            "page_bytes": self.page_bytes,
            "num_blocks": self.num_blocks,
            "pool_bytes": self.pool_bytes,
            "full_num_blocks": self.full_num_blocks,
            "rows": [{
                "seq_len": n,
                "blocks_per_seq": self.blocks_per_seq(n),
                "max_seqs": self.max_seqs(n),
                "full_blocks_per_seq": self.spec.blocks_for_tokens(n),
                "full_max_seqs": self.full_max_seqs(n),
                "optimum_seqs": self.optimum_seqs(n),
                "efficiency": self.efficiency(n),
                "token_efficiency": self.token_efficiency(n),
                "smallest_kind_page_efficiency": self.smallest_kind_page_efficiency(n),
            } for n in seq_lens],
        }


def size_groups(
    spec: CacheSpec,
    layer_kinds: Optional[Sequence[Any]],
    kv_bytes: Union[int, MemoryBudget],
    context: int,
    *,
    max_groups: Optional[int] = None,
) -> GroupSizing:
    """The group-aware pool for ``spec``'s model: the grouping chosen for ``context`` tokens
    (:func:`pagedkv.layer_groups.group_layers`) and the pages ``kv_bytes`` (or a
    :class:`MemoryBudget`'s :attr:`~MemoryBudget.kv_bytes`) holds.

    What an engine sizes its pool with: ``BlockManager(s.num_blocks, s.block_size,
    groups=s.groups)`` over a KV pool of ``s.num_blocks`` pages of ``s.page_spec``'s shape, and
    ``s.max_seqs(max_model_len)`` sequences of the longest length at once. ``layer_kinds``
    ``None`` (or all full) gives one full group of every layer: the plain pool.

    Raises:
        InvalidConfigError: ``layer_kinds`` not one valid kind per layer of ``spec``, a
            ``context`` below 1, or more groups than the manager holds.
        CapacityError: Not one page fits.
    """
    from ._config_model import normalize_layer_kinds
    from .groups import KVCacheGroup
    from .layer_groups import MAX_GROUPS, group_layers

    if not isinstance(spec, CacheSpec):
        raise InvalidConfigError(f"spec must be a CacheSpec, got {type(spec).__name__}")
    kinds = normalize_layer_kinds(layer_kinds, spec.num_layers)
    if kinds is None:
        kinds = (("full", 0),) * spec.num_layers
    _check_int("context", context, 1)
    if isinstance(kv_bytes, MemoryBudget):
        budget: Optional[MemoryBudget] = kv_bytes
        kv = kv_bytes.kv_bytes
    else:
        budget = None
        if isinstance(kv_bytes, bool) or not isinstance(kv_bytes, int):
            raise InvalidConfigError(f"kv_bytes must be an int or a MemoryBudget, got {kv_bytes!r}")
        kv = kv_bytes
    grouping = group_layers([KVCacheGroup(k, s) for k, s in kinds],  # type: ignore[arg-type]
                            context, spec.block_size,
                            max_groups=MAX_GROUPS if max_groups is None else max_groups)
    page = spec.bytes_per_token // spec.num_layers * grouping.slots * spec.block_size
    blocks = kv // page if kv > 0 else 0
    if blocks < 1:
        where = "" if budget is None else f" (budget: {format_bytes(budget.usable_bytes)} usable)"
        raise CapacityError(
            f"no room for a KV page: {format_bytes(kv)} for the KV pool{where}, but one page of "
            f"{grouping.slots} layers × {spec.block_size} tokens needs {format_bytes(page)}")
    if blocks >= 2**32 - 1:
        raise CapacityError(f"{blocks} pages exceed the core's u32 block ids; use a larger block_size")
    return GroupSizing(spec=spec, layer_kinds=kinds, grouping=grouping, context=context,
                       kv_bytes=kv, num_blocks=blocks)


_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
# Far above any real size (2**64 bytes has 20 digits), and far below Python's 4300-digit limit
# on int() of a string, which would otherwise surface as a bare ValueError.
_MAX_SIZE_CHARS = 64
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: Union[str, int]) -> int:
    """Parse ``"80GiB"``, ``"80GB"``, ``"1.5 TiB"``, ``"4096"`` (bytes) into an integer byte count.

    GB/MB/KB/TB are decimal (10⁹…), GiB/MiB/KiB/TiB binary (2³⁰…). A bare ``G``/``M`` is refused as
    ambiguous rather than guessed. Fractions of a byte round down.

    Raises:
        InvalidConfigError: Not a size, a negative int, an unknown unit, or longer than 64
            characters.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InvalidConfigError(f"size must be >= 0, got {text}")
        return text
    if not isinstance(text, str):
        raise InvalidConfigError(f"size must be a string like '80GiB', got {text!r}")
    if len(text) > _MAX_SIZE_CHARS:
        raise InvalidConfigError(
            f"size {text[:20]!r}... is {len(text)} characters long; a size has at most "
            f"{_MAX_SIZE_CHARS} (e.g. '80GiB')", field="size", value=len(text),
            reason=f"at most {_MAX_SIZE_CHARS} characters")
    match = _SIZE_RE.match(text)
    if not match:
        raise InvalidConfigError(f"cannot parse size {text!r}; expected e.g. '80GiB', '80GB' or '4096'")
    number, unit = match.groups()
    unit = unit.lower() or "b"
    if unit not in _UNITS:
        raise InvalidConfigError(
            f"unknown size unit {match.group(2)!r} in {text!r}; use B, KB, MB, GB, TB (decimal) "
            "or KiB, MiB, GiB, TiB (binary)"
        )
    return math.floor(Fraction(number) * _UNITS[unit])


def format_bytes(n: int) -> str:
    """Human-readable binary size, e.g. ``format_bytes(131072) == "128.00 KiB"``; sign kept."""
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
