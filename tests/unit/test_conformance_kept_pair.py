"""engine_runs.KeptPair: a live server pair is reused only for the same configuration and never
outlives a request for another one (so at most two engines run at once)."""

from __future__ import annotations

from kvconnectors.conformance.engine_runs import KeptPair


class FakeServer:
    def __init__(self, name: str) -> None:
        self.name, self.running = name, True

    def is_running(self) -> bool:
        return self.running

    def stop(self) -> None:
        self.running = False


def starter(log: list[str], tag: str):
    def start() -> list[FakeServer]:
        log.append(tag)
        return [FakeServer(f"{tag}-p"), FakeServer(f"{tag}-d")]
    return start


def test_same_configuration_reuses_the_pair_another_stops_it_first() -> None:
    kept, started = KeptPair(), []
    a = kept.get(("nixl", "fail"), starter(started, "a"))
    assert kept.get(("nixl", "fail"), starter(started, "a2")) is a and started == ["a"]
    b = kept.get(("nixl", "recompute"), starter(started, "b"))
    assert started == ["a", "b"] and not any(s.running for s in a) and all(s.running for s in b)
    kept.close()
    assert not any(s.running for s in b) and kept.key is None and not kept.servers


def test_a_dead_server_is_not_handed_out_again() -> None:
    kept, started = KeptPair(), []
    a = kept.get("k", starter(started, "a"))
    a[1].running = False  # the decode died during a test
    again = kept.get("k", starter(started, "a2"))
    assert started == ["a", "a2"] and again is not a and not a[0].running
