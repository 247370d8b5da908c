"""``wait_for``: polls a condition until it holds or a deadline passes, for tests of threads and
sockets whose effects arrive asynchronously."""

from __future__ import annotations

import time
from typing import Callable


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, interval: float = 0.01) -> None:
    """Returns once ``cond()`` is true; raises ``AssertionError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(interval)
