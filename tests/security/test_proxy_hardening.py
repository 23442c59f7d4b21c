"""Issue 34, item 3: the P/D proxy under slow and hostile clients (an attacker's re-test of the
proxy after issue 16's body limits). One test per finding:

1. idle sockets that declare 64 MiB bodies and send none must not take the body budget from
   legitimate requests (it was charged on the declared Content-Length: 7/7 legitimate requests 503);
2. unfinished request heads are closed after --header-timeout, and 300 of them from one address
   (--max-client-connections) do not stop a legitimate client;
3. a stalled body is answered 408 and closed after --body-timeout; an idle keep-alive connection is
   closed after --keepalive-timeout, not after the header timeout;
4. per-client caps: connections over --max-client-connections are closed at once, requests over
   --max-client-requests answered 429;
5. JSON amplification: 16 MiB bodies of `[{},{},...]` (and the same nested in a field, and a body of
   a million top-level fields) grow the proxy's RSS by at most 4 x --max-inflight-body-bytes;
6. /metrics and /health on their own bind (--metrics-port), or behind a bearer token
   (--metrics-token-file);
7. --forward-kv-params refuses transfer-plane keys (push_target, transfer_mode, kvc*) unless
   --unlock-transfer-keys; the Ray backend's forwarded keys the same.

The proxy runs in-process against a fake upstream on 127.0.0.1, hostile sockets come from
127.0.0.2, except for the memory check, which runs the proxy as its own process. No vLLM.

Seen to fail on the code before the fix (each test marked xfail(strict) and run with --runxfail):
1 got [503] * 7; 5 grew the proxy's RSS by 1295 MiB (57 -> 1352); 7 "DID NOT RAISE" for each key;
2, 3, 4 and 6 stopped at their settings ("Unexpected keyword argument 'header_timeout'", 'body_timeout',
'keepalive_timeout', 'max_client_connections', 'metrics_port', 'metrics_token_file'), and the same
scenarios run against that code with its defaults showed the behaviour: after 5 s, 300/300 half-sent
heads from one address still open, a half request line still open, a stalled body still open and
unanswered, /metrics answered 200 on the main port without a token.
"""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import pytest

from kvconnectors.errors import ConfigError
from kvconnectors.integration import proxy as P
from proxy_kit import (ATTACKER, MiB, InProcess, ProxyProcess, Upstream, assert_openai_error, body_of, close_raw,
                       closed_within, open_raw, read_reply, run)

pytestmark = pytest.mark.timeout(60)

SLACK_S = 2.0  # a timeout fires within this after its due time on a busy 2-core machine
GET_HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


def reply_of(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Parse one HTTP response that arrived whole before its connection closed."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


async def metrics_text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url) as r:
        assert r.status == 200
        return await r.text()


# ------------------------------------------------------------------------------ 1. declared lengths


def test_idle_sockets_declaring_large_bodies_do_not_starve_legitimate_requests():
    """Four sockets declare 64 MiB bodies (the whole 256 MiB budget) and send no byte of them.
    Before the fix the budget was charged on the declared length: every legitimate request was a
    503 for as long as they stayed. Now only bytes that arrive are held."""
    async def go():
        async with InProcess(max_body_bytes=64 * MiB, max_inflight_body_bytes=256 * MiB) as h:
            idle = []
            try:
                for _ in range(4):
                    reader, writer = await open_raw(h.port)
                    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n" % (64 * MiB))
                    await writer.drain()
                    idle.append((reader, writer))
                await asyncio.sleep(0.5)  # their heads parsed, their handlers waiting for the bodies
                statuses = [(await h.post(body_of(1000)))[0] for _ in range(7)]
                assert statuses == [200] * 7, f"refused while 4 bodies were only declared: {statuses}"
                assert h.proxy.bodies.held == 0
                # the bytes that do arrive are held against the budget
                idle[0][1].write(b'{"prompt": "' + b"x" * MiB)
                await idle[0][1].drain()
                deadline = time.monotonic() + 5
                while h.proxy.bodies.held < MiB:
                    assert time.monotonic() < deadline, f"only {h.proxy.bodies.held} bytes held"
                    await asyncio.sleep(0.02)
            finally:
                for _, writer in idle:
                    await close_raw(writer)
            deadline = time.monotonic() + 5
            while h.proxy.bodies.held:  # the vanished bodies give their share back
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
    run(go())


# ------------------------------------------------------------------------------ 2. unfinished heads


