"""A real ``pagedkv serve`` subprocess on a free loopback port, for tests that drive it over HTTP
with outside clients (``pagedkv bench serve``, third-party load tools)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeProcess:
    """``python -m pagedkv serve MODEL --port P ...``; :meth:`stop` ends it (SIGTERM, then KILL)."""

    def __init__(self, model: str, args: Optional[List[str]] = None, timeout: float = 120.0,
                 log_path: Optional[str] = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep
                   + os.environ.get("PYTHONPATH", ""))
        self.log = open(log_path, "w+") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedkv", "serve", model, "--port", str(self.port),
             "--device", "cpu", "--log-level", "warning", *(args or [])],
            env=env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pagedkv serve exited with {self.proc.returncode}"
                                   + (f": {self.output()}" if log_path else ""))
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as r:
                    self.models = json.load(r)
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("pagedkv serve did not come up in time")
                time.sleep(0.25)

    def output(self) -> str:
        if self.log is subprocess.DEVNULL:
            return ""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
