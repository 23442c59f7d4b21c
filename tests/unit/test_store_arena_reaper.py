"""Arenas of stores that died without closing them (SIGKILL, the OOM killer) are removed; live
stores' arenas, and files that are not arenas, are never touched (store/arena.reap_stale_arenas)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

import psutil

from kvconnectors.store.arena import reap_stale_arenas


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_arenas_of_dead_unlocked_stores_are_removed(tmp_path) -> None:
    gone, alive = dead_pid(), os.getpid()
    names = {"stale": f"kvc_prefill_1_{gone}", "live_pid": f"kvc_decode_0_{alive}",
             "locked": f"kvc_other_0_{gone}",  # a dead pid's name, but a live store holds its lock
             "other": f"psm_{gone}", "not_ours": f"kvcx_a_1_{gone}"}
    for name in names.values():
        (tmp_path / name).write_bytes(b"kv" * 10)
    holder = os.open(tmp_path / names["locked"], os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        assert reap_stale_arenas(str(tmp_path)) == [names["stale"]]
    finally:
        os.close(holder)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(v for k, v in names.items() if k != "stale")
    assert reap_stale_arenas(str(tmp_path)) == [names["locked"]]  # its holder is gone now


def test_a_missing_directory_is_nothing_to_reap(tmp_path) -> None:
    assert reap_stale_arenas(str(tmp_path / "nope")) == []


def test_an_arena_whose_pid_was_reused_by_a_later_process_is_removed(tmp_path, monkeypatch) -> None:
    """pid_max is often 32768 and a test run wraps it: a SIGKILLed store's pid may belong to a new
    process by the time anyone reaps. A live pid whose process started after the arena was last
    changed is not its store (the arena goes); one started before may be (it stays)."""
    from kvconnectors.store import arena

    path = tmp_path / f"kvc_prefill_1_{os.getpid()}"  # a live pid
    path.write_bytes(b"kv")
    made = os.stat(path).st_ctime
    start = {"t": made - 5.0}

    class Proc:
        def __init__(self, pid: int):
            self.pid = pid

        def create_time(self) -> float:
            return start["t"]

        def status(self) -> str:
            return start.get("status", "running")
    monkeypatch.setattr(arena.psutil, "Process", Proc)
    assert reap_stale_arenas(str(tmp_path)) == []  # started before it was made: may be its store
    start["t"] = made + 5.0
    assert reap_stale_arenas(str(tmp_path)) == [path.name]  # started after: the pid was reused


def test_an_arena_of_a_killed_store_still_a_zombie_is_removed(tmp_path) -> None:
    """A SIGKILLed worker whose parent has not reaped it yet is a zombie: its pid answers kill(0),
    but nothing holds the arena any more."""
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        path = tmp_path / f"kvc_prefill_1_{zombie.pid}"
        path.write_bytes(b"kv")
        assert reap_stale_arenas(str(tmp_path)) == [path.name]
    finally:
        zombie.wait()
