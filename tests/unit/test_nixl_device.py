"""GPU-direct NIXL (transport/nixl_device.py, paths.NixlDevicePull, the worker's start-up decision).

No GPU here: the CUDA caches are CPU tensors with the GPU shapes and strides (mover/shapes.py) in a
geometry that says "cuda", and the NIXL agent is faked at its boundary (`FakeAgent`: the calls
NixlSink makes on nixl._api's agent, recorded), so the decision table, the registered regions and
every READ descriptor (address, length, device, memory type) are checked exactly. Two tests use the
real NIXL agent of this host: merged runs READ byte-exact into DRAM, and a VRAM registration that
UCX without CUDA refuses falls back.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

from kvconnectors.transport.ucx_env import set_cpu_defaults

set_cpu_defaults()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from kvconnectors.errors import FailureCause, TransferError  # noqa: E402
from kvconnectors.mover import Loader, describe_kv_caches  # noqa: E402
from kvconnectors.mover.device import CpuOps  # noqa: E402
from kvconnectors.mover.shapes import synthetic_caches  # noqa: E402
from kvconnectors.transport import nixl as nx  # noqa: E402
from kvconnectors.transport import nixl_device as nd  # noqa: E402
from kvconnectors.transport import nixl_sink  # noqa: E402
from kvconnectors.transport import wire  # noqa: E402
from kvconnectors.transport.paths import NixlDevicePull  # noqa: E402

_MISSING = nx.nixl_import_error()
needs_nixl = pytest.mark.skipif(_MISSING is not None,
                                reason=f"nixl is not importable here ({_MISSING}); pip install 'kvconnectors[nixl]'")

DIMS = dict(num_layers=3, num_blocks=12, heads=2, block_size=16, content=8, dtype=torch.float16)
BACKEND = {"LBHNC": "FLASH_ATTN", "BLHNC": "FLASH_ATTN", "LHBNC": "FLASH_ATTN"}


def _geometry(layout: str, device: str = "cuda"):
    """A GPU-shaped cache on the CPU, whose geometry says `device` (the only CUDA-specific input)."""
    caches = synthetic_caches(layout, **DIMS)
    geo = describe_kv_caches(caches, block_size=16, layout=layout, backend=BACKEND[layout])
    return replace(geo, device=device), caches


# ------------------------------------------------------------------------------ the faked agent
class _Handle:
    def __init__(self, log: list, what: str):
        self.log, self.what = log, what

    def release(self) -> None:
        self.log.append(("release", self.what))


class FakeAgent:
    """The nixl._api agent calls NixlSink makes, recorded; registration can be made to fail."""

    def __init__(self, *, mem_types=("DRAM_SEG", "VRAM_SEG"), fail_register: str | None = None):
        self.name = "fake-consumer"
        self.backends = {"UCX": 1}
        self.mem_types = list(mem_types)
        self.fail_register = fail_register
        self.registered: list[tuple[str, np.ndarray]] = []
        self.deregistered: list = []
        self.prepped: list[tuple[str, str, np.ndarray]] = []  # (agent name, mem type, descs)
        self.log: list = []

    def get_backend_mem_types(self, backend: str) -> list[str]:
        return self.mem_types

    def get_plugin_list(self) -> list[str]:
        return ["UCX"]

    def register_memory(self, descs, mem_type):
        if self.fail_register and mem_type == "VRAM":
            raise RuntimeError(self.fail_register)  # the binding raises nixlBackendError; any exception
        self.registered.append((mem_type, np.array(descs)))
        return ("reg", len(self.registered))

    def deregister_memory(self, reg) -> None:
        self.deregistered.append(reg)

    def add_remote_agent(self, meta: bytes) -> bytes:
        return b"fake-producer"

    def remove_remote_agent(self, name: str) -> None:
        pass

    def prep_xfer_dlist(self, agent_name, descs, mem_type):
        self.prepped.append((agent_name, mem_type, np.array(descs)))
        return _Handle(self.log, f"dlist-{agent_name}")

    def make_prepped_xfer(self, op, loc, loc_idx, rem, rem_idx):
        assert op == "READ" and len(loc_idx) == len(rem_idx)
        return _Handle(self.log, "xfer")

    def transfer(self, xfer) -> str:
        self.log.append(("transfer",))
        return "PROC"

    def check_xfer_state(self, xfer) -> str:
        self.log.append(("check",))
        return "DONE"


@pytest.fixture
def fake(monkeypatch):
    agents: list[FakeAgent] = []
    settings: dict = {}

    def create(role, name, tag):
        agent = FakeAgent(**settings)
        agents.append(agent)
        return agent

    monkeypatch.setattr(nixl_sink, "create_agent", create)  # where NixlSink looks it up
    return SimpleNamespace(agents=agents, settings=settings)


def _reply(offsets, base=0x7000_0000, checksums=None) -> wire.ReadReply:
    return wire.ReadReply(ok=True, offsets=[int(o) for o in offsets], nixl_agent_meta=b"meta",
                          nixl_base_address=base, checksums=checksums)


def _read(layers, n) -> wire.Read:
    return wire.Read(transfer_id="t", layers=list(layers), first_block=0, num_blocks=n, fingerprint="fp",
                     data_path="nixl")


# ------------------------------------------------------------------------------ decision table
def test_decision_table_before_nixl_is_asked():
    """cpu cache or another transport: no decision (a host cache is READ into as DRAM); a cache
    whose block of a layer is several runs, or checksums on: the host path, each with its reason."""
    assert not nd.applies("cpu", "nixl") and not nd.applies("cuda", "tcp") and not nd.applies("cuda", "shm")
    assert nd.applies("cuda", "nixl")
    cpu_geo, _ = _geometry("LBHNC", device="cpu")
    assert Loader(cpu_geo, CpuOps()).direct  # the host path of a cpu cache: bytes land in its blocks

    geo, _ = _geometry("LBHNC")
    assert nd.why_not_direct(geo, checksum=False) is None
    fb = nd.why_not_direct(geo, checksum=True)
    assert fb.reason == "checksum" and "set checksum false" in fb.detail
    split, _ = _geometry("LHBNC")  # H runs per block of a layer
    fb = nd.why_not_direct(split, checksum=False)
    assert fb.reason == "layout" and "LHBNC" in fb.detail and f"{split.runs} runs" in fb.detail
    with pytest.raises(ValueError, match="runs per block"):
        nd.device_rows(split, range(3), [0])
    with pytest.raises(ValueError, match="not one of"):
        nd.Fallback("whatever", "")


def test_layout_and_checksum_fall_back_without_making_an_agent(fake):
    for layout, checksum, reason in (("LHBNC", False, "layout"), ("LBHNC", True, "checksum")):
        geo, _ = _geometry(layout)
        sink, fb = nd.open_direct(geo, checksum=checksum, sink_factory=lambda: nx.NixlSink(tag="t"))
        assert sink is None and fb.reason == reason
    assert fake.agents == []


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_registration_registers_each_device_allocation_once_as_vram(fake, layout):
    geo, caches = _geometry(layout)
    sink, fb = nd.open_direct(geo, checksum=False, sink_factory=lambda: nx.NixlSink(tag="t"))
    assert fb is None and sink is not None
    (agent,) = fake.agents
    storage = next(iter(caches.values())).untyped_storage()  # synthetic caches: one allocation
    assert [(m, d.tolist()) for m, d in agent.registered] == [
        ("VRAM", [[storage.data_ptr(), storage.nbytes(), 0]])]
    sink.close()
    assert len(agent.deregistered) == 1


def test_device_index_goes_into_every_descriptor(fake):
    geo, _ = _geometry("LBHNC")
    sink = nx.NixlSink(tag="t")
    regions = nd.device_regions(geo)
    sink.register_regions(regions, mem="VRAM", device=3)
    assert fake.agents[0].registered[0][1][0, 2] == 3
    rows = nd.DeviceRows(addrs=nd.device_rows(geo, range(1), [0]).addrs, row_bytes=geo.block_bytes, device=3)
    NixlDevicePull(sink=sink).read_into(None, "p:1", _read([0], 1), _reply([0]), rows, deadline=time.monotonic() + 5,
                                        sums=None)
    (_, mem, local), (_, _, remote) = fake.agents[0].prepped
    assert mem == "VRAM" and local[0, 2] == 3 and remote[0, 2] == 0
    # the same addresses registered on another device are not registered memory for this one
    rows0 = replace(rows, device=0)
    with pytest.raises(TransferError, match="no local VRAM memory on device 0"):
        NixlDevicePull(sink=sink).read_into(None, "p:1", _read([0], 1), _reply([0]), rows0,
                                            deadline=time.monotonic() + 5, sums=None)


# ------------------------------------------------------------------------------ descriptors
def test_layer_first_rows_merge_consecutive_blocks_into_consecutive_slots(fake):
    """LBHNC: blocks 3, 4, 5 of a layer are adjacent in device memory; slots 10, 11, 12 adjacent in
    the arena: one run. Block 9 (a gap on the device) and block 6 into a non-adjacent slot (a gap
    in the arena) start runs of their own. Every byte of every row is covered exactly once."""
    geo, _ = _geometry("LBHNC")
    sink, _ = nd.open_direct(geo, checksum=False, sink_factory=lambda: nx.NixlSink(tag="t"))
    targets = [3, 4, 5, 9, 6]
    layers = range(2)
    slot = geo.block_bytes
    slots = [10, 11, 12, 13, 30, 40, 41, 42, 43, 20]  # layer 0: 10..13, 30; layer 1: 40..43, 20
    rows = nd.device_rows(geo, layers, targets)
    nbytes = NixlDevicePull(sink=sink).read_into(None, "p:1", _read(layers, 5), _reply(np.array(slots) * slot),
                                                 rows, deadline=time.monotonic() + 5, sums=None)
    assert nbytes == 10 * slot
    agent = fake.agents[0]
    (who_l, mem_l, local), (who_r, mem_r, remote) = agent.prepped
    assert (who_l, mem_l, who_r, mem_r) == ("NIXL_INIT_AGENT", "VRAM", "fake-producer", "DRAM")

    def dev(layer, block):
        return geo.views[layer].data_ptr() + block * geo.block_stride

    base = 0x7000_0000
    expect = sorted([  # (local, remote, length)
        (dev(0, 3), base + 10 * slot, 3 * slot),  # blocks 3-5 -> slots 10-12: one run
        (dev(0, 6), base + 30 * slot, slot),      # block 6 -> slot 30: after block 5 on the device, not in the arena
        (dev(0, 9), base + 13 * slot, slot),      # block 9: a gap on the device
        (dev(1, 3), base + 40 * slot, 3 * slot),
        (dev(1, 6), base + 20 * slot, slot),
        (dev(1, 9), base + 43 * slot, slot),
    ])
    got = sorted(zip(local[:, 0].tolist(), remote[:, 0].tolist(), local[:, 1].tolist()))
    assert got == expect
    assert (remote[:, 1] == local[:, 1]).all() and (local[:, 2] == 0).all()
    assert geo.views[0].data_ptr() == nd.device_regions(geo)[0][0]  # layer 0 starts the allocation
    # the READ was waited for: transfer, then polled until DONE, and every handle released after
    assert agent.log[0] == ("transfer",) and ("check",) in agent.log
    assert agent.log.index(("check",)) < agent.log.index(("release", "xfer"))
    assert sink.open_handles == 0


def test_cross_layer_rows_of_one_block_merge_across_layers(fake):
    """BLHNC: block b of all layers is one run on the device, so (layer l, b) and (l + 1, b) merge
    when their slots are adjacent too; rows are listed layer-major, merged by address."""
    geo, _ = _geometry("BLHNC")
    assert geo.cross_layer
    sink, _ = nd.open_direct(geo, checksum=False, sink_factory=lambda: nx.NixlSink(tag="t"))
    slot, layers, targets = geo.block_bytes, range(3), [2, 7]
    # layer-major rows: (0,2) (0,7) (1,2) (1,7) (2,2) (2,7); block 2's layers in slots 0,1,2; block 7's 5,6,9
    slots = [0, 5, 1, 6, 2, 9]
    rows = nd.device_rows(geo, layers, targets)
    NixlDevicePull(sink=sink).read_into(None, "p:1", _read(layers, 2), _reply(np.array(slots) * slot), rows,
                                        deadline=time.monotonic() + 5, sums=None)
    (_, _, local), (_, _, remote) = fake.agents[0].prepped
    start = geo.views[0].data_ptr()
    got = sorted(zip(local[:, 0].tolist(), remote[:, 0].tolist(), local[:, 1].tolist()))
    base = 0x7000_0000
    assert got == [(start + 2 * geo.block_stride, base, 3 * slot),                     # all 3 layers of block 2
                   (start + 7 * geo.block_stride, base + 5 * slot, 2 * slot),          # layers 0-1 of block 7
                   (start + 7 * geo.block_stride + 2 * slot, base + 9 * slot, slot)]   # layer 2: slot 9, a gap


def test_merge_runs_edges():
    loc, rem, lens = nd.merge_runs(np.array([], np.uint64), np.array([], np.uint64), 8)
    assert loc.size == rem.size == lens.size == 0
    loc, rem, lens = nd.merge_runs(np.array([16, 0, 8]), np.array([116, 100, 108]), 8)  # out of order
    assert (loc.tolist(), rem.tolist(), lens.tolist()) == ([0], [100], [24])
    with pytest.raises(ValueError):
        nd.merge_runs(np.array([0, 8]), np.array([0]), 8)


def test_direct_read_refuses_to_skip_checksums_and_wrong_destinations(fake):
    geo, _ = _geometry("LBHNC")
    sink, _ = nd.open_direct(geo, checksum=False, sink_factory=lambda: nx.NixlSink(tag="t"))
    path = NixlDevicePull(sink=sink)
    rows = nd.device_rows(geo, range(1), [0, 1])
    with pytest.raises(TransferError, match="cannot verify checksums") as err:
        path.read_into(None, "p:1", _read([0], 2), _reply([0, 8], checksums=[1, 2]), rows,
                       deadline=time.monotonic() + 5, sums=[1, 2])
    assert err.value.cause is FailureCause.PROTOCOL
    with pytest.raises(TransferError, match="needs DeviceRows"):
        path.read_into(None, "p:1", _read([0], 2), _reply([0, 8]), [memoryview(bytearray(8))] * 2,
                       deadline=time.monotonic() + 5, sums=None)
    with pytest.raises(TransferError, match="one offset per block"):
        path.read_into(None, "p:1", _read([0], 2), _reply([0]), rows, deadline=time.monotonic() + 5, sums=None)
    outside = replace(rows, addrs=rows.addrs + np.uint64(1 << 40))
    with pytest.raises(TransferError, match="outside the memory registered with NIXL as VRAM"):
        path.read_into(None, "p:1", _read([0], 2), _reply([0, 8]), outside, deadline=time.monotonic() + 5, sums=None)
    assert fake.agents[0].prepped == []  # refused before NIXL saw anything


# ------------------------------------------------------------------------------ fallbacks
def test_vram_registration_failure_and_missing_vram_fall_back_and_close_the_agent(fake):
    geo, _ = _geometry("LBHNC")
    fake.settings["fail_register"] = "NIXL_ERR_BACKEND: VRAM memory is detected as host by UCX"
    sink, fb = nd.open_direct(geo, checksum=False, sink_factory=lambda: nx.NixlSink(tag="t"))
    assert sink is None and fb.reason == "registration" and "detected as host by UCX" in fb.detail
    assert "VRAM memory on device 0" in fb.detail
    fake.settings.clear()
    fake.settings["mem_types"] = ("DRAM_SEG",)
    sink, fb = nd.open_direct(geo, checksum=False, sink_factory=lambda: nx.NixlSink(tag="t"))
    assert sink is None and fb.reason == "no_vram" and "['DRAM']" in fb.detail
    assert fake.agents[1].registered == []

    def no_agent():
        raise TransferError(FailureCause.PROTOCOL, "NIXL consumer agent 'x' has no UCX backend")
    sink, fb = nd.open_direct(geo, checksum=False, sink_factory=no_agent)
    assert sink is None and fb.reason == "agent" and "no UCX backend" in fb.detail


def _rank(transport="nixl", checksum=False):
    """One consumer rank's pull paths, with the results they record into."""
    from kvconnectors.tiered.pull_paths import PullPaths
    from kvconnectors.tiered.results import LoadResults

    geometry, _ = _geometry("LBHNC")
    results = LoadResults()
    return PullPaths(transport, "engine", 0, geometry, loader=None, record=results.record, checksum=checksum), results


