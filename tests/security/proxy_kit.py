"""Shared pieces of the proxy security tests (test_proxy_limits.py, test_proxy_hardening.py): a fake
upstream, the proxy in-process or as its own process, raw client sockets (from any loopback
address), and the checks of an OpenAI-style error. Everything on 127.0.0.0/8, every wait bounded."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

import aiohttp
import psutil
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvconnectors.integration import proxy as P

MiB = 1 << 20
REPLY_S = 5.0  # a refusal must come within this, with the body never sent
ATTACKER = "127.0.0.2"  # hostile sockets come from here, the legitimate client from 127.0.0.1


def run(coro: Any, timeout: float = 40.0) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


class Upstream:
    """One fake vLLM instance for both roles: a prefill leg (do_remote_decode) waits for `hold`,
    then returns kv_transfer_params; a decode leg answers at once. With `parse=False` it never
    decodes a body (a hostile one would cost this test process what it costs a real engine): a
    prefill leg, told by its raw bytes, is answered 400 when its body is over 1 MiB."""

    def __init__(self, parse: bool = True) -> None:
        self.parse = parse
        self.hold = asyncio.Event()
        self.held = 0      # prefill legs waiting on `hold` now
        self.prefills = 0  # prefill legs that arrived
        self.server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.port}"

    async def start(self) -> "Upstream":
        app = web.Application(client_max_size=256 * MiB)
        app.router.add_get("/health", lambda r: web.Response(text=""))
        app.router.add_post("/v1/completions", self._gen)
        self.server = TestServer(app, host="127.0.0.1", port=0)
        await self.server.start_server()
        return self

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()

    async def _gen(self, request: web.Request) -> web.Response:
        if self.parse:
            body = await request.json()
            prefill = bool((body.get("kv_transfer_params") or {}).get("do_remote_decode"))
        else:
            raw = await request.read()
            prefill = b'"do_remote_decode":true' in raw
            if prefill and len(raw) > MiB:
                self.prefills += 1
                return web.json_response({"error": {"message": "prompt too long", "code": 400}}, status=400)
        if prefill:
            self.prefills += 1
            self.held += 1
            try:
                await asyncio.wait_for(self.hold.wait(), 30)
            finally:
                self.held -= 1
            return web.json_response({"choices": [{"text": "t"}], "kv_transfer_params": {"remote_host": "x"}})
        return web.json_response({"choices": [{"index": 0, "text": "ok"}]})


class InProcess:
    """The proxy on this event loop in front of one Upstream (both roles); `config` are ProxyConfig
    settings. `session` is a client from 127.0.0.1; `attacker` one from ATTACKER."""

    def __init__(self, **config: Any):
        self.config = config
        self.up = Upstream()
        self.up.hold.set()

    async def __aenter__(self) -> "InProcess":
        await self.up.start()
        cfg = P.ProxyConfig(prefill=[P.InstanceSpec(self.up.url)], decode=[P.InstanceSpec(self.up.url)],
                            health_interval=60.0, kv_both=True, **self.config)  # one fake plays both roles
        self.proxy = P.PDProxy(cfg)
        self.port = await self.proxy.start("127.0.0.1", 0)
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
        self.attacker = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20),
                                              connector=aiohttp.TCPConnector(local_addr=(ATTACKER, 0)))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.up.hold.set()
        await self.session.close()
        await self.attacker.close()
        await self.proxy.stop()
        await self.up.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def post(self, data: Any, headers: dict[str, str] | None = None,
                   session: aiohttp.ClientSession | None = None) -> tuple[int, dict[str, str], Any]:
        async with (session or self.session).post(f"{self.url}/v1/completions", data=data, headers={
                "Content-Type": "application/json", **(headers or {})}) as r:
            raw = await r.read()
            return r.status, dict(r.headers), raw


def body_of(nbytes: int) -> bytes:
    """A completions request of exactly `nbytes` bytes of JSON."""
    head, tail = b'{"model": "m", "max_tokens": 2, "prompt": "', b'"}'
    return head + b"x" * (nbytes - len(head) - len(tail)) + tail


async def open_raw(port: int, source: str = ATTACKER) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A plain TCP connection to the proxy from `source` (any 127.x address on Linux)."""
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def close_raw(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 2)
    except (asyncio.TimeoutError, OSError):
        pass


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes | None:
    """What the server sent before it closed the connection, if it closed within `seconds`; None
    if it is still open then."""
    got = b""
    deadline = time.monotonic() + seconds
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            chunk = await asyncio.wait_for(reader.read(65536), left)
            if not chunk:
                return got
            got += chunk
    except asyncio.TimeoutError:
        return None
    except (ConnectionError, OSError):
        return got


async def read_reply(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length (status, lower-cased headers, body)."""
    status_line = await asyncio.wait_for(reader.readline(), REPLY_S)
    headers: dict[str, str] = {}
    while True:
        line = (await asyncio.wait_for(reader.readline(), REPLY_S)).decode().strip()
        if not line:
            break
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), REPLY_S)
    return int(status_line.split()[1]), headers, body


async def headers_only(port: int, content_length: int | None, chunk: int = 0) -> tuple[int, dict[str, str], bytes]:
    """Send a request's headers and none of its body (or, chunked, one `chunk`-byte chunk and then
    nothing, not even the chunk's end); return the reply the proxy sends anyway (TimeoutError if it
    waits for the rest of the body instead)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        length = (f"Content-Length: {content_length}\r\n" if content_length is not None
                  else "Transfer-Encoding: chunked\r\n")
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"{length}\r\n".encode())
        if chunk:
            writer.write(b"%x\r\n" % chunk + b"x" * chunk)
        await writer.drain()
        return await read_reply(reader)
    finally:
        await close_raw(writer)


def assert_openai_error(status: int, headers: dict[str, str], raw: bytes, code: int, type_: str) -> dict:
    ctype = {k.lower(): v for k, v in headers.items()}["content-type"]
    assert status == code and ctype.startswith("application/json"), (status, ctype, raw[:200])
    err = json.loads(raw)["error"]
    assert err["code"] == code and err["type"] == type_ and err["message"], err
    return err


class ProxyProcess:
    """`python -m kvconnectors.integration.proxy` in front of `up` (both roles), as its own process so
    that its memory alone is measured (`rss()`); `args` are extra flags."""

    def __init__(self, up: Upstream, *args: str):
        self.cmd = [sys.executable, "-m", "kvconnectors.integration.proxy", "--prefill", up.url, "--decode", up.url,
                    "--kv-both", "--port", "0", "--health-interval", "60", "--log-level", "INFO", *args]
        self.proc: asyncio.subprocess.Process | None = None
        self.port: int | None = None

    async def __aenter__(self) -> "ProxyProcess":
        self.proc = await asyncio.create_subprocess_exec(*self.cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert self.proc.stderr is not None
        while self.port is None:
            line = (await asyncio.wait_for(self.proc.stderr.readline(), 20)).decode()
            assert line, "the proxy exited before listening"
            m = re.search(r"P/D proxy on http://127\.0\.0\.1:(\d+)", line)
            self.port = int(m.group(1)) if m else None
        self._drain = asyncio.ensure_future(self.proc.stderr.read())  # keep its pipe from filling
        self.ps = psutil.Process(self.proc.pid)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/completions"

    def rss(self) -> int:
        return self.ps.memory_info().rss

    async def __aexit__(self, *exc: Any) -> None:
        proc = self.proc
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        if getattr(self, "_drain", None) is not None:
            self._drain.cancel()
