"""The landing receiver of push mode: what the store server's connection threads call with the
Push and PushEnd requests of producers (landing.py says the rules; this module applies them).

Each Push's header is checked first (`_check_shape`: id, fingerprint, layout, block range, the data
path offered), then its transfer claimed for its sender in the landed-entry table
(landed_entries.py), its receive buffer borrowed (receive_buffers.py), and its group written
(push_writes.py). A PushEnd seals (or fails) the sender's own transfer. Every refusal is typed and
answered in step; what a refusal says of this store's layout or occupancy is told only to peers
that proved the shared secret (`_refuse`). A bug fails the transfer, is answered as a protocol
error, and the connection goes on (or is closed when its stream may be out of step).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence

import numpy as np

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.logs import LogLimiter, get_logger
from kvconnectors.store import StoreClosedError, TieredStore
from kvconnectors.transport import wire
from kvconnectors.transport.faults import FaultRule, with_fault
from kvconnectors.transport.landed_entries import LANDING_LOGGER, ConnectionState, Foreign, LandedEntries
from kvconnectors.transport.paths import PUSH_UNOFFERED, TCP_PUSH, PushPath, offered
from kvconnectors.transport.protocol import HungUp, hang_up, trailing_bytes
from kvconnectors.transport.push_writes import GroupWriter
from kvconnectors.transport.receive_buffers import ReceiveBuffers

logger = get_logger(LANDING_LOGGER)
MAX_MESSAGE = 512                  # characters of a peer's abort message that are kept


class PushReceiver:
    """Lands the pushes of every producer connection, from their threads."""

    def __init__(self, store: TieredStore, entries: LandedEntries, buffers: ReceiveBuffers, *, fingerprint: str,
                 num_layers: int, paths: Sequence[PushPath] = (TCP_PUSH,), test_hooks: bool = False,
                 fragment_rows: Callable[[int, int], tuple[str, int]] | None = None):
        """`paths`: the push data paths accepted (tcp; NixlPush(sink_factory=...) for transport nixl).
        `fragment_rows(start, stop)`: the rows fingerprint and bytes per row of a head fragment
        filling this rank's heads [start, stop) (ValueError: not a fragment this rank takes); None:
        fragments are refused."""
        self.store, self.entries, self.buffers = store, entries, buffers
        self.fingerprint, self.num_layers = fingerprint, num_layers
        self._fragment_rows = fragment_rows
        self.paths: dict[str, PushPath] = {p.name: p for p in paths}
        self.writer = GroupWriter(store, entries, buffers, test_hooks)
        self.log = LogLimiter(logger)  # what a peer can provoke at will

    def handle_push(self, sock: socket.socket, msg: wire.Push, conn: ConnectionState,
                    fault: FaultRule | None) -> None:
        """Land one Push and answer it. Bytes that follow a streamed Push are always consumed
        (refusals are answered in step, so other transfers on this connection go on) unless the
        header itself is unusable or the stream broke; then the connection is closed."""
        try:
            self._handle_push(sock, msg, conn, fault)
        except Exception as exc:  # a bug: fail this transfer, answer, never kill the connection thread
            self._internal_error(sock, msg.transfer_id, conn, exc, "landing")
            if trailing_bytes(msg):
                hang_up(sock)  # where its bytes stand is unknown: the stream may be out of step

    def _handle_push(self, sock: socket.socket, msg: wire.Push, conn: ConnectionState,
                     fault: FaultRule | None) -> None:
        trailing = trailing_bytes(msg)
        rows = len(msg.layers) * msg.num_blocks
        try:
            path = with_fault(self._check_shape(msg), fault)
            path.check(msg, rows, self.row_bytes(msg))
        except HungUp:
            hang_up(sock)  # a fault cut the connection before its data
            return
        except TransferError as exc:
            self.entries.refuse_header(msg.transfer_id, exc, conn)
            self._refuse(sock, exc, conn)
            if trailing:
                hang_up(sock)  # sizes we cannot trust: the unread bytes would be taken for a frame
            return
        nbytes = rows * self.store.slot_bytes  # what it takes from the store and receive buffers
        in_place = path is TCP_PUSH  # (a fault wrapper takes the buffered path below)
        try:
            self.entries.claim(msg, conn)  # before the bytes: the consumer sees it is on its way
            # in place, only NVMe rows pass through a buffer: one chunk's worth
            loan = self.buffers.borrow(path, min(nbytes, self.writer.chunk_rows * self.store.slot_bytes) if in_place
                                       else nbytes)
        except TransferError as exc:
            if trailing and not self.buffers.drain(sock, trailing):
                return
            if not isinstance(exc, Foreign):
                self.entries.fail(msg.transfer_id, exc, conn)
            else:
                self.entries.count_foreign(msg.transfer_id, exc, conn)
            self._refuse(sock, exc, conn)
            return
        conn.buffer = loan if isinstance(loan, np.ndarray) else None
        try:
            if in_place:
                self.writer.land_in_place(sock, msg, conn, self.row_bytes(msg))
            else:
                with path.receive(sock, msg, self.row_bytes(msg), conn.bounce) as buf:
                    try:
                        self.writer.land(msg, buf, path.label)
                    except TransferError:
                        raise
                    except Exception as exc:  # the bytes are in: answer in step
                        logger.exception("landing %r from %s failed unexpectedly", msg.transfer_id, conn.peer)
                        raise TransferError(FailureCause.PROTOCOL,
                                            f"internal error landing this push: {type(exc).__name__}") from None
        except HungUp as broken:  # the stream itself broke
            if broken.error is not None:
                self.entries.fail(msg.transfer_id, broken.error, conn)
            hang_up(sock)
            return
        except TransferError as exc:
            self.entries.fail(msg.transfer_id, exc, conn)
            self._refuse(sock, exc, conn)
            return
        except (ValueError, IndexError, OverflowError, TypeError) as exc:
            # the data path could not take this push (e.g. offsets numpy refuses) before any byte
            # moved; a streamed path has read its bytes or raised HungUp by now
            err = TransferError(FailureCause.PROTOCOL, f"push {msg.transfer_id!r} cannot be received: {exc}")
            self.entries.fail(msg.transfer_id, err, conn)
            self._refuse(sock, err, conn)
            if trailing:
                hang_up(sock)
            return
        finally:
            conn.buffer = None
            self.buffers.repay(loan)
        self.entries.count_push(rows * self.row_bytes(msg))
        if msg.seal:
            self.handle_end(sock, wire.PushEnd(transfer_id=msg.transfer_id), conn)
            return
        wire.send_msg(sock, wire.Ack(ok=True))

    def handle_end(self, sock: socket.socket, msg: wire.PushEnd, conn: ConnectionState) -> None:
        """Seal (ok) or fail (not ok) the sender's own transfer and answer; refuse anyone else's."""
        try:
            self._handle_end(sock, msg, conn)
        except Exception as exc:  # a bug: fail this transfer, answer, never kill the connection thread
            self._internal_error(sock, msg.transfer_id, conn, exc, "ending")

    def _internal_error(self, sock: socket.socket, tid: str, conn: ConnectionState, exc: Exception,
                        doing: str) -> None:
        """A bug while `doing` ("landing", "ending") this push: fail the transfer if it is ours, and answer."""
        logger.exception("%s push of %r from %s failed unexpectedly", doing, tid[:64], conn.peer)
        err = TransferError(FailureCause.PROTOCOL, f"internal error {doing} this push: {type(exc).__name__}")
        try:
            self.entries.fail_if_mine(tid, err, conn)
        except Exception:  # noqa: BLE001 - the answer below matters more
            pass
        self._refuse(sock, err, conn)

    def _handle_end(self, sock: socket.socket, msg: wire.PushEnd, conn: ConnectionState) -> None:
        tid = msg.transfer_id
        try:
            wire.check_transfer_id(tid)
            rec = self.entries.mine(tid, conn)
        except TransferError as exc:
            self.entries.count_foreign(tid, exc, conn)
            self._refuse(sock, exc, conn)
            return
        if rec is None:  # no entry of its own here
            conn.open.discard(tid)
            abort = None if msg.ok else self._abort_error(msg, conn)
            remembered, earlier = self.entries.end_unclaimed(tid, abort, conn)
            if remembered:
                wire.send_msg(sock, wire.Ack(ok=True))
                return
            exc = earlier.refusal() if earlier is not None else Foreign(
                f"transfer {tid!r} was sealed here already" if self.entries.is_sealed(tid)
                else f"nothing of transfer {tid!r} is landing here from this producer",
                FailureCause.PROTOCOL if self.store.contains(tid) else FailureCause.UNKNOWN_TRANSFER)
            self.entries.count_foreign(tid, exc, conn)
            self._refuse(sock, exc, conn)
            return
        conn.open.discard(tid)
        if not msg.ok:
            self.entries.fail(tid, self._abort_error(msg, conn), conn)
            wire.send_msg(sock, wire.Ack(ok=True))
            return
        try:
            self.store.seal(tid)
            self.store.renew(tid)  # the lease runs from the seal: the request is about to arrive
        except (TransferError, ValueError) as exc:
            err = exc if isinstance(exc, TransferError) else TransferError(
                FailureCause.PROTOCOL, f"pushed transfer {tid!r} is incomplete: {exc}")
            self.entries.fail(tid, err, conn)
            self._refuse(sock, err, conn)
            return
        self.entries.mark_landed(tid, rec)
        wire.send_msg(sock, wire.Ack(ok=True))

    def connection_closed(self, conn: ConnectionState) -> None:
        """The producer's connection ended with transfers still open: they will never complete."""
        for tid in list(conn.open):
            try:
                self.entries.fail_if_mine(tid, TransferError(FailureCause.PEER_UNREACHABLE, (
                    f"producer {conn.peer} disconnected before it finished pushing transfer {tid!r}")), conn)
            except StoreClosedError:  # the server is shutting down: nothing left to fail
                break
        conn.open.clear()

    # ------------------------------------------------------------------ internals
    def _check_shape(self, msg: wire.Push) -> PushPath:
        """The path this push lands over, once its header is consistent (the path checks the rest).
        What a refusal says of our layout is told only to authenticated producers (_refuse)."""
        wire.check_transfer_id(msg.transfer_id)
        wire.check_fingerprint(msg.fingerprint, self._expected_fingerprint(msg), peer="producer", us="consumer")
        if msg.num_layers != self.num_layers:
            raise TransferError(FailureCause.LAYOUT_MISMATCH,
                                f"producer pushes {msg.num_layers} layers, this consumer has {self.num_layers}")
        if not 0 < msg.total_blocks <= 1 << 22:
            raise TransferError(FailureCause.PROTOCOL, f"bad total_blocks {msg.total_blocks}")
        wire.check_layers(msg.layers, self.num_layers)
        if msg.first_block < 0 or msg.num_blocks < 1 or msg.first_block + msg.num_blocks > msg.total_blocks:
            raise TransferError(FailureCause.PROTOCOL, (
                f"bad block range [{msg.first_block}, {msg.first_block + msg.num_blocks}) of {msg.total_blocks}"))
        rows = len(msg.layers) * msg.num_blocks
        if msg.checksums is not None and len(msg.checksums) != rows:
            raise TransferError(FailureCause.PROTOCOL, f"{len(msg.checksums)} checksums for {rows} blocks")
        if msg.offsets is not None and any(not 0 <= off < 1 << 63 for off in msg.offsets):
            raise TransferError(FailureCause.PROTOCOL, "push offsets must be in [0, 2**63)")
        if not 0 <= msg.nixl_base_address < 1 << 63:
            raise TransferError(FailureCause.PROTOCOL, f"bad nixl_base_address {msg.nixl_base_address}")
        return offered(self.paths, msg.data_path, PUSH_UNOFFERED, "push data_path")

    def _expected_fingerprint(self, msg: wire.Push) -> str:
        """Whole rows: ours. A head fragment: that of rows holding its heads (checked here)."""
        if msg.heads is None:
            return self.fingerprint
        if msg.data_path != TCP_PUSH.name:
            raise TransferError(FailureCause.PROTOCOL, f"head fragments come inline only, not over {msg.data_path!r}")
        if self._fragment_rows is None:
            raise TransferError(FailureCause.LAYOUT_MISMATCH, "this consumer takes no head fragments "
                                "(its KV heads cannot be sliced, or it is not a decode instance)")
        return self._fragment(msg.heads)[0]

    def _fragment(self, heads: list[int]) -> tuple[str, int]:
        assert self._fragment_rows is not None
        if len(heads) != 2:
            raise TransferError(FailureCause.PROTOCOL, f"push heads {heads[:4]}: need [start, stop)")
        try:
            return self._fragment_rows(heads[0], heads[1])
        except ValueError as exc:
            raise TransferError(FailureCause.LAYOUT_MISMATCH, f"push heads {heads}: {exc}") from None

    def row_bytes(self, msg: wire.Push) -> int:
        """Bytes of one (layer, block) row of this push (after _check_shape): a slot, or a fragment's row."""
        return self.store.slot_bytes if msg.heads is None else self._fragment(msg.heads)[1]

    def _abort_error(self, msg: wire.PushEnd, conn: ConnectionState) -> TransferError:
        text = msg.message[:MAX_MESSAGE]
        return TransferError(wire.failure_cause(msg.cause), f"producer {conn.peer} gave up pushing: {text}")

    def _refuse(self, sock: socket.socket, exc: TransferError, conn: ConnectionState) -> None:
        """Answer a push message with its typed refusal, in step. A peer that has not proved the shared
        secret is not told this store's layout or occupancy (issue 34): the cause only (the details
        are logged here, at most once per 10 s: such a peer may send refusable pushes at will)."""
        if exc.cause in _PRIVATE_CAUSES and not _authenticated(conn):
            self.log.info("unauthenticated", "refused a push message from unauthenticated %s: %s", conn.peer, exc)
            exc = TransferError(exc.cause, f"push refused ({exc.cause.value}); why is not shown to an unauthenticated "
                                           "peer (see the landing side's log; peers that prove the shared secret are told)")
        wire.send_refusal(sock, exc)

    def close(self) -> None:
        for path in self.paths.values():
            path.close()


# Causes whose details describe this store (its layout, its free space): an unauthenticated peer gets
# the cause and this line instead (the details are logged here, and told to peers that prove the secret)
_PRIVATE_CAUSES = (FailureCause.LAYOUT_MISMATCH, FailureCause.STORE_FULL)


def _authenticated(conn: ConnectionState) -> bool:
    """Whether the connection's peer proved the secret (a server without one: nobody did)."""
    session = getattr(conn, "session", None)
    return bool(getattr(session, "authenticated", False))
