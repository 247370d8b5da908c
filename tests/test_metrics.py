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
    with pytest.raises(MetricsUnavailableError, match=r"'\.\[metrics\]'") as info:
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


# ------------------------------------------------------------------------------ the endpoint


def _closed_by_peer(sock, wait_s: float) -> bool:
    """Whether the server has closed ``sock`` (EOF or reset) within ``wait_s``."""
    import select

    r, _, _ = select.select([sock], [], [], wait_s)
    if not r:
        return False
    try:
        return sock.recv(1024) == b""
    except OSError:
        return True


def test_flood_of_half_sent_requests_is_bounded_and_scrapes_still_succeed():
    import socket

    m, sched = _setup()
    threads_before = threading.active_count()
    server, thread, _ = start_metrics_server(0, m, sched)
    port = server.server_port
    flood = []
    try:
        for _ in range(400):
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
            flood.append(s)
        # One thread serves every client, however many are connected.
        assert threading.active_count() <= threads_before + 1
        # A real scrape gets through the flood (urllib's timeout bounds the wait).
        got = _scrape(port)
        assert got[("pagedkv_num_blocks", ())] == 24
        assert threading.active_count() <= threads_before + 1
        assert server.num_connections <= server.max_connections
        # The server closed the flood's sockets: the oldest to stay under the cap, the rest at
        # their deadline.
        assert all(_closed_by_peer(s, 5.0) for s in flood[-server.max_connections:])
        assert all(_closed_by_peer(s, 0.5) for s in flood[:10])
        assert server.num_connections == 0
    finally:
        for s in flood:
            s.close()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    assert not thread.is_alive()


def test_slow_client_is_cut_off_at_the_request_deadline():
    import socket
    import time

    m, sched = _setup()
    server, thread, _ = start_metrics_server(0, m, sched)
    try:
        assert server.server_address[0] == "127.0.0.1"
        s = socket.create_connection(("127.0.0.1", server.server_port), timeout=2)
        request = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n" + b"X: y\r\n" * 40
        cut = False
        started = time.monotonic()
        # One byte every 0.1 s: each arrives well within any per-read timeout, but the whole
        # request would take 30 s; the server must drop it at its deadline (2 s by default).
        for i in range(len(request)):
            try:
                s.sendall(request[i: i + 1])
            except OSError:
                cut = True
                break
            if _closed_by_peer(s, 0.1):
                cut = True
                break
            if time.monotonic() - started > 6:
                break
        s.close()
        assert cut, "a client trickling its request must be disconnected"
        assert server.num_timed_out >= 1
        assert _scrape(server.server_port)[("pagedkv_num_blocks", ())] == 24
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_endpoint_answers_bad_requests_and_refuses_bad_limits():
    import socket

    m, sched = _setup()
    server, thread, _ = start_metrics_server(0, m, sched)
    port = server.server_port

    def ask(raw: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
            s.sendall(raw)
            out = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    return out
                out += chunk

    try:
        assert ask(b"GET /other HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404")
        assert ask(b"POST /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405")
        assert ask(b"nonsense\r\n\r\n").startswith(b"HTTP/1.1 400")
        assert ask(b"GET /metrics HTTP/1.1\r\n" + b"X: " + b"y" * 9000).startswith(
            b"HTTP/1.1 431")
        head = ask(b"HEAD /metrics HTTP/1.1\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n")
        om = ask(b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text\r\n\r\n")
        assert b"application/openmetrics-text" in om and om.rstrip().endswith(b"# EOF")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    for kw in ({"max_connections": 0}, {"request_timeout_s": 0}, {"request_timeout_s": "1"}):
        with pytest.raises(InvalidArgumentError):
            start_metrics_server(0, m, sched, **kw)


def test_scrape_snapshot_is_taken_by_the_step_thread():
    m, sched = _setup()
    sched.add(Sequence(0, PREFIX, request_id="r0"))
    collector = PagedKVCollector(m, sched, max_age_s=0.0, step_wait_s=5.0)

    def run_steps() -> None:
        for _ in range(50):
            _step(sched)

    steps = threading.Thread(target=run_steps)
    seen = []
    real_take = collector._snapshots._take

    def take():
        seen.append(threading.get_ident())
        return real_take()

    collector._snapshots._take = take
    t = threading.Thread(target=lambda: seen.append(("ok", list(collector.collect()))))
    t.start()
    # The scrape waits for a step; the step thread takes the snapshot at its next schedule().
    while sched.metrics_hook is None and t.is_alive():
        t.join(0.001)
    steps.start()
    t.join(10)
    steps.join(10)
    assert seen[0] == steps.ident and seen[1][0] == "ok"
    # Without steps the scrape reads for itself after step_wait_s.
    idle = PagedKVCollector(m, sched, max_age_s=0.0, step_wait_s=0.01)
    assert any(f.name == "pagedkv_num_blocks" for f in idle.collect())
    assert sched.metrics_hook is None
