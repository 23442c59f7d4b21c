"""Issue 16, after the handshake: wire_protection "aead" seals every frame and KV byte (sealed.py).

A relay on the path (relay_kit.Relay) sees the records and changes them: a flipped byte in a frame
or in KV data, a replayed, reordered or dropped record, a record pasted from another connection, a
Hello whose flag is stripped. Each must fail typed (cause auth) and close that connection, never be
accepted, while the server keeps serving others. The default ("handshake") is the control: the same
relay reads the KV bytes in the clear.
"""

from __future__ import annotations

import socket
import threading
import time

import msgspec
import numpy as np
import pytest

from kvconnectors.errors import ConfigError, FailureCause, TransferError
from kvconnectors.store import StoreConfig, TieredStore
from kvconnectors.transport import wire
from kvconnectors.transport.client import StoreClient
from kvconnectors.transport.paths import NixlPull
from kvconnectors.transport.sealed import RECORD_BYTES, SealedSocket, direction_keys
from kvconnectors.transport.server import StoreServer

import landing_kit as lk
from relay_kit import HANDSHAKE_UNITS, Relay, flip
from sec_helpers import BLOCKS, COMPAT, FP, LAYERS, SECRET, dest_views, stage

AEAD = wire.AEAD
RECORD = HANDSHAKE_UNITS  # the first sealed record of a direction


@pytest.fixture
def sealed(make_server):
    srv = make_server(secret=SECRET, protection=AEAD)
    srv.data = stage(srv.store, "t", seed=3)
    return srv


@pytest.fixture
def relays():
    made: list[Relay] = []

    def make(port: int, hook=None) -> Relay:
        made.append(Relay(port, hook))
        return made[-1]

    yield make
    for r in made:
        r.close()


def client(port: int, protection: str = AEAD, **kw) -> StoreClient:
    return StoreClient("127.0.0.1", port, compat=COMPAT, secret=SECRET, connect_timeout_s=3, protection=protection,
                       **kw)


def pull(port: int, tid: str = "t", protection: str = AEAD) -> np.ndarray:
    cache, dest = dest_views()
    with client(port, protection) as c:
        assert c.read(tid, range(LAYERS), 0, dest, fingerprint=FP, deadline=time.monotonic() + 5) == cache.nbytes
        c.release(tid, time.monotonic() + 5)
    return cache


def only(direction: str, unit: int, change):
    """A hook that applies `change` to one unit of one direction of the first connection."""
    def hook(conn: int, d: str, i: int, data: bytes) -> list[bytes]:
        return change(data) if (conn, d, i) == (0, direction, unit) else [data]
    return hook


def failures(srv: StoreServer, want: int, timeout: float = 3.0) -> int:
    deadline = time.monotonic() + timeout
    while srv.counters.integrity_failures < want and time.monotonic() < deadline:
        time.sleep(0.01)
    return srv.counters.integrity_failures


def still_serves(srv: StoreServer) -> None:
    tid = f"after-{time.monotonic_ns()}"
    data = stage(srv.store, tid, seed=9)
    assert np.array_equal(pull(srv.port, tid), data)


# ---------------------------------------------------------------------- round trips
def test_a_sealed_pull_is_byte_exact_and_the_relay_reads_no_kv(sealed, relays) -> None:
    """Seen to fail: with SealedSocket._send_record sending `plain` instead of the ciphertext, the
    relay found the staged bytes on the wire (and the reader failed its tag)."""
    relay = relays(sealed.port)
    assert np.array_equal(pull(relay.port), sealed.data)
    kv = bytes(sealed.data[1, 2, 100:164])
    assert kv not in relay.wire["s2c"]
    assert sealed.counters.integrity_failures == 0


def test_the_default_sends_kv_in_the_clear(make_server, relays) -> None:
    """The control: what the default protects (the handshake only) is what the README says."""
    srv = make_server(secret=SECRET)
    data = stage(srv.store, "t", seed=3)
    relay = relays(srv.port)
    assert np.array_equal(pull(relay.port, protection=wire.HANDSHAKE), data)
    assert bytes(data[1, 2, 100:164]) in relay.wire["s2c"]


