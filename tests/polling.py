"""A bounded wait on a condition another thread or process makes true, for the few tests with no event to wait
on (a server's connection count, another process's SQLite writes, a worker thread being scheduled): the condition
is polled until a deadline, never slept on for a fixed time."""
from __future__ import annotations

import time
from typing import Callable


def wait_for(condition: Callable[[], object], within: float = 30.0, every: float = 0.02) -> bool:
    """Whether `condition()` became true within `within` seconds (checked every `every` seconds)."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() >= deadline:
            return bool(condition())
        time.sleep(every)
    return True
