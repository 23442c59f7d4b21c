"""Issue 16, findings 6 and 7 (proxy half): the P/D proxy bounds the request bodies it holds and
answers every malformed body with OpenAI-style error JSON.

- a body over --max-body-bytes is a 413, answered from its Content-Length before it is read;
- a body that does not fit in what is left of --max-inflight-body-bytes is a 503 (Retry-After),
  also unread; the budget comes back when the requests that held it are answered;
- every JSON parse error, 100k-deep nesting included, is a 400 (today's code: a text/plain 500);
- with 12 concurrent 7 MiB bodies against a proxy process whose budget takes one, the proxy's RSS
  grows by about one body's worth, not twelve (the issue measured 130 -> 1571 MiB for 6 x 60 MiB).

The proxy runs in-process against a fake upstream (aiohttp, this event loop), except for the RSS
check, which runs it as its own process so that only its memory is measured. No vLLM. Seen to fail
on the code before the fix: the 413/503 checks time out waiting for a reply the proxy never sends
while it waits for the body, the deep-JSON check gets text/plain 500, the RSS check grows by
about 240 MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time

import aiohttp
import pytest

from kvconnectors.integration import proxy as P
from proxy_kit import (MiB, InProcess, ProxyProcess, Upstream, assert_openai_error, body_of, headers_only,
                       run)

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------------------------------- 413


def test_body_over_the_limit_is_413_json_answered_before_it_is_read():
    async def go():
        async with InProcess(max_body_bytes=4 * MiB, max_inflight_body_bytes=8 * MiB) as h:
            status, headers, raw = await headers_only(h.port, 4 * MiB + 1)
            err = assert_openai_error(status, headers, raw, 413, "invalid_request_error")
            assert "--max-body-bytes" in err["message"]
            # chunked (no Content-Length): refused once the bytes received cross the limit, without
            # waiting for the rest
            status, headers, raw = await headers_only(h.port, None, chunk=4 * MiB + 1)
            assert_openai_error(status, headers, raw, 413, "invalid_request_error")
            big = body_of(4 * MiB + 100)

            async def chunks():
                step = 256 << 10
                for i in range(0, len(big), step):
                    yield big[i:i + step]
            status, headers, raw = await h.post(chunks())
            assert_openai_error(status, headers, raw, 413, "invalid_request_error")
            assert h.up.prefills == 0 and h.proxy.bodies.held == 0
            # at the limit: served
            status, _, raw = await h.post(body_of(4 * MiB))
            assert status == 200, raw[:200]
            assert h.proxy.bodies.held == 0
    run(go())


# ---------------------------------------------------------------------------------------------- 503


def test_exhausted_body_budget_is_503_json_unread_and_the_budget_comes_back():
    async def go():
        async with InProcess(max_body_bytes=2 * MiB, max_inflight_body_bytes=4 * MiB) as h:
            h.up.hold.clear()
            first = [asyncio.ensure_future(h.post(body_of(2 * MiB))) for _ in range(2)]
            deadline = time.monotonic() + 10
            while h.up.held < 2:  # both bodies read and on their prefill leg: the budget is spent
                assert time.monotonic() < deadline, "the first two requests never reached the prefill leg"
                await asyncio.sleep(0.02)
            assert h.proxy.bodies.held == 4 * MiB
            status, headers, raw = await headers_only(h.port, 1 * MiB)
            err = assert_openai_error(status, headers, raw, 503, "service_unavailable")
            assert headers["retry-after"] == "1" and "--max-inflight-body-bytes" in err["message"]
            status, headers, raw = await h.post(body_of(100))  # even a small one: nothing is left
            assert_openai_error(status, headers, raw, 503, "service_unavailable")
            assert h.up.prefills == 2
            async with h.session.get(f"http://127.0.0.1:{h.port}/metrics") as r:
                text = await r.text()
            assert "kvproxy_inflight_body_bytes 4.194304e+06" in text
            assert re.search(r'kvproxy_body_refusals_total\{reason="body_budget_exhausted"\} 2\.0', text)
            h.up.hold.set()
            for status, _, raw in await asyncio.gather(*first):
                assert status == 200, raw[:200]
            assert h.proxy.bodies.held == 0
            status, _, raw = await h.post(body_of(2 * MiB))
            assert status == 200, raw[:200]
    run(go())


def test_a_client_that_goes_away_mid_body_gives_its_share_back():
    async def go():
        async with InProcess(max_body_bytes=2 * MiB, max_inflight_body_bytes=2 * MiB) as h:
            reader, writer = await asyncio.open_connection("127.0.0.1", h.port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2097152\r\n\r\n" + b"{" * 1000)
            await writer.drain()
            deadline = time.monotonic() + 5
            while h.proxy.bodies.held == 0:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            writer.close()
            while h.proxy.bodies.held:
                assert time.monotonic() < deadline + 5, "the lease of a vanished client was never released"
                await asyncio.sleep(0.02)
            status, _, raw = await h.post(body_of(2 * MiB))
            assert status == 200, raw[:200]
    run(go())


# ---------------------------------------------------------------------------------------------- 400


BAD_JSON = {
    "deep_arrays": b"[" * 100_000 + b"]" * 100_000,
    "deep_objects": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "deep_in_a_field": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "truncated": b'{"prompt": "abc',
    "not_utf8": b'{"prompt": "\xff\xfe"}',
    "empty": b"",
    "array": b"[1, 2]",
    "trailing": b'{"a": 1} x',
}


def test_every_json_error_is_a_400_in_openai_format():
    async def go():
        async with InProcess() as h:
            for name, data in BAD_JSON.items():
                status, headers, raw = await h.post(data)
                err = assert_openai_error(status, headers, raw, 400, "invalid_request_error")
                assert "JSON" in err["message"], (name, err)
            assert h.up.prefills == 0
            status, _, raw = await h.post(body_of(1000))  # and the proxy still serves
            assert status == 200, raw[:200]
    run(go())


def test_limits_are_flags_and_inconsistent_ones_are_refused():
    cfg = P.ProxyConfig(prefill=[P.InstanceSpec("http://p:1")], decode=[P.InstanceSpec("http://d:1")],
                        max_body_bytes=8 * MiB, max_inflight_body_bytes=4 * MiB)
    with pytest.raises(ValueError, match="--max-inflight-body-bytes"):
        cfg.validate()
    parser = argparse.ArgumentParser()
    P.add_arguments(parser)
    args = parser.parse_args(["--prefill", "http://p:1", "--decode", "http://d:1", "--max-body-bytes", "8MiB",
                              "--max-inflight-body-bytes", "1g"])
    cfg = P.config_from_args(args)
    assert (cfg.max_body_bytes, cfg.max_inflight_body_bytes) == (8 * MiB, 1 << 30)
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefill", "http://p:1", "--decode", "http://d:1", "--max-body-bytes", "0"])


# ---------------------------------------------------------------------------------------------- RSS


def test_proxy_memory_stays_bounded_under_concurrent_large_bodies():
    """A proxy process with room for one 7 MiB body; 12 such bodies at once while the prefill leg
    holds the first: its RSS grows by about one body's copies (raw, decoded, prefill leg), not 12."""
    n, size = 12, 7 * MiB

    async def go():
        up = await Upstream().start()
        up.hold.clear()
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        try:
            async with ProxyProcess(up, "--max-body-bytes", "8MiB", "--max-inflight-body-bytes", "8MiB") as proxy:
                up.hold.set()
                async with session.post(proxy.url, data=body_of(1000)) as r:  # warm up: one small request
                    assert r.status == 200
                up.hold.clear()
                base = proxy.rss()
                body = body_of(size)

                async def one() -> int:
                    async with session.post(proxy.url, data=body, headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        return r.status
                tasks = [asyncio.ensure_future(one()) for _ in range(n)]
                peak, deadline = base, time.monotonic() + 20
                while time.monotonic() < deadline and sum(t.done() for t in tasks) < n - up.held:
                    peak = max(peak, proxy.rss())
                    await asyncio.sleep(0.05)
                for _ in range(10):  # a little longer: anything still growing shows
                    peak = max(peak, proxy.rss())
                    await asyncio.sleep(0.05)
                held = up.held
                up.hold.set()
                statuses = sorted(await asyncio.gather(*tasks))
                growth = (peak - base) / MiB
                print(f"proxy RSS {base / MiB:.0f} MiB -> peak {peak / MiB:.0f} MiB (+{growth:.0f}) with {n} x "
                      f"{size // MiB} MiB bodies; held at prefill {held}; statuses {statuses}")
                assert held == 1 and statuses == [200] + [503] * (n - 1), statuses
                assert growth < 64, f"proxy RSS grew by {growth:.0f} MiB"
        finally:
            up.hold.set()
            await session.close()
            await up.close()
    run(go(), timeout=50)
