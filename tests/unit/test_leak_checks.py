"""Meta-tests of the P/D leak check (kvconnectors/testing/leaks.py, issue #17 items 7 and 11):
each leaves one thing held and asserts that `pd_leaks` names it; a clean cluster reports nothing.

The cluster is a stand-in for PDCluster with the real parts the check reads: the launcher's own
instance plans (integration/launcher.py plan_instances, pull or push mode), one real in-process
StoreServer + TieredStore per store those plans run, real processes for the servers' pids
(a sleeping child, or this test process where a test needs a process that holds connections)
and a `metrics()` that returns the idle gauges.

Seen to fail (each break patched into leaks.py at run time by a `-p` plugin): gauges read as
`any(v for _, v in m.get(name, []))` again -> test_a_missing_gauge_is_reported fails; only
`cluster_stores(pd)[:1]` checked -> both test_an_entry_left_in_another_store_is_reported cases
and 6 more fail; "nvme_used_bytes" dropped from HELD_FIELDS -> test_nvme_bytes_held_are_reported
fails; idle_connections() allowing MAX_IDLE_PER_PEER to every holder, or one more to decode holders ->
test_a_pull_connection_left_open_is_reported fails, allowing 2 to prefill holders -> test_push_connections_beyond_the_pool_are_reported fails;
the active_connections comparison disabled -> test_a_connection_no_cluster_process_holds_is_reported
fails; decode plans taken for stores in pull mode too -> test_a_clean_cluster_reports_nothing[pull]
fails (nothing listens there). The pd_leaks this replaced (plans[0] only, a missing gauge reads
as 0) fails 9 of these 11 tests; 4 of them because it returned nothing at all.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvconnectors.integration import launcher
from kvconnectors.integration.cluster import launcher_args
from kvconnectors.serving import free_port
from kvconnectors.store import StoreConfig, TieredStore
from kvconnectors.testing.leaks import IDLE_GAUGES, assert_pd_idle, pd_leaks
from kvconnectors.transport import wire
from kvconnectors.transport.client import StoreClient
from kvconnectors.transport.client_pool import MAX_IDLE_PER_PEER
from kvconnectors.transport.server import StoreServer

SLOT, LAYERS, BLOCKS = 4096, 2, 4
FP = "fingerprint-leaks"
COMPAT = wire.compat_hash("tiered")


@dataclass
class Server:
    """What pd_leaks reads of a VllmServer: name, pid and /metrics."""
    name: str
    pid: int
    gauges: dict[str, list[tuple[dict[str, str], float]]] = field(
        default_factory=lambda: {name: [({"engine": "0"}, 0.0)] for name in IDLE_GAUGES})

    def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        return {k: list(v) for k, v in self.gauges.items()}


@dataclass
class Cluster:
    """What pd_leaks reads of a PDCluster, plus the stores it runs (by instance name)."""
    plans: list[launcher.InstancePlan]
    servers: list[Server]
    stores: dict[str, tuple[TieredStore, StoreServer]]

    def server(self, name: str) -> Server:
        return next(s for s in self.servers if s.name == name)

    def client(self, name: str) -> StoreClient:
        return StoreClient("127.0.0.1", self.stores[name][1].port, compat=COMPAT)


def start_store(nvme_dir: str) -> tuple[TieredStore, StoreServer]:
    store = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=LAYERS * BLOCKS * SLOT, nvme_dirs=[nvme_dir],
                                    nvme_bytes=16 * SLOT, nvme_create_dirs=True, lease_ttl_s=30,
                                    dram_prefault=False))
    return store, StoreServer(store, "127.0.0.1", 0, fingerprint=FP, num_layers=LAYERS, compat=COMPAT)


def build(mode: str, tmp_path, procs: list[subprocess.Popen]) -> Cluster:
    """Two prefill instances and one decode, planned by the launcher: a store for each prefill
    plan and, in push mode, for the decode plan; a pull-mode decode plan gets a port nothing
    listens on (asking it would be a failed status call)."""
    roles = ["prefill-0", "prefill-1", "decode-0"]
    stores = {name: start_store(str(tmp_path / name)) for name in roles
              if name.startswith("prefill") or mode == "push"}
    ports: list[int] = []
    for name in roles:  # plan_instances asks for a store port, then an http port, per instance
        ports += [stores[name][1].port if name in stores else free_port(), free_port()]
    args = launcher_args("model", prefill=2, decode=1, mode=mode)
    plans = launcher.plan_instances(args, cores=[0], port_fn=iter(ports).__next__)
    assert [p.name for p in plans] == roles
    servers = []
    for p in plans:
        procs.append(subprocess.Popen(["sleep", "300"]))
        servers.append(Server(p.name, procs[-1].pid))
    return Cluster(plans, servers, stores)


@pytest.fixture
def cluster_of(tmp_path, monkeypatch) -> Iterator:
    monkeypatch.delenv("KVCONNECTORS_SECRET", raising=False)
    procs: list[subprocess.Popen] = []
    built: list[Cluster] = []

    def make(mode: str) -> Cluster:
        built.append(build(mode, tmp_path / mode, procs))
        return built[-1]

    yield make
    for c in built:
        for store, server in c.stores.values():
            server.close()
            store.close()
    for proc in procs:
        proc.kill()
        proc.wait()


def leave_entry(store: TieredStore, key: str = "left") -> None:
    store.create(key, LAYERS, 1)
    store.write(key, list(range(LAYERS)), 0, np.ones((LAYERS, SLOT), np.uint8))
    store.seal(key)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_clean_cluster_reports_nothing(cluster_of, mode) -> None:
    """In push mode prefill-0 (this process) keeps one pooled push connection to the landing
    store, as PushSender does: that is not a leak."""
    c = cluster_of(mode)
    if mode == "pull":
        assert pd_leaks(c) == []
        return
    c.server("prefill-0").pid = os.getpid()
    with c.client("decode-0"):
        assert pd_leaks(c) == []


def test_a_missing_gauge_is_reported_naming_server_and_metric(cluster_of) -> None:
    c = cluster_of("pull")
    del c.server("decode-0").gauges["vllm:kv_cache_usage_perc"]
    c.server("prefill-1").gauges["vllm:num_requests_running"] = [({"engine": "0"}, 2.0)]
    assert pd_leaks(c) == ["prefill-1: vllm:num_requests_running = 2, not 0",
                           "decode-0: vllm:kv_cache_usage_perc missing from /metrics"]


@pytest.mark.parametrize("mode, owner", [("pull", "prefill-1"), ("push", "decode-0")])
def test_an_entry_left_in_another_store_is_reported(cluster_of, mode, owner) -> None:
    """Not plans[0]'s store: the second producer's staging store, or the decode's landing store."""
    c = cluster_of(mode)
    leave_entry(c.stores[owner][0])
    problems = pd_leaks(c)
    addr = f"127.0.0.1:{c.stores[owner][1].port}"
    assert f"{owner}'s store {addr}: entries = 1" in problems, problems
    assert f"{owner}'s store {addr}: dram_used_bytes = {LAYERS * SLOT}" in problems, problems


