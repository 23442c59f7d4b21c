"""Typed failures. Every failure that can reach a request carries one `FailureCause`, so the
client, the logs and the metrics all say *what* failed, not just that something did. A failure is
data: code reads its fields (`cause`, `detail`, `refused`) and the cause's properties, never its
message."""

from __future__ import annotations

import enum
from typing import TypeVar

# How a KV load failure reads in the client's error message (tiered/client_errors.py writes it):
# "KV transfer failed [checksum_mismatch]: ...". For people: code reads CLIENT_ERROR_CAUSE_FIELD.
CLIENT_ERROR_PREFIX = "KV transfer failed"
# The key of vLLM's OpenAI-style error body ({"error": {"message", "type", "param", "code", ...}})
# that carries the FailureCause value (client_errors.py adds it, the proxy reads it). Here, not
# there: the proxy must not import vLLM.
CLIENT_ERROR_CAUSE_FIELD = "kv_transfer_cause"


def client_error_message(cause: str, text: str) -> str:
    return f"{CLIENT_ERROR_PREFIX} [{cause}]: {text}"


class FailureCause(str, enum.Enum):
    PEER_UNREACHABLE = "peer_unreachable"    # connect refused / reset / peer died mid-transfer
    LEASE_EXPIRED = "lease_expired"          # the producer no longer holds the entry
    CHECKSUM_MISMATCH = "checksum_mismatch"  # bytes changed between staging and receipt
    LAYOUT_MISMATCH = "layout_mismatch"      # dtype / block size / heads / layers differ
    STORE_FULL = "store_full"                # DRAM and NVMe budgets both exhausted
    TIMEOUT = "timeout"                      # a deadline passed with no answer
    UNKNOWN_TRANSFER = "unknown_transfer"    # the peer has never heard of this transfer id
    PROTOCOL = "protocol"                    # malformed or oversized message, version skew
    AUTH = "auth"                            # shared-secret handshake failed
    BAD_PARAMS = "bad_params"                # malformed kv_transfer_params from the client

    # What each cause means for the code that handles it (tests/unit/test_errors.py pins the members).
    @property
    def transient(self) -> bool:
        """A retry may heal it (failure_policy "retry" tries again): the peer, the link or the bytes
        had a bad moment. Layout, params, auth and a lost entry fail the same way every time."""
        return self in (FailureCause.PEER_UNREACHABLE, FailureCause.TIMEOUT, FailureCause.CHECKSUM_MISMATCH,
                        FailureCause.PROTOCOL)

    @property
    def push_lost(self) -> bool:
        """A push that failed with it (and was not refused in step) broke on the wire: the decode is
        gone or stalled, so no consumer will pull the staged copy and the producer releases it. A
        refused push, or one that never connected, keeps it: the consumer pulls instead."""
        return self in (FailureCause.PEER_UNREACHABLE, FailureCause.TIMEOUT)

    @property
    def breaks_stream(self) -> bool:
        """Unless refused in step, the connection it happened on may be out of step: drop it and
        start afresh (a refusal such as store_full keeps it, closing would fail its other transfers)."""
        return self in (FailureCause.PEER_UNREACHABLE, FailureCause.TIMEOUT, FailureCause.PROTOCOL)

    @property
    def nothing_to_release(self) -> bool:
        """After a load failed with it, asking the producer to release the entry is pointless: the
        entry is gone (lease_expired, unknown_transfer) or the producer will not listen (auth)."""
        return self in (FailureCause.AUTH, FailureCause.LEASE_EXPIRED, FailureCause.UNKNOWN_TRANSFER)


class KVConnectorError(Exception):
    """Base of every error kvconnectors raises on purpose."""


class ConfigError(KVConnectorError, ValueError):
    """A configuration value is invalid. The message names the key and the value."""

    def __init__(self, key: str, value: object, why: str):
        self.key, self.value, self.why = key, value, why
        super().__init__(f"invalid kvconnectors config {key}={value!r}: {why}")


_E = TypeVar("_E", bound="TransferError")


class TransferError(KVConnectorError):
    """A transfer-path failure with a typed cause. `str()` reads "[cause] detail" (for logs).

    cause:   what failed (FailureCause).
    detail:  the message without the "[cause] " prefix: what travels in a wire refusal next to its
             cause field and what clients see after "KV transfer failed [cause]: ".
    refused: the peer answered in step ("no", or nothing was sent yet): the connection is fine and,
             for a push, the producer's staged copy is intact for a pull.
    """

    def __init__(self, cause: FailureCause | str, detail: str, *, refused: bool = False):
        self.cause = FailureCause(cause)
        self.detail = detail
        self.refused = refused
        super().__init__(f"[{self.cause.value}] {detail}")

    def refusal(self: _E) -> _E:
        """A copy marked refused (same class, cause and detail); the original stays as it is."""
        twin = _rebuild(type(self), self.__dict__)
        twin.refused = True
        return twin

    def __reduce__(self):  # pickle and copy keep the class and every field (subclasses take other args)
        return _rebuild, (type(self), self.__dict__)


def _rebuild(cls: type[_E], state: dict) -> _E:
    exc = cls.__new__(cls)
    exc.__dict__.update(state)
    exc.args = (f"[{exc.cause.value}] {exc.detail}",)
    return exc


class StoreFullError(TransferError):
    def __init__(self, message: str):
        super().__init__(FailureCause.STORE_FULL, message)


class LeaseExpiredError(TransferError):
    def __init__(self, message: str):
        super().__init__(FailureCause.LEASE_EXPIRED, message)


class UnknownTransferError(TransferError):
    def __init__(self, message: str):
        super().__init__(FailureCause.UNKNOWN_TRANSFER, message)
