"""The worker's connections to other instances' store servers, and who it may call.

Tickets and push targets come from HTTP clients, so every address is checked against
allowed_peers before a connection is made (peers.py). Connections to producers are kept between
pulls (client_pool.py); never one a producer of this configuration would time out (it closes a
connection idle for server_idle_timeout_s).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from kvconnectors.tiered.config import TieredConfig
from kvconnectors.tiered.params import TransferParams
from kvconnectors.transport import wire
from kvconnectors.transport.auth import Secrets
from kvconnectors.transport.client import StoreClient
from kvconnectors.transport.client_pool import ClientPool
from kvconnectors.transport.peers import PeerPolicy


class PeerLinks:
    def __init__(self, config: TieredConfig, engine_id: str, secret: Secrets | None):
        self.config, self.engine_id, self.secret = config, engine_id, secret
        self.peers = PeerPolicy.from_setting(config.allowed_peers, (config.bind_host, config.advertise_host))
        self._kept = ClientPool(self.connect, max_idle_s=min(30.0, config.server_idle_timeout_s / 2))

    def connect(self, host: str, port: int) -> StoreClient:
        """A new connection (not checked against allowed_peers: callers check what clients named)."""
        return StoreClient(host, port, compat=self.config.compat, secret=self.secret,
                           connect_timeout_s=self.config.connect_timeout_s,
                           peer_name=self.engine_id[:wire.MAX_PEER_NAME], protection=self.config.wire_protection)

    def check(self, host: str, port: int, field: str) -> str:
        """`host` if host:port is allowed (the address to connect to); a typed BAD_PARAMS error naming
        `field` otherwise."""
        return self.peers.check(host, port, field)

    def producer(self, p: TransferParams, rank: int) -> AbstractContextManager[StoreClient]:
        """A connection to the ticket's producer `rank` (whose address must be in allowed_peers) for
        a with-block: a kept one when there is one, handed back when the block went well."""
        addr = p.addrs[rank]
        host = self.check(addr.host, addr.port, f"kv_transfer_params.kvc.addrs[{rank}]")
        return self._kept.client(host, addr.port)

    def close(self) -> None:
        self._kept.close()