def test_worker_says_a_failed_registration_once_counts_it_once_per_rank(fake, caplog):
    """Registration raises: one WARNING naming the reason, nixl_vram_fallbacks{registration} +1 for
    the rank, the host path (tcp) for every load after it, each counted as a path fallback, with
    no second log line; two ranks count 2 once merged."""
    from kvconnectors.transport.paths import TCP_PULL

    fake.settings["fail_register"] = "NIXL_ERR_BACKEND"
    ranks = [_rank(), _rank()]
    try:
        with caplog.at_level(logging.WARNING, logger="kvconnectors"):
            for paths, _ in ranks:
                paths.open_device()
            for _ in range(3):
                assert ranks[0][0].for_ticket(SimpleNamespace(req_id="r"), SimpleNamespace(shm_path=""),
                                              direct=False) is TCP_PULL
        lines = [r for r in caplog.records if "not READing into device memory" in r.getMessage()]
        assert len(lines) == 2 and all(r.levelno == logging.WARNING for r in lines)  # one per rank
        assert "registration" in lines[0].getMessage() and "NIXL_ERR_BACKEND" in lines[0].getMessage()
        assert not [r for r in caplog.records if "not registered with NIXL" in r.getMessage()]
        assert ranks[0][0].device is None
        totals = ranks[0][1].totals.data
        assert totals["nixl_vram_fallbacks"] == {"registration": 1}
        assert totals["path_fallbacks"] == {"nixl->tcp": 3}
        merged = ranks[0][1].report(None).aggregate(ranks[1][1].report(None))
        assert merged.data["nixl_vram_fallbacks"] == {"registration": 2}
        assert merged.reduce()["NIXL VRAM fallbacks (registration)"] == 2
    finally:
        for paths, _ in ranks:
            paths.close()


