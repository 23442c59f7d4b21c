"""Shared fixtures. Engine tests build real vLLM engines on CPU; they never run in parallel."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from kvconnectors.transport.ucx_env import set_cpu_defaults

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
set_cpu_defaults()
os.environ.setdefault("KVCONNECTORS_CACHE", str(Path(__file__).resolve().parents[1] / ".cache"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "engine: builds real vLLM engines or servers (slow, serial)")
    config.addinivalue_line("markers", "slow: no engine, but tens of seconds (e.g. builds and installs the wheel)")


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from kvconnectors.testing.tinymodel import ensure_tiny_model

    return str(ensure_tiny_model("tiny"))


@pytest.fixture(scope="session")
def deep_model() -> str:
    from kvconnectors.testing.tinymodel import ensure_tiny_model

    return str(ensure_tiny_model("deep"))


# No silent skips (issue #17, item 10): a skip whose reason matches no pattern of
# tests/allowed_skips.txt fails the session (kvconnectors/testing/skips.py).
def pytest_sessionstart(session: pytest.Session) -> None:
    from kvconnectors.testing.skips import install

    install(session.config, Path(__file__).with_name("allowed_skips.txt"))


# vLLM's ZMQ IPC sockets (<VLLM_RPC_BASE_PATH>/<uuid>) outlive killed engines: the whole session's go
# into one folder (servers make their own inside it), removed when this process exits (not in
# pytest_unconfigure: a test that runs pytest inside this process would unconfigure it early).
_RPC_DIR = tempfile.mkdtemp(prefix="kvc-tests-rpc-")
os.environ["VLLM_RPC_BASE_PATH"] = _RPC_DIR
atexit.register(shutil.rmtree, _RPC_DIR, ignore_errors=True)


_SESSION_START = time.time()
_SESSION_AFFINITY = os.sched_getaffinity(0)


@pytest.fixture(scope="module", autouse=True)
def _process_not_left_pinned():
    """After each module: this process's CPU affinity is what it was at the start. In-process
    engines pin it (kvconnectors/testing/process_state.py), and every server, proxy and client
    started later would inherit one core: the suite once ran ~1.8x slower that way, unnoticed."""
    yield
    now = os.sched_getaffinity(0)
    if now != _SESSION_AFFINITY:
        os.sched_setaffinity(0, _SESSION_AFFINITY)  # the next modules run as they should
        pytest.fail(f"this module left the test process pinned to cores {sorted(now)} "
                    f"(it started on {sorted(_SESSION_AFFINITY)})")


@pytest.fixture(scope="module", autouse=True)
def _no_orphaned_shm_segments():
    """After each module: the shared-memory segments its killed engines left (kvconnectors/testing/shm.py)."""
    yield
    from kvconnectors.testing.shm import remove_orphaned_segments

    remove_orphaned_segments(_SESSION_START)


@pytest.fixture(scope="module", autouse=True)
def _suite_probe(request: pytest.FixtureRequest):
    """KVC_SUITE_PROBE=FILE: one JSON line per module (wall seconds, load, memory, the CPU seconds of
    the busiest processes outside this one), to see why engine modules run slower in the full suite."""
    path = os.environ.get("KVC_SUITE_PROBE")
    if not path:
        yield
        return
    from kvconnectors.testing.probe import ModuleProbe

    probe = ModuleProbe(request.module.__name__)
    yield
    probe.write(path)


@pytest.fixture(scope="module")
def hosts():
    """Three emulated hosts (kvconnectors/testing/hosts.py), one set per module: `pre` (prefill),
    `dec` (decode), `cli` (proxy and client). Without CAP_NET_ADMIN: a skip, which
    tests/allowed_skips.txt does not list, so a CI without it fails loudly."""
    from kvconnectors.testing.hosts import Hosts, HostsUnavailable, require

    try:
        require()
    except HostsUnavailable as exc:
        pytest.skip(f"emulated hosts unavailable: {exc}")
    with Hosts(["pre", "dec", "cli"]) as h:
        yield h
