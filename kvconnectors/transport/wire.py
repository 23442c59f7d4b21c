"""Wire messages of the transfer plane: versioned msgspec structs, length-prefixed msgpack.

Nothing is ever unpickled. Every frame has a size limit, and a peer whose protocol version or
compatibility hash differs is refused at the handshake with a message naming both sides.

Version history:
  1 - pull: Hello/Welcome/Proof, Read (inline|shm), Renew, Release.
  2 - Read data_path "nixl": the consumer READs the blocks itself through NIXL (UCX) from the
      producer's registered DRAM arena. ReadReply gains nixl_agent_meta and nixl_base_address
      (arena offsets travel in `offsets`, as for shm); the consumer answers Release (done) or
      Ack(ok=False) (its READ failed) exactly like the shm path. Additive, but the version is
      bumped so a v1 peer is refused at the handshake with both versions named instead of
      failing later on an unknown data_path. Status/StatusReply: store occupancy for operators
      and leak checks.
  3 - push: the producer streams layer groups into the consumer's landing store (Push, each
      answered by Ack) and ends with PushEnd (seal, or abort with a cause), or with a last Push
      that carries seal=True (one round trip less on the critical path). Push data_path
      "inline" sends the bytes after the frame; "nixl" names arena offsets the landing side READs.
      Locate/LocateReply: which tier holds an entry's slots (vLLM's cache-hit source, host/disk).
  4 - mutual authentication and per-transfer capabilities. Hello carries the client's nonce;
      Welcome the server's nonce and, when the server holds the shared secret, its proof over both
      nonces and the Hello (auth.py); the client proves itself over the same transcript with its
      own role label, so a proof cannot be relayed or reflected. Read, Renew (`tokens`), Release
      and Locate carry the transfer's token from the ticket (`kvc.token`): an entry granted a token
      answers only to it, and a wrong or missing token reads exactly like an unknown id.
      Push carries the token too (the landing side may bind the landed entry to it). StatusReply
      gains auth_failures. A v3 peer (the previous version) is still admitted unless the server
      refuses previous-version peers; it authenticates one way only and presents no tokens, so it
      reaches no entry that was granted one.
      Later, additive (no version bump): Hello.protection and Welcome.protection, the
      wire_protection each side runs ("handshake", the default, or "aead": every frame and KV byte
      after the handshake sealed, sealed.py). A peer that predates them sends neither and reads as
      "handshake"; "aead" joins the authenticated transcript, so it cannot be stripped or added on
      the way. StatusReply gains integrity_failures.

Rolling upgrades: a server accepts peers of the previous version too (ACCEPTED_VERSIONS), for one
release, so prefill and decode pools can be upgraded one at a time. Messages both versions share
encode the same way (fields added since have defaults, unknown fields are ignored), so such a peer
is spoken to unchanged; a message it could not have sent (SINCE) is refused with both versions
named. Anything older is refused at the handshake, naming both sides.
"""

from __future__ import annotations

import hashlib
import re
import socket
import struct
import time
from typing import Union

import msgspec

from kvconnectors.errors import FailureCause, TransferError

PROTOCOL_VERSION = 4
PREVIOUS_VERSION = PROTOCOL_VERSION - 1
ACCEPTED_VERSIONS = (PREVIOUS_VERSION, PROTOCOL_VERSION)  # the previous one for one release
MAX_CONTROL_BYTES = 1 << 20  # a control frame is metadata only; data never travels in frames
MAX_PEER_NAME = 256          # Hello.peer: a name for logs, not a payload
MAX_TOKEN = 128              # a transfer token's length (the scheduler's are 32 characters)
MAX_MESSAGE = 2000           # characters of a refusal's message: diagnostics, not payload
HANDSHAKE, AEAD = "handshake", "aead"  # wire_protection: what the shared secret protects
PROTECTIONS = (HANDSHAKE, AEAD)
_LEN = struct.Struct("!I")


class Hello(msgspec.Struct, tag=True):
    version: int
    compat_hash: str
    peer: str = ""
    nonce: bytes | None = None  # v4: the client's fresh nonce (auth.NONCE_BYTES), always sent
    protection: str = HANDSHAKE  # v4: the client's wire_protection (in the transcript unless the default)


class Welcome(msgspec.Struct, tag=True):
    ok: bool
    nonce: bytes | None = None  # present when the server requires the shared secret
    error: str = ""
    proof: bytes | None = None  # v4, with nonce: the server's proof over the transcript (auth.py)
    protection: str = HANDSHAKE  # v4: the server's wire_protection (a server that predates it: the default)


