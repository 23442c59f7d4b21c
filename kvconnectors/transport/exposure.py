"""Who can reach a listening socket, decided on the address it binds (issue 34, item 5).

One definition for every place that binds on the user's word: TieredConnector's `bind_host`
(tiered/config.py), the Ray backend's store planning (ray/stores.py) and `serve-pd --host`
(integration/launcher.py).

* A *wildcard* is any address that `bind()` reads as "every interface": `""` and every spelling of
  the unspecified address, IPv4 as `inet_aton` reads it (`0`, `0.0`, `0.0.0`, `00`, `0x0`, ...), IPv6
  (`::`, `::0`, `0:0:0:0:0:0:0:0`, ...) and the IPv4-mapped `::ffff:0.0.0.0`. Spellings are resolved
  the way the bind resolves them (getaddrinfo with AI_NUMERICHOST: numbers only, no DNS), never
  compared as text.
* *Loopback* is `localhost` and every address in 127.0.0.0/8 or ::1, however spelled (`127.1`,
  `0x7f.1`, `::ffff:127.0.0.1`, ...). Every other address, and every other host name, is taken to be
  reachable from other hosts: a name's resolution is not ours to trust.
* A bind that is not loopback without the shared secret is refused, unless the user says the
  network is trusted (`allow_insecure`; then it is logged as a warning): `check_exposure`.

Light to import: the standard library and kvconnectors.errors only.
"""

from __future__ import annotations

import ipaddress
import socket

from kvconnectors.errors import ConfigError
from kvconnectors.logs import get_logger

logger = get_logger(__name__)

LOCALHOST_NAMES = frozenset({"localhost", "localhost."})
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
SECRET_HOW = "secret_file, or the KVCONNECTORS_SECRET environment variable"
INSECURE_HOW = "set allow_insecure: true"


def numeric_address(host: str) -> IPAddress | None:
    """The address `bind((host, port))` would use when `host` is numeric, however spelled; None for
    a host name. `""` is the IPv4 wildcard (as bind reads it); `[...]` brackets are dropped; an
    IPv4-mapped IPv6 address is its IPv4 address (that is what it binds)."""
    if not isinstance(host, str):
        return None
    h = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if h == "":
        return ipaddress.IPv4Address(0)
    try:
        ip: IPAddress = ipaddress.ip_address(h.split("%", 1)[0] if ":" in h else h)
    except ValueError:
        try:  # what the C library accepts and ipaddress does not: 0, 0.0, 127.1, 0x7f.1, 017700000001, ...
            infos = socket.getaddrinfo(h, None, type=socket.SOCK_STREAM,
                                       flags=socket.AI_NUMERICHOST | socket.AI_PASSIVE)
            ip = ipaddress.ip_address(str(infos[0][4][0]).split("%", 1)[0])
        except (OSError, UnicodeError, ValueError, IndexError):
            return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_wildcard(host: str) -> bool:
    """`host` binds every interface (an unspecified address, however spelled, or "")."""
    ip = numeric_address(host)
    return ip is not None and ip.is_unspecified


def is_loopback(host: str) -> bool:
    """`host` binds a loopback address only: `localhost`, 127.0.0.0/8 or ::1, however spelled."""
    if isinstance(host, str) and host.lower() in LOCALHOST_NAMES:
        return True
    ip = numeric_address(host)
    return ip is not None and ip.is_loopback


def check_exposure(field: str, host: str, *, has_secret: bool, allow_insecure: bool,
                   secret_how: str = SECRET_HOW, insecure_how: str = INSECURE_HOW,
                   who: str = "the store server",
                   risk: str = "read and release staged KV (other requests' prompts)") -> bool:
    """Refuse (ConfigError naming `field` and `host`) a bind other hosts can reach when no shared
    secret is set, unless `allow_insecure`. Loopback, or a secret: fine. Returns True when the bind
    is exposed without a secret and allowed (a warning is logged), else False.

    `secret_how`: how to set a secret here; `insecure_how`: how to say the network is trusted here;
    `who` and `risk`: what listens and what a stranger could do with it (for the message)."""
    if is_loopback(host) or has_secret:
        return False
    if is_wildcard(host):
        where = f"binds every interface ({host!r} is an unspecified address)"
    elif numeric_address(host) is not None:
        where = f"is not a loopback address: other hosts can reach {who} there"
    else:
        where = f"is a host name other than localhost: other hosts may reach {who} there"
    if allow_insecure:
        logger.warning("%s %r %s, without a shared secret (allowed: the network is trusted to be private)",
                       field, host, where)
        return True
    raise ConfigError(field, host, (
        f"{where}, but no shared secret is set: any host that reaches it could {risk}. Set a secret "
        f"({secret_how}), bind a loopback address (127.0.0.1), or {insecure_how} if the network itself is trusted"))
