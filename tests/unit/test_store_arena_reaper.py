"""Arenas of stores that died without closing them (SIGKILL, the OOM killer) are removed; live
stores' arenas, and files that are not arenas, are never touched (store/arena.reap_stale_arenas)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

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
