"""Rolling upgrades: a store server admits peers of the previous wire version (v2) for one release,
and a consumer accepts the previous ticket version (params v1); anything older is refused naming
both versions.

The v2 peer here speaks the frozen v2 dialect, copied from wire.py as it was before v3 (commit
8f4da06~1): its own structs, its own msgpack union and its own compat hash formula, so the test
does not borrow today's encoding. No engine.

Negative controls, seen to fail: with wire.ACCEPTED_VERSIONS = (PROTOCOL_VERSION,) the v2 read
is refused at the handshake ("incompatible peer: its protocol v2 ..."); with
params.ACCEPTED_PARAMS_VERSIONS = (PARAMS_VERSION,) the v1 ticket is refused (bad_params, field v);
with wire.SINCE emptied a v2 peer's Locate is answered instead of refused. The `window` tests below
keep the first two controls in the suite.
"""

from __future__ import annotations

import hashlib
import socket
import struct
from typing import Union

import msgspec
import numpy as np
import pytest
import xxhash

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.store import StoreConfig, TieredStore
from kvconnectors.tiered import params as kvparams
from kvconnectors.transport import wire

SLOT, LAYERS, BLOCKS = 4096, 2, 5
FP = "fp-upgrade"


# ---------------------------------------------------------------- the frozen v2 dialect (8f4da06~1)
class Hello(msgspec.Struct, tag=True):
    version: int
    compat_hash: str
    peer: str = ""


class Welcome(msgspec.Struct, tag=True):
    ok: bool
    nonce: bytes | None = None
    error: str = ""


class Proof(msgspec.Struct, tag=True):
    mac: bytes


class Read(msgspec.Struct, tag=True):
    transfer_id: str
    layers: list[int]
    first_block: int
    num_blocks: int
    fingerprint: str
    data_path: str = "inline"


class ReadReply(msgspec.Struct, tag=True):
    ok: bool
    cause: str = ""
    message: str = ""
    nbytes: int = 0
    checksums: list[int] | None = None
    shm_path: str = ""
    offsets: list[int] | None = None
    lease_ttl_s: float = 0.0
    nixl_agent_meta: bytes | None = None
    nixl_base_address: int = 0


class Renew(msgspec.Struct, tag=True):
    transfer_ids: list[str]


class RenewReply(msgspec.Struct, tag=True):
    remaining: dict[str, float]
    missing: dict[str, str]


class Release(msgspec.Struct, tag=True):
    transfer_id: str


class Ack(msgspec.Struct, tag=True):
    ok: bool
    cause: str = ""
    message: str = ""


class Status(msgspec.Struct, tag=True):
    pass


class StatusReply(msgspec.Struct, tag=True):
    entries: int
    dram_used_bytes: int
    nvme_used_bytes: int
    pinned: int
    active_connections: int
    counters: dict[str, int]


V2Message = Union[Hello, Welcome, Proof, Read, ReadReply, Renew, RenewReply, Release, Ack, Status, StatusReply]
_enc, _dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(V2Message)


def old_compat_hash(version: int, *parts: str) -> str:
    """compat_hash as v1/v2 peers compute it (their PROTOCOL_VERSION baked in)."""
    h = hashlib.sha256(f"kvconnectors-wire-v{version}".encode())
    for p in parts:
        h.update(b"\0" + p.encode())
    return h.hexdigest()[:16]


class OldPeer:
    """A peer of protocol `version` (1 or 2), speaking the v2 structs above."""

    def __init__(self, port: int, version: int = 2):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.send(Hello(version=version, compat_hash=old_compat_hash(version, "tiered"), peer="old"))
        self.welcome = self.recv()

    def send(self, msg) -> None:
        payload = _enc.encode(msg)
        self.sock.sendall(struct.pack("!I", len(payload)) + payload)

    def recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
            buf += chunk
        return bytes(buf)

    def recv(self):
        (n,) = struct.unpack("!I", self.recv_exact(4))
        return _dec.decode(self.recv_exact(n))

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------- fixtures
@pytest.fixture
def server():
    from kvconnectors.transport.server import StoreServer

    store = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=64 * SLOT, lease_ttl_s=30))
    srv = StoreServer(store, "127.0.0.1", 0, fingerprint=FP, num_layers=LAYERS, compat=wire.compat_hashes("tiered"))
    yield srv
    srv.close()
    store.close()


def stage(store: TieredStore, tid: str) -> np.ndarray:
    data = np.random.default_rng(7).integers(0, 256, (LAYERS, BLOCKS, SLOT), dtype=np.uint8)
    store.create(tid, LAYERS, BLOCKS)
    for layer in range(LAYERS):
        store.write(tid, layer, 0, data[layer])
    store.seal(tid, {"xxh3": [xxhash.xxh3_64_intdigest(data[l, b]) for l in range(LAYERS) for b in range(BLOCKS)]})
    return data


