"""The asynchronous contract through the real TieredConnectorWorker (issue 14), no engine.

test_mover.py holds a copy at the mover (Stager, Loader); here the worker vLLM drives copies
through a CpuOps whose copies wait for a gate that the test opens (the worker gets it from
`ops_for`, so its Stager and Loader copy through it too), and the gate decides:
- producer: `save_kv_layer` returns while its layer's copy is held (it hands the copy to the
  staging thread), `wait_for_save` does not (vLLM reuses the blocks after it), and once the gate
  opens the store holds the cache's bytes;
- consumer: a pull whose host->device copy is held (an LHBNC cache: its blocks are H runs, so
  the bytes land in a host buffer and the Loader scatters them, as on a GPU) is not reported by
  `take_results` (what the connector's get_finished / get_transfer_results report) until the
  copy's event is done, and the blocks then hold the producer's bytes.
Workers are built as in test_tiered_tp.py: CPU caches, a store and a tcp store server each.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import numpy as np
import pytest
import torch

from kvconnectors.mover import CpuOps
from kvconnectors.mover.shapes import synthetic_caches
from kvconnectors.testing.worker_config import worker_vllm_config
from kvconnectors.tiered import params as kvparams
from kvconnectors.tiered import worker as worker_mod
from kvconnectors.tiered.config import TieredConfig
from kvconnectors.tiered.metadata import RecvSpec, SaveSpec, TieredConnectorMetadata
from kvconnectors.tiered.worker import TieredConnectorWorker

LAYOUT = "LHBNC"  # blocks of 2 runs: a CPU consumer loads through the Loader's copy, not in place
HEADS, LAYERS, BLOCKS, BS, C = 2, 3, 8, 16, 8
PRODUCER_IDS, CONSUMER_IDS = [5, 1, 6], [2, 7, 0]
HELD_S = 0.5   # how long a held copy is watched for a premature return or report
BOUND_S = 10.0  # every other wait


class GatedOps(CpuOps):
    """CpuOps whose copies (gathers, scatters) wait until `gate` is set; `reached` says a copy is
    waiting at it, i.e. the worker really copies through these ops and that copy is now held."""

    def __init__(self) -> None:
        super().__init__("gated-copy")
        self.gate, self.reached = threading.Event(), threading.Event()

    def _hold(self) -> None:
        self.reached.set()
        assert self.gate.wait(2 * BOUND_S), "the test never opened the gate"

    def gather(self, src, ids, out, dim=0) -> None:
        self._hold()
        super().gather(src, ids, out, dim)

    def scatter(self, rows, dst, ids) -> None:
        self._hold()
        super().scatter(rows, dst, ids)


class Call:
    """fn() on its own thread: a test sees whether it has returned without hanging on it."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.done, self.error = threading.Event(), None
        threading.Thread(target=self._run, args=(fn,), daemon=True).start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def returned(self, within_s: float) -> bool:
        if self.done.wait(within_s) and self.error is not None:
            raise self.error
        return self.done.is_set()


