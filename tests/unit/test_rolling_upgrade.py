"""Rolling upgrades: a store server admits peers of the previous wire version (v3) for one release,
a client speaks v3 to a server that admits only v3, and a consumer accepts the previous ticket
version (params v3); anything older is refused naming both versions.

The v3 peer here speaks the frozen v3 dialect, copied from wire.py as it was before v4 (commit
f51b62c): its own structs, its own msgpack union, its own compat hash formula and its one-way
HMAC challenge, so the test does not borrow today's encoding. No engine.

Negative controls, seen to fail: with wire.ACCEPTED_VERSIONS = (PROTOCOL_VERSION,) the v3 read
is refused at the handshake ("its protocol v3 is not admitted"); with
params.ACCEPTED_PARAMS_VERSIONS = (PARAMS_VERSION,) the v3 ticket is refused (bad_params, field v);
with StoreServer._check_token accepting any token, the v3 peer reads a granted entry. The `window`
tests below keep the first two controls in the suite.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import time
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
SECRET = b"upgrade-s3cret-s3cret"


# ---------------------------------------------------------------- the frozen v3 dialect (f51b62c)
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
    rejected: dict[str, int] = msgspec.field(default_factory=dict)


class Locate(msgspec.Struct, tag=True):
    transfer_id: str


class LocateReply(msgspec.Struct, tag=True):
    found: bool
    dram_slots: int = 0
    nvme_slots: int = 0


V3Message = Union[Hello, Welcome, Proof, Read, ReadReply, Renew, RenewReply, Release, Ack, Status, StatusReply,
                  Locate, LocateReply]
_enc, _dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(V3Message)


def old_compat_hash(version: int, *parts: str) -> str:
    """compat_hash as v2/v3 peers compute it (their PROTOCOL_VERSION baked in)."""
    h = hashlib.sha256(f"kvconnectors-wire-v{version}".encode())
    for p in parts:
        h.update(b"\0" + p.encode())
    return h.hexdigest()[:16]


def old_prove(secret: bytes, nonce: bytes) -> bytes:
    """v3's one-way challenge answer."""
    return hmac.new(secret, b"kvconnectors-auth-v1" + nonce, hashlib.sha256).digest()


class OldPeer:
    """A peer of protocol `version` (2 or 3), speaking the v3 structs above."""

    def __init__(self, port: int, version: int = 3, secret: bytes | None = None):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.send(Hello(version=version, compat_hash=old_compat_hash(version, "tiered"), peer="old"))
        self.welcome = self.recv()
        if secret is not None and self.welcome.ok and self.welcome.nonce is not None:
            self.send(Proof(mac=old_prove(secret, self.welcome.nonce)))
            self.auth = self.recv()

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
def test_a_v3_peer_reads_a_transfer_byte_exact_from_a_v4_server(server) -> None:
    data = stage(server.store, "t1")
    peer = OldPeer(server.port, version=3)
    try:
        assert peer.welcome == Welcome(ok=True), peer.welcome
        peer.send(Read(transfer_id="t1", layers=[0, 1], first_block=0, num_blocks=BLOCKS, fingerprint=FP))
        reply = peer.recv()
        assert isinstance(reply, ReadReply) and reply.ok, reply
        got = np.frombuffer(peer.recv_exact(reply.nbytes), dtype=np.uint8).reshape(LAYERS, BLOCKS, SLOT)
        assert np.array_equal(got, data), "a v3 peer read different bytes"
        assert reply.checksums == [xxhash.xxh3_64_intdigest(got[l, b]) for l in range(LAYERS) for b in range(BLOCKS)]
        peer.send(Locate(transfer_id="t1"))
        assert peer.recv() == LocateReply(found=True, dram_slots=LAYERS * BLOCKS)
        peer.send(Release(transfer_id="t1"))
        assert peer.recv() == Ack(ok=True)
        peer.send(Status())  # v4's StatusReply has a field v3 lacks: a v3 peer decodes it anyway
        status = peer.recv()
        assert isinstance(status, StatusReply) and status.entries == 0, status
    finally:
        peer.close()


