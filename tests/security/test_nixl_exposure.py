"""Issue 16, finding 5: NIXL exposes the whole arena. NIXL cannot limit a peer to the descriptors of
one entry (the README's Security section says why), so this file pins exactly what is and is not
protected with transport "nixl", and the one rule added for it: across hosts it needs the secret.

NOT protected (pinned, so that a change in NIXL or in our use of it shows up here):
- the agent metadata and base address of ONE nixl ReadReply let its holder READ every slot of the
  producer's registered arena: other requests' staged KV, and released entries' bytes, which stay
  in their slots until overwritten;
- the same metadata lets it WRITE into the arena.
Protected:
- a WRITE into another entry's blocks is detected, not prevented: its consumer's pull fails with
  checksum_mismatch (the xxh3 sums travel on the control socket, not in the arena), with
  `checksum: true`, the default;
- memory outside the registered arena is refused by NIXL, by the READing side's own library (stock
  NIXL checks the remote range against the metadata; a peer speaking UCX directly is not held by it);
- with a secret, a peer that cannot authenticate gets no ReadReply, so no metadata;
- config: transport "nixl" with a bind_host that is not a loopback address needs a secret (fails on
  the code before: it was accepted silently).

In-process producer (TieredStore + StoreServer(nixl=True)) and consumer (StoreClient + NixlSink);
UCX on loopback (conftest.py). Every server, agent and socket is closed at the end of the module.
"""

from __future__ import annotations

import time

from kvconnectors.transport.ucx_env import set_cpu_defaults

set_cpu_defaults()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import xxhash  # noqa: E402

from kvconnectors.errors import ConfigError, FailureCause, TransferError  # noqa: E402
from kvconnectors.tiered.config import TieredConfig  # noqa: E402
from kvconnectors.transport import nixl as nx  # noqa: E402
from kvconnectors.transport import wire  # noqa: E402
from kvconnectors.transport.auth import SECRET_ENV  # noqa: E402
from kvconnectors.transport.client import StoreClient  # noqa: E402
from kvconnectors.transport.paths import NixlPull  # noqa: E402

pytestmark = pytest.mark.timeout(60)

_MISSING = nx.nixl_import_error()
needs_nixl = pytest.mark.skipif(_MISSING is not None,
                                reason=f"nixl is not importable here ({_MISSING}); pip install 'kvconnectors[nixl]'")

SLOT, LAYERS, BLOCKS, ARENA_SLOTS = 4096, 2, 2, 16
FP = "fp-sec"
COMPAT = wire.compat_hash("nixl-exposure")
SECRET = b"s3cret-for-the-nixl-exposure-test"


def _data(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (LAYERS, BLOCKS, SLOT), dtype=np.uint8)


MINE, THEIRS = _data(1), _data(2)


@pytest.fixture(scope="module")
def producer():
    from kvconnectors.store import StoreConfig, TieredStore
    from kvconnectors.transport.server import StoreServer

    store = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=SLOT * ARENA_SLOTS, instance_name="nixlsec"))
    server = StoreServer(store, "127.0.0.1", 0, fingerprint=FP, num_layers=LAYERS, compat=COMPAT, secret=SECRET,
                         nixl=True)
    for key, data in (("mine", MINE), ("theirs", THEIRS)):
        store.create(key, LAYERS, BLOCKS)
        for layer in range(LAYERS):
            store.write(key, layer, 0, data[layer])
        store.seal(key, {"xxh3": [xxhash.xxh3_64_intdigest(data[lr, b]) for lr in range(LAYERS)
                                  for b in range(BLOCKS)]})
    yield store, server
    server.close()
    store.close()


@pytest.fixture(scope="module")
def sink():
    s = nx.NixlSink(tag="sectest")
    yield s
    s.close()


@pytest.fixture(scope="module")
def memory(sink):
    """The consumer's registered memory: a KV-cache stand-in and a scratch area for the scan."""
    cache = np.zeros((LAYERS * BLOCKS, SLOT), dtype=np.uint8)
    scan = np.zeros((ARENA_SLOTS + 1, SLOT), dtype=np.uint8)
    sink.register([cache, scan])
    return cache, scan


class Recording(NixlPull):
    """The honest consumer's nixl path, keeping the reply it was given."""

    def read_into(self, sock, peer, read, reply, dest, **kw):
        self.reply = reply
        return super().read_into(sock, peer, read, reply, dest, **kw)


def _client(producer, secret=SECRET) -> StoreClient:
    return StoreClient("127.0.0.1", producer[1].port, compat=COMPAT, secret=secret, connect_timeout_s=5)


def _pull(client, tid, sink, cache) -> Recording:
    path = Recording(sink=sink)
    cache[:] = 0
    client.read(tid, range(LAYERS), 0, [memoryview(r) for r in cache], fingerprint=FP,
                deadline=time.monotonic() + 10, path=path)
    return path


