"""Consumer-side lease heartbeats and explicit releases.

While a request waits in the consumer's queue, its producer-side entry must not expire; the
keeper renews every tracked transfer each `interval` seconds (one connection per producer per
beat). When a request is aborted before its KV was pulled, the keeper tells the producer to
release the entry now instead of holding it until the TTL runs out. One thread keeps the beat,
woken by an event (no polling while idle); the calls to producers run on a small pool, one at a
time per producer, so a slow or hung producer delays nobody else's renewals (seen: a busy landing
store held the next producer's renewal past a 2 s TTL), and a beat starts every `interval`
whatever the previous one still waits for.

A pushed request (push mode) has two copies that may matter while it queues: the landed copy in
the consumer's own store (what it will load) and the producer's staged copy (what it pulls if the
push was refused or broke; normally released once the push landed). Both are renewed; a copy that
is no longer held at a "maybe" address is expected and not counted as lost.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvconnectors.errors import TransferError
from kvconnectors.logs import get_logger
from kvconnectors.transport.client import StoreClient

logger = get_logger(__name__)

Addr = tuple[str, int]

MAX_CALLS_IN_FLIGHT = 8  # producers called at once; the others wait for a free caller


class LeaseKeeper:
    def __init__(self, interval_s: float, client_factory: Callable[[Addr], StoreClient],
                 rpc_timeout_s: float = 5.0):
        self.interval_s, self.rpc_timeout_s = interval_s, rpc_timeout_s
        self._client = client_factory
        # req_id -> (stores that hold the entry, transfer id, stores that may no longer hold it, its token,
        # more ids that may be held at the latter: head fragments pushed here)
        self._tracked: dict[str, tuple[list[Addr], str, list[Addr], str, tuple[str, ...]]] = {}
        self._beat_soon = False
        self._to_release: list[tuple[Addr, str, str]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._busy: set[Addr] = set()  # producers whose previous call is still under way: skipped meanwhile
        self._calls = ThreadPoolExecutor(MAX_CALLS_IN_FLIGHT, thread_name_prefix="kvc-lease-call")
        self.renewals = 0
        self.releases = 0
        self.lost = 0  # renewals a producer answered with "no longer held"
        self._thread = threading.Thread(target=self._run, name="kvc-lease-keeper", daemon=True)
        self._thread.start()

    def track(self, req_id: str, addrs: list[Addr], transfer_id: str, maybe_addrs: Sequence[Addr] = (),
              token: str = "", maybe_ids: Sequence[str] = ()) -> None:
        """Renew `transfer_id` at every store in `addrs` (a pulled request: the producer's ranks)
        and in `maybe_addrs` (a pushed request: this consumer's landing stores and the producer's
        ranks) until untracked; a "no longer held" answer counts as lost only from `addrs`.
        `maybe_ids` (head fragments pushed here) are renewed at `maybe_addrs` too.
        `token`: the transfer's token from its ticket, presented with every renewal and release."""
        with self._lock:
            self._tracked[req_id] = (list(addrs), transfer_id, [a for a in maybe_addrs if a not in addrs], token,
                                     tuple(maybe_ids))
            self._beat_soon = True
        self._wake.set()  # the ticket's TTL may already be short: beat now, not in a full interval

    def untrack(self, req_id: str) -> None:
        with self._lock:
            self._tracked.pop(req_id, None)

    def release(self, req_id: str, addrs: list[Addr], transfer_id: str, token: str = "") -> None:
        with self._lock:
            self._tracked.pop(req_id, None)
            self._to_release.extend((addr, transfer_id, token) for addr in addrs)
        self._wake.set()

    @property
    def tracked(self) -> int:
        with self._lock:
            return len(self._tracked)

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=self.rpc_timeout_s * 2)
        self._calls.shutdown(wait=True, cancel_futures=True)  # each call ends by its deadline
        self._flush_releases(now=True)  # an engine shutting down still gives back what it was handed

    def _run(self) -> None:
        next_beat = time.monotonic() + self.interval_s
        while not self._stop:
            self._wake.wait(timeout=max(0.0, next_beat - time.monotonic()))
            self._wake.clear()
            if self._stop:
                return
            try:  # one bad answer must not end renewals for everyone
                self._flush_releases()
                with self._lock:
                    soon, self._beat_soon = self._beat_soon, False
                if soon or time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.interval_s  # a fixed rate, however long calls take
                    self._beat()
            except Exception:
                logger.exception("lease keeper round failed; continuing")

    def _flush_releases(self, now: bool = False) -> None:
        """Hand the queued releases to the callers (`now`: make them here, at close)."""
        with self._lock:
            batch, self._to_release = self._to_release, []
        for addr, tid, token in batch:
            if now:
                self._release(addr, tid, token)
            else:
                self._calls.submit(self._release, addr, tid, token)

    def _release(self, addr: Addr, tid: str, token: str) -> None:
        try:
            with self._client(addr) as c:
                c.release(tid, time.monotonic() + self.rpc_timeout_s, token=token)
            with self._lock:
                self.releases += 1
        except (TransferError, OSError) as exc:
            logger.warning("could not release transfer %s at %s:%s (it will expire): %s", tid, *addr, exc)

    def _beat(self) -> None:
        with self._lock:
            by_peer: dict[Addr, dict[str, bool]] = defaultdict(dict)  # addr -> {tid: must be held}
            tokens: dict[str, str] = {}
            for addrs, tid, maybe, token, maybe_ids in self._tracked.values():
                for key in (tid, *maybe_ids):
                    tokens[key] = token
                    for addr in maybe:
                        by_peer[addr].setdefault(key, False)
                for addr in addrs:
                    by_peer[addr][tid] = True
            for addr in [a for a in by_peer if a in self._busy]:
                del by_peer[addr]  # still answering the previous beat: its deadline ends that call
            self._busy.update(by_peer)
        for addr, tids in by_peer.items():
            self._calls.submit(self._renew, addr, tids, [tokens[t] for t in tids])

    def _renew(self, addr: Addr, tids: dict[str, bool], tokens: list[str]) -> None:
        """A caller thread: renew `tids` (id -> must be held) at one producer."""
        try:
            with self._client(addr) as c:
                reply = c.renew(list(tids), time.monotonic() + self.rpc_timeout_s, tokens=tokens)
        except (TransferError, OSError) as exc:
            logger.warning("lease heartbeat to producer %s:%s failed: %s", *addr, exc)
            return
        finally:
            with self._lock:
                self._busy.discard(addr)
        with self._lock:
            self.renewals += len(reply.remaining)
            self.lost += sum(1 for tid in reply.missing if tids.get(tid, True))
