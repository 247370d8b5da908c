"""``pagedkv.metrics``: the Prometheus collector served over real HTTP, and read during steps.

A scheduler drives a real manager (a pool small enough to preempt, shared prompts so the prefix
cache hits); the collector's endpoint is scraped with urllib on a free port and parsed with
prometheus_client's own text-format parser; every exported figure must equal what the manager's
``stats()`` and the scheduler say. A second test scrapes from a thread while the main thread steps:
no scrape may fail. Preemptions and prefix-cache resets are logged on the ``pagedkv`` logger.
"""

from __future__ import annotations

import logging
import threading
import urllib.request
import zlib

import pytest

pytest.importorskip("pagedkv._core")
prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pagedkv.buffers import StepBuffers  # noqa: E402
from pagedkv.errors import InvalidArgumentError  # noqa: E402
from pagedkv.manager import BlockManager  # noqa: E402
from pagedkv.metrics import PagedKVCollector, snapshot, start_metrics_server  # noqa: E402
from pagedkv.scheduler import Scheduler, Sequence  # noqa: E402

BLOCK = 4
PREFIX = list(range(100, 116))  # 4 shared blocks


def _setup(num_blocks=24, max_num_seqs=6):
    m = BlockManager(num_blocks, BLOCK, watermark_blocks=1, max_blocks_per_seq=num_blocks)
    m.attach_buffers(StepBuffers(max_num_seqs, 256, num_blocks, max_copies=64, device="cpu"))
    return m, Scheduler(m, max_num_seqs=max_num_seqs, max_num_batched_tokens=64)


def _step(sched: Scheduler) -> None:
    """One step with a fake model whose next token depends on every token before it."""
    batch = sched.schedule()
    if batch.is_empty:
        return
    sampled = [zlib.crc32(repr(s.token_ids).encode()) % 500 if m else None
               for s, m in zip(batch.seqs, batch.sample_mask())]
    sched.postprocess(batch, sampled)
    done = [s for s in batch.seqs if s.num_output_tokens >= 12]
    if done:
        sched.finish_many(done)


def _scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_http_endpoint_matches_stats():
    m, sched = _setup()
    for i in range(5):
        sched.add(Sequence(i, PREFIX + [i, i + 1, i + 2], request_id=f"r{i}"))
    server, thread, _ = start_metrics_server(0, m, sched, bytes_per_block=4096)
    try:
        port = server.server_port
        for _ in range(25):
            _step(sched)
        assert sched.num_preemptions > 0, "the pool is meant to be small enough to preempt"
        got = _scrape(port)
        s = m.stats()
        assert got[("pagedkv_kv_cache_usage_ratio", ())] == pytest.approx(s.used_blocks / s.num_blocks)
        assert 0.0 <= got[("pagedkv_kv_cache_usage_ratio", ())] <= 1.0
        assert got[("pagedkv_prefix_cache_queries_total", ())] == s.prefix_query_tokens
        assert got[("pagedkv_prefix_cache_hits_total", ())] == s.prefix_hit_tokens
        assert s.prefix_hit_tokens > 0
        by_mode = sched.num_preemptions_by_mode
        assert got[("pagedkv_preemptions_total", (("mode", "recompute"),))] == by_mode["recompute"]
        assert got[("pagedkv_preemptions_total", (("mode", "swap"),))] == by_mode["swap"]
        assert sum(by_mode.values()) == sched.num_preemptions
        assert got[("pagedkv_evictions_total", ())] == s.evictions
        assert got[("pagedkv_num_blocks", ())] == 24
        assert got[("pagedkv_num_free_blocks", ())] == s.free_blocks + s.cached_free_blocks
        assert got[("pagedkv_num_requests_running", ())] == sched.num_running
        assert got[("pagedkv_num_requests_waiting", ())] == sched.num_waiting
        assert ("pagedkv_swapped_out_bytes_total", ()) in got
        # Histogram: cumulative buckets over the live sequences, +Inf = all of them.
        inf = got[("pagedkv_blocks_per_seq_bucket", (("le", "+Inf"),))]
        assert inf == m.num_seqs == sum(s.blocks_per_seq)
        cum = 0
        for k, n in enumerate(s.blocks_per_seq[:-1]):
            cum += n
            assert got[("pagedkv_blocks_per_seq_bucket", (("le", f"{2**k}.0"),))] == cum
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_scrape_during_steps_never_fails():
    m, sched = _setup(num_blocks=32)
    collector = PagedKVCollector(m, sched)
    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(collector)
    stop = threading.Event()
    errors: list = []
    scrapes = [0]

    def reader() -> None:
        try:
            while not stop.is_set():
                text = prometheus_client.generate_latest(registry).decode()
                assert "pagedkv_kv_cache_usage_ratio" in text
                m.stats()
                scrapes[0] += 1
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    try:
        next_id = 0
        for round_ in range(40):
            for _ in range(2):
                sched.add(Sequence(next_id, PREFIX + [next_id % 50] * (1 + next_id % 7),
                                   request_id=f"r{next_id}"))
                next_id += 1
            for _ in range(4):
                _step(sched)
        while sched.has_unfinished():
            _step(sched)
    finally:
        stop.set()
        t.join(timeout=30)
    assert not errors, errors
    assert scrapes[0] > 0
    m.check_invariants()
    assert m.num_seqs == 0


def test_snapshot_without_scheduler_and_bad_input():
    m, _ = _setup()
    d = snapshot(m)
    assert d["kv_cache_usage"] == 0.0 and d["running"] is None
    assert d["preemptions"] == {"swap": 0, "recompute": 0}
    assert d["swapped_out_bytes"] is None
    with pytest.raises(InvalidArgumentError):
        PagedKVCollector(object())
    with pytest.raises(InvalidArgumentError):
        PagedKVCollector(m, bytes_per_block=0)
    with pytest.raises(InvalidArgumentError):
        start_metrics_server(70000, m)


def test_missing_prometheus_names_the_extra(monkeypatch):
    import builtins

    from pagedkv.metrics import MetricsUnavailableError

    real = builtins.__import__

    def no_prometheus(name, *args, **kw):
        if name.startswith("prometheus_client"):
            raise ImportError(name)
        return real(name, *args, **kw)

    m, _ = _setup()
    monkeypatch.setattr(builtins, "__import__", no_prometheus)
    with pytest.raises(MetricsUnavailableError, match=r"pagedkv\[metrics\]") as info:
        PagedKVCollector(m)
    assert isinstance(info.value, ImportError)
    assert "\n" not in str(info.value)


def test_preemption_and_cache_reset_are_logged(caplog):
    m, sched = _setup()
    for i in range(5):
        sched.add(Sequence(i, PREFIX + [i, i + 1, i + 2], request_id=f"r{i}"))
    with caplog.at_level(logging.INFO, logger="pagedkv"):
        for _ in range(25):
            _step(sched)
        m.reset_prefix_cache()
    msgs = [r.getMessage() for r in caplog.records if r.name == "pagedkv"]
    assert any("preempted sequence" in x and "recompute" in x for x in msgs)
    assert any("prefix cache reset" in x for x in msgs)
