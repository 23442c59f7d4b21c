"""Consumer side: which data path a pull takes, and the NIXL agents those paths hold.

The configured transport, bound to what the ticket offers: shm to the arena the ticket names for
that producer rank, nixl into host memory through this process's agent (created at the first nixl
pull, every KV cache layer registered once), or on a CUDA cache straight into device memory when
it could be registered as VRAM at start-up. A ticket or cache that cannot use the configured path
goes over tcp, counted and logged: never silently.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvconnectors.logs import get_logger
from kvconnectors.mover import BlockGeometry, Loader
from kvconnectors.tiered import params as kvparams
from kvconnectors.tiered.metadata import RecvSpec
from kvconnectors.tiered.params import TransferParams
from kvconnectors.transport import nixl as nixl_transport
from kvconnectors.transport import nixl_device
from kvconnectors.transport.paths import TCP_PULL, NixlDevicePull, NixlPull, PullPath, ShmPull

logger = get_logger(__name__)


class PullPaths:
    def __init__(self, transport: str, engine_id: str, tp_rank: int, geometry: BlockGeometry, loader: Loader,
                 record: Callable[..., None], checksum: bool):
        self.transport, self.engine_id, self.tp_rank = transport, engine_id, tp_rank
        self.geometry, self.loader, self._record, self._checksum = geometry, loader, record, checksum
        self._nixl_pull: NixlPull | None = None  # holds this process's consumer NIXL agent
        self.device: NixlDevicePull | None = None  # CUDA cache: its agent, the cache registered as VRAM
        self._lock = threading.Lock()
        self._warned_device = False

    def open_device(self) -> None:
        """CUDA cache and transport nixl, once per rank at start-up: register the device KV cache
        with NIXL as VRAM for GPU-direct READs, or keep the host path, said once here (WARNING,
        naming the reason) and counted in kvconnectors:nixl_vram_fallbacks{reason}."""
        sink, fallback = nixl_device.open_direct(
            self.geometry, checksum=self._checksum,
            sink_factory=lambda: nixl_transport.NixlSink(tag=self.engine_id))
        if sink is not None:
            self.device = NixlDevicePull(sink=sink)
            logger.info("transport nixl, rank %d: pulls READ straight into the %s KV cache (registered with NIXL "
                        "as VRAM; this path has not been validated on GPU hardware)", self.tp_rank,
                        self.geometry.device)
            return
        assert fallback is not None
        self._warned_device = True  # said once, here; each load is still counted in path_fallbacks
        logger.warning("transport nixl, rank %d: not READing into device memory (%s: %s); pulls go over tcp into "
                       "page-locked host memory, then to the device", self.tp_rank, fallback.reason, fallback.detail)
        self._record("record_nixl_vram_fallback", fallback.reason)

    def for_ticket(self, spec: RecvSpec, p: TransferParams, direct: bool = True, rank: int | None = None) -> PullPath:
        """The data path of a pull from producer `rank` (default: this rank's peer): the configured
        one, over shm bound to the arena the ticket names for that rank. A ticket that cannot use it
        (shm, but it names no arena for that rank; nixl into a device cache that is not registered
        as VRAM, see open_device) goes over tcp, counted and logged: never silently."""
        transport = self.transport
        if transport == "nixl" and not direct:
            if not self._warned_device:  # normally said at start-up, with the reason
                self._warned_device = True
                logger.warning("transport nixl: the KV cache is in %s memory, not registered with NIXL; pulling "
                               "over tcp into page-locked host memory instead", self.geometry.device)
            self._record("record_path_fallback", "nixl", TCP_PULL.label)
            return TCP_PULL
        arena = kvparams.shm_arena(p, self.tp_rank if rank is None else rank) if transport == "shm" else ""
        if transport == "shm" and not arena:
            logger.warning("request %s: transport shm configured, but the producer's ticket names no shm arena "
                           "for this rank (is the producer on transport shm and this host?); pulling over tcp",
                           spec.req_id)
            self._record("record_path_fallback", ShmPull.label, TCP_PULL.label)
            return TCP_PULL
        return self.nixl() if transport == "nixl" else ShmPull(arena) if transport == "shm" else TCP_PULL

    def nixl(self) -> NixlPull:
        """The nixl pull path with this process's NIXL agent, created at the first nixl pull with
        every KV cache layer registered once (pull threads share it)."""
        with self._lock:
            if self._nixl_pull is None:
                sink = nixl_transport.NixlSink(tag=self.engine_id)
                try:
                    sink.register(self.loader.host_arrays())
                except BaseException:
                    sink.close()
                    raise
                self._nixl_pull = NixlPull(sink=sink)
            return self._nixl_pull

    def close(self) -> None:
        for path in (self._nixl_pull, self.device):
            if path is not None:
                path.close()
        self._nixl_pull = self.device = None