def test_worker_with_registered_vram_pulls_into_device_rows(fake):
    """Registration ok: the rank holds the direct path, and a load READs (layer, block) device rows
    with verify as configured (off), counted under nixl_vram; the agent is closed at shutdown."""
    from kvconnectors.tiered.config import TieredConfig
    from kvconnectors.tiered.layout import layout_of
    from kvconnectors.tiered.load import Load
    from kvconnectors.tiered.puller import Puller

    paths, results = _rank()
    seen = {}

    class Client:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self, tid, layers, first, dest, **kw):
            seen.update(dest=dest, **kw)
            return len(dest) * dest.row_bytes

    class Links:  # the producer connections the puller is given
        def producer(self, p, rank):
            return Client()

    geometry = paths.geometry
    puller = Puller(layout_of(geometry, 16), geometry, row_layout=None, config=TieredConfig(transport="nixl",
                    checksum=False), links=Links(), paths=paths, loader=None, results=results, resliced=None,
                    landed=None)
    try:
        paths.open_device()
        assert isinstance(paths.device, NixlDevicePull) and results.totals.data["nixl_vram_fallbacks"] == {}
        load = Load(SimpleNamespace(first_block=0), SimpleNamespace(transfer_id="t", token="k", fingerprint="f"),
                    [4, 1], None)
        out = puller._to_device(load, time.monotonic() + 5)
        assert out == {"nixl_vram": geometry.num_layers * 2 * geometry.block_bytes}
        assert seen["path"] is paths.device and seen["verify"] is False
        rows = nd.device_rows(geometry, range(geometry.num_layers), [4, 1])
        assert seen["dest"].addrs.tolist() == rows.addrs.tolist()
    finally:
        puller.close()
        paths.close()
    assert fake.agents[0].deregistered  # the VRAM registration ended with the agent