def test_nvme_bytes_held_are_reported(cluster_of) -> None:
    """An entry that started on NVMe (DRAM held by an unsealed entry, released afterwards): the
    store's own accounting shows the bytes; no file name on disk would."""
    c = cluster_of("pull")
    store = c.stores["prefill-1"][0]
    store.create("fills-dram", LAYERS, BLOCKS)
    store.create("on-nvme", 1, 2)
    store.release("fills-dram")
    assert store.usage()["dram"]["used_bytes"] == 0 and store.info("on-nvme").nvme_slots == 2
    assert not [n for n in os.listdir(store.config.nvme_dirs[0]) if n.endswith(".kv")], "a name to glob for?"
    problems = pd_leaks(c)
    assert f"prefill-1's store 127.0.0.1:{c.stores['prefill-1'][1].port}: nvme_used_bytes = {2 * SLOT}" \
        in problems, problems


def test_a_pull_connection_left_open_is_reported(cluster_of) -> None:
    """A decode worker keeps MAX_IDLE_PER_PEER pull connections per producer store (client_pool.py):
    those are no leak, one more is; a prefill instance keeps none to another's staging store."""
    c = cluster_of("pull")
    c.server("decode-0").pid = os.getpid()
    port = c.stores["prefill-1"][1].port
    with ExitStack() as held:
        for _ in range(MAX_IDLE_PER_PEER):
            held.enter_context(c.client("prefill-1"))
        assert pd_leaks(c) == []
        held.enter_context(c.client("prefill-1"))
        problems = pd_leaks(c)
    assert f"decode-0 pid {os.getpid()} holds {MAX_IDLE_PER_PEER + 1} connections to prefill-1's store " \
           f"127.0.0.1:{port} (at most {MAX_IDLE_PER_PEER} when idle)" in problems, problems
    c.server("decode-0").pid, c.server("prefill-0").pid = c.server("prefill-0").pid, os.getpid()
    with c.client("prefill-1"):
        problems = pd_leaks(c)
    assert f"prefill-0 pid {os.getpid()} holds 1 connections to prefill-1's store 127.0.0.1:{port} " \
           f"(at most 0 when idle)" in problems, problems


