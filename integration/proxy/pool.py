"""The instance pools: each instance's load and health, least-loaded picking, and the /health loop
that takes dead instances out of rotation and puts recovered ones back."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from typing import Any

import aiohttp
from yarl import URL

from .config import InstanceSpec
from .metrics import ProxyMetrics

log = logging.getLogger("kvconnectors.proxy")


class Instance:
    def __init__(self, spec: InstanceSpec, role: str, metrics: ProxyMetrics):
        self.spec, self.role = spec, role
        self.url = spec.url
        self.outstanding = 0
        self.healthy = True
        self.failed_checks = 0
        # Read when /metrics is scraped, so acquire/release (4 per request) touch no lock.
        metrics.outstanding.labels(role, spec.url).set_function(lambda: self.outstanding)
        self._health = metrics.healthy.labels(role, spec.url)
        self._health.set(1)
        self._urls: dict[str, URL] = {}

    def endpoint(self, path: str) -> URL:
        """The parsed URL of `path` on this instance (parsed once, not per request)."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.url + path)
        return url

    def acquire(self) -> None:
        self.outstanding += 1

    def release(self) -> None:
        self.outstanding -= 1

    def set_healthy(self, ok: bool, why: str = "") -> None:
        if ok != self.healthy:
            if ok:
                log.info("%s %s is healthy again; back in rotation", self.role, self.url)
            else:
                log.warning("%s %s taken out of rotation: %s", self.role, self.url, why)
        self.healthy = ok
        self._health.set(1 if ok else 0)

    def record_check(self, ok: bool, unhealthy_after: int, why: str = "") -> None:
        if ok:
            self.failed_checks = 0
            self.set_healthy(True)
        else:
            self.failed_checks += 1
            if self.failed_checks >= unhealthy_after:
                self.set_healthy(False, why)

    def state(self) -> dict[str, Any]:
        return {"url": self.url, "healthy": self.healthy, "outstanding": self.outstanding,
                **({"kv": self.spec.kv_addr} if self.spec.kv_addr else {})}


class Pool:
    """Healthy instances, least outstanding requests first; ties rotate so equal load spreads."""

    def __init__(self, role: str, specs: Sequence[InstanceSpec], metrics: ProxyMetrics):
        self.role = role
        self.instances = [Instance(s, role, metrics) for s in specs]
        self._turn = itertools.count()

    def pick(self, exclude: set[Instance] | frozenset[Instance] = frozenset(),
             need_kv: bool = False) -> Instance | None:
        n = len(self.instances)
        start = next(self._turn) % n
        best: Instance | None = None
        for k in range(n):
            inst = self.instances[(start + k) % n]
            if not inst.healthy or inst in exclude or (need_kv and not inst.spec.kv_addr):
                continue
            if best is None or inst.outstanding < best.outstanding:
                best = inst
        return best

    def any_healthy(self) -> bool:
        return any(i.healthy for i in self.instances)


class HealthChecker:
    """GET /health on every instance, every `interval` seconds: `unhealthy_after` failed probes in a
    row take an instance out of rotation, one good probe puts it back."""

    def __init__(self, instances: Sequence[Instance], *, interval: float, timeout: float, unhealthy_after: int):
        self.instances = list(instances)
        self.interval, self.unhealthy_after = interval, unhealthy_after
        self._timeout = aiohttp.ClientTimeout(total=timeout)  # immutable: built once, not per probe

    async def check_once(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._check(session, i) for i in self.instances))

    async def _check(self, session: aiohttp.ClientSession, inst: Instance) -> None:
        why = ""
        try:
            async with session.get(inst.endpoint("/health"), timeout=self._timeout) as r:
                ok = r.status == 200
                why = f"/health returned HTTP {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            ok, why = False, f"/health failed: {exc.__class__.__name__}: {exc}"
        inst.record_check(ok, self.unhealthy_after, why)

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Probe rounds until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check_once(session)
            except Exception:  # never let the loop die; the next round tries again
                log.exception("health check round failed")
