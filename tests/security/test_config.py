"""Finding 9 (configuration) and finding 2 (tickets and push_target accept any host).

Seen to fail on f51b62c: `bind_host: 0.0.0.0` without a secret was accepted silently; a
world-readable secret_file was accepted; there is no allowed_peers (no kvconnectors.transport.peers,
and the worker connected to whatever host a ticket named).
"""

from __future__ import annotations

import logging
import socket
from types import SimpleNamespace

import pytest

from kvconnectors.errors import ConfigError, FailureCause, TransferError
from kvconnectors.tiered.config import TieredConfig
from kvconnectors.tiered.links import PeerLinks
from kvconnectors.transport.auth import SECRET_ENV, load_secret
from kvconnectors.transport.paths import TCP_PUSH

from sec_helpers import SECRET


@pytest.fixture(autouse=True)
def no_env_secret(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::"])
def test_a_wildcard_bind_without_a_secret_is_refused_unless_allow_insecure(wildcard, tmp_path, monkeypatch,
                                                                          caplog) -> None:
    base = {"bind_host": wildcard, "advertise_host": "10.1.2.3"}
    with pytest.raises(ConfigError) as exc:
        TieredConfig.from_extra(base)
    assert exc.value.key == "bind_host" and "allow_insecure" in str(exc.value) and "secret" in str(exc.value)
    with caplog.at_level(logging.WARNING):
        assert TieredConfig.from_extra({**base, "allow_insecure": True}).bind_host == wildcard
    assert "without a shared secret" in caplog.text
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    assert TieredConfig.from_extra({**base, "secret_file": str(secret)}).bind_host == wildcard
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    assert TieredConfig.from_extra(base).bind_host == wildcard
    assert TieredConfig.from_extra({"bind_host": "127.0.0.1"}).allow_insecure is False


@pytest.mark.parametrize("mode, outcome", [(0o644, "refused"), (0o604, "refused"), (0o640, "warned"),
                                           (0o440, "warned"), (0o600, "quiet"), (0o400, "quiet")])
def test_secret_file_permissions(tmp_path, caplog, mode, outcome) -> None:
    path = tmp_path / f"secret-{mode:o}"
    path.write_bytes(SECRET)
    path.chmod(mode)
    caplog.set_level(logging.WARNING)
    if outcome == "refused":
        with pytest.raises(ConfigError) as exc:
            load_secret(str(path))
        assert exc.value.key == "secret_file" and f"{mode:04o}" in str(exc.value) and "chmod 600" in str(exc.value)
        return
    assert load_secret(str(path)) == SECRET
    warned = [r for r in caplog.records if "readable by its group" in r.getMessage()]
    assert bool(warned) == (outcome == "warned"), caplog.text


def test_allowed_peers_is_validated_and_documented() -> None:
    with pytest.raises(ConfigError) as exc:
        TieredConfig.from_extra({"allowed_peers": ["10.0.0.0/33"]})
    assert exc.value.key == "allowed_peers"
    assert TieredConfig.from_extra({"allowed_peers": ["10.0.0.0/8", "fd00::/64"]}).allowed_peers == ["10.0.0.0/8",
                                                                                                     "fd00::/64"]
    from kvconnectors.transport.peers import PeerPolicy

    own = PeerPolicy.from_setting(["10.0.0.0/8"], ("192.168.5.5", "0.0.0.0", "store.example"))
    assert own.allows_ip("10.2.3.4") and own.allows_ip("192.168.5.5")  # its own address, always
    assert not own.allows_ip("192.168.5.6") and not own.allows_ip("127.0.0.1") and not own.allows_ip("0.0.0.0")


def test_the_default_allows_loopback_and_own_subnets_only() -> None:
    from kvconnectors.transport.peers import PeerPolicy, interface_networks

    policy = PeerPolicy.from_setting(None, ["127.0.0.1"])
    assert policy.check("127.0.0.1", 1, "x") == "127.0.0.1" and policy.allows_ip("::1")
    assert policy.check("localhost", 1, "x") in ("127.0.0.1", "::1")  # a name: resolved, the IP is returned
    for net in interface_networks():
        assert policy.allows_ip(str(net.network_address))
    with pytest.raises(TransferError) as exc:
        policy.check("203.0.113.9", 7000, "kv_transfer_params.kvc.addrs[0]")  # TEST-NET-3, on no interface here
    assert exc.value.cause is FailureCause.BAD_PARAMS
    assert "kv_transfer_params.kvc.addrs[0]='203.0.113.9'" in exc.value.detail and "allowed_peers" in exc.value.detail


def _links(allowed: list[str] | None) -> PeerLinks:
    """The worker's connections to peers, whose own address (10.0.0.9) is always allowed."""
    from kvconnectors.transport.peers import PeerPolicy

    config = TieredConfig.from_extra({"allowed_peers": allowed} if allowed is not None else {})
    links = PeerLinks(config, "e", None)
    links.peers = PeerPolicy.from_setting(config.allowed_peers, ("10.0.0.9",))
    return links


def test_a_ticket_naming_a_host_outside_allowed_peers_is_refused_before_any_connection() -> None:
    from kvconnectors.tiered import params as kvparams

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.3)
    try:
        port = listener.getsockname()[1]
        ticket = kvparams.TransferParams(v=3, transfer_id="t", addrs=[kvparams.PeerAddress("127.0.0.1", port)],
                                         num_tokens=1, num_blocks=1, block_size=16, fingerprint="f",
                                         prompt_hash="h", lease_ttl_s=1, issued_at=0, token=kvparams.new_token())
        with pytest.raises(TransferError) as exc:
            _links(["10.0.0.0/8"]).producer(ticket, 0)
        assert exc.value.cause is FailureCause.BAD_PARAMS
        assert "kv_transfer_params.kvc.addrs[0]='127.0.0.1'" in exc.value.detail, exc.value
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing connected
    finally:
        listener.close()