def test_push_connections_beyond_the_pool_are_reported(cluster_of) -> None:
    c = cluster_of("push")
    c.server("prefill-0").pid = os.getpid()
    with c.client("decode-0"), c.client("decode-0"):
        problems = pd_leaks(c)
    port = c.stores["decode-0"][1].port
    assert problems == [f"prefill-0 pid {os.getpid()} holds 2 connections to decode-0's store 127.0.0.1:{port} "
                        f"(at most 1 when idle)"], problems


def test_a_connection_no_cluster_process_holds_is_reported(cluster_of) -> None:
    """The store counts a connection that none of the cluster's processes holds (here: this test
    process, not part of the cluster): a server side left open."""
    c = cluster_of("push")
    with c.client("prefill-1"), c.client("decode-0"):
        problems = pd_leaks(c)
    assert problems == [
        f"prefill-1's store 127.0.0.1:{c.stores['prefill-1'][1].port}: 1 open connections, "
        f"the cluster's processes hold 0",
        f"decode-0's store 127.0.0.1:{c.stores['decode-0'][1].port}: 1 open connections, "
        f"the cluster's processes hold 0"], problems


def test_a_dead_producer_is_not_asked_but_the_landing_store_is(cluster_of) -> None:
    c = cluster_of("push")
    for name in ("prefill-0", "prefill-1"):
        store, server = c.stores.pop(name)
        server.close()
        store.close()
    alive = pd_leaks(c)
    assert len(alive) == 2 and all("status call failed" in p for p in alive), alive
    assert pd_leaks(c, producer_alive=False) == []
    leave_entry(c.stores["decode-0"][0])
    assert any(p.startswith("decode-0's store") and "entries = 1" in p for p in pd_leaks(c, producer_alive=False))


def test_assert_pd_idle_fails_naming_what_is_held(cluster_of) -> None:
    c = cluster_of("pull")
    assert_pd_idle(c, timeout=0.0)
    leave_entry(c.stores["prefill-1"][0])
    start = time.monotonic()
    with pytest.raises(AssertionError, match="prefill-1's store .*: entries = 1"):
        assert_pd_idle(c, timeout=1.0)
    assert time.monotonic() - start < 10


def test_established_remote_ports_sees_this_process_sockets_by_remote_port():
    import os
    import socket

    from kvconnectors.testing.leaks import established_remote_ports

    with socket.socket() as lsock:
        lsock.bind(("127.0.0.1", 0))
        lsock.listen()
        port = lsock.getsockname()[1]
        before = established_remote_ports(os.getpid())[port]
        with socket.create_connection(("127.0.0.1", port)) as c1, socket.create_connection(("127.0.0.1", port)) as c2:
            a1, _ = lsock.accept()
            a2, _ = lsock.accept()
            with a1, a2:
                assert established_remote_ports(os.getpid())[port] == before + 2
                assert established_remote_ports(os.getpid())[c1.getsockname()[1]] >= 1  # the accepted side
