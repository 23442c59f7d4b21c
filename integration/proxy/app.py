"""The P/D proxy's HTTP app (PDProxy): its routes and, per request, the prefill leg (retried on
another instance), the decode leg and the relay of its JSON or SSE stream back to the client."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import traceback
import uuid
from collections.abc import Sequence
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvconnectors.cli_types import binding

from .clients import ClientGuard
from .config import MODE_HEADER, MODES, ProxyConfig
from .errors import (ClientGone, PassThrough, ProxyError, error_body, error_response, is_connect_error, snippet,
                     upstream_failure)
from .jsonbody import Fields, LegBody, decode_body, decode_object
from .limits import RETRY_AFTER_S, BodyBudget, read_body
from .metrics import ProxyMetrics
from .pool import HealthChecker, Instance, Pool

log = logging.getLogger("kvconnectors.proxy")

REQUEST_ID_HEADER = "X-Request-Id"
# ProxyError reasons of the body limits (limits.py, jsonbody.py): counted in kvproxy_body_refusals,
# logged at debug
LIMIT_REASONS = ("body_too_large", "body_budget_exhausted", "body_timeout", "too_many_strings")
# Headers passed on to both legs (vLLM may run with --api-key).
FORWARDED_HEADERS = ("Authorization",)

# NixlConnector's request shape for "this request will be decoded elsewhere"; TieredConnector
# accepts the same keys and ignores the null ones.
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_kv_params(client: Any, forward: Sequence[str], push_target: str | None = None) -> dict[str, Any]:
    """The prefill leg's kv_transfer_params: the client's keys named in `forward` (none by default: a
    client must not steer the transfer plane unless the operator allows that key, and transfer-plane
    keys need an unlock, config.check_forwarded_keys), then ours, which always win; in push mode the
    decode's landing store to push to. Our proxy's and the Ray backend's."""
    kv = {k: client[k] for k in forward if k in client} if isinstance(client, dict) else {}
    kv.update(PREFILL_KV_PARAMS)
    if push_target is not None:
        kv.update(transfer_mode="push", push_target=push_target)
    return kv


def drop_frames(exc: BaseException) -> None:
    """Clear the locals of the frames `exc` came through. A failed leg's frames hold the request's
    bodies and a local naming the exception (`raise failure`), a cycle that only the cyclic GC frees:
    the bodies of every failed large request stayed resident until it ran (+32 MiB a request)."""
    traceback.clear_frames(exc.__traceback__)


@dataclasses.dataclass
class _Call:
    """One client request as it moves through the legs."""

    endpoint: str            # "completions" | "chat"
    path: str                # /v1/completions | /v1/chat/completions
    body: Fields             # the client's top-level fields, their values raw JSON (jsonbody.py)
    request_id: str
    mode: str
    headers: dict[str, str]
    started: float