def test_a_sealed_push_lands_byte_exact(relays) -> None:
    srv = lk.LandingServer(dram_slots=64, server_kw={"secret": SECRET, "protection": AEAD})
    try:
        relay = relays(srv.server.port)
        with client(relay.port) as c:
            sent = lk.push_all(c, "pushed", 24, seed=5)  # 24 blocks of 4 KiB a Push: several records
        assert np.array_equal(srv.landed("pushed", 24).reshape(sent.shape), sent)
        assert bytes(sent[1, 3, :64]) not in relay.wire["c2s"]
    finally:
        srv.close()


def test_records_are_bounded_and_streams_of_many_views_arrive_whole() -> None:
    """Small views are gathered, large ones sealed in place, every record at most RECORD_BYTES; a
    reader with views of another shape gets the same bytes."""
    a, b = socket.socketpair()
    ka, kb = direction_keys(b"k" * 32, client=True), direction_keys(b"k" * 32, client=False)
    sa = SealedSocket(a, send_key=ka[0], recv_key=ka[1], peer="b")
    sb = SealedSocket(b, send_key=kb[0], recv_key=kb[1], peer="a")
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in (3, 5000, 70_000, RECORD_BYTES * 2 + 7, 1, 17)]
    total = sum(p.nbytes for p in parts)
    t = threading.Thread(target=lambda: sa.sendmsg([memoryview(p) for p in parts]))
    t.start()
    out = np.zeros(total, np.uint8)
    views = [memoryview(out[i:i + 9000]) for i in range(0, total, 9000)]
    got = 0
    while got < total:
        k = sb.recvmsg_into(views)[0]
        assert k > 0
        got += k
        while k:
            if k >= len(views[0]):
                k -= len(views.pop(0))
            else:
                views[0] = views[0][k:]
                k = 0
    t.join()
    assert np.array_equal(out, np.concatenate(parts))
    assert sa._sent <= 2 + total // RECORD_BYTES + 3
    a.close()
    b.close()


# ---------------------------------------------------------------------- tampering
def test_a_flipped_byte_in_kv_data_fails_the_pull_typed(sealed, relays) -> None:
    """s2c record 0 is the ReadReply, record 1 the first KV bytes. Seen to fail: with
    SealedSocket._decrypt skipping decrypt_into's tag check (a plain copy), the pull returned."""
    relay = relays(sealed.port, only("s2c", RECORD + 1, lambda u: [flip(u, 100)]))
    with pytest.raises(TransferError) as exc:
        pull(relay.port)
    assert exc.value.cause is FailureCause.AUTH and "failed its tag" in exc.value.detail, exc.value
    still_serves(sealed)


def test_a_flipped_byte_in_a_frame_is_counted_refused_and_the_server_keeps_serving(sealed, relays) -> None:
    """c2s record 0 is the Read. The server counts it, says so (auth) and hangs up. Seen to fail:
    with StoreServer._integrity_failed not counting, integrity_failures stayed 0."""
    relay = relays(sealed.port, only("c2s", RECORD, lambda u: [flip(u, 6)]))
    with pytest.raises(TransferError) as exc:
        pull(relay.port)
    assert exc.value.cause in (FailureCause.AUTH, FailureCause.PEER_UNREACHABLE), exc.value
    assert failures(sealed, 1) == 1
    assert sealed.counters.rejected.get("integrity") == 1
    with client(sealed.port) as c:
        assert c.status(time.monotonic() + 5).integrity_failures == 1
    still_serves(sealed)


def test_a_flipped_byte_in_pushed_kv_fails_the_push_and_lands_nothing(relays) -> None:
    srv = lk.LandingServer(dram_slots=64, server_kw={"secret": SECRET, "protection": AEAD})
    store = srv.store
    try:
        relay = relays(srv.server.port, only("c2s", RECORD + 1, lambda u: [flip(u, 50)]))  # record 1: the Push's bytes
        with client(relay.port) as c, pytest.raises(TransferError) as exc:
            lk.push_all(c, "pushed", 4, seed=5)
        assert exc.value.cause in (FailureCause.AUTH, FailureCause.PEER_UNREACHABLE), exc.value
        assert failures(srv.server, 1) == 1
        assert not store.is_sealed("pushed") if store.contains("pushed") else True
        with client(srv.server.port) as c:  # the server keeps serving pushes
            sent = lk.push_all(c, "clean", 4, seed=6)
        assert np.array_equal(srv.landed("clean", 4).reshape(sent.shape), sent)
    finally:
        srv.close()


