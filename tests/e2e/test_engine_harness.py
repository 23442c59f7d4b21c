"""The in-process engine harness (kvconnectors/testing/engines.py) leaves the test process as it found it.

vLLM's CPU worker pins the thread that builds it to one core and writes its settings into
os.environ. Once that leaked, every server, proxy and client started by later tests shared one core
and the engine tests after the conformance suite ran ~1.8x slower in the full suite (the demo: 115 s
from a process pinned to one core, 64 s from one that was not).
Seen to fail: with `process_state.kept` made a plain `yield`, both assertions fail (and
tests/conftest.py's check fails the module after it).
"""

from __future__ import annotations

import os

import pytest

from kvconnectors.testing import process_state
from kvconnectors.testing.engines import generate_ids, llm_engine

pytestmark = [pytest.mark.engine]


def test_an_in_process_engine_leaves_affinity_and_environment_as_they_were(tiny_model: str) -> None:
    cores = process_state.all_cores()
    os.sched_setaffinity(0, cores)
    env = dict(os.environ)
    with llm_engine(tiny_model) as llm:
        assert len(generate_ids(llm, [list(range(1, 40))], 2)[0]) == 2
        changed = sorted(k for k in set(os.environ) | set(env) if os.environ.get(k) != env.get(k))
        print(f"while the engine ran: affinity {sorted(os.sched_getaffinity(0))}, environment changed: {changed}")
    assert os.sched_getaffinity(0) == cores, "the engine left this process pinned"
    leaked = {k: os.environ.get(k) for k in set(os.environ) | set(env) if os.environ.get(k) != env.get(k)}
    assert not leaked, f"the engine left its settings in os.environ: {leaked}"