def test_unfinished_request_heads_are_closed_after_the_header_timeout(many_files):
    header_s, cap, n = 1.0, 32, 300

    async def go():
        async with InProcess(header_timeout=header_s, max_client_connections=cap) as h:
            started = time.monotonic()
            half, h_writer = await open_raw(h.port)
            h_writer.write(b"POST /v1/compl")  # half a request line, then nothing
            silent, s_writer = await open_raw(h.port)  # nothing at all
            try:
                for reader in (half, silent):
                    assert await closed_within(reader, header_s + SLACK_S) is not None, \
                        "an unfinished request head was still open after the header timeout"
                elapsed = time.monotonic() - started
                assert 0.8 * header_s <= elapsed <= header_s + SLACK_S, elapsed
            finally:
                await close_raw(h_writer)
                await close_raw(s_writer)

            socks = []
            started_all = time.monotonic()
            try:
                for _ in range(n):
                    reader, writer = await open_raw(h.port)
                    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never the blank line
                    socks.append((reader, writer))
                opened = time.monotonic()
                all_at_once = opened - started_all < 0.8 * header_s  # else the first ones timed out already
                assert h.proxy.clients.connections[ATTACKER] <= cap
                status, _, raw = await h.post(body_of(1000))  # another address is served meanwhile
                assert status == 200, raw[:200]
                closed = await asyncio.gather(*(closed_within(r, header_s + SLACK_S) for r, _ in socks))
                assert all(c is not None for c in closed), f"{sum(c is None for c in closed)} heads still open"
                assert time.monotonic() - opened <= header_s + SLACK_S + 0.5
            finally:
                for _, writer in socks:
                    await close_raw(writer)
            text = await metrics_text(h.session, h.url + "/metrics")
            refused = int(float(re.search(r'kvproxy_client_refusals_total\{reason="client_connections"\} (\S+)',
                                          text).group(1)))
            assert refused == n - cap if all_at_once else 0 < refused <= n - cap, (refused, all_at_once)
            timed_out = re.search(r'kvproxy_client_refusals_total\{reason="header_timeout"\} (\S+)', text)
            assert timed_out and float(timed_out.group(1)) >= 2 + cap, text
    run(go())


# ------------------------------------------------------------------------------ 3. stalled bodies


def test_a_stalled_body_is_answered_408_and_closed_after_the_body_timeout():
    body_s = 1.0

    async def go():
        async with InProcess(body_timeout=body_s) as h:
            for length in (b"Content-Length: 1000\r\n", b"Transfer-Encoding: chunked\r\n"):
                reader, writer = await open_raw(h.port)
                try:
                    start = b'{"prompt": "'
                    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 + length + b"\r\n" + (start if b"Content-Length" in length
                                                       else b"%x\r\n" % 100 + start))
                    await writer.drain()
                    started = time.monotonic()
                    got = await closed_within(reader, body_s + SLACK_S)
                    elapsed = time.monotonic() - started
                    assert got is not None, "a stalled body's connection was still open after the body timeout"
                    status, headers, raw = reply_of(got)
                    err = assert_openai_error(status, headers, raw, 408, "invalid_request_error")
                    assert "--body-timeout" in err["message"], err
                    assert 0.8 * body_s <= elapsed <= body_s + SLACK_S, elapsed
                finally:
                    await close_raw(writer)
            assert h.proxy.bodies.held == 0 and h.up.prefills == 0
            status, _, raw = await h.post(body_of(1000))
            assert status == 200, raw[:200]
            assert 'reason="body_timeout"} 2.0' in await metrics_text(h.session, h.url + "/metrics")
    run(go())


def test_an_idle_keep_alive_connection_lasts_the_keepalive_timeout_not_the_header_timeout():
    header_s, keepalive_s = 1.0, 2.5

    async def go():
        async with InProcess(header_timeout=header_s, keepalive_timeout=keepalive_s) as h:
            reader, writer = await open_raw(h.port, "127.0.0.1")
            try:
                writer.write(GET_HEALTH)
                assert (await read_reply(reader))[0] == 200
                await asyncio.sleep(header_s + 0.5)  # idle past the header timeout: still open
                writer.write(GET_HEALTH)
                assert (await read_reply(reader))[0] == 200
                idle_from = time.monotonic()
                assert await closed_within(reader, keepalive_s + SLACK_S) is not None, \
                    "an idle keep-alive connection was still open after the keep-alive timeout"
                assert time.monotonic() - idle_from >= 0.8 * keepalive_s
            finally:
                await close_raw(writer)
    run(go())


# ------------------------------------------------------------------------------ 4. per-client caps


