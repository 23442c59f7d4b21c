"""Talking to NIXL: its Python API imported on first use, agents made with the UCX backend, the
descriptor arrays its calls take, its exceptions turned into `TransferError`s, and the backoff both
ends poll with. The producer's agent is nixl_source.py, the consumer's nixl_sink.py.

No spinning while idle. NIXL's UCX progress thread busy-polls a whole core per agent even when
nothing moves, so both agents run with the progress thread off and are progressed only while a
transfer is in flight: the consumer polls its transfer's state, the producer (the READ target, which
must progress or the consumer's connection wire-up is never answered) polls its worker from the
connection thread that waits for the consumer's Release, with the same backoff (0, 50 us, doubling
to 1 ms; 10 ms once a transfer has run for seconds). An idle agent then costs no CPU.

Both agents use NIXL's STRICT thread-sync mode (one lock around every agent call): the server has a
thread per connection, the consumer a pool of pull threads, and they share one agent per process.

Every NIXL failure becomes a `TransferError` (peer_unreachable / timeout / protocol) whose message
names the step that failed, and transfer handles and descriptor lists are released on every path.

On a CPU-only host set UCX_NET_DEVICES=lo and UCX_MODULES=^ib in the environment of every process
that loads NIXL (see ../reference/transfer_engines_on_cpu.md); this module leaves UCX's environment
alone, because on an RDMA host those settings would disable the network it should use.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvconnectors.errors import ConfigError, FailureCause, TransferError

INSTALL_HINT = "pip install 'kvconnectors[nixl]' (install the CPU torch wheel first on CPU hosts)"

_api_module: Any = None
_api_lock = threading.Lock()


def _api() -> Any:
    """`nixl._api`, imported on first use (the import alone costs ~2 s)."""
    global _api_module
    if _api_module is None:
        with _api_lock:
            if _api_module is None:
                from nixl import _api as api  # noqa: PLC0415 - optional dependency

                _api_module = api
    return _api_module


def nixl_import_error() -> str | None:
    """None when NIXL imports here, else why it does not."""
    try:
        _api()
    except Exception as exc:  # ImportError, or a backend wheel that fails to load its libraries
        return f"{type(exc).__name__}: {exc}"
    return None


def require_nixl() -> None:
    """Fail start-up of transport "nixl" with an actionable message when NIXL cannot be imported."""
    why = nixl_import_error()
    if why is not None:
        raise ConfigError("transport", "nixl", f"needs the NIXL Python package, which cannot be imported "
                                               f"here ({why}); install it with {INSTALL_HINT}")


def agent_config(progress_thread: bool = False) -> Any:
    """UCX backend; progress thread off unless asked (it spins a core even when idle)."""
    api = _api()
    return api.nixl_agent_config(enable_prog_thread=progress_thread, enable_listen_thread=False,
                                 backends=["UCX"], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)


def unique_agent_name(role: str, tag: str = "") -> str:
    """Names are unique per process start, so a restarted producer is told apart from its old self."""
    tag = "".join(c for c in tag if c.isalnum() or c in "-_.")[:32]
    return f"kvc-{role}-{tag + '-' if tag else ''}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def describe_error(exc: BaseException) -> str:
    """The exception's type and text, for a TransferError's message."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def cause_of(exc: BaseException) -> FailureCause:
    """The failure a NIXL exception stands for, read from its binding's class name."""
    name = type(exc).__name__
    if "RemoteDisconnect" in name:
        return FailureCause.PEER_UNREACHABLE
    if "Cancelled" in name:
        return FailureCause.TIMEOUT
    return FailureCause.PROTOCOL


def create_agent(role: str, name: str | None, tag: str) -> Any:
    """An agent with the UCX backend; `role` ("producer", "consumer") names it in errors."""
    try:
        api = _api()
    except Exception as exc:
        raise TransferError(FailureCause.PROTOCOL, f"NIXL is not importable ({describe_error(exc)}); "
                                                   f"install it with {INSTALL_HINT}") from None
    name = name or unique_agent_name(role, tag)
    try:
        agent = api.nixl_agent(name, agent_config())
    except Exception as exc:
        raise TransferError(FailureCause.PROTOCOL,
                            f"NIXL {role} agent {name!r} could not be created: {describe_error(exc)}") from None
    if "UCX" not in agent.backends:
        raise TransferError(FailureCause.PROTOCOL, (
            f"NIXL {role} agent {name!r} has no UCX backend (plugins found: {agent.get_plugin_list()}); "
            "check NIXL_PLUGIN_DIR and the UCX libraries of the nixl wheel"))
    return agent


def reg_descs(regions: Sequence[tuple[int, int]], device: int = 0) -> np.ndarray:
    """register_memory's descriptors: one (address, nbytes, device) row per region (the device
    is the CUDA index for VRAM, 0 for DRAM)."""
    descs = np.zeros((len(regions), 3), dtype=np.uint64)
    for i, (addr, nbytes) in enumerate(regions):
        descs[i, 0], descs[i, 1] = addr, nbytes
    descs[:, 2] = device
    return descs


def xfer_descs(addrs: np.ndarray, length: int | np.ndarray, device: int = 0) -> np.ndarray:
    """prep_xfer_dlist's descriptors: one (address, length, device) row per block or run (`length`
    one for all, or one each; device: the CUDA index for VRAM, 0 for DRAM)."""
    d = np.zeros((len(addrs), 3), dtype=np.uint64)
    d[:, 0] = addrs
    d[:, 1] = length
    d[:, 2] = device
    return d


class Backoff:
    """Sleep lengths for polling an in-flight transfer: 0, 50 us, doubling to 1 ms, then 10 ms once
    the transfer has been in flight for `slow_after_s` (stalled, or very large: either way 10 ms is
    noise), so a stuck peer costs almost nothing while the deadline runs out."""

    def __init__(self, first_s: float = 50e-6, cap_s: float = 1e-3, slow_after_s: float = 2.0,
                 slow_cap_s: float = 10e-3):
        self.first_s, self.cap_s, self.slow_cap_s = first_s, cap_s, slow_cap_s
        self.slow_at = time.monotonic() + slow_after_s
        self.delay = 0.0

    def next(self) -> float:
        d = self.delay
        cap = self.slow_cap_s if time.monotonic() >= self.slow_at else self.cap_s
        self.delay = min(max(d * 2, self.first_s), cap)
        return d