def test_the_fallback_metric_is_exported_with_its_reason():
    from prometheus_client import CollectorRegistry

    from kvconnectors.tiered import metrics
    from kvconnectors.tiered.stats import TieredStats

    m = next(m for m in metrics.INTERVAL if m.key == "nixl_vram_fallbacks")
    assert m.name == "kvconnectors:nixl_vram_fallbacks" and m.labels == ("reason",)
    assert "nixl_vram" in metrics.DATA_PATHS
    stats = TieredStats()
    assert stats.is_empty()
    stats.record_nixl_vram_fallback("no_vram")
    assert not stats.is_empty()  # a start-up fallback alone still ships
    registry = CollectorRegistry()
    prom = _prom(registry)
    prom.observe(stats.data)
    assert registry.get_sample_value("kvconnectors:nixl_vram_fallbacks_total",
                                     {"model_name": "m", "engine": "0", "reason": "no_vram"}) == 1


def _prom(registry):
    from functools import partial

    from prometheus_client import Counter, Gauge, Histogram

    from kvconnectors.tiered.prom import TieredPromMetrics

    types = {cls: partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}))
    return TieredPromMetrics(vllm_config, types, ["model_name", "engine"], {0: ["m", "0"]}, registry=registry)


# ------------------------------------------------------------------------------ real NIXL on this host
@needs_nixl
def test_real_agent_reads_merged_runs_byte_exact_into_dram():
    """The variable-length descriptors merge_runs makes, through a real UCX READ (host memory: the
    same call shapes the VRAM path uses, with mem "DRAM")."""
    slot = 4096
    arena = np.random.default_rng(3).integers(0, 256, (16, slot), dtype=np.uint8)
    cache = np.zeros((16, slot), dtype=np.uint8)
    source = nx.NixlSource(arena.ctypes.data, arena.nbytes, tag="runs")
    sink = nx.NixlSink(tag="runs")
    a, b = socket.socketpair()
    server = threading.Thread(target=source.serve_until_readable, args=(a, time.monotonic() + 30), daemon=True)
    server.start()
    try:
        sink.register([cache])
        targets = [3, 4, 5, 9, 0]
        slots = [7, 8, 9, 1, 15]
        local = np.uint64(cache.ctypes.data) + np.array(targets, np.uint64) * np.uint64(slot)
        remote = np.uint64(source.base_address) + np.array(slots, np.uint64) * np.uint64(slot)
        loc, rem, lens = nd.merge_runs(local, remote, slot)
        assert len(loc) == 3  # 3-5 <- 7-9 merged
        assert sink.read_runs("runs", source.metadata, rem, loc, lens, time.monotonic() + 10) == 5 * slot
        for t, s in zip(targets, slots):
            assert np.array_equal(cache[t], arena[s])
        assert not cache[[1, 2, 6, 7, 8, 10]].any() and sink.open_handles == 0
    finally:
        b.sendall(b"x")
        server.join(5)
        sink.close()
        source.close()
        a.close()
        b.close()


@needs_nixl
def test_real_ucx_without_cuda_refuses_vram_and_the_consumer_falls_back():
    """This host's UCX has no CUDA support: registering memory as VRAM raises in NIXL, which
    open_direct turns into the registration fallback (no exception, the agent closed)."""
    geo, _ = _geometry("LBHNC")  # host memory, declared VRAM: what UCX without CUDA cannot register
    made = []

    def factory():
        made.append(nx.NixlSink(tag="novram"))
        return made[-1]

    sink, fb = nd.open_direct(geo, checksum=False, sink_factory=factory)
    if sink is not None:  # a UCX that took host memory as VRAM: then it must be registered, and nothing fell back
        assert fb is None
        sink.close()
        return
    assert fb.reason in ("registration", "no_vram"), fb
    with pytest.raises(TransferError, match="is closed"):
        made[0].register_regions([(1, 1)])