def test_per_client_connection_and_request_caps():
    async def go():
        async with InProcess(max_client_connections=4, max_client_requests=2) as h:
            held = [await open_raw(h.port) for _ in range(4)]
            try:
                reader, writer = await open_raw(h.port)
                started = time.monotonic()
                assert await closed_within(reader, 1.0) == b"", "a connection over the per-client cap stayed open"
                assert time.monotonic() - started < 0.5
                await close_raw(writer)
                for r, _ in held:
                    assert await closed_within(r, 0.05) is None  # the ones within the cap are open
                status, _, raw = await h.post(body_of(1000))  # another address: not capped
                assert status == 200, raw[:200]
                await close_raw(held.pop()[1])
                deadline = time.monotonic() + 5
                while h.proxy.clients.connections[ATTACKER] > 3:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
                reader, writer = await open_raw(h.port)  # room again
                held.append((reader, writer))
                writer.write(GET_HEALTH)
                assert (await read_reply(reader))[0] == 200
            finally:
                for _, writer in held:
                    await close_raw(writer)

            h.up.hold.clear()
            first = [asyncio.ensure_future(h.post(body_of(1000))) for _ in range(2)]
            deadline = time.monotonic() + 10
            while h.up.held < 2:
                assert time.monotonic() < deadline, "the first two requests never reached the prefill leg"
                await asyncio.sleep(0.02)
            status, headers, raw = await h.post(body_of(1000))
            err = assert_openai_error(status, headers, raw, 429, "rate_limit_exceeded")
            assert "--max-client-requests" in err["message"] and headers["Retry-After"] == "1", (err, headers)
            async with h.attacker.get(h.url + "/health") as r:  # another client is not affected
                assert r.status == 200
            h.up.hold.set()
            assert [s for s, _, _ in await asyncio.gather(*first)] == [200, 200]
            status, _, raw = await h.post(body_of(1000))
            assert status == 200, raw[:200]
            text = await metrics_text(h.session, h.url + "/metrics")
            assert 'kvproxy_client_refusals_total{reason="client_connections"} 1.0' in text
            assert 'kvproxy_client_refusals_total{reason="client_requests"} 1.0' in text
    run(go())


# ------------------------------------------------------------------------------ 5. JSON amplification


