"""Stateful property test: the manager against a plain Python model of its documented rules.

The model keeps what the documentation promises — block tables and token counts, reference counts
(block tables holding a block), the free list and the LRU of cached-free blocks, the prefix cache
keyed by content (salt and the whole token prefix, which the chained hash stands for), the
copy-on-write queue and the copy sources held back until a step emits them. It predicts, for every
operation, either the exact error or the exact outcome; where the core's choice is free (which id
the free list hands out) the model checks the choice is legal and learns it. After every rule the
real state is compared with the model in full and ``check_invariants()`` is run.
"""

from __future__ import annotations

from typing import Optional

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv import BlockManager, StepBuffers, _core
from pagedkv import errors as E

SEQ_IDS = st.integers(0, 11)
SALTS = st.sampled_from([None, b"a"])
# A tiny vocabulary and a few shared stems make prefix hits common.
STEMS = [[0, 1, 0, 1, 2, 2, 0, 1], [1, 1, 1, 1, 1, 1, 1, 1], [2, 0, 2, 0, 1, 0]]


class Seq:
    def __init__(self, tokens: list[int], table: list[int], registered: int, salt: Optional[bytes]):
        self.tokens = tokens
        self.table = table
        self.registered = registered
        self.salt = salt


class ManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(6, 24),
        block_size=st.sampled_from([1, 2, 4]),
        watermark=st.integers(0, 3),
        max_blocks=st.sampled_from([None, 3, 6]),
        caching=st.sampled_from([True, True, False]),
    )
    def setup(self, num_blocks, block_size, watermark, max_blocks, caching) -> None:
        watermark = min(watermark, num_blocks - 1)
        self.m = BlockManager(
            num_blocks,
            block_size,
            watermark_blocks=watermark,
            max_blocks_per_seq=max_blocks,
            enable_prefix_caching=caching,
            hash_seed=0x5EED,
        )
        self.N, self.B, self.W = num_blocks, block_size, watermark
        self.maxb = self.m.max_blocks_per_seq
        self.caching = caching
        self.bufs = StepBuffers(6, 64, self.maxb, max_copies=12, device="cpu")
        self.m.attach_buffers(self.bufs)
        self.seqs: dict[int, Seq] = {}
        self.free: set[int] = set(range(num_blocks))
        self.lru: list[int] = []  # oldest first
        self.hashed: dict[int, tuple] = {}  # block -> content key
        self.by_key: dict[tuple, int] = {}
        self.pending: list[tuple[int, int]] = []
        self.deferred: set[int] = set()
        self.counters = dict(evictions=0, cow_copies=0, query=0, hit=0)

    # ------------------------------------------------------------------------------ model helpers

    def refcount(self, b: int) -> int:
        return sum(s.table.count(b) for s in self.seqs.values())

    def avail(self) -> int:
        return len(self.free) + len(self.lru)

    def key(self, salt: Optional[bytes], tokens: list[int], j: int) -> tuple:
        return (salt or b"", tuple(tokens[: (j + 1) * self.B]))

    def take(self, got: int) -> None:
        """One allocation, whose id the core chose as `got`: free list first, then the LRU head."""
        if self.free:
            assert got in self.free, f"block {got} handed out but not free"
            self.free.remove(got)
        else:
            assert self.lru and got == self.lru[0], f"evicted {got}, expected LRU head {self.lru[:1]}"
            self.lru.pop(0)
            del self.by_key[self.hashed.pop(got)]
            self.counters["evictions"] += 1
            event("eviction")

    def park(self, b: int) -> None:
        if b in self.hashed:
            self.lru.append(b)
        else:
            self.free.add(b)

    def unreferenced(self, b: int) -> None:
        if self.pending:
            for i, (src, dst) in enumerate(self.pending):
                if dst == b:
                    del self.pending[i]
                    if not any(s == src for s, _ in self.pending) and src in self.deferred:
                        self.deferred.remove(src)
                        self.park(src)
                    break
            if any(s == b for s, _ in self.pending):
                event("copy source deferred")
                self.deferred.add(b)
                return
        self.park(b)

    def drop_ref(self, b: int) -> None:
        if self.refcount(b) == 0:
            self.unreferenced(b)

    def needs_cow(self, s: Seq) -> bool:
        return len(s.tokens) % self.B != 0 and self.refcount(s.table[-1]) > 1

    def cow(self, s: Seq, new_tail: int) -> None:
        src = s.table[-1]
        self.take(new_tail)
        s.table[-1] = new_tail
        origin = next((s0 for s0, d in self.pending if d == src), src)
        self.pending.append((origin, new_tail))
        self.counters["cow_copies"] += 1
        event("copy-on-write")
        self.drop_ref(src)

    def pick(self, data, label: str) -> int:
        """A live sequence id most of the time, else any id (usually an unknown one)."""
        if self.seqs and data.draw(st.integers(0, 9), label=f"{label} live?") > 0:
            return data.draw(st.sampled_from(sorted(self.seqs)), label=label)
        return data.draw(SEQ_IDS, label=label)

    def fresh(self, data, label: str) -> int:
        """An id not in use most of the time, else any id."""
        unused = [i for i in range(12) if i not in self.seqs]
        if unused and data.draw(st.integers(0, 9), label=f"{label} fresh?") > 0:
            return data.draw(st.sampled_from(unused), label=label)
        return data.draw(SEQ_IDS, label=label)

    def blocks_for(self, n: int) -> int:
        return -(-n // self.B)

    def expect(self, err: Optional[type], fn, *args, **kw):
        """Runs a real call that the model expects to fail with `err` (or succeed when None)."""
        event(f"{fn.__name__}: {'ok' if err is None else err.__name__}")
        if err is None:
            return fn(*args, **kw)
        try:
            fn(*args, **kw)
        except E.PagedKVError as e:
            assert type(e) is err, f"expected {err.__name__}, got {type(e).__name__}: {e}"
            return None
        raise AssertionError(f"expected {err.__name__}, call succeeded")

    # ------------------------------------------------------------------------------------- rules

    @rule(
        data=st.data(),
        stem=st.sampled_from(STEMS),
        cut=st.integers(1, 8),
        tail=st.lists(st.integers(0, 2), max_size=6),
        salt=SALTS,
    )
    def admit(self, data, stem, cut, tail, salt) -> None:
        sid = self.fresh(data, "sid")
        tokens = stem[:cut] + tail
        n = len(tokens)
        nb = self.blocks_for(n)
        err = None
        hits: list[int] = []
        revive = 0
        if sid in self.seqs:
            err = E.DuplicateSequenceError
        elif nb > self.maxb:
            err = E.SequenceTooLongError
        else:
            if self.caching:
                for j in range(min((n - 1) // self.B, n // self.B)):
                    b = self.by_key.get(self.key(salt, tokens, j))
                    if b is None:
                        break
                    revive += b in self.lru
                    hits.append(b)
            needed = nb - len(hits) + revive
            if needed > self.avail():
                err = E.OutOfBlocksError
            elif self.avail() - needed < self.W:
                err = E.WatermarkReachedError
        res = self.expect(err, self.m.admit, sid, tokens, cache_salt=salt)
        if err is not None:
            return
        new = nb - len(hits)
        if hits:
            event("admit: prefix hit")
        # No host tier here: every cached token is a GPU hit.
        assert tuple(res) == (len(hits) * self.B, new, nb, n, len(hits) * self.B, 0)
        table = self.m.block_table(sid)
        assert table[: len(hits)] == hits
        for b in hits:
            if b in self.lru:
                self.lru.remove(b)
        # The core takes what the free list holds first, then evicts; `take` checks each choice.
        for b in table[len(hits) :]:
            self.take(b)
        self.seqs[sid] = Seq(tokens, table, len(hits), salt)
        if self.caching:
            self.counters["query"] += n
            self.counters["hit"] += len(hits) * self.B

    @rule(data=st.data(), toks=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def append(self, data, toks) -> None:
        sid = self.pick(data, "sid")
        s = self.seqs.get(sid)
        err = None
        if s is None:
            err = E.UnknownSequenceError
        else:
            nb = self.blocks_for(len(s.tokens) + len(toks))
            if nb > self.maxb:
                err = E.SequenceTooLongError
            else:
                cow = self.needs_cow(s)
                if nb - len(s.table) + cow > self.avail():
                    err = E.OutOfBlocksError
        self.expect(err, self.m.append, sid, toks)
        if err is not None:
            return
        real = self.m.block_table(sid)
        old = len(s.table)
        if self.needs_cow(s):
            self.cow(s, real[old - 1])
        for b in real[old:]:
            self.take(b)
            s.table.append(b)
        s.tokens += toks

    @rule(data=st.data(), size=st.integers(0, 6), tok=st.integers(0, 2), mismatch=st.integers(0, 9))
    def append_batch(self, data, size, tok, mismatch) -> None:
        seqs = list(dict.fromkeys(self.pick(data, "sid") for _ in range(size)))
        toks = [tok] * (len(seqs) + (1 if mismatch == 0 else 0))
        err = None
        if len(toks) != len(seqs):
            err = E.InvalidArgumentError
        else:
            needed = 0
            # Every id is resolved before any length is looked at.
            if any(sid not in self.seqs for sid in seqs):
                err = E.UnknownSequenceError
            for sid in seqs if err is None else ():
                s = self.seqs[sid]
                if len(s.tokens) % self.B == 0:
                    if len(s.tokens) // self.B + 1 > self.maxb:
                        err = E.SequenceTooLongError
                        break
                    needed += 1
                elif self.needs_cow(s):
                    needed += 1
            if err is None and needed > self.avail():
                err = E.OutOfBlocksError
        self.expect(err, self.m.append_batch, seqs, toks)
        if err is not None:
            return
        for sid in seqs:
            s = self.seqs[sid]
            real = self.m.block_table(sid)
            if len(s.tokens) % self.B == 0:
                self.take(real[len(s.table)])
                s.table.append(real[len(s.table)])
            elif self.needs_cow(s):
                self.cow(s, real[len(s.table) - 1])
            s.tokens.append(tok)

    @rule(data=st.data())
    def fork(self, data) -> None:
        parent, child = self.pick(data, "parent"), self.fresh(data, "child")
        err = None
        if parent not in self.seqs:
            err = E.UnknownSequenceError
        elif child in self.seqs:
            err = E.DuplicateSequenceError
        self.expect(err, self.m.fork, parent, child)
        if err is None:
            p = self.seqs[parent]
            self.seqs[child] = Seq(list(p.tokens), list(p.table), p.registered, p.salt)

    @rule(data=st.data())
    def free(self, data) -> None:
        sid = self.pick(data, "sid")
        err = None if sid in self.seqs else E.UnknownSequenceError
        self.expect(err, self.m.free, sid)
        if err is None:
            s = self.seqs.pop(sid)
            for b in reversed(s.table):
                self.drop_ref(b)

    @precondition(lambda self: bool(getattr(self, "seqs", None)))
    @rule(data=st.data(), size=st.integers(1, 7))
    def step(self, data, size) -> None:
        live = sorted(self.seqs)
        seqs = data.draw(st.permutations(live), label="order")[:size]
        nums = [data.draw(st.integers(1, len(self.seqs[s].tokens)), label="n") for s in seqs]
        if data.draw(st.integers(0, 9), label="bad count") == 0:
            nums[-1] = len(self.seqs[seqs[-1]].tokens) + 1
        err = None
        tokens = sum(nums)
        if nums[-1] > len(self.seqs[seqs[-1]].tokens):
            err = E.InvalidArgumentError
        elif len(seqs) > 6:
            err = E.BufferTooSmallError
        elif tokens > 64:
            err = E.BufferTooSmallError
        elif 2 * len(self.pending) > 2 * 12:
            err = E.BufferTooSmallError
        info = self.expect(err, self.m.step, seqs, nums)
        if err is not None:
            return
        h = self.bufs.host
        pos = 0
        for i, (sid, n) in enumerate(zip(seqs, nums)):
            s = self.seqs[sid]
            L = len(s.tokens)
            want = [s.table[p // self.B] * self.B + p % self.B for p in range(L - n, L)]
            assert h.slot_mapping[pos : pos + n].tolist() == want
            assert h.block_tables[i, : len(s.table)].tolist() == s.table
            assert h.seq_lens[i].item() == L
            pos += n
        assert info.num_tokens == tokens and info.num_seqs == len(seqs)
        assert h.copies[: info.num_copies].tolist() == [list(c) for c in self.pending]
        self.pending.clear()
        for b in list(self.deferred):
            self.deferred.discard(b)
            self.park(b)
        if self.caching:
            for sid in seqs:
                s = self.seqs[sid]
                full = len(s.tokens) // self.B
                for j in range(s.registered, full):
                    b, k = s.table[j], self.key(s.salt, s.tokens, j)
                    if b not in self.hashed and k not in self.by_key:
                        self.hashed[b] = k
                        self.by_key[k] = b
                s.registered = max(s.registered, full)

    # ------------------------------------------------------------------------------- invariants

    @invariant()
    def matches_model(self) -> None:
        if not hasattr(self, "m"):
            return
        m = self.m
        m.check_invariants()
        assert len(m) == len(self.seqs)
        for sid, s in self.seqs.items():
            assert m.block_table(sid) == s.table, sid
            assert m.seq_len(sid) == len(s.tokens)
            hashes = m.block_hashes(sid)
            assert [h is not None for h in hashes] == [b in self.hashed for b in s.table]
            if any(h is not None for h in hashes):
                chain = _core.hash_blocks(s.tokens, self.B, cache_salt=s.salt, hash_seed=0x5EED)
                for j, h in enumerate(hashes):
                    if h is not None:
                        assert h == chain[j]
        refs = [0] * self.N
        for s in self.seqs.values():
            for b in s.table:
                refs[b] += 1
        assert [m.block_refcount(b) for b in range(self.N)] == refs
        assert m.pending_copies() == self.pending
        st_ = m.stats()
        assert st_.free_blocks == len(self.free)
        assert st_.cached_free_blocks == len(self.lru)
        assert m.num_free_blocks == self.avail()
        assert st_.used_blocks == self.N - self.avail()
        assert st_.used_tokens == sum(len(s.tokens) for s in self.seqs.values())
        assert st_.shared_blocks == sum(r > 1 for r in refs)
        assert st_.evictions == self.counters["evictions"]
        assert st_.cow_copies == self.counters["cow_copies"]
        assert st_.prefix_query_tokens == self.counters["query"]
        assert st_.prefix_hit_tokens == self.counters["hit"]
        # Every block is in exactly one place.
        for b in range(self.N):
            places = (refs[b] > 0) + (b in self.free) + (b in self.lru) + (b in self.deferred)
            assert places == 1, b


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(
    max_examples=200,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
