"""The store server's admission (transport/admission.py) without sockets' traffic: which connection
makes room for a newcomer at each cap, and when a newcomer is refused. The security suite floods a
real server (tests/security/test_dos.py); this pins the choices."""

from __future__ import annotations

import socket

import pytest

from kvconnectors.transport.admission import Admission, Caps, peer_key, prefix_key


@pytest.fixture
def socks():
    made: list[socket.socket] = []

    def new() -> socket.socket:
        made.append(socket.socket())
        return made[-1]

    yield new
    for s in made:
        s.close()


def admitted(adm: Admission, sock, host: str):
    seat, refused, evicted = adm.admit(sock, (host, 1234))
    assert seat is not None, refused
    return seat, evicted


def test_a_full_pending_budget_makes_room_by_closing_the_oldest_pending(socks) -> None:
    reasons: list[str] = []
    adm = Admission(Caps(max_pending=4, max_pending_per_peer=4, max_pending_per_prefix=4), on_evict=reasons.append)
    first = [socks() for _ in range(4)]
    for i, s in enumerate(first):
        admitted(adm, s, f"10.0.{i}.1")  # four prefixes: only the global pending cap binds
    newcomer = socks()
    _, evicted = admitted(adm, newcomer, "10.9.9.9")
    assert evicted == [first[0]] and reasons == ["too_many_pending"] and len(adm) == 4


def test_one_addresss_pending_connections_make_room_among_themselves(socks) -> None:
    adm = Admission(Caps(max_pending=64, max_pending_per_peer=2))
    a, b = socks(), socks()
    admitted(adm, a, "10.0.0.2")
    seat_b, _ = admitted(adm, b, "10.0.0.2")
    other, _ = admitted(adm, socks(), "10.0.0.3")  # another address is not touched
    _, evicted = admitted(adm, socks(), "10.0.0.2")
    assert evicted == [a]


def test_a_prefix_is_capped_beside_its_addresses(socks) -> None:
    reasons: list[str] = []
    adm = Admission(Caps(max_pending=64, max_pending_per_peer=8, max_pending_per_prefix=3), on_evict=reasons.append)
    first = socks()
    admitted(adm, first, "10.0.0.2")
    admitted(adm, socks(), "10.0.0.3")
    admitted(adm, socks(), "10.0.0.4")
    _, evicted = admitted(adm, socks(), "10.0.0.5")  # same /24
    assert evicted == [first] and reasons == ["too_many_per_prefix"]
    _, evicted = admitted(adm, socks(), "10.0.1.5")  # another /24: room of its own
    assert evicted == []


def test_at_max_connections_the_longest_idle_unauthenticated_session_goes_first(socks) -> None:
    adm = Admission(Caps(max_connections=3, max_pending=3))
    seats = [admitted(adm, socks(), f"10.0.{i}.1")[0] for i in range(3)]
    adm.handshake_done(seats[0], authenticated=True)    # idle longest, but authenticated
    adm.handshake_done(seats[1], authenticated=False)
    adm.handshake_done(seats[2], authenticated=False)
    assert adm.begin(seats[1])                           # serving a request: never evicted
    _, evicted = admitted(adm, socks(), "10.0.9.1")
    assert evicted == [seats[2].sock]
    assert not adm.begin(seats[2]), "an evicted seat's thread must stop"


def test_a_newcomer_is_refused_only_when_nothing_may_go(socks) -> None:
    adm = Admission(Caps(max_connections=2, max_pending=2))
    seats = [admitted(adm, socks(), f"10.0.{i}.1")[0] for i in range(2)]
    for seat in seats:
        adm.handshake_done(seat, authenticated=True)
        adm.begin(seat)
    seat, refused, evicted = adm.admit(socks(), ("10.0.9.1", 1))
    assert seat is None and refused == "too_many_connections" and evicted == []
    assert len(adm) == 2 and all(not s.evicted for s in seats)


@pytest.mark.parametrize("host, peer, prefix", [
    ("127.0.0.5", "127.0.0.5", "127.0.0.0/24"),
    ("::ffff:10.1.2.3", "10.1.2.3", "10.1.2.0/24"),
    ("2001:db8:1:2:3::4", "2001:db8:1:2::/64", "2001:db8:1::/48"),
])
def test_what_the_caps_count_by(host, peer, prefix) -> None:
    assert peer_key((host, 1)) == peer and prefix_key((host, 1)) == prefix