def amplifying_bodies(size: int) -> dict[str, bytes]:
    """Three bodies of about `size` bytes whose decoded JSON is many times their size."""
    n = size // 3 - 16
    fields = b",".join(b'"%x":0' % i for i in range(size // 10))
    return {"containers": b"[" + b"{}," * n + b"{}]",
            "nested": b'{"model": "m", "prompt": [' + b"{}," * n + b"{}]}",
            "fields": b"{" + fields[:size - 64].rpartition(b",")[0] + b"}"}


def test_json_amplification_is_bounded():
    """Bodies of 16 MiB whose decoded form is 10-25 times that, three of each at once, against a
    proxy process with a 32 MiB in-flight budget: its RSS grows by at most 4 x 32 MiB. (Before the
    fix, each `[{},{},...]` body decoded to ~400 MiB of Python objects.)"""
    inflight = 32 * MiB
    bodies = amplifying_bodies(16 * MiB - 4096)

    async def go():
        up = await Upstream(parse=False).start()
        up.hold.set()
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        try:
            limits = ("--max-body-bytes", "16MiB", "--max-inflight-body-bytes", str(inflight))
            async with ProxyProcess(up, *limits) as proxy:
                async with session.post(proxy.url, data=body_of(1000)) as r:  # warm up: one small request
                    assert r.status == 200
                base = peak = proxy.rss()

                async def one(body: bytes) -> int:
                    async with session.post(proxy.url, data=body, headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        return r.status
                statuses: dict[str, list[int]] = {}
                for kind, body in bodies.items():
                    tasks = [asyncio.ensure_future(one(body)) for _ in range(3)]
                    while not all(t.done() for t in tasks):
                        peak = max(peak, proxy.rss())
                        await asyncio.sleep(0.02)
                    statuses[kind] = sorted(t.result() for t in tasks)
                for _ in range(10):  # a little longer: anything still growing shows
                    peak = max(peak, proxy.rss())
                    await asyncio.sleep(0.05)
                growth = peak - base
                print(f"proxy RSS {base / MiB:.0f} MiB -> peak {peak / MiB:.0f} MiB (+{growth / MiB:.0f}); "
                      f"statuses {statuses}")
                assert growth <= 4 * inflight, f"proxy RSS grew by {growth / MiB:.0f} MiB"
                for kind, got in statuses.items():  # each kind was read whole at least once, then refused
                    assert set(got) <= {400, 413, 503} and set(got) - {503}, (kind, got)
        finally:
            await session.close()
            await up.close()
    run(go(), timeout=50)


# ------------------------------------------------------------------------------ 6. monitoring endpoints


def test_metrics_and_health_on_their_own_bind():
    async def go():
        async with InProcess(metrics_port=0) as h:
            monitor = f"http://127.0.0.1:{h.proxy.metrics_port}"
            assert h.proxy.metrics_port not in (None, 0, h.port)
            for path in ("/metrics", "/health", "/healthcheck"):
                async with h.session.get(h.url + path) as r:
                    assert r.status == 404, (path, r.status)
            status, _, raw = await h.post(body_of(1000))
            assert status == 200, raw[:200]
            assert "kvproxy_requests_total" in await metrics_text(h.session, monitor + "/metrics")
            async with h.session.get(monitor + "/health") as r:
                assert r.status == 200 and (await r.json())["status"] == "ok"
            async with h.session.post(monitor + "/v1/completions", data=body_of(1000)) as r:
                assert r.status in (404, 405)  # the monitoring bind serves monitoring only
    run(go())


def test_metrics_and_health_behind_a_token(tmp_path):
    token = "s3cret-metrics-token"
    path = tmp_path / "token"
    path.write_text(token + "\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match="--metrics-token-file .*readable by every user"):
        P.ProxyConfig(prefill=[P.InstanceSpec("http://127.0.0.1:1")], decode=[P.InstanceSpec("http://127.0.0.1:2")],
                      metrics_token_file=str(path)).validate()  # the shared secret file's checks
    path.chmod(0o600)

    async def go():
        async with InProcess(metrics_token_file=str(path)) as h:
            for route in ("/metrics", "/health"):
                for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
                    async with h.session.get(h.url + route, headers=auth) as r:
                        raw = await r.read()
                        err = assert_openai_error(r.status, dict(r.headers), raw, 401, "authentication_error")
                        assert "--metrics-token-file" in err["message"] and r.headers["WWW-Authenticate"] == "Bearer"
                async with h.session.get(h.url + route, headers={"Authorization": f"Bearer {token}"}) as r:
                    assert r.status == 200, route
            status, _, raw = await h.post(body_of(1000))  # the API itself needs no token
            assert status == 200, raw[:200]
    run(go())
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for bad in (empty, tmp_path / "missing"):
        cfg = P.ProxyConfig(prefill=[P.InstanceSpec("http://p:1")], decode=[P.InstanceSpec("http://d:1")],
                            metrics_token_file=str(bad))
        with pytest.raises(ValueError, match="--metrics-token-file"):
            cfg.validate()


# ------------------------------------------------------------------------------ 7. transfer-plane keys


@pytest.mark.parametrize("key", ["push_target", "transfer_mode", "kvc_fault", "kvc"])
def test_transfer_plane_keys_are_refused_unless_unlocked(key, capsys):
    specs = {"prefill": [P.InstanceSpec("http://127.0.0.1:1")], "decode": [P.InstanceSpec("http://127.0.0.1:2")]}
    with pytest.raises(ValueError) as refused:
        P.ProxyConfig(**specs, forward_kv_params=("priority_hint", key)).validate()
    message = str(refused.value)
    assert "--forward-kv-params" in message and repr(key) in message and "--unlock-transfer-keys" in message, message
    P.ProxyConfig(**specs, forward_kv_params=("priority_hint", key), unlock_transfer_keys=True).validate()
    P.ProxyConfig(**specs, forward_kv_params=("priority_hint",)).validate()  # other keys pass as before
    rc = P.main(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--port", "0",
                 "--forward-kv-params", key])
    err = capsys.readouterr().err
    assert rc == 2 and "--forward-kv-params" in err and repr(key) in err, err

    backend = pytest.importorskip("kvconnectors.integration.ray.backend")
    with pytest.raises(ConfigError) as refused:
        backend.forwarded_keys({backend.FORWARD_KV_PARAMS: [key]})
    message = str(refused.value)
    assert backend.FORWARD_KV_PARAMS in message and repr(key) in message, message
    assert backend.UNLOCK_TRANSFER_KEYS in message, message
    assert backend.forwarded_keys({backend.FORWARD_KV_PARAMS: [key], backend.UNLOCK_TRANSFER_KEYS: True}) == (key,)
    assert backend.forwarded_keys({backend.FORWARD_KV_PARAMS: ["priority_hint"]}) == ("priority_hint",)


def test_per_client_caps_count_an_ipv6_client_by_its_64() -> None:
    """Review follow-up: a host holds a whole IPv6 /64; counted by address, it would have endless
    fresh ones to get past the per-client caps. Counted as the store server counts."""
    from kvconnectors.integration.proxy.clients import client_address

    assert client_address(("2001:db8:1:2::5", 1, 0, 0)) == client_address(("2001:db8:1:2:ffff::9", 2, 0, 0))
    assert client_address(("2001:db8:1:3::5", 1, 0, 0)) != client_address(("2001:db8:1:2::5", 1, 0, 0))
    assert client_address(("::ffff:10.1.2.3", 1, 0, 0)) == client_address(("10.1.2.3", 5)) == "10.1.2.3"
    assert client_address(None) == ""