# ---------------------------------------------------------------- wire
def test_a_v2_peer_reads_a_transfer_byte_exact_from_a_v3_server(server) -> None:
    data = stage(server.store, "t1")
    peer = OldPeer(server.port, version=2)
    try:
        assert peer.welcome == Welcome(ok=True), peer.welcome
        peer.send(Read(transfer_id="t1", layers=[0, 1], first_block=0, num_blocks=BLOCKS, fingerprint=FP))
        reply = peer.recv()
        assert isinstance(reply, ReadReply) and reply.ok, reply
        got = np.frombuffer(peer.recv_exact(reply.nbytes), dtype=np.uint8).reshape(LAYERS, BLOCKS, SLOT)
        assert np.array_equal(got, data), "a v2 peer read different bytes"
        assert reply.checksums == [xxhash.xxh3_64_intdigest(got[l, b]) for l in range(LAYERS) for b in range(BLOCKS)]
        peer.send(Release(transfer_id="t1"))
        assert peer.recv() == Ack(ok=True)
        peer.send(Status())  # v3's StatusReply has a field v2 lacks: a v2 peer decodes it anyway
        status = peer.recv()
        assert isinstance(status, StatusReply) and status.entries == 0, status
    finally:
        peer.close()


def test_a_v2_peer_is_refused_what_v2_did_not_have_and_keeps_its_connection(server) -> None:
    peer = OldPeer(server.port, version=2)
    try:
        assert peer.welcome.ok, peer.welcome
        # a v3-only message on a v2 connection (encoded with today's structs: v2 had none)
        payload = msgspec.msgpack.encode(wire.Locate(transfer_id="t"))
        peer.sock.sendall(struct.pack("!I", len(payload)) + payload)
        refusal = peer.recv()
        assert isinstance(refusal, Ack) and not refusal.ok and refusal.cause == FailureCause.PROTOCOL.value, refusal
        assert "Locate needs protocol v3" in refusal.message and "speaks v2" in refusal.message, refusal.message
        peer.send(Status())  # answered in step: the connection still serves
        assert isinstance(peer.recv(), StatusReply)
    finally:
        peer.close()


def test_a_v1_peer_is_refused_naming_both_versions(server) -> None:
    peer = OldPeer(server.port, version=1)
    try:
        assert not peer.welcome.ok
        assert "its protocol v1" in peer.welcome.error and f"this server v{wire.PROTOCOL_VERSION}" in peer.welcome.error
        assert "admits v2, v3" in peer.welcome.error, peer.welcome.error
    finally:
        peer.close()
    assert server.counters.rejected.get("protocol") == 1


@pytest.mark.parametrize("window", [True, False])
def test_the_v2_window_is_what_admits_a_v2_peer(monkeypatch, window) -> None:
    """Control: without the compatibility window (only the current version accepted) the same v2
    peer is refused at the handshake."""
    from kvconnectors.transport.server import StoreServer

    if not window:
        monkeypatch.setattr(wire, "ACCEPTED_VERSIONS", (wire.PROTOCOL_VERSION,))
    store = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=16 * SLOT))
    srv = StoreServer(store, "127.0.0.1", 0, fingerprint=FP, num_layers=LAYERS, compat=wire.compat_hashes("tiered"))
    try:
        peer = OldPeer(srv.port, version=2)
        peer.close()
        assert peer.welcome.ok is window, peer.welcome
        if not window:
            assert "its protocol v2" in peer.welcome.error
    finally:
        srv.close()
        store.close()


def test_the_compat_hash_of_each_version_is_the_one_its_peers_compute() -> None:
    assert wire.compat_hash("tiered") == old_compat_hash(wire.PROTOCOL_VERSION, "tiered")
    assert wire.compat_hashes("tiered") == {2: old_compat_hash(2, "tiered"), 3: old_compat_hash(3, "tiered")}


# ---------------------------------------------------------------- ticket
def _ticket(v: int, **extra) -> dict:
    tokens = list(range(20))
    raw = {"v": v, "transfer_id": "e:r1", "addrs": [["127.0.0.1", 5000]], "num_tokens": 20, "num_blocks": 2,
           "block_size": 16, "fingerprint": FP, "prompt_hash": kvparams.prompt_hash(tokens), "lease_ttl_s": 30.0,
           "issued_at": 1.0, "transport": "tcp", "shm_path": "", **extra}
    return {kvparams.KEY: raw, "do_remote_prefill": True}


def test_a_v1_ticket_is_parsed_with_defaults_for_what_v1_lacked() -> None:
    p = kvparams.parse(_ticket(1), list(range(20)), 16)
    assert p.v == 1 and p.push_target == "" and p.transfer_id == "e:r1"


@pytest.mark.parametrize("v", [0, kvparams.PARAMS_VERSION + 1])
def test_tickets_outside_the_window_are_refused_naming_the_versions(v) -> None:
    with pytest.raises(TransferError) as exc:
        kvparams.parse(_ticket(v), list(range(20)), 16)
    assert exc.value.cause is FailureCause.BAD_PARAMS
    assert f"kvc.v={v}" in str(exc.value) and "accepts versions 1 and 2" in str(exc.value), exc.value


def test_a_v1_ticket_cannot_carry_a_v2_field() -> None:
    with pytest.raises(TransferError, match="push_target.*added in version 2"):
        kvparams.parse(_ticket(1, push_target="127.0.0.1:7000"), list(range(20)), 16)


def test_without_the_window_a_v1_ticket_is_refused(monkeypatch) -> None:
    """Control: the window, not a lenient parser, is what admits v1 tickets."""
    monkeypatch.setattr(kvparams, "ACCEPTED_PARAMS_VERSIONS", (kvparams.PARAMS_VERSION,))
    with pytest.raises(TransferError, match=r"kvc\.v=1"):
        kvparams.parse(_ticket(1), list(range(20)), 16)