class Proof(msgspec.Struct, tag=True):
    mac: bytes


class Read(msgspec.Struct, tag=True):
    """Ask for `num_blocks` blocks from `first_block` of each listed layer of a transfer."""
    transfer_id: str
    layers: list[int]
    first_block: int
    num_blocks: int
    fingerprint: str
    data_path: str = "inline"  # inline: bytes follow the reply on this socket; shm / nixl: offsets only
    token: str = ""            # v4: the transfer's token from the ticket
    heads: list[int] | None = None  # inline_heads: [start, stop) of the producer rank's own KV heads


class ReadReply(msgspec.Struct, tag=True):
    ok: bool
    cause: str = ""
    message: str = ""
    nbytes: int = 0                       # inline: raw bytes that follow, layer-major, block order
    checksums: list[int] | None = None    # xxh3_64 per (layer, block) in the same order
    shm_path: str = ""
    offsets: list[int] | None = None      # shm / nixl: arena offset per (layer, block)
    lease_ttl_s: float = 0.0
    nixl_agent_meta: bytes | None = None  # nixl (v2): the producer agent's metadata, for add_remote_agent
    nixl_base_address: int = 0            # nixl (v2): address of arena offset 0 in the producer's memory


class Renew(msgspec.Struct, tag=True):
    transfer_ids: list[str]
    tokens: list[str] | None = None  # v4: one per transfer id, in the same order ("" for none)


class RenewReply(msgspec.Struct, tag=True):
    remaining: dict[str, float]
    missing: dict[str, str]  # transfer id -> cause (lease_expired / unknown_transfer)


class Release(msgspec.Struct, tag=True):
    transfer_id: str
    token: str = ""  # v4


class Ack(msgspec.Struct, tag=True):
    ok: bool
    cause: str = ""
    message: str = ""


class Status(msgspec.Struct, tag=True):
    """Ask the server for its store's occupancy (operators, leak checks in tests)."""


class StatusReply(msgspec.Struct, tag=True):
    entries: int
    dram_used_bytes: int
    nvme_used_bytes: int
    pinned: int
    active_connections: int
    counters: dict[str, int]
    rejected: dict[str, int] = msgspec.field(default_factory=dict)  # server refusals by cause (auth, ...)
    auth_failures: int = 0  # v4: handshakes that failed the shared-secret proof, since start
    integrity_failures: int = 0  # sealed records (wire_protection aead) that failed their tag, since start
    tp_size: int = 0  # TP size of the instance this store belongs to (0: not said, an earlier release)
    dram_capacity_bytes: int = 0  # the tiers' sizes, for "store nearly full" alerts (0: not said, an earlier release)
    nvme_capacity_bytes: int = 0


class Push(msgspec.Struct, tag=True):
    """Blocks [first_block, +num_blocks) of `layers` of a transfer, into the receiver's landing
    store. The first Push of a transfer creates its entry there (num_layers x total_blocks)."""
    transfer_id: str
    num_layers: int
    total_blocks: int
    fingerprint: str
    layers: list[int]
    first_block: int
    num_blocks: int
    checksums: list[int] | None = None    # xxh3_64 per (layer, block), layer-major
    data_path: str = "inline"             # inline: nbytes follow the frame; nixl: READ from offsets
    nbytes: int = 0
    offsets: list[int] | None = None      # nixl: sender arena offset per (layer, block)
    nixl_agent_meta: bytes | None = None  # nixl: the sender agent's metadata (first Push per connection)
    nixl_base_address: int = 0
    seal: bool = False                    # the transfer's last Push: seal after landing it (no PushEnd)
    token: str = ""                       # v4: the transfer's token (the landing side may bind it)
    # A head fragment (decode TP < prefill TP): rows hold only the receiving rank's heads
    # [start, stop), under the fragment's own transfer id; None: whole rows
    heads: list[int] | None = None


class PushEnd(msgspec.Struct, tag=True):
    """Every block of every layer has been pushed (ok): seal it. Or the producer gave up (not ok):
    drop what arrived and remember why, so the consumer's load fails with that cause."""
    transfer_id: str
    ok: bool = True
    cause: str = ""
    message: str = ""


class Locate(msgspec.Struct, tag=True):
    """Where does the store hold this transfer (DRAM / NVMe slots)?"""
    transfer_id: str
    token: str = ""  # v4


class LocateReply(msgspec.Struct, tag=True):
    found: bool
    dram_slots: int = 0
    nvme_slots: int = 0


