"""Shared pieces of the security tests: a real store server on 127.0.0.1 over a small store, an
entry staged in it, and a record of exceptions that escaped any thread (a connection thread
that dies unanswered is a finding, not noise)."""

from __future__ import annotations

import resource
import threading

import pytest

from kvconnectors.testing.logcapture import plain_logging
from kvconnectors.store import StoreConfig, TieredStore

from sec_helpers import COMPAT, FP, LAYERS, SLOT  # noqa: E402


@pytest.fixture
def make_server():
    """make_server(**StoreServer kwargs) -> a running server over its own small store; all closed after."""
    from kvconnectors.transport.server import StoreServer

    made = []

    def make(**kw):
        store = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=64 * SLOT, lease_ttl_s=30))
        kw.setdefault("compat", COMPAT)
        srv = StoreServer(store, "127.0.0.1", 0, fingerprint=FP, num_layers=LAYERS, **kw)
        made.append((srv, store))
        return srv

    yield make
    for srv, store in made:
        srv.close()
        store.close()


@pytest.fixture
def thread_errors(monkeypatch):
    """Exceptions that escaped a thread's target during the test (threading.excepthook)."""
    seen: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    return seen


@pytest.fixture
def many_files():
    """Room for a few hundred sockets on both ends (RLIMIT_NOFILE raised, restored after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(autouse=True)
def plain_kvconnectors_logging():
    """caplog reads kvconnectors records on the root logger (testing/logcapture.py)."""
    with plain_logging():
        yield

