"""PDCluster.stop removes the shm arenas its workers could not, once their processes are gone."""

from __future__ import annotations

import subprocess
import sys
import time

from kvconnectors.integration import cluster


def test_stop_waits_for_an_exiting_workers_arena_then_reaps_it(tmp_path, monkeypatch) -> None:
    """A worker orphaned by a killed rank may still be exiting when the servers are stopped: its
    arena is reaped once it is gone (a single reap at stop left it; seen in two full runs)."""
    monkeypatch.setattr(cluster, "SHM_DIR", str(tmp_path))
    pd = cluster.PDCluster.__new__(cluster.PDCluster)
    pd._arenas_before = cluster._arena_names()
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    try:
        arena = tmp_path / f"kvc_engine_0_{worker.pid}"
        arena.write_bytes(b"\0" * 4096)  # made after its process started, as a store's arena is
        start = time.monotonic()
        pd._reap_arenas(timeout_s=20)
        assert not arena.exists(), "the exiting worker's arena outlived the cluster's stop"
        assert 1.0 < time.monotonic() - start < 15, "it should wait for the worker, and not much longer"
    finally:
        worker.kill()
        worker.wait()


def test_arenas_from_before_the_cluster_are_not_waited_for(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cluster, "SHM_DIR", str(tmp_path))
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / f"kvc_other_0_{worker.pid}").write_bytes(b"\0" * 4096)  # another, live store's
        pd = cluster.PDCluster.__new__(cluster.PDCluster)
        pd._arenas_before = cluster._arena_names()
        start = time.monotonic()
        pd._reap_arenas(timeout_s=20)
        assert time.monotonic() - start < 2 and (tmp_path / f"kvc_other_0_{worker.pid}").exists()
    finally:
        worker.kill()
        worker.wait()