@pytest.mark.parametrize("attack", ["replay", "reorder", "drop"])
def test_a_replayed_reordered_or_dropped_record_fails(sealed, relays, attack) -> None:
    """s2c records 1 and 2 carry KV bytes (4 KiB blocks gathered into records: 8 blocks, 32 KiB,
    one record; so reorder the ReadReply with it). Seen to fail: with the nonce counter not
    advanced in SealedSocket._decrypt (every record under nonce 0), the replay was accepted."""
    held: list[bytes] = []

    def hook(conn, d, i, data):
        if conn or d != "s2c" or i < RECORD:
            return [data]
        if attack == "replay":
            return [data, data] if i == RECORD else [data]
        if attack == "drop":
            return [] if i == RECORD else [data]
        if i == RECORD:  # reorder: hold the ReadReply, send the KV record first
            held.append(data)
            return []
        out, held[:] = [data, *held], []
        return out

    relay = relays(sealed.port, hook)
    with pytest.raises(TransferError) as exc:
        pull(relay.port)
    assert exc.value.cause is FailureCause.AUTH, exc.value
    still_serves(sealed)


def test_a_record_pasted_from_another_connection_fails(sealed, relays) -> None:
    """Connection 1's Read in place of connection 2's (same position, same length): other keys."""
    saved: dict[int, bytes] = {}

    def hook(conn, d, i, data):
        if d == "c2s" and i == RECORD:
            saved.setdefault(conn, data)
            if conn == 1:
                return [saved[0]]
        return [data]

    relay = relays(sealed.port, hook)
    pull(relay.port)  # connection 0: clean
    with pytest.raises(TransferError):
        pull(relay.port)
    assert failures(sealed, 1) == 1


# ---------------------------------------------------------------------- negotiation
def _rewrite(kind: type, **fields):
    def change(unit: bytes) -> list[bytes]:
        msg = wire._decoder.decode(unit[4:])
        assert isinstance(msg, kind), msg
        return [wire.encode(msgspec.structs.replace(msg, **fields))]
    return change


def test_a_relay_that_strips_the_flag_is_refused(sealed, relays) -> None:
    """The Hello says "handshake" on the way: the aead server refuses, naming both values."""
    relay = relays(sealed.port, only("c2s", 0, _rewrite(wire.Hello, protection=wire.HANDSHAKE)))
    with pytest.raises(TransferError) as exc:
        client(relay.port)
    assert exc.value.cause is FailureCause.AUTH and "'aead'" in exc.value.detail and "'handshake'" in exc.value.detail


def test_a_relay_that_strips_the_flag_and_forges_the_echo_fails_the_proof(make_server, relays) -> None:
    """Against a server running the default, a relay strips the client's "aead" and forges
    Welcome.protection: the server's proof is over a transcript without "aead", so the client
    refuses it (and never runs unsealed). Seen to fail: with auth.transcript ignoring
    `protection`, the client accepted a session the relay had downgraded."""
    srv = make_server(secret=SECRET)
    hook = lambda conn, d, i, data: (_rewrite(wire.Hello, protection=wire.HANDSHAKE)(data) if (d, i) == ("c2s", 0)
                                     else _rewrite(wire.Welcome, protection=AEAD)(data) if (d, i) == ("s2c", 0)
                                     else [data])
    relay = relays(srv.port, hook)
    with pytest.raises(TransferError) as exc:
        client(relay.port)
    assert exc.value.cause is FailureCause.AUTH and "did not prove" in exc.value.detail, exc.value


@pytest.mark.parametrize("server_side, client_side", [(AEAD, wire.HANDSHAKE), (wire.HANDSHAKE, AEAD)])
def test_a_mismatch_between_sides_is_typed_and_names_both(make_server, server_side, client_side) -> None:
    srv = make_server(secret=SECRET, protection=server_side)
    with pytest.raises(TransferError) as exc:
        client(srv.port, client_side)
    assert exc.value.cause is FailureCause.AUTH and exc.value.refused, exc.value
    assert "wire_protection" in exc.value.detail
    assert f"'{server_side}'" in exc.value.detail and f"'{client_side}'" in exc.value.detail, exc.value.detail