def u8_blocks(caches: dict[str, torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    """Per layer, blocks `ids` as uint8 [n, block bytes] (LHBNC: logical order is physical order)."""
    return [t[ids].contiguous().view(torch.uint8).reshape(len(ids), -1) for t in caches.values()]


@pytest.fixture
def make_worker(monkeypatch) -> Iterator[Callable[..., TieredConnectorWorker]]:
    """make_worker(role "p"/"c", caches, ops=None): a worker registered on `caches`, copying
    through `ops` (None: the CpuOps it would make itself). Gates are opened and workers shut
    down at the end, whatever the test did."""
    made: list[tuple[TieredConnectorWorker, CpuOps | None]] = []

    def build(role: str, caches: dict[str, torch.Tensor], ops: CpuOps | None = None) -> TieredConnectorWorker:
        vllm_config = worker_vllm_config(role, BS, HEADS, layout=LAYOUT)
        w = TieredConnectorWorker(vllm_config, TieredConfig(dram_bytes="4m", load_timeout_s=BOUND_S,
                                                            connect_timeout_s=2), f"{role}-async")
        made.append((w, ops))
        with monkeypatch.context() as m:
            if ops is not None:
                m.setattr(worker_mod, "ops_for", lambda device_type: ops)
            w.register_kv_caches(caches)
        assert ops is None or w.ops is ops
        return w
    yield build
    for w, ops in made:
        if ops is not None:
            ops.gate.set()
        w.shutdown()
        if ops is not None:
            ops.close()


def caches(seed: int) -> dict[str, torch.Tensor]:
    return synthetic_caches(LAYOUT, num_layers=LAYERS, num_blocks=BLOCKS, heads=HEADS, block_size=BS, content=C,
                            dtype=torch.float32, seed=seed)


def save_meta(tid: str) -> TieredConnectorMetadata:
    return TieredConnectorMetadata(saves=[SaveSpec("r", tid, PRODUCER_IDS, 0, len(PRODUCER_IDS), True,
                                                   token=f"tok-{tid}")])


def test_save_kv_layer_returns_while_its_copy_is_held_and_wait_for_save_waits_for_it(make_worker) -> None:
    """Guards: save_kv_layer only hands the layer's copy over (the forward goes on to the next
    layer); wait_for_save returns only once every staged byte is in the store (vLLM may then
    reuse the blocks); the store then holds the cache's blocks byte for byte."""
    src, ops = caches(seed=1), GatedOps()
    producer = make_worker("p", src, ops)
    meta = save_meta("t-save")
    for name in src:  # the gate stays closed until after wait_for_save is seen blocked
        assert Call(lambda name=name: producer.save_kv_layer(meta, name)).returned(BOUND_S), (
            f"save_kv_layer({name}) did not return while its copy was held")
    assert ops.reached.wait(BOUND_S), "no staging copy went through the worker's ops"
    waiting = Call(lambda: producer.wait_for_save(meta))
    assert not waiting.returned(HELD_S), "wait_for_save returned while a staging copy was held"
    assert not producer.store.is_sealed("t-save")
    ops.gate.set()
    assert waiting.returned(BOUND_S), "wait_for_save did not return once the copies could run"
    assert producer.store.is_sealed("t-save")
    n = len(PRODUCER_IDS)
    rows = np.empty((LAYERS * n, producer.store.slot_bytes), np.uint8)
    producer.store.read_into("t-save", list(range(LAYERS)), 0, rows)
    for layer, want in enumerate(u8_blocks(src, PRODUCER_IDS)):
        assert torch.equal(torch.from_numpy(rows[layer * n:(layer + 1) * n]), want), f"layer {layer}"


def test_a_load_is_not_reported_before_its_copy_into_the_blocks_is_done(make_worker) -> None:
    """Guards: a pull whose bytes are in but whose host->device copy is held is not reported
    finished (take_results, what get_finished reports), the blocks are untouched meanwhile;
    once the copy runs it is reported, and the blocks hold the producer's bytes."""
    src, dst, ops = caches(seed=1), caches(seed=2), GatedOps()
    producer, consumer = make_worker("p", src), make_worker("c", dst, ops)
    assert not consumer.loader.direct, "this cache is loaded in place: no copy to hold"
    meta = save_meta("t-load")
    for name in src:
        producer.save_kv_layer(meta, name)
    producer.wait_for_save(meta)
    hs = producer.get_handshake_metadata()
    ticket = msgspec.to_builtins(kvparams.TransferParams(
        v=kvparams.PARAMS_VERSION, transfer_id="t-load", addrs=[kvparams.PeerAddress(hs.host, hs.port)],
        num_tokens=len(PRODUCER_IDS) * BS, num_blocks=len(PRODUCER_IDS), block_size=BS,
        fingerprint=hs.fingerprint, prompt_hash="h", lease_ttl_s=30, issued_at=0, token="tok-t-load",
        tp_size=1, kv_heads=hs.kv_heads))
    before = u8_blocks(dst, CONSUMER_IDS)
    consumer.start_load_kv(TieredConnectorMetadata(recvs=[RecvSpec("r", ticket, CONSUMER_IDS, 0)]))
    assert ops.reached.wait(BOUND_S), "the load never reached its copy into the blocks"
    held_until = time.monotonic() + HELD_S
    while time.monotonic() < held_until:
        done, failed = consumer.take_results()
        assert not done and not failed, f"reported while its copy was held: done {done}, failed {failed}"
        time.sleep(0.01)
    assert all(torch.equal(a, b) for a, b in zip(u8_blocks(dst, CONSUMER_IDS), before)), "blocks changed"
    ops.gate.set()
    deadline = time.monotonic() + BOUND_S
    done: set[str] = set()
    while "r" not in done and time.monotonic() < deadline:
        done, failed = consumer.take_results(wait_s=0.05)
        assert not failed, failed
    assert "r" in done, "the load was not reported once its copy was done"
    for layer, (got, want) in enumerate(zip(u8_blocks(dst, CONSUMER_IDS), u8_blocks(src, PRODUCER_IDS))):
        assert torch.equal(got, want), f"layer {layer}"