def test_a_v3_peer_presents_no_token_so_a_granted_entry_is_unknown_to_it(server) -> None:
    """A v3 peer cannot present a transfer token: an entry granted one answers it exactly as an
    unknown id does, on every request, and stays in the store (no downgrade past the tokens)."""
    stage(server.store, "granted")
    server.grant("granted", kvparams.new_token())
    peer = OldPeer(server.port, version=3)
    try:
        for tid in ("granted", "never-staged"):
            peer.send(Read(transfer_id=tid, layers=[0, 1], first_block=0, num_blocks=BLOCKS, fingerprint=FP))
            reply = peer.recv()
            assert isinstance(reply, ReadReply) and not reply.ok and reply.cause == "unknown_transfer", reply
            assert reply.message == f"transfer {tid!r} is not in this store"
            peer.send(Renew(transfer_ids=[tid]))
            assert peer.recv() == RenewReply(remaining={}, missing={tid: "unknown_transfer"})
            peer.send(Locate(transfer_id=tid))
            assert peer.recv() == LocateReply(found=False)
            peer.send(Release(transfer_id=tid))
            assert peer.recv() == Ack(ok=False, cause="unknown_transfer", message=f"transfer {tid!r} is not in this store")
    finally:
        peer.close()
    assert server.store.contains("granted")


def test_a_v3_peer_is_refused_by_a_server_holding_the_secret() -> None:
    """v3's one-way challenge binds nothing to the connection and its server proves nothing: a
    server that holds the secret admits no v3 peer, whatever secret the peer holds (issue 34)."""
    from kvconnectors.transport.server import StoreServer

    store = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=16 * SLOT))
    srv = StoreServer(store, "127.0.0.1", 0, fingerprint=FP, num_layers=LAYERS, compat=wire.compat_hashes("tiered"),
                      secret=SECRET)
    try:
        for secret in (SECRET, b"another-secret-another", None):
            peer = OldPeer(srv.port, version=3, secret=secret)
            peer.close()
            assert not peer.welcome.ok and peer.welcome.nonce is None, peer.welcome
            assert "authenticates one way only" in peer.welcome.error, peer.welcome.error
        assert srv.counters.rejected.get("previous_wire") == 3 and srv.counters.auth_failures == 0
    finally:
        srv.close()
        store.close()


def test_a_v4_client_speaks_v3_to_a_server_that_admits_only_v3() -> None:
    """The client side of the window, in a pool without a secret: an instance not upgraded yet is
    spoken to in its version (its refusal names the versions it admits); without the previous
    version's hash the client does not fall back."""
    from kvconnectors.transport.client import StoreClient
    from kvconnectors.transport.server import StoreServer

    store = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=16 * SLOT))
    srv = StoreServer(store, "127.0.0.1", 0, fingerprint=FP, num_layers=LAYERS,
                      compat={3: wire.compat_hash("tiered", version=3)})
    try:
        with StoreClient("127.0.0.1", srv.port, compat=wire.compat_hashes("tiered")) as c:
            assert c.version == 3 and not c.session.authenticated and not c.session.mutual
            assert c.status(time.monotonic() + 5).entries == 0
        with pytest.raises(TransferError, match="admits v3"):
            StoreClient("127.0.0.1", srv.port, compat=wire.compat_hash("tiered"))
    finally:
        srv.close()
        store.close()


def test_the_previous_versions_refusal_wording_is_understood() -> None:
    """What a v3 server answers a v4 Hello (f51b62c's check_hello), read for the fallback."""
    old = "incompatible peer: its protocol v4 compat ed730ab0dac12ff9, this server v3 compat d3dfed9708bc2a9b " \
          "(admits v2, v3)"
    assert wire.admitted_versions(old) == {2, 3}
    assert wire.admitted_versions(wire.check_hello(wire.Hello(version=9, compat_hash="x"),
                                                   wire.compat_hashes("tiered"))) == {3, 4}


