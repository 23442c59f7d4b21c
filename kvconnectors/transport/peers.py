"""Which hosts this instance connects to when a ticket or a request names them (`allowed_peers`).

Tickets (`kv_transfer_params.kvc.addrs`) and `push_target` come from HTTP clients: without a check,
any caller of the API could point a decode instance at a host of its choosing (a fake producer)
or a prefill instance's pushes at one. Every such address is resolved here, checked against the
allowed networks, and the caller connects to the checked IP address (not the name again, so a
second DNS answer cannot swap it).

The default (`allowed_peers` unset): the loopback networks plus the networks of this host's own
interface addresses as configured (10.0.3.7/24 on eth0 allows 10.0.3.0/24), plus the configured
bind/advertise addresses themselves. Pools across routed subnets (Kubernetes pods on different
nodes, where an interface is often a /32) must list their networks; `["0.0.0.0/0", "::/0"]`
allows every host.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvconnectors.errors import ConfigError, FailureCause, TransferError
from kvconnectors.logs import get_logger
from kvconnectors.transport.exposure import numeric_address

logger = get_logger(__name__)
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
LOOPBACK = ("127.0.0.0/8", "::1/128")
_CACHE_S = 30.0     # a resolved name is trusted this long (one lookup per host, not per transfer)
_CACHE_MAX = 1024


def parse_networks(values: Iterable[object], key: str = "allowed_peers") -> list[Network]:
    """CIDRs (or single addresses) -> networks; a bad one is a ConfigError naming it."""
    out: list[Network] = []
    for v in values:
        if not isinstance(v, str):
            raise ConfigError(key, v, "each entry must be a CIDR string such as '10.0.0.0/16' or an IP address")
        try:
            out.append(ipaddress.ip_network(v.strip(), strict=False))
        except ValueError as exc:
            raise ConfigError(key, v, f"is not a network in CIDR notation ({exc})") from None
    return out


def interface_networks() -> list[Network]:
    """The networks of this host's own interface addresses (psutil; IPv6 link-local left out)."""
    import psutil

    nets: list[Network] = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6) or not a.netmask:
                continue
            addr = a.address.split("%", 1)[0]
            try:
                mask = ipaddress.ip_address(a.netmask.split("%", 1)[0])
                net = ipaddress.ip_network(f"{addr}/{bin(int(mask)).count('1')}", strict=False)
            except ValueError:
                continue
            if not net.is_link_local:
                nets.append(net)
    return nets


def default_networks(own_hosts: Sequence[str | None] = ()) -> list[Network]:
    nets = parse_networks(LOOPBACK)
    try:
        nets += interface_networks()
    except Exception as exc:  # no psutil support on this platform: loopback and own hosts only
        logger.warning("allowed_peers: cannot list this host's interfaces (%r); the default allows loopback "
                       "and the configured hosts only", exc)
    return list(dict.fromkeys(nets + _own(own_hosts)))


def _own(hosts: Sequence[str | None]) -> list[Network]:
    """The IP literals among this instance's own bind/advertise hosts, as /32 (/128) networks."""
    out: list[Network] = []
    for host in hosts:
        try:
            addr = ipaddress.ip_address(host or "")
        except ValueError:
            continue  # a name: its addresses are on an interface, or must be listed
        if not addr.is_unspecified:
            out.append(ipaddress.ip_network(addr))
    return out


class PeerPolicy:
    """`check(host, port, field)` -> the IP address to connect to, or a typed BAD_PARAMS refusal
    naming the field, the value and the setting."""

    def __init__(self, networks: Sequence[Network], *, configured: bool):
        self.networks = list(networks)
        self.configured = configured  # False: the default (for the refusal's wording)
        self._cache: OrderedDict[str, tuple[float, list[str]]] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_setting(cls, allowed: Sequence[str] | None, own_hosts: Sequence[str | None] = ()) -> "PeerPolicy":
        """`own_hosts`: this instance's bind/advertise addresses, always allowed (its own landing
        store is one of the peers it talks to)."""
        if allowed is None:
            return cls(default_networks(own_hosts), configured=False)
        return cls(parse_networks(allowed) + _own(own_hosts), configured=True)

    def allows_ip(self, ip: str) -> bool:
        addr = numeric_address(ip) if ip else None  # the scope id dropped, an IPv4-mapped one as IPv4
        return addr is not None and any(addr.version == n.version and addr in n for n in self.networks)

    def check(self, host: str, port: int, field: str) -> str:
        ips = self._resolve(host, port, field)
        for ip in ips:
            if self.allows_ip(ip):
                return ip
        shown = ", ".join(str(n) for n in self.networks[:8]) + (", ..." if len(self.networks) > 8 else "")
        where = "" if ips == [host] else f" (resolves to {', '.join(ips[:4])})"
        default = "" if self.configured else " (the default: loopback and this host's own subnets)"
        raise TransferError(FailureCause.BAD_PARAMS, (
            f"{field}={host!r}{where} is not in allowed_peers [{shown}]{default}; "
            "add its network to the TieredConnector setting allowed_peers if this peer is yours"))

    def _resolve(self, host: str, port: int, field: str) -> list[str]:
        try:
            ipaddress.ip_address(host.split("%", 1)[0])
            return [host]
        except ValueError:
            pass
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(host)
            if hit is not None and hit[0] > now:
                return hit[1]
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise TransferError(FailureCause.PEER_UNREACHABLE, f"{field}={host!r} does not resolve: {exc}") from None
        ips = list(dict.fromkeys(str(info[4][0]) for info in infos))
        with self._lock:
            self._cache[host] = (now + _CACHE_S, ips)
            while len(self._cache) > _CACHE_MAX:
                self._cache.popitem(last=False)
        return ips
