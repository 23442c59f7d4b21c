"""The idle-CPU checks can fail: one busy-polling thread or process beside idle servers is caught.

These switch off what `test_idle_server_uses_no_cpu` and tests/e2e/test_tiered_servers.py's idle P/D pairs guard (one
thread or one descendant process spins) and assert that the same assertion those tests use fails
and names the spinner. Before kvconnectors.testing.cpu, the unit check dropped the busiest thread
as "the test's own", so the spinning-thread case below passed.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import psutil
import pytest

from kvconnectors.store import StoreConfig, TieredStore
from kvconnectors.testing import cpu
from kvconnectors.transport import wire
from kvconnectors.transport.client import StoreClient
from kvconnectors.transport.server import StoreServer

SLOT = 4096
COMPAT = wire.compat_hash("tiered")
WINDOW_S = 1.0  # the check is a rate: a spinner costs ~1 core, far above the limit, in any window
TREE_WINDOW_S, TREE_MAX_CORES = 0.5, 0.05  # the e2e test's tolerance over its baseline


@pytest.fixture
def idle_server() -> Iterator[StoreServer]:
    """A store server with an open, idle client connection, as in the real unit check."""
    store = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=16 * SLOT))
    srv = StoreServer(store, "127.0.0.1", 0, fingerprint="fp", num_layers=2, compat=COMPAT)
    client = StoreClient("127.0.0.1", srv.port, compat=COMPAT)
    try:
        yield srv
    finally:
        client.close()
        srv.close()
        store.close()


def _poll_nonblocking(sock: socket.socket, stop: threading.Event) -> None:
    """A busy-polling receive loop: what an idle transport thread must never do."""
    while not stop.is_set():
        try:
            sock.recv(1)
        except BlockingIOError:
            pass


def test_one_busy_polling_thread_fails_the_idle_check(idle_server) -> None:
    a, b = socket.socketpair()
    a.setblocking(False)
    stop = threading.Event()
    spinner = threading.Thread(target=_poll_nonblocking, args=(a, stop), name="kvc-test-spinner", daemon=True)
    spinner.start()
    try:
        with pytest.raises(AssertionError) as err:
            cpu.assert_process_idle("an idle store server and client", window_s=WINDOW_S)
    finally:
        stop.set()
        spinner.join(5)
        a.close()
        b.close()
    assert f"kvc-test-spinner (tid {spinner.native_id}," in str(err.value)  # the message names it


def test_the_same_check_passes_without_the_spinner(idle_server) -> None:
    cpu.assert_process_idle("an idle store server and client", window_s=WINDOW_S)


def _start_tree(work: str) -> subprocess.Popen:
    """A parent that waits on a grandchild, which says "ready" (its start-up done), then runs `work`."""
    child = f"print('ready', flush=True)\n{work}"
    return subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"],
                            stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize("work,busy", [("while True: pass", True), ("import time; time.sleep(60)", False)])
def test_the_tree_check_catches_a_spinning_grandchild_only(work: str, busy: bool) -> None:
    """The e2e check's path: the process tree is rediscovered per snapshot; a grandchild spins or sleeps."""
    parent = _start_tree(work)
    try:
        assert parent.stdout is not None and parent.stdout.readline() == "ready\n"
        grandchild = psutil.Process(parent.pid).children(recursive=True)[0]
        usage = cpu.measure(lambda: cpu.tree_pids([parent.pid]), TREE_WINDOW_S)
        if not busy:
            cpu.assert_cpu_at_most(usage, TREE_MAX_CORES, "an idle process tree")
            return
        with pytest.raises(AssertionError) as err:
            cpu.assert_cpu_at_most(usage, TREE_MAX_CORES, "an idle process tree")
        assert f"(tid {grandchild.pid}, pid {grandchild.pid}" in str(err.value)  # names the spinner
    finally:
        for p in psutil.Process(parent.pid).children(recursive=True):
            p.kill()
        parent.kill()
        parent.wait(5)
