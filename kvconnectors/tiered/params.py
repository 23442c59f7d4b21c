"""`kv_transfer_params`: what the producer hands back to the client and the proxy carries to
the consumer. Built by the producer's scheduler side, validated by the consumer's.

The NIXL-compatible top-level keys (do_remote_prefill, remote_host, ...) let existing proxies
route it unchanged; our own fields sit under "kvc" and are validated with msgspec, so a
malformed or tampered value fails its request with a message naming the field.
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec
import xxhash

from kvconnectors.errors import FailureCause, TransferError

PARAMS_VERSION = 4  # 2: push_target; 3: token; 4: model-wide fingerprint, tp_size, kv_heads
# Tickets a consumer accepts: the previous version too, for one release (a producer pool may still
# run it while the consumers are upgraded). v3 carries the rows fingerprint (KVLayout.rows_fingerprint,
# with the producer's TP size in it): only an equal-TP consumer may load it, as before.
ACCEPTED_PARAMS_VERSIONS = (PARAMS_VERSION - 1, PARAMS_VERSION)
KEY = "kvc"
_MAX_TOKENS = 1 << 24
TOKEN_BYTES = 24  # random bytes of a transfer token (192 bits; 32 URL-safe characters)
_MIN_TOKEN_CHARS = 22  # 16 bytes, the least a ticket may carry
_TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def new_token() -> str:
    """A transfer's capability: whoever presents it may read, renew, release and locate the
    transfer on the producer's store server (and nobody else)."""
    return secrets.token_urlsafe(TOKEN_BYTES)


class PeerAddress(msgspec.Struct, array_like=True):
    host: str
    port: int


class TransferParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The consumer's ticket to one staged transfer. Version 4. Fields at their defaults are left out
    of the JSON, so a field added since (shm_paths) reaches only the consumers of tickets that use it:
    a tcp ticket reads the same to a consumer of the previous release."""
    v: int
    transfer_id: str
    addrs: list[PeerAddress]        # producer store server per tensor-parallel rank
    num_tokens: int                 # prompt tokens staged
    num_blocks: int
    block_size: int
    fingerprint: str                # v4: model-wide KV fingerprint (v3: rows fingerprint); must equal the consumer's
    prompt_hash: str                # xxh3 of the prompt token ids: the consumer must hold the same prompt
    lease_ttl_s: float              # remaining TTL when issued
    issued_at: float                # producer wall clock at issue, for diagnostics only
    transport: str = "tcp"
    shm_path: str = ""              # rank 0's shm arena (what tickets before shm_paths named)
    push_target: str = ""           # push mode: the landing store (rank 0) the producer streamed to
    token: str = ""                 # v3: the transfer's capability at the producer's store servers
    tp_size: int = 0                # v4: the producer's TP size (= len(addrs): addrs[r] serves rank r's heads)
    kv_heads: int = 0               # v4: the model's KV heads (vLLM's split gives each rank's range)
    shm_paths: list[str] = []       # transport shm: each rank's arena; a reply naming another is refused


def shm_arena(p: TransferParams, rank: int) -> str:
    """The shm arena producer rank `rank` named in the ticket ("" when it named none): the only
    one a consumer copies that rank's KV out of, whatever a reply says."""
    if p.shm_paths:
        return p.shm_paths[rank] if rank < len(p.shm_paths) else ""
    return p.shm_path if rank == 0 else ""  # a ticket of before shm_paths: rank 0's only


def prompt_hash(token_ids: list[int]) -> str:
    h = xxhash.xxh3_64()
    for t in token_ids:
        h.update(int(t).to_bytes(4, "little", signed=False))
    return h.hexdigest()


def producer_params(p: TransferParams, engine_id: str) -> dict[str, Any]:
    first = p.addrs[0]
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_host": first.host,
        "remote_port": first.port,
        KEY: msgspec.to_builtins(p),
    }


def is_ours(params: dict[str, Any] | None) -> bool:
    return bool(params) and KEY in params


