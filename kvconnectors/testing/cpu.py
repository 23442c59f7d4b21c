"""CPU used by every thread of a set of processes over a window, for idle-CPU checks.

Every thread counts, the busiest included: the only thread left out is the one that measures,
identified by identity (its pid and `threading.get_native_id()`), so a spinning server thread
cannot hide as "the test's own". Totals come from the process counters, which keep the time of
threads that exited during the window; per-thread figures (from /proc/<pid>/task/<tid>) are
there to name the busy thread in a failure message.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

ThreadKey = tuple[int, int]  # (pid, tid)


@dataclass(frozen=True)
class ThreadCpu:
    pid: int
    tid: int
    process: str  # the process's name
    name: str  # the thread's name (Python's name for threads of this process, else /proc comm)
    cpu_s: float  # user + system seconds


@dataclass(frozen=True)
class Snapshot:
    at: float  # time.monotonic()
    processes: dict[int, float]  # pid -> user + system seconds of the whole process
    threads: dict[ThreadKey, ThreadCpu]


@dataclass(frozen=True)
class CpuUsage:
    window_s: float
    total_s: float  # every thread of the measured processes, less the measuring thread
    threads: tuple[ThreadCpu, ...]  # per-thread seconds in the window, busiest first, measurer left out
    excluded: ThreadCpu | None  # the measuring thread, when it was in a measured process

    @property
    def cores(self) -> float:
        return self.total_s / self.window_s if self.window_s > 0 else 0.0

    @property
    def unattributed_s(self) -> float:
        """Time of threads that exited during the window (in the totals, in no thread's row)."""
        return max(0.0, self.total_s - sum(t.cpu_s for t in self.threads))

    def describe(self, top: int = 5) -> str:
        rows = [f"  {t.name} (tid {t.tid}, pid {t.pid} {t.process}): {t.cpu_s:.3f} CPU-s"
                for t in self.threads[:top]]
        if self.unattributed_s >= 0.02:  # below that it is clock-tick rounding between the two counters
            rows.append(f"  in no live thread (threads that exited in the window): {self.unattributed_s:.3f} CPU-s")
        head = (f"{self.cores:.3f} cores ({self.total_s:.3f} CPU-s in {self.window_s:.2f} s, "
                f"{len(self.threads)} threads); busiest:")
        return "\n".join([head, *rows])


def tree_pids(roots: Iterable[int | None]) -> list[int]:
    """`roots` and all their live descendants (gone or None roots are skipped)."""
    pids: list[int] = []
    for root in roots:
        if root is None:
            continue
        try:
            proc = psutil.Process(root)
            pids += [proc.pid, *(c.pid for c in proc.children(recursive=True))]
        except psutil.Error:
            continue
    return pids


def _comm(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "?"


def _python_names() -> dict[int, str]:
    """Python's thread names by native id: comm does not carry them on Python < 3.14."""
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def snapshot(pids: Iterable[int]) -> Snapshot:
    """CPU seconds so far of each process in `pids` and of each of its threads (gone ones skipped)."""
    own, py_names = os.getpid(), _python_names()
    processes: dict[int, float] = {}
    threads: dict[ThreadKey, ThreadCpu] = {}
    for pid in dict.fromkeys(pids):
        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                pname, times, rows = proc.name(), proc.cpu_times(), proc.threads()
        except psutil.Error:  # exited (or a zombie) since it was listed
            continue
        processes[pid] = times.user + times.system
        for r in rows:
            name = py_names.get(r.id) if pid == own else None
            threads[(pid, r.id)] = ThreadCpu(pid, r.id, pname, name or _comm(pid, r.id),
                                             r.user_time + r.system_time)
    return Snapshot(time.monotonic(), processes, threads)


def usage_between(before: Snapshot, after: Snapshot, exclude: ThreadKey | None = None) -> CpuUsage:
    """What each process and thread in `after` used since `before`; `exclude` is left out of both.

    A process or thread absent from `before` started in the window, so all of its time counts.
    """
    total = sum(s - before.processes.get(pid, 0.0) for pid, s in after.processes.items())
    rows = []
    excluded = None
    for key, t in after.threads.items():
        prev = before.threads.get(key)
        row = ThreadCpu(t.pid, t.tid, t.process, t.name, max(0.0, t.cpu_s - (prev.cpu_s if prev else 0.0)))
        if key == exclude:
            excluded = row
            total -= row.cpu_s
        else:
            rows.append(row)
    rows.sort(key=lambda r: r.cpu_s, reverse=True)
    return CpuUsage(after.at - before.at, max(0.0, total), tuple(rows), excluded)


def measure(pids: Callable[[], Iterable[int]] | Iterable[int], seconds: float) -> CpuUsage:
    """CPU used by every thread of `pids` while the calling thread sleeps `seconds`.

    `pids` may be a callable, asked again for the second snapshot so processes started in the
    window count too. The calling thread is the measurer: it alone is left out (by identity).
    """
    if callable(pids):
        listing = pids
    else:
        fixed = list(pids)
        listing = lambda: fixed  # noqa: E731
    me = (os.getpid(), threading.get_native_id())
    before = snapshot(listing())
    time.sleep(seconds)
    return usage_between(before, snapshot(listing()), exclude=me)


# An idle in-process server: 0.05 CPU-s over 2 s for all its threads together (~2 clock ticks of
# slack per second, where a polling thread costs a whole core).
IDLE_WINDOW_S = 2.0
IDLE_MAX_CORES = 0.025


def assert_cpu_at_most(usage: CpuUsage, max_cores: float, what: str) -> None:
    """Fail, naming the busiest threads, when `usage` exceeds `max_cores`."""
    assert usage.cores <= max_cores, f"{what} used more than {max_cores:.3f} cores: {usage.describe()}"


def assert_process_idle(what: str, window_s: float = IDLE_WINDOW_S, max_cores: float = IDLE_MAX_CORES) -> None:
    """Every thread of this process but the caller (which measures) uses ~no CPU over `window_s`."""
    assert_cpu_at_most(measure([os.getpid()], window_s), max_cores, what)