def test_a_v2_peer_is_refused_naming_the_versions_admitted(server) -> None:
    peer = OldPeer(server.port, version=2)
    try:
        assert not peer.welcome.ok
        assert "its protocol v2 is not admitted" in peer.welcome.error, peer.welcome.error
        assert "admits v3, v4" in peer.welcome.error, peer.welcome.error
        assert wire.compat_hash("tiered") not in peer.welcome.error  # nothing about this server's build
    finally:
        peer.close()
    assert server.counters.rejected.get("protocol") == 1


def test_a_message_younger_than_a_peers_version_is_refused_naming_both() -> None:
    with pytest.raises(TransferError, match="Locate needs protocol v3; this connection speaks v2"):
        wire.check_since(wire.Locate(transfer_id="t"), 2)
    wire.check_since(wire.Locate(transfer_id="t"), wire.PREVIOUS_VERSION)  # every accepted version has it


@pytest.mark.parametrize("window", [True, False])
def test_the_v3_window_is_what_admits_a_v3_peer(monkeypatch, window) -> None:
    """Control: without the compatibility window (only the current version accepted) the same v3
    peer is refused at the handshake."""
    from kvconnectors.transport.server import StoreServer

    if not window:
        monkeypatch.setattr(wire, "ACCEPTED_VERSIONS", (wire.PROTOCOL_VERSION,))
    store = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=16 * SLOT))
    srv = StoreServer(store, "127.0.0.1", 0, fingerprint=FP, num_layers=LAYERS, compat=wire.compat_hashes("tiered"))
    try:
        peer = OldPeer(srv.port, version=3)
        peer.close()
        assert peer.welcome.ok is window, peer.welcome
        if not window:
            assert "its protocol v3 is not admitted" in peer.welcome.error
    finally:
        srv.close()
        store.close()


def test_allow_previous_wire_false_refuses_a_v3_peer() -> None:
    """The setting that opens the window for a rolling upgrade (off by default) and closes it."""
    from kvconnectors.tiered.config import TieredConfig
    from kvconnectors.transport.server import StoreServer

    assert TieredConfig.from_extra({"allow_previous_wire": True}).compat == wire.compat_hashes("tiered")
    compat = TieredConfig.from_extra({}).compat  # off by default (issue 34)
    store = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=16 * SLOT))
    srv = StoreServer(store, "127.0.0.1", 0, fingerprint=FP, num_layers=LAYERS, compat=compat)
    try:
        peer = OldPeer(srv.port, version=3)
        peer.close()
        assert not peer.welcome.ok and "admits v4)" in peer.welcome.error, peer.welcome
    finally:
        srv.close()
        store.close()


def test_the_compat_hash_of_each_version_is_the_one_its_peers_compute() -> None:
    assert wire.compat_hash("tiered") == old_compat_hash(wire.PROTOCOL_VERSION, "tiered")
    assert wire.compat_hashes("tiered") == {3: old_compat_hash(3, "tiered"), 4: old_compat_hash(4, "tiered")}


# ---------------------------------------------------------------- ticket
def _ticket(v: int, **extra) -> dict:
    tokens = list(range(20))
    raw = {"v": v, "transfer_id": "e:r1", "addrs": [["127.0.0.1", 5000]], "num_tokens": 20, "num_blocks": 2,
           "block_size": 16, "fingerprint": FP, "prompt_hash": kvparams.prompt_hash(tokens), "lease_ttl_s": 30.0,
           "issued_at": 1.0, "transport": "tcp", "shm_path": "", **extra}
    return {kvparams.KEY: raw, "do_remote_prefill": True}


