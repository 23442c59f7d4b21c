"""The emulated-hosts fixture: namespaces joined by a bridge, shaped links, cables that unplug,
and nothing left behind. Every socket here is opened inside a host: the machine's own namespace
must never be used to reach the hosts' private addresses."""

from __future__ import annotations

import socket
import subprocess
import threading

import pytest

from kvconnectors.testing import hosts as hosts_mod
from kvconnectors.testing.hosts import Hosts

PORT = 9009


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def serve_once(h: Hosts, name: str, ready: threading.Event, got: list[int]) -> None:
    with h.inside(name), socket.socket() as srv:
        srv.bind((h.address(name), PORT))
        srv.listen()
        srv.settimeout(10)
        ready.set()
        conn, _ = srv.accept()
        with conn:
            total = 0
            while data := conn.recv(1 << 16):
                total += len(data)
        got.append(total)


def test_hosts_talk_over_their_link_and_leave_nothing_behind() -> None:
    with Hosts(["a", "b"]) as h:
        names = {host.netns for host in h.hosts.values()} | {h.switch}
        assert names <= netns_names()
        ready, got = threading.Event(), []
        t = threading.Thread(target=serve_once, args=(h, "a", ready, got))
        t.start()
        assert ready.wait(10)
        before = h.tx_bytes("b")
        with h.inside("b"), socket.create_connection((h.address("a"), PORT), timeout=5) as c:
            c.sendall(b"x" * (1 << 20))
        t.join(10)
        assert got == [1 << 20]
        assert h.tx_bytes("b") - before >= 1 << 20  # counted on b's own device, not the machine's
    assert not names & netns_names(), "namespaces left behind"


def test_a_shaped_link_has_its_token_bucket_and_an_unplugged_one_carries_nothing() -> None:
    with Hosts(["a", "b"]) as h:
        h.shape("a", egress="100mbit", ingress="50mbit")
        out = h.run("a", ["tc", "qdisc", "show", "dev", "eth0"]).stdout
        assert "tbf" in out and "100Mbit" in out, out
        h.unshape("a")
        assert "tbf" not in h.run("a", ["tc", "qdisc", "show", "dev", "eth0"]).stdout
        h.link("a", up=False)
        with h.inside("b"), socket.socket() as s:
            s.settimeout(1.0)
            with pytest.raises(OSError):  # no route while unplugged (timeout or unreachable)
                s.connect((h.address("a"), PORT))
        h.link("a", up=True)
        with h.inside("b"), socket.socket() as s:
            s.settimeout(5.0)
            with pytest.raises(ConnectionRefusedError):  # reachable again: a's kernel answers
                s.connect((h.address("a"), PORT))


def test_namespaces_of_dead_runs_are_removed_and_bad_names_refused() -> None:
    stale = f"{hosts_mod.PREFIX}999999-x"  # no process has that pid here
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in hosts_mod.remove_stale()
        assert stale not in netns_names()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
    for bad in (["a", "a"], ["Host"], ["toolonghostname"]):
        with pytest.raises(ValueError):
            Hosts(bad)