def test_a_previous_version_peer_cannot_use_aead(make_server) -> None:
    """v3 cannot seal: an aead server refuses a v3 Hello; an aead client never falls back to v3."""
    srv = make_server(secret=SECRET, protection=AEAD, compat=wire.compat_hashes("tiered"))
    v3 = {wire.PREVIOUS_VERSION: wire.compat_hash("tiered", version=wire.PREVIOUS_VERSION)}
    with pytest.raises(TransferError, match="needs protocol v4"):
        StoreClient("127.0.0.1", srv.port, compat=v3, secret=SECRET, connect_timeout_s=3)
    old = make_server(secret=SECRET, compat=v3)  # a server not upgraded yet
    with pytest.raises(TransferError) as exc:
        StoreClient("127.0.0.1", old.port, compat=wire.compat_hashes("tiered"), secret=SECRET, connect_timeout_s=3,
                    protection=AEAD)
    assert exc.value.cause is FailureCause.AUTH and "cannot seal" in exc.value.detail, exc.value
    # nor does a secret holder under "handshake" (issue 34: v3's server proves nothing)
    with pytest.raises(TransferError) as exc:
        StoreClient("127.0.0.1", old.port, compat=wire.compat_hashes("tiered"), secret=SECRET, connect_timeout_s=3)
    assert exc.value.cause is FailureCause.AUTH and "never speaks it" in exc.value.detail, exc.value


def test_nixl_is_refused_under_aead_and_shm_is_served(make_server) -> None:
    """NIXL moves bytes outside the sealed socket: refused at construction and on the wire. shm is
    same-host memory: allowed (its control frames are sealed)."""
    store = TieredStore(StoreConfig(slot_bytes=4096, dram_bytes=4 * 4096))
    try:
        with pytest.raises(ConfigError) as exc:
            StoreServer(store, "127.0.0.1", 0, fingerprint=FP, num_layers=LAYERS, compat=COMPAT, secret=SECRET,
                        protection=AEAD, paths=[NixlPull()])
        assert exc.value.key == "wire_protection"
    finally:
        store.close()
    srv = make_server(secret=SECRET, protection=AEAD)
    with client(srv.port) as c:
        c._send(wire.Read(transfer_id="t", layers=[0], first_block=0, num_blocks=1, fingerprint=FP,
                          data_path="nixl"))
        msg = wire.recv_msg(c.sock, time.monotonic() + 5)  # the reply comes sealed, in step
        assert isinstance(msg, wire.ReadReply) and not msg.ok and "not sealed" in msg.message, msg
        assert c.status(time.monotonic() + 5).entries == 0  # the connection stays in step


# ---------------------------------------------------------------------- configuration
def test_aead_without_a_secret_is_refused_naming_the_field(monkeypatch) -> None:
    from kvconnectors.tiered.config import TieredConfig

    monkeypatch.delenv("KVCONNECTORS_SECRET", raising=False)
    with pytest.raises(ConfigError) as exc:
        TieredConfig.from_extra({"wire_protection": "aead"})
    assert exc.value.key == "wire_protection" and "secret" in exc.value.why
    with pytest.raises(ConfigError) as exc:
        StoreClient("127.0.0.1", 1, compat=COMPAT, protection=AEAD)
    assert exc.value.key == "wire_protection"
    monkeypatch.setenv("KVCONNECTORS_SECRET", SECRET.decode())
    with pytest.raises(ConfigError) as exc:
        TieredConfig.from_extra({"wire_protection": "aead", "transport": "nixl"})
    assert exc.value.key == "wire_protection" and "nixl" in exc.value.why
    assert TieredConfig.from_extra({"wire_protection": "aead", "transport": "shm"}).wire_protection == AEAD
    with pytest.raises(ConfigError):
        TieredConfig.from_extra({"wire_protection": "tls"})


def test_aead_server_without_a_secret_is_refused() -> None:
    store = TieredStore(StoreConfig(slot_bytes=4096, dram_bytes=4 * 4096))
    try:
        with pytest.raises(ConfigError) as exc:
            StoreServer(store, "127.0.0.1", 0, fingerprint=FP, num_layers=LAYERS, compat=COMPAT, protection=AEAD)
        assert exc.value.key == "wire_protection"
    finally:
        store.close()