class PDProxy:
    def __init__(self, config: ProxyConfig):
        config.validate()
        self.config = config
        self.metrics = ProxyMetrics()
        self.bodies = BodyBudget(config.max_inflight_body_bytes)
        self.metrics.body_bytes.set_function(lambda: self.bodies.held)
        self.clients = ClientGuard(max_connections=config.max_client_connections,
                                   max_requests=config.max_client_requests, header_timeout=config.header_timeout,
                                   metrics=self.metrics)
        self._metrics_token = config.metrics_token()
        self.prefill = Pool("prefill", config.prefill, self.metrics)
        self.decode = Pool("decode", config.decode, self.metrics)
        self.health = HealthChecker(self.all_instances(), interval=config.health_interval,
                                    timeout=config.health_timeout, unhealthy_after=config.unhealthy_after)
        self.app = self._build_app()
        # with --metrics-port, /metrics and /health have an app (and a listener) of their own
        self.monitor_app = self._build_monitor_app() if config.metrics_port is not None else None
        self.session: aiohttp.ClientSession | None = None
        # ClientTimeout objects are immutable: build them once, not per request.
        c = config
        self._prefill_timeout = aiohttp.ClientTimeout(total=c.prefill_timeout, sock_connect=c.connect_timeout)
        self._decode_timeout = aiohttp.ClientTimeout(total=c.decode_timeout, sock_connect=c.connect_timeout,
                                                     sock_read=c.decode_idle_timeout)
        self._models_timeout = aiohttp.ClientTimeout(total=c.connect_timeout + 10)
        self._runners: list[web.AppRunner] = []
        self._listeners: list[asyncio.AbstractServer] = []
        self._health_task: asyncio.Task[None] | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None

    # ---- lifecycle ----------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        # client_max_size: a backstop only; bodies are read by limits.read_body, which answers 413/503 as JSON
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self.clients.middleware])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        if self.config.metrics_port is None:
            self._add_monitor_routes(app)
        return app

    def _build_monitor_app(self) -> web.Application:
        app = web.Application(middlewares=[self.clients.middleware])
        self._add_monitor_routes(app)
        return app

    def _add_monitor_routes(self, app: web.Application) -> None:
        for path, handler in (("/health", self._health), ("/healthcheck", self._health), ("/metrics", self._metrics)):
            app.router.add_get(path, self._token_checked(handler))

    async def start(self, host: str = "127.0.0.1", port: int = 8000) -> int:
        """Check every instance once, then listen. Returns the bound port (useful with port=0)."""
        self.session = self._new_session()
        await self.check_health_once()
        self._health_task = asyncio.create_task(self.health.run(self.session), name="proxy-health")
        self.port = await self._listen(self.app, host, port)
        log.info("P/D proxy on http://%s:%s (mode %s); prefill %s; decode %s", host, self.port,
                 self.config.mode, [i.url for i in self.prefill.instances],
                 [i.state() for i in self.decode.instances])
        if self.monitor_app is not None:
            assert self.config.metrics_port is not None
            self.metrics_port = await self._listen(self.monitor_app, self.config.metrics_host, self.config.metrics_port)
            log.info("P/D proxy metrics and health on http://%s:%s", self.config.metrics_host, self.metrics_port)
        return self.port

    async def _listen(self, app: web.Application, host: str, port: int) -> int:
        """Serve `app` on host:port through the per-client guard (clients.py); returns the bound port."""
        # handler_cancellation: a client that disconnects cancels its handler, which closes both
        # upstream connections, which makes vLLM abort the request.
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                               keepalive_timeout=self.config.keepalive_timeout)
        await runner.setup()
        self._runners.append(runner)
        assert runner.server is not None
        with binding(host, port):  # a taken port: PortInUseError, which the CLI turns into one line
            listener = await asyncio.get_running_loop().create_server(
                self.clients.factory(runner.server), host, port, backlog=128)  # aiohttp's TCPSite backlog
        self._listeners.append(listener)
        sockets = listener.sockets or []
        return sockets[0].getsockname()[1] if sockets else port

    def _new_session(self) -> aiohttp.ClientSession:
        """Keep-alive connections to every instance (limit_per_host=0: only the total is bounded).
        No cookie jar: vLLM sets no cookies, and the jar is consulted on every request. Bodies are
        relayed as received, so ask for them uncompressed (auto_decompress is off)."""
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.config.max_connections, limit_per_host=0),
            cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
            headers={"Accept-Encoding": "identity"})

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
            self._health_task = None
        for listener in self._listeners:  # as aiohttp's TCPSite.stop: no new connections, open ones to cleanup()
            listener.close()
        self._listeners.clear()
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
        if self.session is not None:
            await self.session.close()
            self.session = None

    # ---- health -------------------------------------------------------------------------

    def all_instances(self) -> list[Instance]:
        return self.prefill.instances + self.decode.instances

    async def check_health_once(self) -> None:
        assert self.session is not None
        await self.health.check_once(self.session)

    # ---- small endpoints ----------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        ok = self.prefill.any_healthy() and self.decode.any_healthy()
        body = {"status": "ok" if ok else "unavailable", "mode": self.config.mode,
                "prefill": [i.state() for i in self.prefill.instances],
                "decode": [i.state() for i in self.decode.instances]}
        return web.json_response(body, status=200 if ok else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _token_checked(self, handler: Any) -> Any:
        """`handler` behind --metrics-token-file's bearer token, when there is one."""
        token = self._metrics_token
        if token is None:
            return handler
        expected = b"Bearer " + token

        async def checked(request: web.Request) -> web.StreamResponse:
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, expected):
                return error_response(401, "authentication_error", (
                    f"{request.path} needs 'Authorization: Bearer TOKEN' with the token of --metrics-token-file"),
                    {"WWW-Authenticate": "Bearer"})
            return await handler(request)
        return checked

    async def _models(self, request: web.Request) -> web.Response:
        assert self.session is not None
        inst = self.decode.pick()
        if inst is None:
            return self._error(503, "service_unavailable", "no healthy decode instance", "")
        try:
            async with self.session.get(inst.endpoint("/v1/models"), headers=self._forward_headers(request),
                                        timeout=self._models_timeout) as r:
                return web.Response(body=await r.read(), status=r.status,
                                    content_type=r.content_type or "application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return self._error(502, "upstream_unavailable", f"decode instance {inst.url}: {exc}", "")

    # ---- the P/D flow -------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "completions", "/v1/completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat", "/v1/chat/completions")

    def _forward_headers(self, request: web.Request) -> dict[str, str]:
        return {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}

    def _error(self, status: int, type_: str, message: str, request_id: str,
               headers: dict[str, str] | None = None) -> web.Response:
        headers = {**({REQUEST_ID_HEADER: request_id} if request_id else {}), **(headers or {})}
        return error_response(status, type_, message, headers)

    async def _handle(self, request: web.Request, endpoint: str, path: str) -> web.StreamResponse:
        started = time.monotonic()
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        status = 500
        lease = None
        try:
            # 413 / 503 before reading what the limits refuse; held until the response is sent
            data, lease = await read_body(request, self.bodies, self.config.max_body_bytes, self.config.body_timeout)
            body = decode_body(data, self.config.max_body_strings)  # its values are views of `data`
            del data
            mode = request.headers.get(MODE_HEADER, self.config.mode).strip().lower()
            if mode not in MODES:
                raise ProxyError(400, "invalid_request_error",
                                 f"header {MODE_HEADER}: {mode!r} is not one of {list(MODES)}")
            headers = {**self._forward_headers(request), REQUEST_ID_HEADER: request_id,
                       "Content-Type": "application/json"}
            call = _Call(endpoint, path, body, request_id, mode, headers, started)
            resp = await self._run(request, call)
            status = resp.status
            return resp
        except ClientGone as exc:
            drop_frames(exc)
            status = 499  # client closed the request (nginx's convention)
            log.info("request %s: client disconnected; upstream request closed", request_id)
            return exc.response
        except PassThrough as exc:
            drop_frames(exc)
            status = exc.status
            return web.Response(body=exc.body, status=exc.status, content_type=exc.content_type or "application/json",
                                headers={REQUEST_ID_HEADER: request_id})
        except ProxyError as exc:
            drop_frames(exc)
            status = exc.status
            if exc.reason in LIMIT_REASONS:  # counted by status; one line per refusal would flood the log
                self.metrics.body_refusals.labels(exc.reason).inc()
                log.debug("request %s refused: %s", request_id, exc.message)
            else:
                log.warning("request %s failed: %s", request_id, exc.message)
            retry = {"Retry-After": str(RETRY_AFTER_S)} if exc.reason == "body_budget_exhausted" else None
            resp = self._error(exc.status, exc.type, f"{exc.message} (request id {request_id})", request_id, retry)
            if exc.reason == "body_timeout" and request.transport is not None:
                # The rest of the body is not coming: answer and close now (after any other refusal,
                # aiohttp lingers up to 10 s to drain the body, so that the client reads the answer).
                await resp.prepare(request)
                await resp.write_eof()
                request.transport.close()
            return resp
        except asyncio.CancelledError:
            status = 499
            raise
        except Exception as exc:  # a bug, not the client: still OpenAI-style JSON, never aiohttp's text/plain 500
            status = 500
            log.exception("request %s: internal error", request_id)
            drop_frames(exc)
            return self._error(500, "internal_error", f"proxy internal error: {type(exc).__name__} "
                               f"(request id {request_id})", request_id)
        finally:
            if lease is not None:
                lease.release()
            m = self.metrics
            m.child(m.requests, endpoint, str(status)).inc()
            m.child(m.e2e, endpoint).observe(time.monotonic() - started)

    async def _run(self, request: web.Request, call: _Call) -> web.StreamResponse:
        if call.mode == "push":
            # The prefill instance must know where to push before it starts, so decode goes first.
            decode = self.decode.pick(need_kv=True)
            if decode is None:
                if any(i.spec.kv_addr for i in self.decode.instances):
                    raise ProxyError(503, "service_unavailable", "no healthy decode instance with a KV store "
                                     "address for push mode", "no_healthy_instance")
                raise ProxyError(400, "invalid_request_error", "push mode needs decode instances started "
                                 "with a KV store address (--decode URL,kv=HOST:PORT)")
            decode.acquire()  # hold its slot from now, so concurrent pushes spread out
            try:
                kv = await self._prefill(call, push_target=decode.spec.kv_addr)
                return await self._decode(request, call, kv, decode)
            finally:
                decode.release()
        kv = await self._prefill(call)
        decode = self.decode.pick()
        if decode is None:
            self.metrics.decode_failures.labels("no_healthy_instance").inc()
            raise ProxyError(503, "service_unavailable", "no healthy decode instance", "no_healthy_instance")
        decode.acquire()
        try:
            return await self._decode(request, call, kv, decode)
        finally:
            decode.release()

    def _prefill_body(self, call: _Call, push_target: str | None) -> dict[str, Any]:
        body: dict[str, Any] = dict(call.body)
        body["max_tokens"] = 1
        if call.endpoint == "chat":
            body["max_completion_tokens"] = 1
        body["stream"] = False
        body.pop("stream_options", None)
        body.pop("min_tokens", None)
        forward = self.config.forward_kv_params
        client_kv = decode_object(call.body.get("kv_transfer_params")) if forward else {}
        body["kv_transfer_params"] = prefill_kv_params(client_kv, forward, push_target)
        return body

    async def _prefill(self, call: _Call, push_target: str | None = None) -> dict[str, Any]:
        """Run the prefill leg, retrying retryable failures on other instances. Returns the
        kv_transfer_params for the decode leg."""
        body = LegBody(self._prefill_body(call, push_target))
        tried: set[Instance] = set()
        errors: list[str] = []
        last: ProxyError | None = None
        for attempt in range(1 + max(0, self.config.prefill_retries)):
            inst = self.prefill.pick(exclude=tried)
            if inst is None:
                break
            tried.add(inst)
            if attempt:
                self.metrics.retries.inc()
                log.info("request %s: retrying prefill on %s", call.request_id, inst.url)
            try:
                return await self._prefill_once(inst, call, body)
            except PassThrough as exc:
                self.metrics.prefill_failures.labels(exc.reason).inc()
                raise
            except ProxyError as exc:
                self.metrics.prefill_failures.labels(exc.reason).inc()
                errors.append(exc.message)
                last = exc
                if not exc.retryable:
                    raise
        if last is None:
            self.metrics.prefill_failures.labels("no_healthy_instance").inc()
            raise ProxyError(503, "service_unavailable", "no healthy prefill instance", "no_healthy_instance")
        if len(errors) > 1:
            raise ProxyError(last.status, last.type,
                             f"prefill failed on {len(errors)} instances: " + "; ".join(errors), last.reason)
        raise last

    async def _prefill_once(self, inst: Instance, call: _Call, body: LegBody) -> dict[str, Any]:
        assert self.session is not None
        cfg = self.config
        t0 = time.monotonic()
        inst.acquire()
        try:
            async with self.session.post(inst.endpoint(call.path), data=body.chunks(),
                                         headers={**call.headers, "Content-Length": str(body.size)},
                                         timeout=self._prefill_timeout) as resp:
                data = await resp.read()
                failure = upstream_failure("prefill", inst.url, resp.status, data, resp.content_type)
                if failure is not None:
                    raise failure
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            if is_connect_error(exc):
                inst.set_healthy(False, f"connect failed: {exc}")
                raise ProxyError(502, "upstream_unavailable", f"prefill instance {inst.url} unreachable: {exc}",
                                 "connect_error", retryable=True) from None
            if isinstance(exc, asyncio.TimeoutError):
                raise ProxyError(504, "upstream_timeout", f"prefill instance {inst.url} did not answer within "
                                 f"{cfg.prefill_timeout:g} s (--prefill-timeout)", "timeout") from None
            raise ProxyError(502, "upstream_error", f"prefill instance {inst.url} failed: "
                             f"{exc.__class__.__name__}: {exc}", "connection_lost", retryable=True) from None
        finally:
            inst.release()
        try:
            kv = msgspec.json.decode(data).get("kv_transfer_params")
        except (ValueError, AttributeError):
            raise ProxyError(502, "upstream_error", f"prefill instance {inst.url} returned a body that is not "
                             f"JSON: {snippet(data, 120)}", "bad_response", retryable=True) from None
        if not isinstance(kv, dict) or not kv:
            # vLLM answers normally when no connector is configured; decoding from scratch would
            # hide that the transfer never happened, so fail loudly instead.
            raise ProxyError(502, "kv_transfer_error", f"prefill instance {inst.url} returned no "
                             "kv_transfer_params: is it running with --kv-transfer-config and kv_role "
                             "kv_producer (or kv_both)? Refusing to decode without the KV transfer",
                             "missing_kv_transfer_params")
        self.metrics.prefill_latency.observe(time.monotonic() - t0)
        return kv

    async def _decode(self, request: web.Request, call: _Call, kv: dict[str, Any],
                      inst: Instance) -> web.StreamResponse:
        assert self.session is not None
        cfg = self.config
        leg = LegBody({**call.body, "kv_transfer_params": kv})
        out: web.StreamResponse | None = None
        fail = self.metrics.decode_failures
        try:
            async with self.session.post(inst.endpoint(call.path), data=leg.chunks(),
                                         headers={**call.headers, "Content-Length": str(leg.size)},
                                         timeout=self._decode_timeout) as up:
                try:
                    if up.status >= 400:  # an error body, never a stream: read it whole
                        failure = upstream_failure("decode", inst.url, up.status, await up.read(), up.content_type)
                        if failure is not None:
                            fail.labels(failure.reason).inc()
                            raise failure
                    if up.content_type != "text/event-stream":
                        data = await up.read()
                        return web.Response(body=data, status=up.status,
                                            content_type=up.content_type or "application/json",
                                            headers={REQUEST_ID_HEADER: call.request_id})
                    out = web.StreamResponse(status=up.status, headers={
                        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                        REQUEST_ID_HEADER: call.request_id})
                    await out.prepare(request)
                    await self._relay_stream(up, out, call)
                    try:
                        await out.write_eof()
                    except (ConnectionResetError, RuntimeError):
                        raise ClientGone(out) from None
                    return out
                except (asyncio.CancelledError, ClientGone):
                    # The client went away: drop the upstream connection so vLLM aborts the request.
                    fail.labels("client_disconnect").inc()
                    up.close()
                    raise
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            if is_connect_error(exc):
                inst.set_healthy(False, f"connect failed: {exc}")
                reason, status, type_ = "connect_error", 502, "upstream_unavailable"
                msg = f"decode instance {inst.url} unreachable: {exc}"
            elif isinstance(exc, asyncio.TimeoutError):
                reason, status, type_ = "timeout", 504, "upstream_timeout"
                msg = (f"decode instance {inst.url} timed out (no data for {cfg.decode_idle_timeout:g} s, "
                       f"--decode-idle-timeout, or over {cfg.decode_timeout:g} s in all, --decode-timeout)")
            else:
                reason, status, type_ = "connection_lost", 502, "upstream_error"
                msg = f"decode instance {inst.url} failed: {exc.__class__.__name__}: {exc}"
            fail.labels(reason).inc()
            if out is None:
                raise ProxyError(status, type_, msg, reason) from None
            # Headers are gone already: end the stream with an error event, as vLLM does.
            log.warning("request %s: decode stream broken: %s", call.request_id, msg)
            event = error_body(status, type_, f"{msg} (request id {call.request_id})")
            try:
                await out.write(f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())
                await out.write_eof()
            except (ConnectionResetError, RuntimeError):
                pass
            return out

    async def _relay_stream(self, up: aiohttp.ClientResponse, out: web.StreamResponse, call: _Call) -> None:
        """Forward bytes as they come; time SSE events for TTFT and inter-token latency."""
        buf = b""
        last: float | None = None
        m = self.metrics
        ttft, itl = m.child(m.ttft, call.endpoint), m.child(m.itl, call.endpoint)
        async for chunk in up.content.iter_any():
            try:
                await out.write(chunk)
            except (ConnectionResetError, RuntimeError):  # RuntimeError: transport already closed
                raise ClientGone(out) from None
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if not event.startswith(b"data:") or event.strip() == b"data: [DONE]":
                    continue
                now = time.monotonic()
                if last is None:
                    ttft.observe(now - call.started)
                else:
                    itl.observe(now - last)
                last = now
