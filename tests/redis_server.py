"""A real ``redis-server`` on loopback for the remote tier's tests.

:class:`RedisServer` starts the Debian package's binary on a free port with persistence off
(``--save "" --appendonly no``), waits until it answers PING, and can be stopped, paused (SIGSTOP:
a server that accepts connections but never answers) and restarted on the same port.
:func:`redis_or_skip` decides what a missing binary means: a skip on a developer's machine, a
failure where ``PAGEDKV_REQUIRE_REDIS`` is set (CI, ``scripts/test.sh``), so a broken install never
passes as skipped tests.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

import pytest

REQUIRE_ENV = "PAGEDKV_REQUIRE_REDIS"


def redis_or_skip() -> str:
    """Path of ``redis-server`` and of an importable redis-py, or skip / fail as described above."""
    binary = shutil.which("redis-server")
    problem = None
    if binary is None:
        problem = "redis-server is not on PATH (scripts/setup.sh installs Debian's redis-server)"
    else:
        try:
            import redis  # noqa: F401
        except ImportError:
            problem = "redis-py is not installed (pip install -r requirements/dev.txt)"
    if problem is not None:
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{problem}, and {REQUIRE_ENV} is set", pytrace=False)
        pytest.skip(problem)
    assert binary is not None
    return binary


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process; :attr:`url` stays the same across :meth:`restart`."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = _free_port()
        self.proc: Optional[subprocess.Popen[bytes]] = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, wait_s: float = 10.0) -> None:
        assert self.proc is None
        self.proc = subprocess.Popen(
            [
                self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir), "--daemonize", "no",
                "--loglevel", "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + wait_s
        while not _ping(self.port):
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError(f"redis-server exited at start-up on port {self.port}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer PING on port {self.port} in {wait_s} s")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL: the server vanishes without closing anything gracefully."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        proc.kill()
        proc.wait()

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        self.stop()
        self.start()
