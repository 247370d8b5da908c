"""Pool sizing and byte sizes: how much of a device's memory the KV pool gets, in blocks.

Owns :class:`CapacityError`, :class:`MemoryBudget` / :func:`num_blocks_for` (``floor((total ×
utilization − weights − activation peak − graph reserve) / bytes_per_block)``) and
:func:`parse_bytes` / :func:`format_bytes` (``"80GiB"``-style sizes for the CLI). Re-exported by
:mod:`pagedkv.config`.

**Invariants.** A :class:`MemoryBudget` is immutable and validated on construction; a budget that
leaves no room for one block raises :class:`CapacityError`, bad input
:class:`pagedkv.errors.InvalidConfigError`. Sizes are exact (``Fraction``), rounded down.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Union

from ._config_spec import CacheSpec, _check_int
from .errors import InvalidConfigError, PagedKVError


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
