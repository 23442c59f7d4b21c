"""Emulated hosts on one machine: network namespaces joined by a bridge, with shaped links.

```
with Hosts(["prefill", "decode", "client"]) as hosts:
    hosts.shape("prefill", egress="200mbit")          # prefill -> anyone at 200 Mbit/s (tc tbf)
    with hosts.inside("prefill"):                     # this thread, and what it starts, is "on" that host
        server = VllmServer(model, host=hosts.address("prefill"), ...).start()
    hosts.link("prefill", up=False)                   # unplug the cable
```

Each host is a namespace `kvch<pid>-<name>` with one device `eth0` on a private /24 (10.77.k.0/24),
plugged into a bridge in a switch namespace; nothing is added to the machine's own namespace, so
traffic stays inside. `inside()` moves the calling *thread* into a host's namespace (setns(2));
processes and threads it starts there stay there. Reach hosts' addresses only from inside a host:
the machine's own namespace has no route to them and would send such traffic out of the machine.
Needs CAP_NET_ADMIN (root here); `require()` says precisely what is missing. Namespaces of runs
whose process is gone are removed at start.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

NETNS_DIR = Path("/var/run/netns")
PREFIX = "kvch"
DEVICE = "eth0"
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


class HostsUnavailable(RuntimeError):
    """This process cannot create network namespaces (the reason says what is missing)."""


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    address: str
    switch_port: str   # the bridge-side end of this host's veth pair (shaping towards the host)


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *(("-n", netns) if netns else ()), *args]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res


def require() -> None:
    """Raise HostsUnavailable naming what is missing (no `ip`, no CAP_NET_ADMIN)."""
    if subprocess.run(["which", "ip"], capture_output=True).returncode != 0:
        raise HostsUnavailable("the `ip` command (iproute2) is not installed")
    probe = f"{PREFIX}{os.getpid()}-probe"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        raise HostsUnavailable(f"cannot create a network namespace (needs CAP_NET_ADMIN): {res.stderr.strip()}")
    _ip("netns", "del", probe, check=False)


def remove_stale() -> list[str]:
    """Delete namespaces left by runs whose process no longer exists; returns their names."""
    gone = []
    for path in NETNS_DIR.glob(f"{PREFIX}*") if NETNS_DIR.exists() else ():
        m = re.match(rf"{PREFIX}(\d+)-", path.name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _ip("netns", "del", path.name, check=False)
            gone.append(path.name)
    return gone


@contextlib.contextmanager
def in_netns(netns: str) -> Iterator[None]:
    """Run the calling thread in `netns` for the block (sockets it opens, processes and threads it
    starts stay there), then back where it was."""
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(NETNS_DIR / netns, os.O_RDONLY)
        try:
            if _libc.setns(target, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
        finally:
            os.close(target)
        try:
            yield
        finally:
            if _libc.setns(original, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns back from {netns}: {os.strerror(err)}")
    finally:
        os.close(original)


class Hosts:
    def __init__(self, names: Sequence[str], *, subnet: int | None = None):
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be distinct and non-empty, got {list(names)}")
        for name in names:
            if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", name):
                raise ValueError(f"host name {name!r}: 1-8 lowercase letters/digits, starting with a letter")
        self.run_id = f"{PREFIX}{os.getpid()}"
        # a /24 per run, so two runs on one machine do not share addresses
        self.subnet = subnet if subnet is not None else 20 + os.getpid() % 200
        self.switch = f"{self.run_id}-sw"
        self.hosts = {name: Host(name, f"{self.run_id}-{name}", f"10.77.{self.subnet}.{i + 1}", f"p{i}")
                      for i, name in enumerate(names)}
        self._created: list[str] = []

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> "Hosts":
        require()
        remove_stale()
        try:
            self._add_netns(self.switch)
            _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
            _ip("link", "set", "br0", "up", netns=self.switch)
            for host in self.hosts.values():
                self._add_netns(host.netns)
                # create the pair inside the switch namespace, then move one end to the host
                _ip("link", "add", host.switch_port, "type", "veth", "peer", "name", DEVICE, "netns", host.netns,
                    netns=self.switch)
                _ip("link", "set", host.switch_port, "master", "br0", "up", netns=self.switch)
                _ip("addr", "add", f"{host.address}/24", "dev", DEVICE, netns=host.netns)
                _ip("link", "set", DEVICE, "up", netns=host.netns)
                _ip("link", "set", "lo", "up", netns=host.netns)
        except BaseException:
            self.close()
            raise
        return self

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)

    def close(self) -> None:
        for name in reversed(self._created):
            _ip("netns", "del", name, check=False)  # deleting a namespace deletes its veth ends
        self._created.clear()

    def __enter__(self) -> "Hosts":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- using hosts ---------------------------------------------------------------------------
    def address(self, name: str) -> str:
        return self.hosts[name].address

    def inside(self, name: str) -> contextlib.AbstractContextManager[None]:
        return in_netns(self.hosts[name].netns)

    def run(self, name: str, argv: Sequence[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.hosts[name].netns, *argv], capture_output=True,
                              text=True, timeout=timeout)

    def shape(self, name: str, *, egress: str | None = None, ingress: str | None = None,
              burst: str = "256kb", latency: str = "100ms") -> None:
        """Token-bucket rates (tc tbf, e.g. "200mbit") for traffic leaving and reaching `name`;
        None leaves that direction as it is."""
        host = self.hosts[name]
        for rate, netns, dev in ((egress, host.netns, DEVICE), (ingress, self.switch, host.switch_port)):
            if rate is not None:
                self._tc(netns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                         "latency", latency)

    def unshape(self, name: str) -> None:
        host = self.hosts[name]
        for netns, dev in ((host.netns, DEVICE), (self.switch, host.switch_port)):
            self._tc(netns, "qdisc", "del", "dev", dev, "root", check=False)

    def link(self, name: str, *, up: bool) -> None:
        """Plug (up) or unplug (down) the host's cable: its switch port goes down too."""
        host = self.hosts[name]
        state = "up" if up else "down"
        _ip("link", "set", host.switch_port, state, netns=self.switch)
        _ip("link", "set", DEVICE, state, netns=host.netns)

    def tx_bytes(self, name: str) -> int:
        """Bytes the host has sent on its device (what crossed its link). Read over netlink: /sys
        shows the namespace it was mounted in, not the calling thread's."""
        out = _ip("-s", "link", "show", DEVICE, netns=self.hosts[name].netns).stdout.splitlines()
        i = next(i for i, line in enumerate(out) if "TX:" in line)
        return int(out[i + 1].split()[0])

    @staticmethod
    def _tc(netns: str, *args: str, check: bool = True) -> None:
        res = subprocess.run(["ip", "netns", "exec", netns, "tc", *args], capture_output=True, text=True, timeout=30)
        if check and res.returncode != 0:
            raise RuntimeError(f"tc {' '.join(args)} in {netns} failed: {res.stderr.strip()}")
