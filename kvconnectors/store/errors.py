"""Store-local errors that `kvconnectors.errors` has no type for. Everything else the store raises
is one of the shared typed errors (StoreFullError, LeaseExpiredError, UnknownTransferError,
ConfigError) or a plain ValueError/TypeError for caller bugs (bad bounds, wrong buffer size)."""

from __future__ import annotations

from kvconnectors.errors import KVConnectorError


class NotSealedError(KVConnectorError, RuntimeError):
    """A consumer asked for an entry the producer has not sealed yet (its bytes may be incomplete)."""


class StoreClosedError(KVConnectorError, RuntimeError):
    """The store was closed; its memory and files are gone."""
