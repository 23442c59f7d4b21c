"""UCX settings for a CPU-only host, in one place: every process that may load NIXL (engines, store
servers, benchmarks, tests) takes them from here, and a vLLM server started by `serving` gets them in
its environment. Loopback only, and none of UCX's InfiniBand modules: with Debian's libibverbs1
installed (Mooncake needs it) they crash processes at exit, and otherwise UCX probes InfiniBand and
every NIC on each start. Set with setdefault, so an RDMA host's own settings win."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

CPU_DEFAULT_ENV: dict[str, str] = {"UCX_MODULES": "^ib", "UCX_NET_DEVICES": "lo"}


def set_cpu_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set the CPU-host UCX settings in `environ` (this process's environment by default) where they are
    not set already. Call before NIXL is first imported: UCX reads them when it loads."""
    for key, value in CPU_DEFAULT_ENV.items():
        environ.setdefault(key, value)
