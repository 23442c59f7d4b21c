"""A Ray cluster for tests, started the way users start one: `ray start` per node, an application by
`serve run CONFIG --non-blocking`, requests over HTTP to Serve's ingress. The test process never
calls `ray.init`, so nothing it imported (kvconnectors.ray, say) can register our connector backend
for the cluster: what the replicas see is what a user's `serve run` gives them.

Nodes can sit in emulated hosts (kvconnectors/testing/hosts.py): each `ray start` then runs inside
that host's network namespace with the host's address. Everything started is stopped by `stop()`
(`ray stop --force`, then any process of the cluster's trees still alive, vLLM engines included),
and the temp dir (logs, sockets, the configs written here) is removed. Serve is shut down first,
from a short-lived driver: `ray stop --force` alone SIGKILLs the replicas and leaves their vLLM
engine processes (EngineCore, its workers) running, orphaned. `ray stop` stops every Ray node of the
machine, not only this cluster's: do not run these tests beside a Ray cluster of your own. Auth: Ray 2.60's token
authentication with a token from the environment (RAY_AUTH_TOKEN), so nothing is written to
~/.ray; the same environment carries KVCONNECTORS_SECRET to every replica.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from kvconnectors.logs import get_logger

logger = get_logger(__name__)

BIN = Path(sys.executable).parent
# Replicas stop their engines cleanly when Serve shuts them down (not when Ray kills them).
SERVE_SHUTDOWN = ("import sys, ray; from ray import serve; "
                  "ray.init(address=sys.argv[1], log_to_driver=False); serve.shutdown(); ray.shutdown()")


NODE_IPS = ("import json, sys, ray; ray.init(address=sys.argv[1], log_to_driver=False); "
            "print(json.dumps({k[len('kvc_node_'):]: n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'] "
            "for k in n['Resources'] if k.startswith('kvc_node_')})); ray.shutdown()")


# Waits in one driver for an app to be RUNNING (or failed): a new deploy replaces the old app
# behind the same HTTP port, so an answer from the port alone does not say which app answered.
APP_STATUS = """
import json, sys, time, ray
from ray import serve
ray.init(address=sys.argv[1], log_to_driver=False)
name, deadline = sys.argv[2], time.monotonic() + float(sys.argv[3])
while True:
    app = serve.status().applications.get(name)
    status = str(getattr(app.status, "value", app.status)) if app else "MISSING"
    if status in ("RUNNING", "DEPLOY_FAILED", "UNHEALTHY") or time.monotonic() > deadline:
        break
    time.sleep(1.0)