def parse(params: dict[str, Any], prompt_token_ids: list[int] | None, block_size: int) -> TransferParams:
    """Validate the consumer side's params; every problem becomes a BAD_PARAMS TransferError."""
    raw = params.get(KEY)
    try:
        p = msgspec.convert(raw, TransferParams)
    except msgspec.ValidationError as exc:
        raise TransferError(FailureCause.BAD_PARAMS, f"kv_transfer_params.{KEY}: {exc}") from None
    def bad(field: str, why: str) -> TransferError:
        return TransferError(FailureCause.BAD_PARAMS,
                             f"kv_transfer_params.{KEY}.{field}={getattr(p, field)!r}: {why}")
    if p.v not in ACCEPTED_PARAMS_VERSIONS:
        raise bad("v", f"this consumer accepts versions {' and '.join(map(str, ACCEPTED_PARAMS_VERSIONS))}")
    if p.v < 2 and p.push_target:
        raise bad("push_target", f"version {p.v} tickets have no push_target (added in version 2)")
    if p.v < 3 and p.token:  # (a token is never echoed: it is a capability)
        raise TransferError(FailureCause.BAD_PARAMS, (
            f"kv_transfer_params.{KEY}.token: version {p.v} tickets have no token (added in version 3)"))
    if p.v < 4 and (p.tp_size or p.kv_heads):
        raise bad("tp_size" if p.tp_size else "kv_heads", f"version {p.v} tickets have none (added in version 4)")
    if not p.transfer_id or len(p.transfer_id) > 512:
        raise bad("transfer_id", "must be 1..512 characters")
    if not p.addrs or any(not (0 < a.port < 65536) or not a.host for a in p.addrs):
        raise bad("addrs", "needs host and a port in 1..65535 per rank")
    if p.v >= 4 and p.tp_size != len(p.addrs):
        raise bad("tp_size", f"must equal the {len(p.addrs)} producer addresses (one per rank)")
    if p.shm_paths and len(p.shm_paths) != len(p.addrs):
        raise bad("shm_paths", f"must name one arena per producer rank ({len(p.addrs)})")
    if p.v >= 4 and not 0 < p.kv_heads <= 1 << 16:
        raise bad("kv_heads", "must be a positive number of KV heads")
    if not 0 < p.num_tokens <= _MAX_TOKENS:
        raise bad("num_tokens", f"must be in 1..{_MAX_TOKENS}")
    if p.block_size != block_size:
        raise TransferError(FailureCause.LAYOUT_MISMATCH, (
            f"producer block_size {p.block_size} differs from this consumer's {block_size}"))
    if p.num_blocks != -(-p.num_tokens // p.block_size):
        raise bad("num_blocks", f"does not match num_tokens={p.num_tokens} at block_size={p.block_size}")
    if not (0 < p.lease_ttl_s < 1e7):
        raise bad("lease_ttl_s", "must be a positive number of seconds")
    if p.v >= 3 and not (_MIN_TOKEN_CHARS <= len(p.token) <= 128 and set(p.token) <= _TOKEN_CHARS):
        raise TransferError(FailureCause.BAD_PARAMS, (
            f"kv_transfer_params.{KEY}.token: a version {p.v} ticket carries the transfer's token, "
            f"{_MIN_TOKEN_CHARS}..128 URL-safe characters (got {len(p.token)} characters)"))
    if prompt_token_ids is not None:
        if len(prompt_token_ids) != p.num_tokens:
            raise bad("num_tokens", f"but this request's prompt has {len(prompt_token_ids)} tokens")
        if prompt_hash(prompt_token_ids) != p.prompt_hash:
            raise bad("prompt_hash", "differs from this request's prompt: the KV belongs to another prompt")
    return p


def retries_for(params: dict[str, Any], policy: str | None, retries: int, engine_policy: str) -> int:
    """Extra pull attempts for this request: the connector's policy, overridable per request with
    kv_transfer_params {"failure_policy": "retry"|"fail"|"recompute", "retries": N}.

    fail/recompute themselves are applied by vLLM engine-wide, so a request may only name the
    engine's own choice (or "retry"); anything else is refused rather than silently ignored.
    """
    req_policy = params.get("failure_policy", policy)
    if req_policy not in (None, "retry", "fail", "recompute"):
        raise TransferError(FailureCause.BAD_PARAMS, f"kv_transfer_params.failure_policy={req_policy!r}: "
                                                     "must be retry, fail or recompute")
    if req_policy in ("fail", "recompute") and req_policy != engine_policy:
        raise TransferError(FailureCause.BAD_PARAMS, (
            f"kv_transfer_params.failure_policy={req_policy!r}: this engine applies "
            f"kv_load_failure_policy={engine_policy!r} to failed loads"))
    if req_policy != "retry":
        return 0
    n = params.get("retries", retries)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 10:
        raise TransferError(FailureCause.BAD_PARAMS, f"kv_transfer_params.retries={n!r}: must be an integer in [0, 10]")
    return n
