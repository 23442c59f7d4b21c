"""Typed failures. Every failure that can reach a request carries one `FailureCause`, so the
client, the logs and the metrics all say *what* failed, not just that something did."""

from __future__ import annotations

import enum
import re

# How a KV load failure reads in the client's error (tiered/client_errors.py writes it, the proxy parses
# it): "KV transfer failed [checksum_mismatch]: ...". Here, not there: the proxy must not import vLLM.
CLIENT_ERROR_PREFIX = "KV transfer failed"
CLIENT_ERROR_CAUSE = re.compile(re.escape(CLIENT_ERROR_PREFIX) + r" \[(\w+)\]: ")


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


class KVConnectorError(Exception):
    """Base of every error kvconnectors raises on purpose."""


class ConfigError(KVConnectorError, ValueError):
    """A configuration value is invalid. The message names the key and the value."""

    def __init__(self, key: str, value: object, why: str):
        self.key, self.value, self.why = key, value, why
        super().__init__(f"invalid kvconnectors config {key}={value!r}: {why}")


class TransferError(KVConnectorError):
    """A transfer-path failure with a typed cause."""

    def __init__(self, cause: FailureCause, message: str):
        self.cause = FailureCause(cause)
        super().__init__(f"[{self.cause.value}] {message}")


class StoreFullError(TransferError):
    def __init__(self, message: str):
        super().__init__(FailureCause.STORE_FULL, message)


class LeaseExpiredError(TransferError):
    def __init__(self, message: str):
        super().__init__(FailureCause.LEASE_EXPIRED, message)


class UnknownTransferError(TransferError):
    def __init__(self, message: str):
        super().__init__(FailureCause.UNKNOWN_TRANSFER, message)