print(json.dumps({"status": status, "message": app.message if app else ""}))
ray.shutdown()
"""


@dataclass
class RayNode:
    name: str
    ip: str | None = None  # --node-ip-address; None lets Ray choose. After add_node: the address Ray registered
    inside: Callable[[], contextlib.AbstractContextManager[None]] | None = None  # its host's namespace


@dataclass
class RayCluster:
    """The first node added is the head (GCS, Serve's controller and ingress). Each node gets its
    own Ray temp dir under `temp_dir` (Ray puts its unix sockets there: two nodes on one machine must
    not share them, and their paths must stay under 107 characters, hence a short default)."""
    temp_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvray-", dir="/tmp")))
    env: dict[str, str] = field(default_factory=dict)
    gcs_port: int = 6379
    nodes: list[RayNode] = field(default_factory=list)
    _procs: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.temp_dir = Path(self.temp_dir)
        self.env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
                    "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", **self.env}

    @property
    def address(self) -> str:
        """The GCS address (the head's node address is known once the head has started)."""
        return f"{self.nodes[0].ip or '127.0.0.1'}:{self.gcs_port}"

    def _environ(self) -> dict[str, str]:
        env = {**os.environ, **self.env}
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
        return env

    @staticmethod
    def _on(node: RayNode) -> contextlib.AbstractContextManager[None]:
        """Inside the node's host (network namespace), or here."""
        return node.inside() if node.inside else contextlib.nullcontext()

    def _run(self, node: RayNode, argv: list[str], timeout: float) -> str:
        with self._on(node):
            res = subprocess.run(argv, env=self._environ(), capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0:
            raise RuntimeError(f"`{' '.join(argv)}` failed ({res.returncode}):\n{res.stdout[-3000:]}\n"
                               f"{res.stderr[-3000:]}")
        return res.stdout

    def add_node(self, node: RayNode, *, num_cpus: int, resources: Mapping[str, float] | None = None,
                 timeout: float = 120.0) -> None:
        """The first node added is the head."""
        node_dir = self.temp_dir / node.name
        node_dir.mkdir(parents=True, exist_ok=True)
        resources = {**(resources or {}), f"kvc_node_{node.name}": 1}  # to find the node again (node_ips)
        argv = [str(BIN / "ray"), "start", f"--num-cpus={num_cpus}", f"--resources={json.dumps(resources)}",
                "--disable-usage-stats", f"--temp-dir={node_dir}"]
        if node.ip:
            argv.append(f"--node-ip-address={node.ip}")
        if not self.nodes:
            argv += ["--head", f"--port={self.gcs_port}", "--include-dashboard=false"]
        else:
            argv += [f"--address={self.address}"]
        self.nodes.append(node)
        self._run(node, argv, timeout)
        self._track()
        registered = self.node_ips()
        if node.ip and registered.get(node.name) != node.ip:
            raise RuntimeError(f"Ray node {node.name}: asked for address {node.ip}, Ray registered "
                               f"{registered.get(node.name)}")
        node.ip = registered[node.name]

    def node_ips(self) -> dict[str, str]:
        """Node name -> the address Ray registered for it (NodeManagerAddress: what replicas advertise)."""
        return json.loads(self._run(self.nodes[0], [sys.executable, "-c", NODE_IPS, self.address], 120).splitlines()[-1])

    def serve_run(self, config: Mapping[str, Any], name: str, timeout: float = 120.0) -> Path:
        """Deploy a Serve config (written to the temp dir as YAML) with `serve run --non-blocking`
        from the head's host; returns the file. Replaces a running app of the same name."""
        import yaml  # noqa: PLC0415 - PyYAML comes with Ray

        path = self.temp_dir / f"app-{name}.yaml"
        path.write_text(yaml.safe_dump(dict(config), sort_keys=False), encoding="utf-8")
        self._run(self.nodes[0], [str(BIN / "serve"), "run", str(path), "--non-blocking",
                                  f"--address={self.address}"], timeout)
        self._track()
        return path

    def wait_running(self, app: str, timeout: float = 420.0) -> None:
        """Until Serve reports `app` RUNNING; raises with Serve's message when it failed or timed out."""
        out = self._run(self.nodes[0], [sys.executable, "-c", APP_STATUS, self.address, app, str(timeout)],
                        timeout + 60)
        state = json.loads(out.splitlines()[-1])
        if state["status"] != "RUNNING":
            raise RuntimeError(f"Serve app {app!r}: {state['status']} after up to {timeout:.0f} s: {state['message']}; "
                               f"logs under {self._head_logs()}/serve")
        self._track()

    def wait_ready(self, url: str, model: str, timeout: float = 420.0,
                   alive: Callable[[], None] | None = None) -> float:
        """Poll the ingress until a 1-token completion answers; seconds waited. `alive` may raise
        to stop early (a replica that failed for good)."""
        start = time.monotonic()
        body = json.dumps({"model": model, "prompt": [1, 2, 3], "max_tokens": 1}).encode()
        last = ""
        node = self.nodes[0]
        while time.monotonic() - start < timeout:
            if alive is not None:
                alive()
            try:
                with self._on(node):
                    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                                 headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=30) as resp:
                        if resp.status == 200:
                            self._track()
                            return time.monotonic() - start
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
            time.sleep(2.0)
            self._track()
        raise TimeoutError(f"Serve app at {url} not answering after {timeout:.0f} s (last: {last}); "
                           f"logs under {self._head_logs()}/serve")

    def _head_logs(self) -> Path:
        return self.temp_dir / self.nodes[0].name / "session_latest" / "logs"

    def serve_logs(self) -> dict[str, str]:
        """File name -> text of every Serve log (controller, proxies, replicas) of this session."""
        return {p.name: p.read_text(errors="replace") for p in sorted((self._head_logs() / "serve").glob("*.log"))}

    def worker_logs(self) -> dict[str, str]:
        """"node/file" -> text of every Ray worker's stdout/stderr on every node (replicas, their vLLM logs)."""
        return {f"{n.name}/{p.name}": p.read_text(errors="replace")
                for n in self.nodes for p in sorted((self.temp_dir / n.name / "session_latest" / "logs").glob("worker-*.*"))}

    def replicas(self, deployment: str) -> list[psutil.Process]:
        """Live replica processes of `deployment` (e.g. "Decode:tiny"), by Ray's process title."""
        marker = f"ServeReplica:pd:{deployment}"
        out = []
        for p in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if any(marker in part for part in (p.info["cmdline"] or [])) and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    def _roots(self) -> list[psutil.Process]:
        roots = []
        marker = str(self.temp_dir)
        for p in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if any(marker in part for part in (p.info["cmdline"] or [])):
                    roots.append(p)
        return roots

    def _track(self) -> None:
        """Remember every process of the cluster (by its temp dir) and their descendants."""
        for root in self._roots():
            with contextlib.suppress(psutil.Error):
                self._procs.add(root.pid)
                self._procs.update(c.pid for c in root.children(recursive=True))

    def alive(self) -> list[str]:
        """Processes this cluster started that still run (zombies aside)."""
        self._track()
        out = []
        for pid in sorted(self._procs):
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{pid} {' '.join(p.cmdline())[:100]}")
        return out

    def stop(self, timeout: float = 60.0) -> list[str]:
        """Stop every node and every process they started; returns what had to be SIGKILLed after
        `ray stop` (empty when Ray cleaned up after itself). Removes the temp dir."""
        if not self.nodes:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            return []
        self._track()
        try:
            self._run(self.nodes[0], [sys.executable, "-c", SERVE_SHUTDOWN, self.address], timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            logger.warning("Ray cluster: serve.shutdown() failed, stopping Ray anyway: %s", exc)
        for node in reversed(self.nodes):
            with contextlib.suppress(Exception):
                self._run(node, [str(BIN / "ray"), "stop", "--force"], timeout)
        deadline = time.monotonic() + 15.0
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        killed = self.alive()
        for pid in list(self._procs):
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        self.nodes.clear()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return killed


