"""Provisional tokens through the binding and ``pagedkv.BlockManager``.

The core's rules (``docs/architecture.md``, "Provisional tokens"): committed drafts leave exactly the
state appending their ids would have (hashes, prefix hits), provisional tokens are never hashed or
cached, every call is all or nothing. The stateful test drives two managers side by side — one
speculating (provisional tokens, a step over them, commit or rewind), one appending only the
accepted ids — and holds them equal after every rule, with ``check_invariants`` on both.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedkv import BlockManager, StepBuffers
from pagedkv import errors as E

SEED = 0x5EED
#: Blocks in each twin's pool.
POOL = 96


def _pair(num_blocks: int = 64, block_size: int = 4, k: int = 3) -> tuple[BlockManager, BlockManager]:
    a = BlockManager(num_blocks, block_size, max_provisional=k, hash_seed=SEED, watermark_blocks=0)
    b = BlockManager(num_blocks, block_size, hash_seed=SEED, watermark_blocks=0)
    for m in (a, b):
        m.attach_buffers(StepBuffers(4, 64, m.max_blocks_per_seq, device="cpu", backend="numpy"))
    return a, b


def test_config_and_queries() -> None:
    m = BlockManager(16, 4, max_provisional=2)
    assert m.max_provisional == 2
    assert BlockManager(16, 4).max_provisional == 0
    m.admit(1, [1, 2, 3, 4, 5])
    m.append_provisional(1, 2)
    assert (m.seq_len(1), m.committed_len(1), m.num_provisional(1)) == (7, 5, 2)
    m.commit(1, [8])
    assert (m.seq_len(1), m.committed_len(1), m.num_provisional(1)) == (6, 6, 0)
    m.append_provisional(1, 1)
    m.rewind(1)
    assert m.seq_len(1) == 6
    m.check_invariants()


def test_typed_errors_leave_state_unchanged() -> None:
    m = BlockManager(16, 4, max_provisional=2)
    m.admit(1, [1, 2, 3])
    m.admit(2, [4, 5, 6])
    before = (m.seq_len(1), m.num_free_blocks)
    with pytest.raises(E.InvalidArgumentError, match="max_provisional"):
        m.append_provisional(1, 3)
    with pytest.raises(E.InvalidArgumentError, match="num_provisional"):
        m.append_provisional(1, 0)
    with pytest.raises(E.InvalidArgumentError, match="num_tokens"):
        m.append_provisional(1, -1)
    with pytest.raises(E.InvalidArgumentError, match="num_tokens"):
        m.append_provisional(1, True)  # type: ignore[arg-type]
    with pytest.raises(E.UnknownSequenceError):
        m.append_provisional(9, 1)
    with pytest.raises(E.InvalidArgumentError):
        m.append_provisional_batch([1, 2], [1])
    with pytest.raises(E.InvalidArgumentError, match="seqs"):
        m.append_provisional_batch([1, 1], [1, 1])
    # One row over the limit: the other row is not grown either.
    with pytest.raises(E.InvalidArgumentError):
        m.append_provisional_batch([1, 2], [1, 3])
    assert (m.seq_len(1), m.num_free_blocks) == before
    assert m.num_provisional(2) == 0

    m.append_provisional_batch([1, 2], [2, 1])
    with pytest.raises(E.InvalidArgumentError, match="n_accepted"):
        m.commit(2, [7, 7])  # holds 1
    with pytest.raises(E.InvalidArgumentError, match="tokens.len"):
        m.commit_batch([1, 2], [1, 1], [7])
    with pytest.raises(E.InvalidArgumentError, match="num_accepted.len"):
        m.commit_batch([1, 2], [1], [7])
    with pytest.raises(E.InvalidArgumentError, match="seqs"):
        m.commit_batch([1, 1], [1, 1], [7, 7])
    assert (m.num_provisional(1), m.num_provisional(2)) == (2, 1)
    # A sequence holding provisional tokens refuses plain appends and forks.
    with pytest.raises(E.InvalidSequenceStateError):
        m.append(1, [5])
    with pytest.raises(E.InvalidSequenceStateError):
        m.fork(1, 3)
    m.commit_batch([1, 2], [2, 0], [7, 8])
    assert (m.committed_len(1), m.committed_len(2)) == (5, 3)
    m.check_invariants()
    with pytest.raises(E.InvalidArgumentError):
        BlockManager(16, 4, max_provisional=-1)


def test_provisional_tokens_never_hit_the_prefix_cache() -> None:
    a, _ = _pair(block_size=4, k=4)
    a.admit(1, [1, 2, 3])
    a.step([1], [3])
    a.append(1, [4])
    a.append_provisional(1, 4)  # positions 4..7: a whole block of drafts
    a.step([1], [5])
    # The drafts' block is full and was computed, but its content is not known: no hit past 4.
    assert a.admit(2, [1, 2, 3, 4, 5, 6, 7, 8, 9]).cached_tokens == 4
    a.free(2)
    a.commit(1, [5, 6, 7, 8])
    # Committed: the block scheduled by that step is now registered without another step.
    assert a.admit(3, [1, 2, 3, 4, 5, 6, 7, 8, 9]).cached_tokens == 8
    a.check_invariants()


def test_commit_equals_plain_append() -> None:
    a, b = _pair(block_size=2, k=3)
    prompt = [3, 1, 4, 1, 5]
    for m in (a, b):
        m.admit(1, prompt)
        m.step([1], [5])
    # Three speculative rounds: accept 2 of 3, 0 of 3, 3 of 3.
    for drafts, acc, bonus in (([9, 2, 6], 2, 5), ([3, 5, 8], 0, 9), ([7, 9, 3], 3, 2)):
        a.append(1, [bonus])
        a.append_provisional(1, len(drafts))
        a.step([1], [1 + len(drafts)])
        a.commit(1, drafts[:acc])
        b.append(1, [bonus] + drafts[:acc])
        b.step([1], [1 + acc])
        assert a.block_hashes(1) == b.block_hashes(1)
        assert a.seq_len(1) == b.seq_len(1)
    probe = prompt + [5, 9, 2, 9, 2, 7, 9, 3, 0]
    assert a.admit(2, probe).cached_tokens == b.admit(2, probe).cached_tokens == 12
    a.check_invariants()
    b.check_invariants()


class Twins(RuleBasedStateMachine):
    """A speculating manager and a plain one, fed the same accepted tokens."""

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        k=st.integers(1, 4),
        caching=st.booleans(),
    )
    def setup(self, block_size: int, k: int, caching: bool) -> None:
        self.k = k
        self.bs = block_size
        self.a = BlockManager(POOL, block_size, max_provisional=k, hash_seed=SEED,
                              watermark_blocks=0, enable_prefix_caching=caching)
        self.b = BlockManager(POOL, block_size, hash_seed=SEED, watermark_blocks=0,
                              enable_prefix_caching=caching)
        for m in (self.a, self.b):
            m.attach_buffers(StepBuffers(4, 64, m.max_blocks_per_seq, device="cpu",
                                         backend="numpy"))
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    def _both(self, f) -> None:  # type: ignore[no-untyped-def]
        f(self.a)
        f(self.b)

    def _fits(self, grow: int, new_tokens: int = 0) -> bool:
        """Whether the pool holds every live sequence grown by ``grow`` tokens (each counted
        whole, forks too, plus one copy-on-write block each) and ``new_tokens`` more: the walk
        tests provisional tokens, not running out of blocks."""
        bs = self.bs
        held = sum(-(-(len(t) + grow) // bs) + 1 for t in self.tokens.values())
        return held + -(-new_tokens // bs) <= POOL

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def admit(self, prompt: list[int]) -> None:
        if len(self.tokens) >= 4 or not self._fits(0, len(prompt)):
            return
        sid = self.next_id
        self.next_id += 1
        ra = self.a.admit(sid, prompt)
        rb = self.b.admit(sid, prompt)
        assert ra.cached_tokens == rb.cached_tokens
        n = len(prompt) - ra.cached_tokens
        self._both(lambda m: m.step([sid], [n]))
        self.tokens[sid] = list(prompt)

    @rule(data=st.data())
    def speculate(self, data: st.DataObject) -> None:
        if not self.tokens:
            return
        if not self._fits(1 + self.k):
            return
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        bonus = data.draw(st.integers(0, 2))
        n = data.draw(st.integers(1, self.k))
        drafts = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
        acc = data.draw(st.integers(0, n))
        scheduled = data.draw(st.booleans())
        self.a.append(sid, [bonus])
        self.a.append_provisional(sid, n)
        if scheduled:
            self.a.step([sid], [1 + n])
        # Provisional tokens are invisible to the prefix cache whatever was scheduled.
        assert self.a.committed_len(sid) == len(self.tokens[sid]) + 1
        if acc == 0 and data.draw(st.booleans()):
            self.a.rewind(sid)
        else:
            self.a.commit(sid, drafts[:acc])
        if not scheduled:
            self.a.step([sid], [1 + acc])
        self.b.append(sid, [bonus] + drafts[:acc])
        self.b.step([sid], [1 + acc])
        self.tokens[sid] += [bonus] + drafts[:acc]

    @rule(data=st.data())
    def speculate_batch(self, data: st.DataObject) -> None:
        if not self.tokens or not self._fits(1 + self.k):
            return
        sids = sorted(self.tokens)
        counts = [data.draw(st.integers(1, self.k)) for _ in sids]
        drafts = [data.draw(st.lists(st.integers(0, 2), min_size=c, max_size=c)) for c in counts]
        accs = [data.draw(st.integers(0, c)) for c in counts]
        bonus = [data.draw(st.integers(0, 2)) for _ in sids]
        self.a.append_batch(sids, bonus)
        self.a.append_provisional_batch(sids, counts)
        self.a.step(sids, [1 + c for c in counts])
        flat = [t for d, n in zip(drafts, accs) for t in d[:n]]
        self.a.commit_batch(sids, accs, flat)
        for sid, bo, d, n in zip(sids, bonus, drafts, accs):
            self.b.append(sid, [bo] + d[:n])
            self.tokens[sid] += [bo] + d[:n]
        self.b.step(sids, [1 + n for n in accs])

    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        if not self.tokens or len(self.tokens) >= 4 or not self._fits(0, 2 * self.bs):
            return
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.next_id
        self.next_id += 1
        self._both(lambda m: m.fork(parent, child))
        self.tokens[child] = list(self.tokens[parent])

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        if not self.tokens:
            return
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self._both(lambda m: m.free(sid))
        del self.tokens[sid]

    @rule(probe=st.lists(st.integers(0, 2), min_size=1, max_size=16))
    def probe_hits(self, probe: list[int]) -> None:
        if not self._fits(0, len(probe)):
            return
        assert self.a.can_admit(probe) == self.b.can_admit(probe)
        pid = 10_000 + self.next_id
        self.next_id += 1
        assert self.a.admit(pid, probe).cached_tokens == self.b.admit(pid, probe).cached_tokens
        self._both(lambda m: m.free(pid))

    @invariant()
    def same_state(self) -> None:
        if not hasattr(self, "a"):
            return
        for sid, toks in self.tokens.items():
            assert self.a.seq_len(sid) == self.b.seq_len(sid) == len(toks)
            assert self.a.num_provisional(sid) == 0
            assert self.a.block_hashes(sid) == self.b.block_hashes(sid)
        sa, sb = self.a.stats(), self.b.stats()
        for f in ("prefix_hit_tokens", "prefix_query_tokens", "used_tokens", "used_blocks",
                  "cached_free_blocks", "free_blocks"):
            assert getattr(sa, f) == getattr(sb, f), f
        self.a.check_invariants()
        self.b.check_invariants()


Twins.TestCase.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTwins = Twins.TestCase