def _addrs(arr: np.ndarray, rows) -> np.ndarray:
    return np.uint64(arr.ctypes.data) + np.asarray(rows, dtype=np.uint64) * np.uint64(SLOT)


@needs_nixl
def test_one_reply_exposes_the_whole_arena_for_read_and_write(producer, sink, memory):
    store, server = producer
    cache, scan = memory
    with _client(producer) as client:
        path = _pull(client, "mine", sink, cache)  # an honest pull of the entry this peer's ticket names
        assert np.array_equal(cache.reshape(LAYERS, BLOCKS, SLOT), MINE)
        meta, base = path.reply.nixl_agent_meta, path.reply.nixl_base_address
        key = client.address  # the consumer's cached agent for this producer

        # NOT protected: with only that reply, READ every slot of the arena
        rows = np.arange(ARENA_SLOTS)
        sink.read(key, meta, np.uint64(base) + rows.astype(np.uint64) * np.uint64(SLOT), _addrs(scan, rows), SLOT,
                  time.monotonic() + 10)
        found = {bytes(r) for r in scan[:ARENA_SLOTS]}
        assert all(bytes(THEIRS[lr, b]) in found for lr in range(LAYERS) for b in range(BLOCKS)), \
            "another entry's KV is no longer readable through one reply's metadata: NIXL restricts READs now"
        assert all(bytes(MINE[lr, b]) in found for lr in range(LAYERS) for b in range(BLOCKS)), \
            "a released entry's bytes stay in its slots until overwritten"
        assert "mine" not in store.keys()

        # Protected (by the READing side's NIXL): one byte past the registered arena is refused
        with pytest.raises(TransferError):
            sink.read(key, meta, np.asarray([base + server.nixl.nbytes], dtype=np.uint64), _addrs(scan, [0]), SLOT,
                      time.monotonic() + 5)

        # NOT protected: WRITE into the first slot of "theirs"
        victim = next(i for i in range(ARENA_SLOTS) if np.array_equal(scan[i], THEIRS[0, 0]))
        scan[ARENA_SLOTS] = 0xEE
        assert _write(sink, server, key, meta, base + victim * SLOT, _addrs(scan, [ARENA_SLOTS])[0]) == "DONE"

        # Protected (detected): "theirs"'s own consumer fails on its checksums, nothing corrupt lands silently
        with pytest.raises(TransferError) as exc:
            _pull(client, "theirs", sink, cache)
        assert exc.value.cause is FailureCause.CHECKSUM_MISMATCH


def _write(sink, server, key, meta, remote_addr: int, local_addr: int) -> str:
    """WRITE one slot from the consumer's registered memory into the producer's arena, through the
    same stock NIXL agent, the way a malicious holder of the metadata would."""
    agent, name = sink._agent, sink._peer(key, meta)
    loc = agent.prep_xfer_dlist("NIXL_INIT_AGENT", nx.xfer_descs(np.asarray([local_addr], np.uint64), SLOT), "DRAM")
    rem = agent.prep_xfer_dlist(name, nx.xfer_descs(np.asarray([remote_addr], np.uint64), SLOT), "DRAM")
    idx = np.arange(1, dtype=np.int32)
    xfer = agent.make_prepped_xfer("WRITE", loc, idx, rem, idx)
    try:
        state, deadline = agent.transfer(xfer), time.monotonic() + 10
        while state == "PROC" and time.monotonic() < deadline:
            server.nixl.progress()
            time.sleep(0.001)
            state = agent.check_xfer_state(xfer)
        return state
    finally:
        for h in (xfer, rem, loc):
            h.release()


@needs_nixl
def test_a_peer_without_the_secret_gets_no_metadata(producer):
    store, server = producer
    reads = server.counters.reads
    for secret in (None, b"not-the-secret-but-16-bytes-long"):
        with pytest.raises(TransferError) as exc:
            _client(producer, secret=secret)
        assert exc.value.cause is FailureCause.AUTH
    assert server.counters.reads == reads


def test_nixl_across_hosts_requires_a_secret(monkeypatch, tmp_path):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    for host in ("10.1.2.3", "node-7.cluster.local"):
        with pytest.raises(ConfigError, match="secret_file.*transport 'nixl'"):
            TieredConfig(transport="nixl", bind_host=host)
    # a wildcard too (another rule may refuse a secret-less wildcard bind first, for any transport)
    with pytest.raises(ConfigError, match="secret"):
        TieredConfig(transport="nixl", bind_host="::", advertise_host="10.1.2.3")
    # accepted: loopback (one host), a secret file, or the variable
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        TieredConfig(transport="nixl", bind_host=host)
    TieredConfig(transport="nixl", bind_host="10.1.2.3", secret_file=str(tmp_path / "secret"))
    monkeypatch.setenv(SECRET_ENV, "x" * 32)
    TieredConfig(transport="nixl", bind_host="10.1.2.3")
