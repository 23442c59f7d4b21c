"""Issue 34, row 1: mutual authentication could be downgraded. With `allow_previous_wire` on (the
old default), a consumer holding the shared secret fell back to the previous wire version (v3)
when a server said it admitted only v3, and a v3 server proves nothing: a fake server with no
secret received the ticket's token and the decode loaded the fake's bytes.

Now a side that holds a secret never speaks v3 (client or server), `allow_previous_wire` is off
by default, and turning it on beside a secret is refused at start-up. Without a secret the window
still admits v3 when asked for (tests/unit/test_rolling_upgrade.py).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvconnectors.errors import ConfigError, FailureCause, TransferError
from kvconnectors.transport import auth, wire
from kvconnectors.transport.client import StoreClient

from sec_helpers import COMPAT, FP, LAYERS, SECRET, dest_views

TOKEN = "ticket-token-0123456789abcdefgh"
V3 = {3: wire.compat_hash("tiered", version=3)}


class V3OnlyFake:
    """A fake producer on 127.0.0.1 that holds no secret: it refuses a v4 Hello naming only v3 as
    admitted (what a not-yet-upgraded server says), accepts a v3 Hello with no challenge, and
    records every request it gets afterwards (a Read carries the ticket's token)."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.requests: list[wire.Message] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.listener.settimeout(5)
        for _ in range(2):
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                deadline = time.monotonic() + 5
                try:
                    hello = wire.recv_msg(conn, deadline)
                    if hello.version >= 4:
                        wire.send_msg(conn, wire.Welcome(ok=False, error=wire.check_hello(hello, V3)))
                        continue
                    wire.send_msg(conn, wire.Welcome(ok=True))  # no nonce: it asks for nothing, proves nothing
                    while True:
                        self.requests.append(wire.recv_msg(conn, deadline))
                except (TransferError, OSError):
                    return

    def close(self) -> None:
        self.listener.close()
        self._thread.join(timeout=10)


def test_a_secret_holder_never_falls_back_to_a_v3_server_that_proves_nothing() -> None:
    fake = V3OnlyFake()
    _, dest = dest_views()
    try:
        with pytest.raises(TransferError) as exc:
            with StoreClient("127.0.0.1", fake.port, compat=wire.compat_hashes("tiered"), secret=SECRET,
                             connect_timeout_s=3) as c:
                c.read("t", range(LAYERS), 0, dest, fingerprint=FP, deadline=time.monotonic() + 3, token=TOKEN)
    finally:
        fake.close()
    assert exc.value.cause is FailureCause.AUTH and "v3" in exc.value.detail, exc.value
    assert not fake.requests, f"the fake got {fake.requests!r}"


def test_a_server_holding_a_secret_refuses_a_v3_peer_even_with_the_window_open(make_server) -> None:
    srv = make_server(secret=SECRET, compat=wire.compat_hashes("tiered"))
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        wire.send_msg(s, wire.Hello(version=3, compat_hash=V3[3], peer="old"))
        welcome = wire.recv_msg(s, time.monotonic() + 5)
    assert isinstance(welcome, wire.Welcome) and not welcome.ok and welcome.nonce is None, welcome
    assert "v3" in welcome.error and "secret" in welcome.error, welcome.error


def test_without_a_secret_the_window_still_admits_v3_when_asked_for(make_server) -> None:
    """The positive control: a pool without a secret may still roll forward one instance at a time."""
    srv = make_server(compat=wire.compat_hashes("tiered"))
    with StoreClient("127.0.0.1", srv.port, compat=V3, connect_timeout_s=3) as c:
        assert c.version == 3 and c.status(time.monotonic() + 3).entries == 0


def test_allow_previous_wire_is_off_by_default() -> None:
    from kvconnectors.tiered.config import TieredConfig

    cfg = TieredConfig.from_extra({})
    assert cfg.allow_previous_wire is False
    assert cfg.compat == wire.compat_hash("tiered"), "the default must admit this wire version only"


def test_allow_previous_wire_beside_a_secret_is_refused_at_start_up(monkeypatch, tmp_path) -> None:
    from kvconnectors.tiered.config import TieredConfig

    monkeypatch.setenv(auth.SECRET_ENV, "x7-Kq9!vB2#mZp4$Lr8")
    with pytest.raises(ConfigError) as exc:
        TieredConfig.from_extra({"allow_previous_wire": True})
    assert "allow_previous_wire" in str(exc.value) and "True" in str(exc.value), exc.value
    monkeypatch.delenv(auth.SECRET_ENV)
    assert TieredConfig.from_extra({"allow_previous_wire": True}).compat == wire.compat_hashes("tiered")


def test_the_consumer_with_a_secret_refuses_a_v3_only_producer_naming_the_reason(make_server) -> None:
    """A real server not upgraded yet (admits v3 only) holding the same secret: still refused,
    because v3 authenticates one way only."""
    old = make_server(secret=SECRET, compat=V3)
    with pytest.raises(TransferError) as exc:
        StoreClient("127.0.0.1", old.port, compat=wire.compat_hashes("tiered"), secret=SECRET, connect_timeout_s=3)
    assert exc.value.cause is FailureCause.AUTH and "v3" in exc.value.detail, exc.value
    assert COMPAT not in exc.value.detail
