"""Grants: the per-transfer capabilities of a store server.

The worker `grant`s each staged transfer the token of its ticket; Read, Renew, Release and Locate
of a granted transfer must present that token (`authorized`, `check`), and a wrong or missing one
is answered exactly like an unknown id. With `require_grants` (a producer's server) an id never
granted is unknown too. A pushed entry answers to the token its pushes carried (asked of the
landing side's table through `landed_token`); a landed entry whose token is no longer known
answers nobody. Bounded: beyond `max_grants` the grants of transfers the store no longer holds
are forgotten, oldest first; a live transfer's grant never is.
"""

from __future__ import annotations

import hmac
import threading
from collections import OrderedDict
from collections.abc import Callable

from kvconnectors.errors import UnknownTransferError
from kvconnectors.logs import LogLimiter
from kvconnectors.store import TieredStore


class Grants:
    def __init__(self, store: TieredStore, *, max_grants: int, require_grants: bool, log: LogLimiter,
                 landed_token: Callable[[str], str | None] | None = None):
        """`landed_token(transfer_id)`: the token a pushed entry answers to ("": none; None: not
        pushed here); None when this server takes no pushes."""
        self.store, self.max_grants, self.require_grants, self.log = store, max_grants, require_grants, log
        self._landed_token = landed_token
        self._grants: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def grant(self, transfer_id: str, token: str) -> None:
        """From now on, `transfer_id` answers only to `token` (the ticket's). Bounded: beyond
        max_grants the oldest grants of transfers the store no longer holds are forgotten first."""
        if not token:
            return
        with self._lock:
            self._grants[transfer_id] = token
            self._grants.move_to_end(transfer_id)
            if len(self._grants) > self.max_grants:
                self._prune()

    def revoke(self, transfer_id: str) -> None:
        with self._lock:
            self._grants.pop(transfer_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._grants)

    def _prune(self) -> None:
        """(lock held) Forget the grants of transfers the store no longer holds, oldest first, down
        to 3/4 of max_grants. A live transfer's grant is never forgotten (on a server without
        require_grants that would open it to any peer): live grants are bounded by the store's live
        entries, each of which holds at least one slot."""
        target = self.max_grants * 3 // 4
        for tid in list(self._grants):
            if len(self._grants) <= target:
                return
            if not self.store.contains(tid):
                del self._grants[tid]
        if len(self._grants) > self.max_grants:
            self.log.warning("grants", "store server: %d live transfers hold tokens (max_grants %d); keeping them",
                             len(self._grants), self.max_grants)

    def authorized(self, transfer_id: str, token: str) -> bool:
        with self._lock:
            want = self._grants.get(transfer_id)
        if want is None and self._landed_token is not None:
            want = self._landed_token(transfer_id)  # a pushed entry: its pushes' token ("": none)
            if want is None and self.store.contains(transfer_id):
                return False  # landed, its token no longer known (forgotten, or going): it answers nobody
        if want is None:
            return not self.require_grants
        return bool(token) and hmac.compare_digest(want.encode(), token.encode())

    def check(self, transfer_id: str, token: str) -> None:
        if not self.authorized(transfer_id, token):  # worded exactly as the store words an unknown id
            raise UnknownTransferError(f"transfer {transfer_id!r} is not in this store")
