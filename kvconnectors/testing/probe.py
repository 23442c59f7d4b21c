"""Per-module resource probe for the test suite (tests/conftest.py, KVC_SUITE_PROBE=FILE): where
the machine's CPU went while one module ran, and what memory looked like at its end."""

from __future__ import annotations

import json
import os
import time

import psutil


def _cpu_by_process() -> dict[int, tuple[str, float]]:
    out: dict[int, tuple[str, float]] = {}
    for p in psutil.process_iter(["name", "cmdline", "cpu_times"]):
        try:
            t = p.info["cpu_times"]
            if t is None:
                continue
            cmd = " ".join(p.info["cmdline"] or [p.info["name"] or "?"])[:160]
            out[p.pid] = (cmd, t.user + t.system)
        except (psutil.Error, TypeError):
            continue
    return out


class ModuleProbe:
    def __init__(self, module: str):
        self.module = module
        self.start = time.monotonic()
        self.cpu0 = _cpu_by_process()
        self.own0 = psutil.Process().cpu_times()
        self.machine0 = psutil.cpu_times()

    def write(self, path: str) -> None:
        cpu1 = _cpu_by_process()
        me = os.getpid()
        spent = []
        for pid, (cmd, t) in cpu1.items():
            if pid == me:
                continue
            before = self.cpu0.get(pid, (cmd, 0.0))[1]
            if t - before > 0.5:
                spent.append((round(t - before, 1), pid, cmd))
        spent.sort(reverse=True)
        own = psutil.Process().cpu_times()
        m1 = psutil.cpu_times()
        mem = {k: v for k, v in (line.split(":") for line in open("/proc/meminfo"))}
        row = {
            "module": self.module, "wall_s": round(time.monotonic() - self.start, 1),
            "loadavg": os.getloadavg(), "pytest_cpu_s": round(own.user + own.system - self.own0.user - self.own0.system, 1),
            "children_cpu_s": round(own.children_user + own.children_system
                                    - self.own0.children_user - self.own0.children_system, 1),
            "live_processes_cpu_s": spent[:8],
            "meminfo_kib": {k: int(mem[k].split()[0]) for k in ("MemAvailable", "Cached", "Shmem", "SwapFree")
                            if k in mem},
            # the whole machine over the module: busy, idle and stolen (by the hypervisor) CPU seconds
            "machine_cpu_s": {k: round(getattr(m1, k) - getattr(self.machine0, k), 1)
                              for k in ("user", "system", "idle", "iowait", "steal")},
        }
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
