"""nixl device: GPU-direct pulls, a nixl READ straight into device (VRAM) KV blocks.

Only a sink end: on the wire it is a nixl pull, and the producer serves it as one (nixl.py). The
rows' device addresses and the run merging are transport/nixl_device.py's.
"""

from __future__ import annotations

import numpy as np

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.transport.nixl_device import DeviceRows, merge_runs
from kvconnectors.transport.paths.nixl import NixlPull


class NixlDevicePull(NixlPull):
    """GPU-direct: the consumer READs the blocks straight into its device KV cache, registered
    with its agent as VRAM (nixl_device.py). On the wire it is a nixl pull (the producer serves
    it the same way); its bytes are counted under `nixl_vram`. `dest` is a DeviceRows, not views.
    It cannot verify checksums (no host copy of the rows exists): asked to, it refuses the read
    rather than skip the check. NOT VALIDATED ON HARDWARE (nixl_device.CUDA_VALIDATED)."""
    label = "nixl_vram"

    def read_into(self, sock, peer, read, reply, dest, *, deadline, sums, dest_addrs=None) -> int:
        if not isinstance(dest, DeviceRows):
            raise TransferError(FailureCause.PROTOCOL, f"a GPU-direct nixl read needs DeviceRows, got "
                                                       f"{type(dest).__name__}")
        if sums is not None:
            raise TransferError(FailureCause.PROTOCOL, (
                "the GPU-direct nixl path cannot verify checksums (they are computed on host rows); "
                "a consumer that verifies uses the host path"))
        self._check_reply(peer, reply, dest)
        remote = np.uint64(reply.nixl_base_address) + np.asarray(reply.offsets, dtype=np.uint64)
        local, remote, lengths = merge_runs(dest.addrs, remote, dest.row_bytes)
        # returns only once NIXL says DONE: the bytes are in the device blocks when the load is reported
        return self.sink.read_runs(peer, reply.nixl_agent_meta, remote, local, lengths, deadline,
                                   mem="VRAM", device=dest.device)