Message = Union[Hello, Welcome, Proof, Read, ReadReply, Renew, RenewReply, Release, Ack, Status, StatusReply,
                Push, PushEnd, Locate, LocateReply]
# The version that introduced each message (those missing exist in every accepted version). None is
# younger than ACCEPTED_VERSIONS[0] today: v4 added fields (with defaults), not messages.
SINCE: dict[type, int] = {Push: 3, PushEnd: 3, Locate: 3, LocateReply: 3}
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def compat_hash(*parts: str, version: int = PROTOCOL_VERSION) -> str:
    """Hash of what both sides must agree on (protocol version plus caller-given parts)."""
    h = hashlib.sha256(f"kvconnectors-wire-v{version}".encode())
    for p in parts:
        h.update(b"\0" + p.encode())
    return h.hexdigest()[:16]


def compat_hashes(*parts: str) -> dict[int, str]:
    """What a peer of each accepted version presents in its Hello, for a server to admit it."""
    return {v: compat_hash(*parts, version=v) for v in ACCEPTED_VERSIONS}


def check_hello(hello: Hello, compat: dict[int, str]) -> str:
    """Why this server refuses the peer's Hello ("" when it admits it). `compat`: the hash a peer of
    each version this server admits must present. The answer goes to a peer that has not
    authenticated: it names the versions admitted (what a peer needs to speak) and the peer's own
    values, never this server's compat hash (the server logs that itself)."""
    if compat.get(hello.version) == hello.compat_hash:
        if len(hello.peer) > MAX_PEER_NAME:
            return f"incompatible peer: its name is {len(hello.peer)} characters (at most {MAX_PEER_NAME})"
        return ""
    versions = ", ".join(f"v{v}" for v in sorted(compat))
    if hello.version in compat:
        why = f"its compat {hello.compat_hash[:64]} differs from this server's for v{hello.version}"
    else:
        why = f"its protocol v{hello.version} is not admitted"
    return f"incompatible peer: {why} (this server admits {versions})"


PROTECTION_MISMATCH = "wire_protection differs"


def protection_mismatch(ours: str, theirs: str, us: str = "server") -> str:
    """A refusal naming both sides' wire_protection (the value is not secret)."""
    return (f"{PROTECTION_MISMATCH}: this {us} runs {ours!r}, the peer {theirs[:32]!r}; set the TieredConnector "
            "setting wire_protection to the same value on both sides")


def admitted_versions(error: str) -> set[int]:
    """The versions a server's handshake refusal says it admits (this version's wording and the
    previous one's: "... (admits v2, v3)"), for a client that may fall back to an older one."""
    m = re.search(r"admits ((?:v\d+(?:, )?)+)\)", error)
    return {int(v) for v in re.findall(r"v(\d+)", m.group(1))} if m else set()


def check_since(msg: Message, version: int) -> None:
    """Refuse a message the peer's protocol version did not have (a typed protocol error)."""
    since = SINCE.get(type(msg), 0)
    if since > version:
        raise TransferError(FailureCause.PROTOCOL, (
            f"{type(msg).__name__} needs protocol v{since}; this connection speaks v{version} "
            f"(the server speaks v{PROTOCOL_VERSION})"))


MAX_RENEW = 4096              # transfer ids per Renew
MAX_RENEW_BYTES = 512 << 10   # UTF-8 bytes of a Renew's ids and tokens: its reply then fits MAX_CONTROL_BYTES


def renew_bytes(ids: list[str], tokens: list[str] | None) -> int:
    return sum(len(t.encode()) for t in ids) + (sum(len(t.encode()) for t in tokens) if tokens else 0)


def renew_batches(ids: list[str], tokens: list[str] | None, batch: int = MAX_RENEW):
    """[start, end) ranges of `ids` that each fit one Renew (count and bytes)."""
    start, size = 0, 0
    for i, tid in enumerate(ids):
        n = len(tid.encode()) + (len(tokens[i].encode()) if tokens else 0)
        if i > start and (i - start >= batch or size + n > MAX_RENEW_BYTES):
            yield start, i
            start, size = i, 0
        size += n
    if start < len(ids):
        yield start, len(ids)


# Header checks both ends make of a transfer request (the server of a Read, the landing side of a Push).
def check_transfer_id(transfer_id: str) -> None:
    if not transfer_id or len(transfer_id) > 512:
        raise TransferError(FailureCause.PROTOCOL, f"bad transfer_id {transfer_id[:64]!r}")


