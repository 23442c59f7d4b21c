"""Receiving side of push mode: the decode instance's store server lands pushed layer groups in its
own store, under its own lease, and seals them at PushEnd.

    producer (PushSender)                       consumer store server (Landing)
    Push(layers 0-3, blocks, checksums) + bytes  ─▶ first Push: bind the transfer to this producer,
                                                 check layout and that it would fit; every Push:
                                                 receive (a buffer lent under the cap), verify
                                                 checksums, reserve the group's slots, write, renew
                                            ◀── Ack
    ... one Push per layer group, while the producer's later layers still compute ...
    PushEnd(ok)                                 ─▶ seal: every (layer, block) must have arrived
                                            ◀── Ack                        (consumer's load wakes)

A transfer that cannot land (layout mismatch, store full, bad checksum, producer gone mid-stream,
PushEnd(ok=False)) is dropped at once and its cause remembered, so the consumer's load fails (or
falls back to pulling) with that cause instead of waiting for its deadline. Partial layer sets are
never readable: only sealed entries are.

Who may do what (the landing side faces any peer that reaches the store port):
- Owner. The first Push of a transfer binds it to the producer that sent it: `ConnectionState.owner`
  (unique to the connection by default; the server may give the authenticated session's id).
  Only that owner continues, fails (PushEnd ok=False or a bad Push of its own) or seals it; its
  connection ending fails what it left open. Anyone else's Push, PushEnd or malformed Push for
  that id is refused in step and touches nothing. A sealed entry is never deleted by a push
  message at all, its owner's included: it belongs to the consumer now (released or expired).
  A failure is remembered for an id nobody holds (a first Push refused, an abort before any data)
  so the consumer learns it at once; a peer that knew an id before its producer's first Push could
  pre-empt it that way (as it could claim it), so transfer ids must stay unguessable.
- Reservation. The first Push checks that the whole transfer would fit in the store's free slots
  now, but reserves nothing. A tcp push lands in place: its bytes are read straight into the
  store's slots a chunk (IN_PLACE_CHUNK_BYTES) at a time, each chunk reserved just before its
  bytes are read and committed once they pass their checksums (a failed chunk gives its slots
  back with the transfer); the decode then copies slot -> blocks, two host copies in all. Other
  paths reserve a group when its bytes have arrived and passed their checksums. So a claim of a
  large transfer holds only what was delivered, plus at most one chunk: a 4 KiB push "of" 128
  blocks holds one chunk. The price: transfers admitted side by side may not all find room for
  their last groups; the one that does not is refused in step with store_full (its producer keeps
  its copy, the consumer pulls it) and gives back what it held. Reservations take free DRAM, then
  free NVMe; landed entries are not spilled to make room for them.
- Lease. Until sealed, the entry's lease is renewed only by its owner's pushes (the store entry
  is created with a writer): a stranger's Renew, or Release, is answered "unknown" and neither
  keeps it alive nor ends it.
- Capability. The first Push's `token` (the ticket's) is the entry's: from then on every Read,
  Renew, Release and Locate of it on the wire must present it (`LandedEntries.token_of`, checked by
  the store server), as for a producer's entries; without it the entry reads exactly like an unknown id. An
  entry pushed without a token answers nobody on the wire (its consumer reads it locally). The
  consumer's lease keeper presents the ticket's token.
- Receive buffers. A push borrows from one pool shared by every connection (`ReceiveBuffers`; a
  tcp push one chunk, for its rows bound for NVMe; a fault-wrapped one its whole group): at most
  `max_receive_bytes` in all (default: a
  quarter of the store's DRAM, at least two of the largest Pushes a PushSender sends, 2 x 64 MiB);
  kept for reuse, never per connection. A push that would need more is refused in step with
  store_full (its bytes are read and dropped; the producer keeps its copy, the consumer pulls)
  instead of allocating. NIXL pushes READ through one registered bounce buffer; those larger than
  it (from producers that do not split groups) are gathered in a buffer counted against the cap.
- Head fragments (decode TP < prefill TP, tiered/tp.py `push_routes`). A Push with `heads` [start, stop)
  carries rows holding only those of this rank's KV heads, under the fragment's own id: its
  fingerprint must be that of such rows (`fragment_rows`, None: fragments are refused), over tcp
  only. Otherwise it is an ordinary pushed transfer (owner, lease, seal); each row lands in the
  first bytes of a whole slot (the consumer assembles the fragments into its rows).
- Errors. Every refusal is typed and answered in step; a bug while landing fails the transfer, is
  answered as a protocol error, and the connection goes on (or is closed when its stream may be
  out of step).

The parts, each its own object owning its state, assembled here (`Landing`):
    push_receiver.PushReceiver   what the store server's connection threads call (Push, PushEnd)
      push_writes.GroupWriter    writes an accepted group into the store (in place, or whole)
    landed_entries.LandedEntries the records of what lands, filled by the receiver, asked by the
                                 worker (tiered/landed.py) and by the store server's grants
    receive_buffers.ReceiveBuffers the receive-buffer cap every connection borrows under
Calls flow one way: receiver -> writer -> table and buffers; the worker and the grants only ask
the table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvconnectors.store import TieredStore
from kvconnectors.transport.landed_entries import LandedEntries
from kvconnectors.transport.paths import TCP_PUSH, PushPath
from kvconnectors.transport.push_receiver import PushReceiver
from kvconnectors.transport.receive_buffers import MIN_RECEIVE_BYTES, ReceiveBuffers


class Landing:
    """The landing side of one store, assembled: `entries` (the worker's), `receiver` (the store
    server's), `receive_buffers` (the receiver's cap). Owns no state of its own."""

    def __init__(self, store: TieredStore, *, fingerprint: str, num_layers: int,
                 paths: Sequence[PushPath] = (TCP_PUSH,), seen_grace_s: float = 5.0, test_hooks: bool = False,
                 max_receive_bytes: int | None = None,
                 fragment_rows: Callable[[int, int], tuple[str, int]] | None = None):
        """`paths`: the push data paths accepted (tcp; NixlPush(sink_factory=...) for transport nixl).
        `max_receive_bytes`: cap on every connection's push receive buffers together (default: a
        quarter of the store's DRAM, at least MIN_RECEIVE_BYTES). `fragment_rows(start, stop)`:
        the rows fingerprint and bytes per row of a head fragment filling this rank's heads
        [start, stop) (ValueError: not a fragment this rank takes); None: fragments are refused.
        `seen_grace_s`: accepted and unused (kept for callers that pass it)."""
        self.entries = LandedEntries(store)
        self.receive_buffers = ReceiveBuffers(max_receive_bytes if max_receive_bytes is not None
                                              else max(MIN_RECEIVE_BYTES, store.arena_bytes // 4))
        self.receiver = PushReceiver(store, self.entries, self.receive_buffers, fingerprint=fingerprint,
                                     num_layers=num_layers, paths=paths, test_hooks=test_hooks,
                                     fragment_rows=fragment_rows)

    def close(self) -> None:
        self.receiver.close()
        self.receive_buffers.drop_free()
