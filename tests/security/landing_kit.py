"""What the landing security tests share: a decode-side landing store behind a real StoreServer
on 127.0.0.1, producers and attackers as plain StoreClients (each its own connection, so its own
owner on the landing side), and pushes built by hand (the wire messages a PushSender sends)."""

from __future__ import annotations

import time

import numpy as np
import xxhash

from kvconnectors.errors import TransferError
from kvconnectors.store import StoreConfig, TieredStore
from kvconnectors.transport import wire
from kvconnectors.transport.client import StoreClient
from kvconnectors.transport.landing import Landing
from kvconnectors.transport.server import StoreServer

SLOT = 4096
LAYERS = 2
FP = "fp-landing-security"
COMPAT = wire.compat_hash("tiered")
RPC_S = 5.0  # every call's deadline: a missing answer fails the test in seconds, never hangs it


class LandingServer:
    def __init__(self, *, dram_slots: int = 256, ttl_s: float = 30.0, server_kw: dict | None = None,
                 secret: bytes | None = None, **landing_kw):
        """`secret`: the server's and its clients' (None: no peer authenticates)."""
        self.secret = secret
        self.store = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=dram_slots * SLOT, lease_ttl_s=ttl_s))
        try:
            self.landing = Landing(self.store, fingerprint=FP, num_layers=LAYERS, **landing_kw)
        except TypeError:
            if "max_receive_bytes" not in landing_kw:
                raise
            # the code before issue 16's fix had no cap to set: test that it holds none either
            landing_kw.pop("max_receive_bytes")
            self.landing = Landing(self.store, fingerprint=FP, num_layers=LAYERS, **landing_kw)
        self.server = StoreServer(self.store, "127.0.0.1", 0, fingerprint=FP, num_layers=LAYERS, compat=COMPAT,
                                  landing=self.landing, **{"secret": secret, **(server_kw or {})})
        self._clients: list[StoreClient] = []

    def client(self) -> StoreClient:
        c = StoreClient("127.0.0.1", self.server.port, compat=COMPAT, connect_timeout_s=RPC_S, secret=self.secret)
        self._clients.append(c)
        return c

    def close(self) -> None:
        for c in self._clients:
            c.close()
        self.server.close()
        deadline = time.monotonic() + 5  # connection threads finish their clean-up before the store goes
        while self.server.active_connections and time.monotonic() < deadline:
            time.sleep(0.01)
        self.store.close()

    def landed(self, tid: str, total_blocks: int) -> np.ndarray:
        """The sealed landing copy, as the consumer reads it: [LAYERS, total_blocks, SLOT]."""
        self.landing.entries.wait(tid, time.monotonic() + RPC_S, time.monotonic() + RPC_S)
        out = np.empty((LAYERS * total_blocks, SLOT), np.uint8)
        self.store.read_into(tid, list(range(LAYERS)), 0, out)
        return out.reshape(LAYERS, total_blocks, SLOT)

    def used_slots(self) -> int:
        u = self.store.usage()
        return (u["dram"]["used_bytes"] + u["nvme"]["used_bytes"]) // SLOT


def blocks(layers: list[int], n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (len(layers) * n, SLOT), dtype=np.uint8)


def push_msg(tid: str, layer_ids: list[int], first: int, n: int, total: int, data: np.ndarray | None,
             **over) -> wire.Push:
    """A Push of blocks [first, first+n) of `layer_ids` of a `total`-block transfer; `over`
    replaces any field (malformed ones too)."""
    fields = dict(transfer_id=tid, num_layers=LAYERS, total_blocks=total, fingerprint=FP, layers=layer_ids,
                  first_block=first, num_blocks=n,
                  checksums=None if data is None else [xxhash.xxh3_64_intdigest(r) for r in data],
                  nbytes=len(layer_ids) * n * SLOT)
    fields.update(over)
    return wire.Push(**fields)


def push(c: StoreClient, tid: str, layers: list[int], first: int, n: int, total_blocks: int, *, seed: int = 0,
         seal: bool = False, **over) -> np.ndarray:
    """One group pushed and acknowledged (TransferError if refused); returns its rows."""
    data = blocks(layers, n, seed)
    c.push(push_msg(tid, layers, first, n, total_blocks, data, seal=seal, **over),
           [memoryview(data.reshape(-1))], time.monotonic() + RPC_S)
    return data


def push_all(c: StoreClient, tid: str, total_blocks: int, seed: int = 0) -> np.ndarray:
    """A whole transfer, one Push per layer, the last one sealing: [LAYERS, total_blocks, SLOT]."""
    out = [push(c, tid, [layer], 0, total_blocks, total_blocks, seed=seed + layer, seal=layer == LAYERS - 1)
           for layer in range(LAYERS)]
    return np.stack(out)


def refused(call, *args, **kw) -> TransferError:
    """The typed, in-step refusal `call` must get (an answer, not a dropped connection)."""
    try:
        call(*args, **kw)
    except TransferError as exc:
        assert exc.refused, f"expected a refusal in step, got {exc!r}"
        return exc
    raise AssertionError(f"{getattr(call, '__name__', call)} was accepted; expected a refusal")


def refused_header(srv: LandingServer, msg: wire.Push) -> wire.Ack:
    """Send a Push header alone on a fresh connection (a malformed streamed push ends its
    connection after the answer: its byte count cannot be trusted) and return the refusal."""
    c = srv.client()
    wire.send_msg(c.sock, msg)
    reply = wire.recv_msg(c.sock, time.monotonic() + RPC_S)
    assert isinstance(reply, wire.Ack) and not reply.ok, reply
    return reply


def still_serves(c: StoreClient) -> None:
    """The connection answers the next request: its thread did not die, the stream is in step."""
    assert c.status(time.monotonic() + RPC_S).entries >= 0