def check_fingerprint(theirs: str, ours: str, *, peer: str, us: str, reveal: bool = True) -> None:
    """The KV layout the peer (`peer`: "consumer" / "producer") has must be ours (`us`). `reveal`
    False (a peer that has not authenticated): the refusal does not name our layout."""
    if theirs != ours:
        mine = ours if reveal else "(not shown to an unauthenticated peer; see this side's log)"
        raise TransferError(FailureCause.LAYOUT_MISMATCH,
                            f"{peer} KV layout {theirs[:64]} differs from this {us}'s {mine}")


def check_layers(layers: list[int], num_layers: int) -> None:
    """Distinct layer numbers in [0, num_layers), at least one."""
    if (not layers or len(layers) > num_layers or len(set(layers)) != len(layers)
            or any(not 0 <= layer < num_layers for layer in layers)):
        raise TransferError(FailureCause.PROTOCOL, (
            f"layers {layers[:8]}{'...' if len(layers) > 8 else ''}: need distinct layers in [0, {num_layers})"))


def failure_cause(name: str) -> FailureCause:
    """A peer's cause string; one this version does not know (a newer peer) reads as protocol."""
    try:
        return FailureCause(name or "protocol")
    except ValueError:
        return FailureCause.PROTOCOL


def encode(msg: Message, limit: int | None = None) -> bytes:
    """The frame of `msg` (length prefix included). `limit`: refuse (typed protocol error) a frame
    the peer would refuse to read, before anything is sent."""
    payload = _encoder.encode(msg)
    if limit is not None and len(payload) > limit:
        raise TransferError(FailureCause.PROTOCOL, (
            f"{type(msg).__name__} of {len(payload)} bytes exceeds the control-frame limit of {limit}; "
            "split the request"))
    return _LEN.pack(len(payload)) + payload


def send_msg(sock: socket.socket, msg: Message, limit: int | None = None) -> None:
    sock.sendall(encode(msg, limit))


def send_refusal(sock: socket.socket, exc: TransferError, read: bool = False) -> None:
    """Answer a request with its typed failure (a ReadReply for a Read, else an Ack), best effort:
    a peer that is already gone needs no answer. The message is cut to MAX_MESSAGE characters."""
    detail = exc.detail if len(exc.detail) <= MAX_MESSAGE else exc.detail[:MAX_MESSAGE] + "..."
    reply = (ReadReply(ok=False, cause=exc.cause.value, message=detail) if read
             else Ack(ok=False, cause=exc.cause.value, message=detail))
    try:
        send_msg(sock, reply)
    except OSError:
        pass


def send_all(sock: socket.socket, views: list[memoryview], batch: int = 512) -> None:
    """Gather-send many buffers with few syscalls (sendmsg), resuming after partial sends."""
    i = 0
    while i < len(views):
        chunk = views[i:i + batch]
        sent = sock.sendmsg(chunk)
        for v in chunk:  # advance past fully sent views; trim a partially sent one
            if sent >= len(v):
                sent -= len(v)
                i += 1
            else:
                views[i] = v[sent:]
                break


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view` from the socket; the deadline bounds the whole read, not each recv."""
    got, n = 0, len(view)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError(FailureCause.TIMEOUT, f"peer sent {got} of {n} bytes before the deadline")
            sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:], n - got)
        except socket.timeout:
            raise TransferError(FailureCause.TIMEOUT, f"peer sent {got} of {n} bytes before the deadline") from None
        except OSError as exc:
            raise TransferError(FailureCause.PEER_UNREACHABLE, f"connection lost after {got} of {n} bytes: {exc}") from None
        if k == 0:
            raise TransferError(FailureCause.PEER_UNREACHABLE, f"peer closed the connection after {got} of {n} bytes")
        got += k


def recv_msg(sock: socket.socket, deadline: float | None = None, max_bytes: int = MAX_CONTROL_BYTES) -> Message:
    head = bytearray(_LEN.size)
    recv_exact(sock, memoryview(head), deadline)
    (length,) = _LEN.unpack(head)
    if length > max_bytes:
        raise TransferError(FailureCause.PROTOCOL, f"control frame of {length} bytes exceeds the limit of {max_bytes}")
    body = bytearray(length)
    recv_exact(sock, memoryview(body), deadline)
    try:
        return _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TransferError(FailureCause.PROTOCOL, f"malformed control frame: {str(exc)[:200]}") from None
    except RecursionError:  # msgspec skips an unknown field's value recursively: deep nesting
        raise TransferError(FailureCause.PROTOCOL, "malformed control frame: nested too deeply") from None
