"""The remote tier: KV blocks in a Redis or Valkey server shared by several engines.

Owns :class:`RemoteStore`. Keys are ``pagedkv:<fingerprint hex>:<key id>:<block hash hex>`` (so
engines of different layouts, or of fleets with different tier secrets, never see each other's
keys), values are :mod:`~pagedkv.tiers.record` records, checked on every read exactly as the disk
tier checks them. Engines with the same fingerprint, the same tier secret and the same hash key
share blocks: one engine's ``put`` is another's hit.

**Trust.** Anyone who can write to the server (another tenant, a compromised client, a router
holding the prefix-hash key) can put any bytes under any key. Every record therefore carries a
MAC under the fleet's tier secret (:class:`~pagedkv.tiers.secret.TierSecret`), which only engines
hold: a re-encoded value with a valid checksum, a real record moved to another key, or another
fleet's record is a counted miss (``unauthenticated``) and is deleted. A store without a secret
refuses to start (:class:`~pagedkv.errors.TierSecretError`): a shared tier that trusts whatever it
reads would serve an attacker's KV.

**Failure model.** The server is a cache, not a dependency: a dead, restarting, overloaded or
misbehaving server turns reads into misses and writes into drops, counted in :meth:`RemoteStore.stats`
(``errors``, ``timeouts``), never an exception to the caller. Each socket operation is bounded by
``timeout_s`` and redis-py's own retries are off. After a failure (anything but an error reply
such as ``OOM``, which fails only its call) the store *backs off*: for
``backoff_s`` every operation is a counted miss (``unavailable``) without touching the network, so a
dead server costs nothing per engine step; the first operation after that probes the server again.

**Invariants.** Only bytes that verified are returned; a corrupt or foreign value under a key is
deleted (best effort) so it costs one miss, not one per reader. Bad arguments raise
:class:`~pagedkv.errors.InvalidConfigError` / :class:`~pagedkv.errors.InvalidArgumentError`.
``redis`` (the ``pagedkv[remote]`` extra) is imported when a store is built, not at package import.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Callable, List, Optional, Sequence, Set, Tuple, Type, TypeVar

from .. import _optional
from ..errors import InvalidArgumentError, InvalidConfigError, TierSecretError
from .record import (
    FINGERPRINT_BYTES,
    BlockMeta,
    Buffer,
    Reason,
    StoreClosedError,
    TierStats,
    as_byte_view,
    decode_checked,
    encode_into,
    record_size,
)
from .secret import ENV_VAR, TierSecret, load_tier_secret, secret_for_config

__all__ = ["RemoteStore", "KEY_PREFIX"]

KEY_PREFIX = "pagedkv"
_log = logging.getLogger("pagedkv")
_T = TypeVar("_T")


class RemoteStore:
    """KV blocks of one layout (``fingerprint``) in the Redis/Valkey server at ``url``.

    Args:
        url: ``redis://host:port/db`` (or ``rediss://``, ``unix://``), as redis-py reads it.
        fingerprint: :func:`pagedkv.tiers.fingerprint.fingerprint` of the engine's layout.
        block_bytes: Bytes of one block; every payload has this size.
        timeout_s: Bound on each connect, send and receive.
        ttl_s: Expiry of stored blocks (``None``: the server's eviction policy alone).
        backoff_s: How long a failure keeps the store from touching the server.
        threads: Worker threads for ``*_async``.
        secret: The fleet's tier secret (:func:`pagedkv.tiers.secret.load_tier_secret`); ``None``:
            ``PAGEDKV_TIER_SECRET``, and without it the store refuses to start.

    Raises:
        TierSecretError: ``secret`` is missing.
        InvalidConfigError: Another argument is out of its domain.
    """

    def __init__(
        self,
        url: str,
        fingerprint: bytes,
        block_bytes: int,
        *,
        timeout_s: float = 0.05,
        ttl_s: Optional[float] = None,
        backoff_s: float = 1.0,
        threads: int = 2,
        secret: Optional[TierSecret] = None,
    ) -> None:
        if secret is None:
            secret = load_tier_secret()
        if secret is None:
            raise TierSecretError(
                f"a shared remote tier needs a tier secret to authenticate its records: set "
                f"{ENV_VAR} or EngineConfig.tier_secret_file (a 0600 file) to the fleet's secret "
                f"(at least 32 bytes, e.g. `openssl rand -hex 32`), the same on every engine",
                field="secret", value=ENV_VAR, reason="missing",
            )
        if not isinstance(secret, TierSecret):
            raise InvalidConfigError(
                f"secret must be a pagedkv.tiers.secret.TierSecret, got {type(secret).__name__}",
                field="secret", value=type(secret).__name__, reason="not a TierSecret",
            )
        if not isinstance(fingerprint, (bytes, bytearray)) or len(fingerprint) != FINGERPRINT_BYTES:
            raise InvalidConfigError(
                f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {fingerprint!r}",
                field="fingerprint", value=fingerprint, reason="wrong length",
            )
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
            raise InvalidConfigError(
                f"block_bytes must be an integer >= 1, got {block_bytes!r}", field="block_bytes",
                value=block_bytes, reason="must be >= 1",
            )
        for name, value, allow_none in (("timeout_s", timeout_s, False), ("ttl_s", ttl_s, True)):
            if value is None and allow_none:
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
                math.isfinite(value) and value > 0
            ):
                raise InvalidConfigError(
                    f"{name} must be a positive number of seconds, got {value!r}", field=name,
                    value=value, reason="must be > 0",
                )
        if not isinstance(backoff_s, (int, float)) or isinstance(backoff_s, bool) or not (
            math.isfinite(backoff_s) and backoff_s >= 0
        ):
            raise InvalidConfigError(
                f"backoff_s must be a number of seconds >= 0, got {backoff_s!r}", field="backoff_s",
                value=backoff_s, reason="must be >= 0",
            )
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise InvalidConfigError(
                f"threads must be an integer >= 1, got {threads!r}", field="threads", value=threads,
                reason="must be >= 1",
            )
        if not isinstance(url, str) or not url:
            raise InvalidConfigError(
                f"remote url must be a non-empty string such as 'redis://host:6379/0', got {url!r}",
                field="url", value=url, reason="not a string",
            )
        redis = _optional.require("redis", "RemoteStore")
        retry = _optional.require("redis.retry", "RemoteStore")
        backoff = _optional.require("redis.backoff", "RemoteStore")
        self.fingerprint = bytes(fingerprint)
        #: The key every record is authenticated with.
        self.secret = secret
        self.block_bytes = block_bytes
        self.timeout_s = float(timeout_s)
        self.ttl_ms = None if ttl_s is None else max(1, int(round(ttl_s * 1000)))
        self.backoff_s = float(backoff_s)
        self._prefix = f"{KEY_PREFIX}:{self.fingerprint.hex()}:{secret.key_id}:"
        try:
            self._client = redis.Redis.from_url(
                url,
                socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s,
                retry_on_timeout=False,
                retry=retry.Retry(backoff.NoBackoff(), 0),
                health_check_interval=0,
                **_python_packer(redis),
            )
        except (ValueError, TypeError) as exc:
            raise InvalidConfigError(
                f"remote url {url!r} is not a Redis URL: {exc}", field="url", value=url, reason=str(exc)
            ) from None
        self.url = url
        self._errors: Tuple[Type[BaseException], ...] = (redis.RedisError, OSError)
        self._timeouts: Tuple[Type[BaseException], ...] = (redis.TimeoutError, socket.timeout)
        # A server that answered with an error reply is up (OOM, READONLY, ...): only that call
        # fails. Anything else (refused, reset, timed out, a reply that does not parse) backs off.
        self._answered: Tuple[Type[BaseException], ...] = (redis.ResponseError,)
        self._lock = threading.Lock()
        self._stats = TierStats()
        self._down_until = 0.0
        self._logged: Set[type] = set()
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pagedkv-remote")

    # ---------------------------------------------------------------- plumbing

    def key(self, block_hash: int) -> bytes:
        """The server key of ``block_hash`` under this store's fingerprint and secret's key id."""
        return f"{self._prefix}{self._check_hash(block_hash):032x}".encode()

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def _call(self, op: Callable[[], _T]) -> Tuple[bool, Optional[_T]]:
        """``(True, result)``, or ``(False, None)`` after a counted failure or while backing off."""
        if time.monotonic() < self._down_until:
            self._count(unavailable=1)
            return False, None
        try:
            return True, op()
        except self._errors as exc:
            if isinstance(exc, self._timeouts):
                self._count(timeouts=1)
            else:
                self._count(errors=1)
            if not isinstance(exc, self._answered):
                self._down_until = time.monotonic() + self.backoff_s
                try:
                    # Drop idle sockets to the old server: after a restart they are all dead.
                    self._client.connection_pool.disconnect(inuse_connections=False)
                except Exception:  # noqa: BLE001 - tearing down sockets must not raise either
                    pass
            return False, None
        except Exception as exc:  # noqa: BLE001 - the contract: a failing tier is a miss
            # Not a failure redis-py names (a bug here or in redis-py): counted, logged once per
            # type, and backed off like a failure, so it cannot repeat every step.
            self._count(errors=1)
            self._down_until = time.monotonic() + self.backoff_s
            if type(exc) not in self._logged:
                self._logged.add(type(exc))
                _log.warning("remote tier %s: unexpected %s; served as a miss", self.url,
                             type(exc).__name__, exc_info=True)
            return False, None

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self!r} is closed", store=repr(self))

    def _check_meta(self, meta: Any) -> BlockMeta:
        self._check_open()
        if not isinstance(meta, BlockMeta):
            raise InvalidArgumentError(
                f"meta must be a pagedkv.tiers.BlockMeta, got {type(meta).__name__}", what="meta",
                value=type(meta).__name__, reason="not a BlockMeta",
            )
        return meta

    def _check_payload(self, data: Buffer, what: str = "data") -> memoryview:
        view = as_byte_view(data, what)
        if view.nbytes != self.block_bytes:
            raise InvalidArgumentError(
                f"{what} holds {view.nbytes} bytes; this store's blocks are {self.block_bytes} bytes",
                what=what, value=view.nbytes, reason=f"must be {self.block_bytes} bytes",
            )
        return view

    @staticmethod
    def _check_hash(block_hash: Any) -> int:
        if isinstance(block_hash, bool) or not isinstance(block_hash, int) or not 0 <= block_hash < 1 << 128:
            raise InvalidArgumentError(
                f"block hash must be an integer in [0, 2**128), got {block_hash!r}", what="block_hash",
                value=block_hash, reason="out of range",
            )
        return block_hash

    # ---------------------------------------------------------------- writes

    def _put_work(self, meta: BlockMeta, view: memoryview) -> bool:
        record = bytearray(record_size(len(meta.token_ids), self.block_bytes))
        encode_into(record, self.fingerprint, meta, view, secret=self.secret)
        key = self.key(meta.block_hash)
        ok, _ = self._call(lambda: self._client.set(key, memoryview(record), px=self.ttl_ms))
        if ok:
            self._count(puts=1, bytes_written=len(record))
        else:
            self._count(dropped=1)
        return ok

    def put(self, meta: BlockMeta, data: Buffer) -> bool:
        """Store one block (on the caller's thread); ``False`` if the server did not take it."""
        return self._put_work(self._check_meta(meta), self._check_payload(data))

    def put_async(self, meta: BlockMeta, data: Buffer) -> "Future[bool]":
        """:meth:`put` on the thread pool. ``data`` must stay unchanged until the future is done."""
        return self._pool.submit(self._put_work, self._check_meta(meta), self._check_payload(data))

    # ---------------------------------------------------------------- reads

    def _get_work(self, meta: BlockMeta) -> Optional[memoryview]:
        key = self.key(meta.block_hash)
        ok, value = self._call(lambda: self._client.get(key))
        if not ok or value is None:
            self._count(misses=1)
            return None
        if not isinstance(value, (bytes, bytearray, memoryview)):
            # Not a string reply (an integer, array or map under our key): not a record at all.
            self._count(misses=1, corrupt=1)
            self._call(lambda: self._client.delete(key))
            return None
        payload, reason = decode_checked(
            value, fingerprint=self.fingerprint, block_hash=meta.block_hash, token_ids=meta.token_ids,
            salt_digest=meta.salt_digest, payload_len=self.block_bytes, secret=self.secret,
            group=meta.group,
        )
        if reason is Reason.OK:
            self._count(hits=1, bytes_read=len(value))
            return payload
        self._count(misses=1, bytes_read=len(value), **{reason.counter: 1})
        if reason.counter != "mismatched":
            # Bad or forged bytes under our key: delete them so every other reader is spared the
            # miss (whoever wrote them could delete the key anyway).
            self._call(lambda: self._client.delete(key))
        return None

    def get(self, meta: BlockMeta) -> Optional[bytes]:
        """The block's bytes if stored and verified, else ``None``."""
        view = self._get_work(self._check_meta(meta))
        return None if view is None else bytes(view)

    def get_async(self, meta: BlockMeta) -> "Future[Optional[bytes]]":
        """:meth:`get` on the thread pool; the future never holds an exception."""
        meta = self._check_meta(meta)
        return self._pool.submit(lambda: self._as_bytes(self._get_work(meta)))

    @staticmethod
    def _as_bytes(view: Optional[memoryview]) -> Optional[bytes]:
        return None if view is None else bytes(view)

    def get_into(self, meta: BlockMeta, out: Buffer) -> bool:
        """Copy the verified block into the writable buffer ``out``; ``False`` (untouched) on a miss."""
        dest = self._check_out(out)
        view = self._get_work(self._check_meta(meta))
        if view is None:
            return False
        dest[:] = view
        return True

    def get_into_async(self, meta: BlockMeta, out: Buffer) -> "Future[bool]":
        """:meth:`get_into` on the thread pool; ``out`` must not be touched until the future is done."""
        dest = self._check_out(out)
        meta = self._check_meta(meta)

        def work() -> bool:
            view = self._get_work(meta)
            if view is None:
                return False
            dest[:] = view
            return True

        return self._pool.submit(work)

    def _check_out(self, out: Buffer) -> memoryview:
        view = self._check_payload(out, "out")
        if view.readonly:
            raise InvalidArgumentError(
                "out must be a writable buffer", what="out", value=type(out).__name__, reason="read-only"
            )
        return view

    # ---------------------------------------------------------------- lookups

    def contains(self, block_hash: int) -> bool:
        """Whether the server holds the block (``False`` when it cannot be asked)."""
        self._check_open()
        key = self.key(block_hash)
        ok, n = self._call(lambda: self._client.exists(key))
        return bool(ok and n)

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        """How many of the leading ``hashes`` the server holds: one round trip (pipelined EXISTS)."""
        n = 0
        for present in self.holds(hashes):
            if not present:
                break
            n += 1
        return n

    def holds(self, hashes: Sequence[int]) -> List[bool]:
        """Which of ``hashes`` the server holds, each on its own: one round trip (pipelined
        EXISTS); all ``False`` when it cannot be asked."""
        self._check_open()
        keys = [self.key(h) for h in hashes]
        if not keys:
            return []

        def ask() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return list(pipe.execute())

        ok, found = self._call(ask)
        if not ok or found is None or len(found) != len(keys):
            return [False] * len(keys)
        return [bool(f) for f in found]

    def remove(self, block_hash: int) -> bool:
        """Delete one block; ``True`` if the server held it."""
        self._check_open()
        key = self.key(block_hash)
        ok, n = self._call(lambda: self._client.delete(key))
        return bool(ok and n)

    def stats(self) -> TierStats:
        """A snapshot of the counters (blocks, usage and capacity are the server's: ``None``)."""
        with self._lock:
            return replace(self._stats)

    def close(self) -> None:
        """Finish queued operations and close the connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        try:
            self._client.close()
        except self._errors:
            pass

    def __enter__(self) -> "RemoteStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteStore({self.url!r}, fingerprint={self.fingerprint.hex()})"

    # ------------------------------------------------- as a backend (pagedkv.tiers.store.BlockStore)

    #: The tier's name in the engine's figures, and its KV events' locality.
    name = "remote"
    locality = "REMOTE"

    def take_removed(self) -> list[int]:
        """Always ``[]``: the server evicts (and expires) blocks by its own policy, unseen here."""
        return []

    @classmethod
    def from_config(cls, config: object, fingerprint: bytes,
                    block_bytes: int) -> Optional["RemoteStore"]:
        """The store ``config.remote_cache_url`` asks for (with ``remote_cache_timeout_s``), or
        None without one (the registry's factory, :mod:`pagedkv.tiers.store`); its records
        authenticated under :func:`~pagedkv.tiers.secret.secret_for_config` (without a secret it
        refuses to start: :class:`~pagedkv.errors.TierSecretError`)."""
        url = getattr(config, "remote_cache_url", None)
        if url is None:
            return None
        secret = secret_for_config(config)
        timeout = getattr(config, "remote_cache_timeout_s", None)
        if timeout is None:
            return cls(url, fingerprint, block_bytes, secret=secret)
        return cls(url, fingerprint, block_bytes, timeout_s=timeout, secret=secret)


def _python_packer(redis: Any) -> dict[str, Any]:
    """``command_packer=`` redis-py's pure-Python serializer, where this redis-py has one.

    With ``hiredis`` installed redis-py also serializes commands through it, which copies a 2 MiB
    value twice more and made ``put`` 4x slower on the dev box; its reply parser, the fast part, is
    kept. The Python serializer sends a large value as its own buffer, without a copy.
    """
    connection = getattr(redis, "connection", None)
    serializer = getattr(connection, "PythonRespSerializer", None)
    encoder = getattr(connection, "Encoder", None)
    if serializer is None or encoder is None:
        return {}
    try:
        return {"command_packer": serializer(6000, encoder("utf-8", "strict", False).encode)}
    except TypeError:  # another signature: keep redis-py's default
        return {}
