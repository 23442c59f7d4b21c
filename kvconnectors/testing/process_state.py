"""This process's CPU affinity and environment, put back after code that changes them in-process.

vLLM's CPU worker, run in-process, pins the calling thread to one core and writes its settings
into os.environ (LD_PRELOAD, LOCAL_WORLD_SIZE, VLLM_DIST_IDENT, ...); NIXL's agent pins the thread
that creates it. Left behind, every thread and process started later inherits them: in the full
suite the servers, proxies and clients of every later test shared one core, and each engine test
after the conformance suite ran ~1.8x slower.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Put back this thread's CPU affinity and os.environ on exit."""
    affinity = os.sched_getaffinity(0)
    env = dict(os.environ)
    try:
        yield
    finally:
        os.sched_setaffinity(0, affinity)
        for key in set(os.environ) - set(env):
            del os.environ[key]
        os.environ.update(env)


def all_cores() -> set[int]:
    """The machine's cores (not this process's affinity, which the code above may have narrowed)."""
    return set(range(os.cpu_count() or 1))
