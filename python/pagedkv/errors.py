"""Exception classes raised by pagedkv.

Owns one class per variant of the core's error enum (``pagedkv::Error`` in ``rust/core/src/error.rs``);
the extension module raises these classes, never a bare ``RuntimeError``. Invariants:

* every class derives from :class:`PagedKVError`, so ``except PagedKVError`` catches all of them;
* ``str(err)`` is the core's message verbatim (it names the offending value and the limit it broke),
  including for the :class:`KeyError` subclass, whose default ``str`` would quote it;
* the variant's fields are attributes of the exception (``err.seq_id``, ``err.needed``, ...), and are
  also available as the ``err.fields`` dict;
* an operation that raised left the manager unchanged.

The second base of each class is the built-in a caller would naturally catch: ``ValueError`` for bad
values, ``KeyError`` for an unknown sequence id, ``IndexError`` for a block id outside the pool,
``RuntimeError`` for states that are not the caller's input, ``MemoryError`` for an allocation the
system refused (:class:`AllocationFailedError`). Running out of KV blocks deliberately
does *not* derive from ``MemoryError``: that one means the interpreter itself is out of memory and
generic handlers treat it as fatal, whereas a full block pool is an ordinary scheduling outcome.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Tuple

__all__ = [
    "PagedKVError",
    "InvalidConfigError",
    "InvalidArgumentError",
    "UnknownSequenceError",
    "DuplicateSequenceError",
    "OutOfBlocksError",
    "WatermarkReachedError",
    "SequenceTooLongError",
    "BufferTooSmallError",
    "BufferInvalidError",
    "BuffersNotRegisteredError",
    "InvalidBlockError",
    "RefcountUnderflowError",
    "PrefixCollisionError",
    "InvariantViolationError",
    "AllocationFailedError",
    "OutOfHostBlocksError",
    "InvalidSequenceStateError",
]


class PagedKVError(Exception):
    """Base class of every pagedkv error.

    Args:
        message: The human-readable message (the core's ``Display`` text).
        **fields: The variant's structured fields; each becomes an attribute.
    """

    #: Names of the structured fields this class carries, in the core's order. Each subclass also
    #: declares them as class-level annotations, so type checkers see ``err.seq_id`` and its type.
    field_names: ClassVar[Tuple[str, ...]] = ()
    #: The fields the error was raised with (a subset of :attr:`field_names`, or extra ones).
    fields: dict[str, Any]

    def __init__(self, message: str = "", **fields: Any) -> None:
        super().__init__(message)
        self.fields = dict(fields)
        # A declared field the raiser did not give reads as None rather than AttributeError (the
        # Python sizing code raises InvalidConfigError with a message alone, for example).
        for name in self.field_names:
            if name not in fields:
                setattr(self, name, None)
        for name, value in fields.items():
            setattr(self, name, value)

    @property
    def message(self) -> str:
        """The message the error was raised with."""
        return str(self.args[0]) if self.args else ""

    def __str__(self) -> str:
        # KeyError.__str__ would repr() the message; the core's text is already meant for humans.
        return self.message


# Raised by the Python package, not the core: no variant of the core's enum, so it stays out of
# `__all__` (which lists exactly the core's variants and the base class).
class MissingDependencyError(PagedKVError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it.

    ``str(err)`` is one line, e.g. ``--plot needs matplotlib, which is not installed: pip install
    '.[plot]' in a clone of the pagedkv repository``.

    Attributes: ``module`` (the top-level module missing), ``extra`` (the ``pagedkv[...]`` extra).
    """

    module: str
    extra: Optional[str]

    field_names = ("module", "extra")


class InvalidConfigError(PagedKVError, ValueError):
    """A configuration value is out of range (block size 0, no blocks, watermark ≥ pool, ...).

    Attributes: ``field`` (name), ``value``, ``reason``.
    """

    field: Optional[str]
    value: object
    reason: Optional[str]

    field_names = ("field", "value", "reason")


class InvalidArgumentError(PagedKVError, ValueError):
    """An argument is out of range: a negative id, a token id above ``u32::MAX``, a length mismatch.

    Attributes: ``what`` (argument name), ``value``, ``reason``.
    """

    what: str
    value: object
    reason: str

    field_names = ("what", "value", "reason")


class UnknownSequenceError(PagedKVError, KeyError):
    """The sequence id is not known to the manager.

    Attributes: ``seq_id``.
    """

    seq_id: int

    field_names = ("seq_id",)


class DuplicateSequenceError(PagedKVError, ValueError):
    """The sequence id is already in use.

    Attributes: ``seq_id``.
    """

    seq_id: int

    field_names = ("seq_id",)


class OutOfBlocksError(PagedKVError):
    """The pool does not hold enough free blocks, watermark reserve included.

    Attributes: ``needed``, ``available``.
    """

    needed: int
    available: int

    field_names: ClassVar[Tuple[str, ...]] = ("needed", "available")


class WatermarkReachedError(OutOfBlocksError):
    """An admission would dip into the watermark reserve kept for running sequences.

    Derives from :class:`OutOfBlocksError` because a scheduler handles both the same way (defer the
    request); catch this class alone to tell "reserve protected" from "pool truly empty".

    Attributes: ``needed``, ``available`` (free blocks above the reserve), ``watermark``.
    """

    watermark: int

    field_names = ("needed", "available", "watermark")


class SequenceTooLongError(PagedKVError, ValueError):
    """A sequence would need more blocks than one block-table row holds.

    Attributes: ``seq_id``, ``needed_blocks``, ``max_blocks_per_seq``.
    """

    seq_id: int
    needed_blocks: int
    max_blocks_per_seq: int

    field_names = ("seq_id", "needed_blocks", "max_blocks_per_seq")


class BufferTooSmallError(PagedKVError, ValueError):
    """A caller-owned step buffer is too small for this step (or for its declared layout).

    Attributes: ``buffer`` (name), ``needed``, ``capacity`` (in elements).
    """

    buffer: str
    needed: int
    capacity: int

    field_names = ("buffer", "needed", "capacity")


class BufferInvalidError(PagedKVError, ValueError):
    """A step buffer has the wrong dtype, is not contiguous host memory, or has a bad pointer.

    Attributes: ``buffer`` (name), ``expected``, ``got``.
    """

    buffer: str
    expected: str
    got: str

    field_names = ("buffer", "expected", "got")


class BuffersNotRegisteredError(PagedKVError, RuntimeError):
    """A step was requested before step buffers were attached."""


class InvalidBlockError(PagedKVError, IndexError):
    """A block id outside the pool.

    Attributes: ``block``, ``num_blocks``.
    """

    block: int
    num_blocks: int

    field_names = ("block", "num_blocks")


class RefcountUnderflowError(PagedKVError, RuntimeError):
    """A block's reference count would drop below zero (a double free).

    Attributes: ``block``.
    """

    block: int

    field_names = ("block",)


class PrefixCollisionError(PagedKVError, RuntimeError):
    """A cached block's token ids differ from the request's (a hash collision).

    The manager's verify mode currently serves such a hit as a miss and counts it
    (``Stats.prefix_collisions``) instead of raising; the class exists for the core's variant.

    Attributes: ``block``.
    """

    block: int

    field_names = ("block",)


class InvariantViolationError(PagedKVError, RuntimeError):
    """``check_invariants`` found the manager's state inconsistent; a bug if ever seen.

    Attributes: ``detail`` (the core's description).
    """

    detail: str

    field_names = ("detail",)


class AllocationFailedError(PagedKVError, MemoryError):
    """An allocation was refused: a block pool, step buffers, or their pinned or device copies.

    Raised instead of aborting the process or leaking the allocator's own exception (torch's
    ``RuntimeError`` / ``OutOfMemoryError``). Derives from ``MemoryError`` because it is one: the
    request did not fit the memory there is; nothing was allocated and nothing changed.

    Attributes: ``what`` (what was being allocated), ``bytes`` (the size asked for).
    """

    what: str
    bytes: int  # an annotation only: the builtin is not shadowed in the class body

    field_names = ("what", "bytes")


class OutOfHostBlocksError(PagedKVError):
    """The host block pool lacks the free blocks a swap-out needs (always, with
    ``num_host_blocks=0``: swap disabled). A scheduler falls back to recompute.

    Not an :class:`OutOfBlocksError`: the device pool is not what ran out.

    Attributes: ``needed``, ``available``.
    """

    needed: int
    available: int

    field_names = ("needed", "available")


class InvalidSequenceStateError(PagedKVError, ValueError):
    """The sequence is not in the state the call needs: stepping, appending to or forking a
    swapped-out or recompute-preempted sequence, swapping in a running one, resuming one that was
    not preempted by recompute.

    Attributes: ``seq_id``, ``state`` (``"running"``, ``"swapped"`` or ``"recompute"``),
    ``expected`` (what the call needs).
    """

    seq_id: int
    state: str
    expected: str

    field_names = ("seq_id", "state", "expected")


# Raised by the Python engine, not the core: it is no variant of the core's enum, so it stays out of
# `__all__` (which lists exactly the core's variants and the base class).
class ModelLoadError(PagedKVError, ValueError):
    """A model cannot be loaded: the path does not exist, holds no model, or its architecture is not
    one the engine supports (the Llama family: Llama 2/3, Mistral, Qwen2, SmolLM2).

    Attributes: ``path``, ``reason``.
    """

    path: str
    reason: str

    field_names = ("path", "reason")


# Raised by the Python package, not the core (so it stays out of `__all__`). A bad setting used to
# surface as InvalidConfigError from one layer and InvalidArgumentError from another; one class
# deriving from both lets every layer raise the same error while handlers written for either
# class keep catching it.
class ConfigArgumentError(InvalidConfigError, InvalidArgumentError):
    """A setting is out of range: a block size the layer cannot use, an engine knob
    (:class:`pagedkv.engine.config.EngineConfig`) outside its domain, two exclusive knobs given.

    Attributes: ``field`` and ``what`` (both the setting's name), ``value``, ``reason``.
    """

    field: str
    what: str
    value: object
    reason: str

    # mypy infers each base's field_names as a 3-tuple; this class carries both bases' names.
    field_names = ("field", "what", "value", "reason")  # type: ignore[assignment]

    def __init__(self, message: str = "", **fields: Any) -> None:
        name = fields.get("field", fields.get("what"))
        fields.setdefault("field", name)
        fields.setdefault("what", name)
        super().__init__(message, **fields)


# Raised by the asyncio engine front (pagedkv.engine.async_llm), not the core; kept out of
# `__all__` for the same reason as ModelLoadError.
class EngineOverloadedError(PagedKVError, RuntimeError):
    """A request was refused because ``max_queue_size`` requests already wait for their first
    token (an HTTP server answers 503: retry later).

    Attributes: ``waiting``, ``max_queue_size``.
    """

    waiting: int
    max_queue_size: int

    field_names = ("waiting", "max_queue_size")


class EngineDeadError(PagedKVError, RuntimeError):
    """The engine loop stopped (shut down, or a step failed in a way that is no request's input):
    the request was not served, and no further request will be.

    Attributes: ``reason``.
    """

    reason: str

    field_names = ("reason",)


# Raised by the tiered prefix cache (pagedkv.tiers), not the core; kept out of `__all__` for the
# same reason as ModelLoadError.
class TierOrderError(PagedKVError, RuntimeError):
    """A step's swap-outs were about to run while the host tier still held blocks the manager had
    demoted and nobody had copied out: ``TierCache.after_schedule`` must run between
    ``Scheduler.schedule`` and the step's execution (the swap-outs reuse the demoted slots).
    Nothing was queued, and the demoted blocks were handed to the lower tiers before the raise.

    Attributes: ``pending`` (the demotions that had not been taken), ``rule`` (the order broken).
    """

    pending: int
    rule: str

    field_names = ("pending", "rule")


# Raised by the tiers below the host (pagedkv.tiers), not the core; kept out of `__all__` for the
# same reason as ModelLoadError.
class TierSecretError(InvalidConfigError):
    """The tier secret (the key that authenticates disk and remote tier records) is missing where
    one is required (a shared remote tier), or is too short. Never carries the secret itself.

    Attributes: ``field`` (where the secret was looked for), ``value`` (a file path or the
    variable's name, never the secret), ``reason``.
    """

    field: Optional[str]
    value: object
    reason: Optional[str]

    field_names = ("field", "value", "reason")


class UnsafePathError(PagedKVError, PermissionError):
    """A file or directory pagedkv would trust is not safe to use: not owned by the process's
    user, writable by group or others (readable too, for a secret), reached through a symbolic
    link, hard-linked elsewhere (``st_nlink > 1``), or not the kind of file expected. Nothing was
    read from it or written through it.

    Attributes: ``path``, ``reason``.
    """

    path: str
    reason: str

    field_names = ("path", "reason")


class CacheIOError(PagedKVError, OSError):
    """A disk tier's directory or one of its files could not be prepared at start-up (a full
    disk, a read-only file system, an I/O error). Once running, I/O errors are counted misses.

    Attributes: ``path``, ``errno``, ``reason``.
    """

    path: str
    errno: Optional[int]  # type: ignore[assignment]
    reason: str

    field_names = ("path", "errno", "reason")
