"""A prefill/decode pool as a Python object: the launcher's servers plus an in-process proxy.

    with PDCluster(model, connector="TieredConnector", transport="tcp") as pd:
        pd.complete("hello", max_tokens=8)      # through the proxy
        pd.decode[0].metrics()                   # any instance directly

Used by the demo, the end-to-end tests and the benchmarks; `kvconnectors serve-pd` is the
same thing for a terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvconnectors.integration import launcher
from kvconnectors.integration import proxy as proxy_mod
from kvconnectors.serving import VllmServer, free_port, stop_all
from kvconnectors.store.arena import SHM_DIR, arena_names, reap_stale_arenas

if TYPE_CHECKING:
    from kvconnectors.testing.hosts import Hosts

log = logging.getLogger(__name__)


def launcher_args(model: str, **options: Any) -> argparse.Namespace:
    """The launcher's argument namespace, built through its own parser (so defaults match)."""
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    argv = ["--model", model, "--quiet"]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, value if isinstance(value, str) else str(value)]
    return parser.parse_args(argv)


class PDCluster:
    def __init__(self, model: str, *, connector: str = "TieredConnector", transport: str | None = None,
                 prefill: int = 1, decode: int = 1, kv_extra: dict | None = None, vllm_args: str = "",
                 proxy_args: Sequence[str] = (), log_dir: Path | None = None, health_timeout: float = 300.0,
                 proxy_process: bool = False, mode: str = "pull", device: str = "auto", gpus: str | None = None,
                 hosts: "Hosts | None" = None, placement: Mapping[str, str] | None = None,
                 prefill_tp: int | None = None, decode_tp: int | None = None, test_settings: bool = True):
        """`device` and `gpus` as serve-pd's --device and --gpus (e.g. gpus="0,1"), `prefill_tp` and
        `decode_tp` as its --prefill-tp and --decode-tp, `test_settings` as its --test-settings (on:
        tests and benchmarks compare transfers, which a prefix-cache hit would hide). `hosts` and
        `placement` put instances on emulated hosts: placement maps an instance name (prefill-0) or
        a role (prefill, decode, proxy) to a host name of `hosts`; run requests from
        `inside_client()`."""
        import json

        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kvc-cluster-"))
        self.args = launcher_args(
            model, connector=connector, transport=transport, prefill=prefill, decode=decode,
            kv_transfer_config_extra=json.dumps(kv_extra) if kv_extra else None, vllm_args=vllm_args,
            health_timeout=health_timeout, proxy_port=free_port(), log_dir=str(self.log_dir), mode=mode,
            device=device, gpus=gpus, prefill_tp=prefill_tp, decode_tp=decode_tp, test_settings=test_settings)
        launcher.validate(self.args)
        self.plans = launcher.plan_instances(self.args)
        self.hosts, self.placement = hosts, dict(placement or {})
        if hosts is not None:
            for plan in self.plans:
                plan.place_on(hosts.address(self._host_of(plan.name, plan.role)))
                # emulated hosts share one kernel: UCX would move nixl's bytes through shared
                # memory (cma, posix) instead of the link; a real second host has no such path
                plan.env["UCX_TLS"] = "tcp,self"
        self.servers: list[VllmServer] = [launcher.build_server(p, self.args, self.log_dir) for p in self.plans]
        self._extra_proxy_args = list(proxy_args)
        # built now so that bad proxy_args fail before any server starts
        self.proxy_config = launcher.proxy_config(self.plans, self.args, self._extra_proxy_args)
        self._proxy: ProxyThread | ProxyProcess | None = None
        self._proxy_process = proxy_process  # its own process: no GIL shared with the caller
        self.proxy_url = ""

    @property
    def prefill(self) -> list[VllmServer]:
        return [s for s, p in zip(self.servers, self.plans) if p.role == "prefill"]

    @property
    def decode(self) -> list[VllmServer]:
        return [s for s, p in zip(self.servers, self.plans) if p.role == "decode"]

    def _host_of(self, name: str, role: str) -> str:
        host = self.placement.get(name) or self.placement.get(role)
        if host is None:
            raise ValueError(f"placement names no host for {name} (role {role}): {self.placement}")
        return host

    def _on(self, name: str, role: str) -> contextlib.AbstractContextManager[None]:
        """Run what follows (and what it starts) on the instance's host; a no-op without hosts."""
        if self.hosts is None:
            return contextlib.nullcontext()
        return self.hosts.inside(self._host_of(name, role))

    def inside_client(self) -> contextlib.AbstractContextManager[None]:
        """Where requests to the proxy come from: the proxy's host (a no-op without hosts)."""
        return self._on("proxy", "proxy")

    def start(self) -> "PDCluster":
        self._arenas_before = _arena_names()
        try:
            for s, p in zip(self.servers, self.plans):
                with self._on(p.name, p.role):
                    s.start(wait=False)
            for s, p in zip(self.servers, self.plans):
                with self._on(p.name, p.role):  # /health is only reachable from a host
                    s.wait_healthy()
            # Pick the proxy's port only now: one chosen before the servers started could have
            # been taken by one of their own ephemeral sockets meanwhile.
            self.args.proxy_port = 0 if not self._proxy_process else free_port()
            self.proxy_config = launcher.proxy_config(self.plans, self.args, self._extra_proxy_args)
            with self.inside_client():
                self._proxy = (ProxyProcess(proxy_mod.config_argv(self.proxy_config), self.proxy_config,
                                            self.log_dir) if self._proxy_process
                               else ProxyThread(self.proxy_config)).start()
            self.proxy_url = self._proxy.url
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._proxy is not None:
            self._proxy.stop()
            self._proxy = None
        stop_all(self.servers)
        self._reap_arenas()

    def _reap_arenas(self, timeout_s: float = 30.0) -> None:
        """Remove the shm arenas of this cluster's workers that could not (tests kill ranks on
        purpose). A worker orphaned by its killed rank may still be exiting when the servers are
        stopped (seen: twice in full runs on a loaded 2-core host, P2->D1 over shm), and an arena is
        reaped only once its process is gone: wait for that, a bounded while, for the arenas made
        since this cluster started."""
        deadline = time.monotonic() + timeout_s
        while True:
            reap_stale_arenas(SHM_DIR)
            left = _arena_names() - getattr(self, "_arenas_before", set())
            if not left:
                return
            if time.monotonic() >= deadline:
                log.warning("shm arenas still held %.0f s after the cluster stopped (their processes live "
                               "on): %s", timeout_s, sorted(left))
                return
            time.sleep(0.25)

    def __enter__(self) -> "PDCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ProxyThread:
    """The asyncio P/D proxy running on its own event loop in a background thread."""

    def __init__(self, config: proxy_mod.ProxyConfig):
        self.config = config
        self.url = ""
        self.proxy: proxy_mod.PDProxy | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 60.0) -> "ProxyThread":
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self.proxy = proxy_mod.PDProxy(self.config)
                port = loop.run_until_complete(self.proxy.start(self.config.host, self.config.port))
                self.url = f"http://{self.config.host}:{port}"
            except BaseException as exc:  # surfaced to start()
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self.proxy.stop())
            loop.close()

        self._thread = threading.Thread(target=run, name="kvc-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(timeout=timeout) or errors:
            raise RuntimeError(f"proxy did not start: {errors[0] if errors else 'timeout'}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        self._loop = self._thread = None


class ProxyProcess:
    """The proxy as `python -m kvconnectors.integration.proxy` in its own process group."""

    def __init__(self, argv: Sequence[str], config: proxy_mod.ProxyConfig, log_dir: Path):
        """`argv`: the proxy's command line, which must say what `config` says (config_argv(config))."""
        self.argv, self.config, self.log_path = list(argv), config, log_dir / "proxy.log"
        self.url = f"http://{config.host}:{config.port}"
        self.proc: "subprocess.Popen[bytes] | None" = None

    def start(self, timeout: float = 60.0) -> "ProxyProcess":
        import subprocess
        import sys
        import urllib.request

        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvconnectors.integration.proxy", *self.argv],
                                         cwd=launcher.PACKAGE_ROOT, stdout=log_file, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"proxy exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"proxy not healthy after {timeout} s")

    def stop(self) -> None:
        import subprocess

        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None


def _arena_names() -> set[str]:
    """The shm arenas of TieredConnector stores on this host (their files in SHM_DIR)."""
    return set(arena_names(SHM_DIR))
