"""ServerSettings: every value a store server is started with, declared once (type, default, doc)
and checked at construction.

The store server's parts (handshake.py, grants.py, pull_service.py, admission.py) each read the
fields they need from one frozen instance; nothing changes them afterwards. Each invalid value
raises ConfigError naming the field and the value (the secret's value is never named). What is
not a value but a collaborator (the store, the landing side, the data paths, the fault plan, the
staging-failure lookup) is handed to StoreServer beside the settings, not declared here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from kvconnectors.errors import ConfigError
from kvconnectors.transport import wire
from kvconnectors.transport.admission import Caps
from kvconnectors.transport.protocol import check_protection

HANDSHAKE_TIMEOUT_S = 2.0   # accept to authenticated, every step together
MAX_GRANTS = 1 << 16        # remembered transfer tokens beyond which those of ended transfers are forgotten
SERVER_LOGGER = "kvconnectors.transport.server"  # every part of the server logs as the server


@dataclass(frozen=True)
class ServerSettings:
    fingerprint: str                      # the layout fingerprint a Read must present
    num_layers: int                       # layers of every transfer this store holds
    compat: str | Mapping[int, str]       # the hash peers must present, or one per admitted protocol
    #                                       version (wire.compat_hashes: peers of the previous version too)
    secret: bytes | None = field(default=None, repr=False)  # the shared secret (auth.Secrets during a rotation);
    #                                       None: nobody authenticates. Never in a repr
    rows_fingerprint: str = ""            # a Read may present it instead of `fingerprint` (a consumer holding
    #                                       a previous-version ticket, which carries it); "": `fingerprint`
    protection: str = wire.HANDSHAKE      # the wire_protection setting ("aead" needs the secret)
    nixl: bool = False                    # offer the nixl pull path (default paths only)
    require_grants: bool = False          # an id never granted a token is unknown (a producer's server,
    #                                       where every transfer is granted when its staging starts)
    max_grants: int = MAX_GRANTS          # remembered grants beyond which those of ended transfers are forgotten
    idle_timeout_s: float = 300.0         # an authenticated connection without a request is closed after it
    seal_wait_s: float = 10.0             # how long a Read waits for its transfer to be fully staged
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S  # accept to authenticated, every step together
    max_connections: int = 256            # admission caps (admission.py)
    max_per_peer: int = 64
    max_pending: int = 64
    max_pending_per_peer: int | None = None    # default: half of max_pending
    max_pending_per_prefix: int | None = None  # default: half of max_pending
    log_interval_s: float = 10.0          # at most one line per interval of what a peer can provoke at will
    tp_size: int = 0                      # the TP size of this store's instance, said in StatusReply

    def __post_init__(self) -> None:
        check_protection(self.protection, self.secret)  # first, as the server always checked it
        for name in ("fingerprint", "rows_fingerprint"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(name, getattr(self, name), "must be a string")
        if not isinstance(self.compat, (str, Mapping)):
            raise ConfigError("compat", self.compat, "must be a compat hash or a mapping of version -> hash")
        for name in ("idle_timeout_s", "seal_wait_s", "handshake_timeout_s"):
            _number(name, getattr(self, name), positive=True)
        _number("log_interval_s", self.log_interval_s, positive=False)
        for name in ("num_layers", "max_grants"):
            _count(name, getattr(self, name), least=1)
        for name in ("max_connections", "max_per_peer", "max_pending", "tp_size"):
            _count(name, getattr(self, name), least=0)
        for name in ("max_pending_per_peer", "max_pending_per_prefix"):
            if getattr(self, name) is not None:
                _count(name, getattr(self, name), least=0)

    @property
    def compat_hashes(self) -> dict[int, str]:
        """Protocol version -> the compat hash its peers must present."""
        return dict(self.compat) if isinstance(self.compat, Mapping) else {wire.PROTOCOL_VERSION: self.compat}

    @property
    def effective_rows_fingerprint(self) -> str:
        return self.rows_fingerprint or self.fingerprint

    @property
    def caps(self) -> Caps:
        return Caps(max_connections=self.max_connections, max_per_peer=self.max_per_peer,
                    max_pending=self.max_pending, max_pending_per_peer=self.max_pending_per_peer,
                    max_pending_per_prefix=self.max_pending_per_prefix)


FIELDS = frozenset(f.name for f in fields(ServerSettings))


def _number(name: str, value: object, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (value <= 0 if positive else value < 0):
        raise ConfigError(name, value, f"must be a finite number of seconds {'>' if positive else '>='} 0")


def _count(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(name, value, f"must be an integer >= {least}")