def test_a_v3_ticket_is_parsed_with_defaults_for_what_v3_lacked() -> None:
    p = kvparams.parse(_ticket(3, push_target="127.0.0.1:7000", token=kvparams.new_token()), list(range(20)), 16)
    assert p.v == 3 and p.tp_size == 0 and p.kv_heads == 0 and p.push_target == "127.0.0.1:7000"


def test_a_v4_ticket_states_the_producer_tp_and_kv_heads() -> None:
    token = kvparams.new_token()
    p = kvparams.parse(_ticket(4, token=token, tp_size=1, kv_heads=2), list(range(20)), 16)
    assert (p.tp_size, p.kv_heads) == (1, 2)
    with pytest.raises(TransferError, match=r"kvc\.tp_size=2.*1 producer addresses"):
        kvparams.parse(_ticket(4, token=token, tp_size=2, kv_heads=2), list(range(20)), 16)
    with pytest.raises(TransferError, match=r"kvc\.kv_heads=0"):
        kvparams.parse(_ticket(4, token=token, tp_size=1), list(range(20)), 16)


def test_a_v3_ticket_needs_its_token() -> None:
    token = kvparams.new_token()
    assert kvparams.parse(_ticket(3, token=token), list(range(20)), 16).token == token
    for bad in ("", "short", "x" * 21, "=" * 32, "t" * 129):
        with pytest.raises(TransferError, match=r"kvc\.token") as exc:
            kvparams.parse(_ticket(3, token=bad), list(range(20)), 16)
        assert bad not in str(exc.value) or not bad, "a token is never echoed"


@pytest.mark.parametrize("v", [2, kvparams.PARAMS_VERSION + 1])
def test_tickets_outside_the_window_are_refused_naming_the_versions(v) -> None:
    with pytest.raises(TransferError) as exc:
        kvparams.parse(_ticket(v), list(range(20)), 16)
    assert exc.value.cause is FailureCause.BAD_PARAMS
    assert f"kvc.v={v}" in str(exc.value) and "accepts versions 3 and 4" in str(exc.value), exc.value


def test_a_v3_ticket_cannot_carry_a_v4_field() -> None:
    with pytest.raises(TransferError, match="tp_size.*added in version 4"):
        kvparams.parse(_ticket(3, token=kvparams.new_token(), tp_size=1), list(range(20)), 16)


def test_without_the_window_a_v3_ticket_is_refused(monkeypatch) -> None:
    """Control: the window, not a lenient parser, is what admits v3 tickets."""
    monkeypatch.setattr(kvparams, "ACCEPTED_PARAMS_VERSIONS", (kvparams.PARAMS_VERSION,))
    with pytest.raises(TransferError, match=r"kvc\.v=3"):
        kvparams.parse(_ticket(3, token=kvparams.new_token()), list(range(20)), 16)


def test_a_tcp_ticket_carries_no_field_a_previous_consumer_would_refuse() -> None:
    """Tickets leave fields at their defaults out (issue 34 added shm_paths): a tcp pull ticket of
    this release has only the fields the previous release's consumer knew, which refuses unknown ones."""
    token = kvparams.new_token()
    ticket = kvparams.TransferParams(
        v=kvparams.PARAMS_VERSION, transfer_id="t", addrs=[kvparams.PeerAddress("127.0.0.1", 7000)], num_tokens=20,
        num_blocks=2, block_size=16, fingerprint="fp", prompt_hash=kvparams.prompt_hash(list(range(20))),
        lease_ttl_s=30, issued_at=0, token=token, tp_size=1, kv_heads=2)
    built = msgspec.to_builtins(ticket)
    before = {"v", "transfer_id", "addrs", "num_tokens", "num_blocks", "block_size", "fingerprint", "prompt_hash",
              "lease_ttl_s", "issued_at", "transport", "shm_path", "push_target", "token", "tp_size", "kv_heads"}
    assert set(built) <= before, set(built) - before
    assert kvparams.parse(kvparams.producer_params(ticket, "engine"), list(range(20)), 16) == ticket