def test_a_push_target_outside_allowed_peers_is_refused_naming_field_and_value(caplog) -> None:
    """Checked before anything connects (not even the ask for the decode's TP size); the transfer is
    staged for a pull, the refusal logged and counted. An allowed target is asked, then pushed to."""
    from kvconnectors.tiered.pushes import ConsumerSizes, PushBook
    from kvconnectors.tiered.results import LoadResults

    links, results = _links(["10.0.0.0/8"]), LoadResults()
    layout = SimpleNamespace(tp_rank=1, tp_size=2, rows_fingerprint="f", num_layers=1)
    book = PushBook(None, layout, None, links.config, links, TCP_PUSH, results.record, on_lost=lambda tid, e: None)
    asked: list[tuple[str, int]] = []
    book._sizes = ConsumerSizes(lambda host, port: asked.append((host, port)) or 2, 2)
    try:
        book.start("t1", "192.168.77.1:7000")
        assert asked == [] and book.routes("t1") == []
        assert results.totals.data["failures"] == {"push_bad_params": 1}
        assert "kv_transfer_params.push_target='192.168.77.1'" in caplog.text, caplog.text
        book.start("t2", "10.9.8.7:7000")
        assert asked == [("10.9.8.7", 7000)]
        assert [r.target for r in book.routes("t2")] == [("10.9.8.7", 7001)]  # rank r: port + r
    finally:
        book.close()


def test_the_scheduler_stages_a_disallowed_push_target_for_a_pull(caplog) -> None:
    from kvconnectors.tiered.scheduler import TieredConnectorScheduler
    from kvconnectors.transport.peers import PeerPolicy

    s = TieredConnectorScheduler.__new__(TieredConnectorScheduler)
    s.config = TieredConfig.from_extra({"allowed_peers": ["10.0.0.0/8"], "transfer_mode": "push"})
    s._peers = PeerPolicy.from_setting(s.config.allowed_peers)
    s._warned_push = False
    with caplog.at_level(logging.WARNING):
        assert s._push_target({"push_target": "192.168.77.1:7000"}) == ""
        assert s._push_target({"push_target": "10.0.0.5:7000"}) == "10.0.0.5:7000"
    assert "allowed_peers" in caplog.text
