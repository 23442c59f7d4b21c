"""The prefill/decode proxy: one OpenAI endpoint in front of pools of vLLM prefill and decode servers.

Per request (pull mode, the flow of vLLM's toy proxy and NixlConnector):
  1. prefill leg: the client's body with max_tokens=1, stream=false and
     kv_transfer_params={"do_remote_decode": true, ...} goes to the least-loaded healthy prefill
     instance; a connection error or 5xx is retried on another prefill instance;
  2. the prefill response's `kv_transfer_params` (where the KV is and how to get it) is put on the
     client's original body, which goes to the least-loaded healthy decode instance;
  3. the decode response (JSON or SSE stream) goes back to the client.
Push mode (`--mode push`, or header `X-KV-Transfer-Mode: push`) picks the decode instance first and
tells the prefill instance where to push: `transfer_mode: "push", push_target: "<decode KV store>"`.

Every wait is bounded (per-leg timeouts), every failure reaches the client as OpenAI-style error JSON
(`{"error": {"message", "type", "code"}}`, code = HTTP status), a client that goes away closes both
upstream requests (vLLM then aborts them), and a health loop takes dead instances out and puts
recovered ones back. Prometheus metrics at /metrics.

Run: `kvconnectors proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200` or
`python -m kvconnectors.integration.proxy ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import logging
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

import aiohttp
import msgspec
from aiohttp import web
from msgspec import Meta
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from yarl import URL

from kvconnectors import settings
from kvconnectors.cli_types import (LOG_LEVELS, MAX_PORT, HelpFormatter, PortInUseError, binding, log_level,
                                    non_negative_int, pipe_safe, port_or_zero, positive_float, positive_int)
from kvconnectors.cli_types import port as parse_port
# why a decode's KV load failed, as TieredConnector reports it (kvconnectors/errors.py imports no vLLM)
from kvconnectors.errors import CLIENT_ERROR_CAUSE_FIELD, FailureCause

log = logging.getLogger("kvconnectors.proxy")

REQUEST_ID_HEADER = "X-Request-Id"
MODE_HEADER = "X-KV-Transfer-Mode"
Mode = Literal["pull", "push"]
MODES: tuple[str, ...] = get_args(Mode)
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


# --------------------------------------------------------------------------------------------
# configuration


@dataclasses.dataclass(frozen=True)
class InstanceSpec:
    url: str                      # http://host:port, no trailing slash
    kv_addr: str | None = None    # host:port of the instance's KV store (decode, push mode)


Seconds = Annotated[float, Meta(gt=0)]


def _flag(help: str, *, ge: int | None = None, le: int | None = None, **extra: Any) -> Meta:
    """A setting's range, help text and how its flag reads (`extra`: the keys of kvconnectors/settings.py)."""
    return Meta(ge=ge, le=le, description=help, extra=extra)


def _format_decode(spec: InstanceSpec) -> str:
    return spec.url + (f",kv={spec.kv_addr}" if spec.kv_addr else "")


class ProxyConfig(msgspec.Struct, kw_only=True):
    """Every proxy setting, declared once: type and range, default, and the help of its flag
    (`add_arguments` derives the command line from these fields)."""
    prefill: Annotated[list[InstanceSpec], _flag(
        "a prefill (kv_producer) instance, e.g. http://127.0.0.1:8100; repeat for more",
        parse=parse_prefill, format=lambda s: s.url, repeat=True, metavar="URL")]
    decode: Annotated[list[InstanceSpec], _flag(
        "a decode (kv_consumer) instance; kv= is the address of its KV store, needed for push mode; "
        "repeat for more", parse=parse_decode, format=_format_decode, repeat=True,
        metavar="URL[,kv=HOST:PORT]")]
    host: Annotated[str, _flag("address to listen on (0.0.0.0 for all)")] = "127.0.0.1"
    port: Annotated[int, _flag("port to listen on; 0 picks a free one (the log says which)", ge=0, le=MAX_PORT,
                               parse=port_or_zero)] = 8000
    mode: Annotated[Mode, _flag(
        "pull: decode fetches the KV after prefill; push: prefill pushes it to the chosen decode instance "
        f"while it computes. Per request: header {MODE_HEADER}")] = "pull"
    connect_timeout: Annotated[Seconds, _flag("seconds to open a connection to an instance",
                                              parse=positive_float)] = 5.0
    prefill_timeout: Annotated[Seconds, _flag("seconds for a whole prefill leg (per attempt)",
                                              parse=positive_float)] = 300.0
    decode_timeout: Annotated[Seconds, _flag("seconds for a whole decode leg, streaming included",
                                             parse=positive_float)] = 3600.0
    decode_idle_timeout: Annotated[Seconds, _flag("seconds without any byte from the decode instance before "
                                                  "giving up", parse=positive_float)] = 120.0
    prefill_retries: Annotated[int, _flag("extra prefill attempts, each on another instance, after a connection "
                                          "error or 5xx", ge=0, parse=non_negative_int)] = 2
    health_interval: Annotated[Seconds, _flag("seconds between GET /health rounds over all instances",
                                              parse=positive_float)] = 5.0
    health_timeout: Annotated[Seconds, _flag("seconds for one /health probe", parse=positive_float)] = 2.0
    unhealthy_after: Annotated[int, _flag("failed /health probes in a row before an instance leaves rotation (a "
                                          "refused connection during a request takes it out at once)",
                                          ge=1, parse=positive_int)] = 2
    max_connections: Annotated[int, _flag("upper bound on open upstream connections", ge=1,
                                          parse=positive_int)] = 1024
    max_body_bytes: Annotated[int, _flag("largest client request body, in bytes", ge=1, cli=False)] = 64 * 2**20
    log_level: Annotated[Literal[LOG_LEVELS], _flag("proxy log level, in any case (debug or DEBUG)",
                                                    parse=log_level)] = "INFO"
    forward_kv_params: Annotated[tuple[str, ...], _flag(
        "keys of the client's own kv_transfer_params to pass on to the prefill leg (e.g. kvc_fault for "
        "TieredConnector's test hooks); none by default", parse=parse_key_list, format=",".join,
        metavar="KEY[,KEY...]")] = ()

    def __post_init__(self) -> None:
        settings.check_fields(self)

    def validate(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("need at least one --prefill and one --decode instance")
        if self.mode not in MODES:
            raise ValueError(f"--mode {self.mode!r}: expected one of {MODES}")
        if self.mode == "push":
            missing = [d.url for d in self.decode if not d.kv_addr]
            if missing:
                raise ValueError(f"--mode push needs kv=HOST:PORT on every --decode; missing on {missing}")
        for flag, specs in (("--prefill", self.prefill), ("--decode", self.decode)):
            urls = [s.url for s in specs]
            dups = sorted({u for u in urls if urls.count(u) > 1})
            if dups:
                raise ValueError(f"{flag} lists the same instance more than once: {dups}")


def parse_url(value: str) -> str:
    """argparse type: an instance base URL, http(s)://host:port, no path."""
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(
            f"invalid URL {value!r}: expected http://HOST:PORT (with the scheme), e.g. http://127.0.0.1:8100")
    try:
        parts.port
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port in URL {value!r}") from None
    if parts.path not in ("", "/") or parts.query:
        raise argparse.ArgumentTypeError(
            f"invalid URL {value!r}: give the server root (http://HOST:PORT), not a path like /v1")
    return f"{parts.scheme}://{parts.netloc}"


def parse_key_list(value: str) -> tuple[str, ...]:
    """argparse type: comma-separated kv_transfer_params keys."""
    keys = tuple(k.strip() for k in value.split(",") if k.strip())
    if not keys or not all(k.replace("_", "").isalnum() for k in keys):
        raise argparse.ArgumentTypeError(f"invalid key list {value!r}: expected KEY[,KEY...] of letters, digits, _")
    return keys


def parse_hostport(value: str) -> str:
    host, sep, port_text = value.rpartition(":")
    try:
        port: int | None = parse_port(port_text)
    except argparse.ArgumentTypeError:
        port = None
    if not sep or not host or port is None:
        raise argparse.ArgumentTypeError(f"invalid address {value!r}: expected HOST:PORT")
    return f"{host}:{port}"


def parse_prefill(value: str) -> InstanceSpec:
    return InstanceSpec(parse_url(value))


def parse_decode(value: str) -> InstanceSpec:
    """argparse type: `URL` or `URL,kv=HOST:PORT`."""
    url, *opts = value.split(",")
    kv = None
    for opt in opts:
        key, _, val = opt.partition("=")
        if key.strip() != "kv":
            raise argparse.ArgumentTypeError(f"unknown option {opt!r} in {value!r}: expected URL[,kv=HOST:PORT]")
        try:
            kv = parse_hostport(val.strip())
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"invalid kv address {val!r} in {value!r}: expected kv=HOST:PORT") from None
    return InstanceSpec(parse_url(url), kv)


# --------------------------------------------------------------------------------------------
# metrics


class ProxyMetrics:
    """All proxy metrics, in their own registry (several proxies can live in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        lat = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
        self.ttft = Histogram("kvproxy_ttft_seconds", "Time to first streamed decode event, from request arrival",
                              ["endpoint"], buckets=lat, registry=r)
        self.itl = Histogram("kvproxy_itl_seconds", "Time between streamed decode events",
                             ["endpoint"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
                             registry=r)
        self.e2e = Histogram("kvproxy_e2e_latency_seconds", "Request latency, arrival to last byte",
                             ["endpoint"], buckets=lat, registry=r)
        self.prefill_latency = Histogram("kvproxy_prefill_latency_seconds", "Prefill leg latency (successful attempt)",
                                         buckets=lat, registry=r)
        self.requests = Counter("kvproxy_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.outstanding = Gauge("kvproxy_outstanding_requests", "Requests in flight per instance",
                                 ["role", "instance"], registry=r)
        self.healthy = Gauge("kvproxy_instance_healthy", "1 if the instance is in rotation, else 0",
                             ["role", "instance"], registry=r)
        self.prefill_failures = Counter("kvproxy_prefill_failures", "Failed prefill attempts by reason",
                                        ["reason"], registry=r)
        self.decode_failures = Counter("kvproxy_decode_failures", "Failed decode legs by reason",
                                       ["reason"], registry=r)
        self.retries = Counter("kvproxy_prefill_retries", "Prefill attempts retried on another instance",
                               registry=r)
        # labels() takes a lock and builds its key on every call: the per-request path looks its
        # children up in these dicts instead.
        self._children: dict[tuple[Any, ...], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c


# --------------------------------------------------------------------------------------------
# instances and routing


class Instance:
    def __init__(self, spec: InstanceSpec, role: str, metrics: ProxyMetrics):
        self.spec, self.role = spec, role
        self.url = spec.url
        self.outstanding = 0
        self.healthy = True
        self.failed_checks = 0
        # Read when /metrics is scraped, so acquire/release (4 per request) touch no lock.
        metrics.outstanding.labels(role, spec.url).set_function(lambda: self.outstanding)
        self._health = metrics.healthy.labels(role, spec.url)
        self._health.set(1)
        self._urls: dict[str, URL] = {}

    def endpoint(self, path: str) -> URL:
        """The parsed URL of `path` on this instance (parsed once, not per request)."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.url + path)
        return url

    def acquire(self) -> None:
        self.outstanding += 1

    def release(self) -> None:
        self.outstanding -= 1

    def set_healthy(self, ok: bool, why: str = "") -> None:
        if ok != self.healthy:
            if ok:
                log.info("%s %s is healthy again; back in rotation", self.role, self.url)
            else:
                log.warning("%s %s taken out of rotation: %s", self.role, self.url, why)
        self.healthy = ok
        self._health.set(1 if ok else 0)

    def record_check(self, ok: bool, unhealthy_after: int, why: str = "") -> None:
        if ok:
            self.failed_checks = 0
            self.set_healthy(True)
        else:
            self.failed_checks += 1
            if self.failed_checks >= unhealthy_after:
                self.set_healthy(False, why)

    def state(self) -> dict[str, Any]:
        return {"url": self.url, "healthy": self.healthy, "outstanding": self.outstanding,
                **({"kv": self.spec.kv_addr} if self.spec.kv_addr else {})}


class Pool:
    """Healthy instances, least outstanding requests first; ties rotate so equal load spreads."""

    def __init__(self, role: str, specs: Sequence[InstanceSpec], metrics: ProxyMetrics):
        self.role = role
        self.instances = [Instance(s, role, metrics) for s in specs]
        self._turn = itertools.count()

    def pick(self, exclude: set[Instance] | frozenset[Instance] = frozenset(),
             need_kv: bool = False) -> Instance | None:
        n = len(self.instances)
        start = next(self._turn) % n
        best: Instance | None = None
        for k in range(n):
            inst = self.instances[(start + k) % n]
            if not inst.healthy or inst in exclude or (need_kv and not inst.spec.kv_addr):
                continue
            if best is None or inst.outstanding < best.outstanding:
                best = inst
        return best

    def any_healthy(self) -> bool:
        return any(i.healthy for i in self.instances)


# --------------------------------------------------------------------------------------------
# errors


class ProxyError(Exception):
    """A request failure to report to the client as OpenAI-style error JSON."""

    def __init__(self, status: int, type_: str, message: str, reason: str = "", retryable: bool = False):
        super().__init__(message)
        self.status, self.type, self.message = status, type_, message
        self.reason = reason or type_
        self.retryable = retryable


class ClientGone(Exception):
    """The client closed its connection mid-response; `response` is what was being written."""

    def __init__(self, response: web.StreamResponse):
        super().__init__("client disconnected")
        self.response = response


class PassThrough(Exception):
    """An upstream 4xx (the client's request is at fault): hand it back unchanged."""

    def __init__(self, status: int, body: bytes, content_type: str):
        super().__init__(status)
        self.status, self.body, self.content_type = status, body, content_type


def error_body(status: int, type_: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": status}}


def kv_failure_cause(data: bytes) -> FailureCause | None:
    """The cause a TieredConnector decode put in its error body's own field (client_errors.py);
    None for any other body, and for a value this version does not know (metric labels stay bounded)."""
    try:
        return FailureCause(json.loads(data)["error"][CLIENT_ERROR_CAUSE_FIELD])
    except (ValueError, KeyError, TypeError):
        return None


def _snippet(data: bytes | str, n: int = 300) -> str:
    text = data.decode(errors="replace") if isinstance(data, bytes) else data
    try:  # vLLM's own error JSON: keep just its message
        text = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        pass
    text = " ".join(str(text).split())
    return text[:n] + ("..." if len(text) > n else "")


def _is_connect_error(exc: BaseException) -> bool:
    return isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))


# --------------------------------------------------------------------------------------------
# the proxy


@dataclasses.dataclass
class _Call:
    """One client request as it moves through the legs."""

    endpoint: str            # "completions" | "chat"
    path: str                # /v1/completions | /v1/chat/completions
    body: dict[str, Any]
    request_id: str
    mode: str
    headers: dict[str, str]
    started: float


class PDProxy:
    def __init__(self, config: ProxyConfig):
        config.validate()
        self.config = config
        self.metrics = ProxyMetrics()
        self.prefill = Pool("prefill", config.prefill, self.metrics)
        self.decode = Pool("decode", config.decode, self.metrics)
        self.app = self._build_app()
        self.session: aiohttp.ClientSession | None = None
        # ClientTimeout objects are immutable: build them once, not per request.
        c = config
        self._prefill_timeout = aiohttp.ClientTimeout(total=c.prefill_timeout, sock_connect=c.connect_timeout)
        self._decode_timeout = aiohttp.ClientTimeout(total=c.decode_timeout, sock_connect=c.connect_timeout,
                                                     sock_read=c.decode_idle_timeout)
        self._health_timeout = aiohttp.ClientTimeout(total=c.health_timeout)
        self._models_timeout = aiohttp.ClientTimeout(total=c.connect_timeout + 10)
        self._runner: web.AppRunner | None = None
        self._health_task: asyncio.Task[None] | None = None
        self.port: int | None = None

    # ---- lifecycle ----------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/healthcheck", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 8000) -> int:
        """Check every instance once, then listen. Returns the bound port (useful with port=0)."""
        self.session = self._new_session()
        await self.check_health_once()
        self._health_task = asyncio.create_task(self._health_loop(), name="proxy-health")
        # handler_cancellation: a client that disconnects cancels its handler, which closes both
        # upstream connections, which makes vLLM abort the request.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        with binding(host, port):  # a taken port: PortInUseError, which the CLI turns into one line
            await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else port
        log.info("P/D proxy on http://%s:%s (mode %s); prefill %s; decode %s", host, self.port,
                 self.config.mode, [i.url for i in self.prefill.instances],
                 [i.state() for i in self.decode.instances])
        return self.port

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
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.session is not None:
            await self.session.close()
            self.session = None

    # ---- health -------------------------------------------------------------------------

    def all_instances(self) -> list[Instance]:
        return self.prefill.instances + self.decode.instances

    async def check_health_once(self) -> None:
        await asyncio.gather(*(self._check(i) for i in self.all_instances()))

    async def _check(self, inst: Instance) -> None:
        assert self.session is not None
        why = ""
        try:
            async with self.session.get(inst.endpoint("/health"), timeout=self._health_timeout) as r:
                ok = r.status == 200
                why = f"/health returned HTTP {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            ok, why = False, f"/health failed: {exc.__class__.__name__}: {exc}"
        inst.record_check(ok, self.config.unhealthy_after, why)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            try:
                await self.check_health_once()
            except Exception:  # never let the loop die; the next round tries again
                log.exception("health check round failed")

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

    def _error(self, status: int, type_: str, message: str, request_id: str) -> web.Response:
        headers = {REQUEST_ID_HEADER: request_id} if request_id else {}
        return web.json_response(error_body(status, type_, message), status=status, headers=headers)

    async def _handle(self, request: web.Request, endpoint: str, path: str) -> web.StreamResponse:
        started = time.monotonic()
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        status = 500
        try:
            try:  # msgspec: 5-10x faster than json both ways, which counts on long prompts
                body = msgspec.json.decode(await request.read())
                if not isinstance(body, dict):
                    raise ValueError("the body must be a JSON object")
            except ValueError as exc:  # msgspec.DecodeError is a ValueError
                raise ProxyError(400, "invalid_request_error", f"invalid JSON body: {exc}") from None
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
            status = 499  # client closed the request (nginx's convention)
            log.info("request %s: client disconnected; upstream request closed", request_id)
            return exc.response
        except PassThrough as exc:
            status = exc.status
            return web.Response(body=exc.body, status=exc.status, content_type=exc.content_type or "application/json",
                                headers={REQUEST_ID_HEADER: request_id})
        except ProxyError as exc:
            status = exc.status
            log.warning("request %s failed: %s", request_id, exc.message)
            return self._error(exc.status, exc.type, f"{exc.message} (request id {request_id})", request_id)
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
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
        body = dict(call.body)
        body["max_tokens"] = 1
        if call.endpoint == "chat":
            body["max_completion_tokens"] = 1
        body["stream"] = False
        body.pop("stream_options", None)
        body.pop("min_tokens", None)
        kv = self._forwarded_kv_params(call)
        kv.update(PREFILL_KV_PARAMS)  # the proxy's own keys always win
        if push_target is not None:
            kv.update(transfer_mode="push", push_target=push_target)
        body["kv_transfer_params"] = kv
        return body

    def _forwarded_kv_params(self, call: _Call) -> dict[str, Any]:
        """The client's kv_transfer_params keys named by --forward-kv-params (none by default: a
        client must not steer the transfer plane unless the operator allows that key)."""
        theirs = call.body.get("kv_transfer_params")
        if not self.config.forward_kv_params or not isinstance(theirs, dict):
            return {}
        return {k: theirs[k] for k in self.config.forward_kv_params if k in theirs}

    async def _prefill(self, call: _Call, push_target: str | None = None) -> dict[str, Any]:
        """Run the prefill leg, retrying retryable failures on other instances. Returns the
        kv_transfer_params for the decode leg."""
        body = msgspec.json.encode(self._prefill_body(call, push_target))
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
            except PassThrough:
                self.metrics.prefill_failures.labels("http_4xx").inc()
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

    async def _prefill_once(self, inst: Instance, call: _Call, body: bytes) -> dict[str, Any]:
        assert self.session is not None
        cfg = self.config
        t0 = time.monotonic()
        inst.acquire()
        try:
            async with self.session.post(inst.endpoint(call.path), data=body, headers=call.headers,
                                         timeout=self._prefill_timeout) as resp:
                data = await resp.read()
                if resp.status >= 500:
                    raise ProxyError(502, "upstream_error", f"prefill instance {inst.url} returned HTTP "
                                     f"{resp.status}: {_snippet(data)}", "http_5xx", retryable=True)
                if resp.status >= 400:
                    raise PassThrough(resp.status, data, resp.content_type)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            if _is_connect_error(exc):
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
                             f"JSON: {_snippet(data, 120)}", "bad_response", retryable=True) from None
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
        body = dict(call.body)
        body["kv_transfer_params"] = kv
        out: web.StreamResponse | None = None
        fail = self.metrics.decode_failures
        try:
            async with self.session.post(inst.endpoint(call.path), data=msgspec.json.encode(body),
                                         headers=call.headers, timeout=self._decode_timeout) as up:
                try:
                    if up.status >= 400:
                        data = await up.read()
                        if up.status < 500:
                            fail.labels("http_4xx").inc()
                            raise PassThrough(up.status, data, up.content_type)
                        text = _snippet(data)
                        cause = kv_failure_cause(data)
                        if cause is not None:  # TieredConnector names why the load failed
                            fail.labels(f"kv_{cause.value}").inc()
                            raise ProxyError(502, "kv_transfer_error", f"decode instance {inst.url} could not "
                                             f"load the prompt's KV cache: {text}", f"kv_{cause.value}")
                        fail.labels("http_5xx").inc()
                        raise ProxyError(502, "upstream_error", f"decode instance {inst.url} returned HTTP "
                                         f"{up.status}: {text}", "http_5xx")
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
            if _is_connect_error(exc):
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


# --------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ProxyConfig setting: --prefill, --decode, --host, --port, --mode, ... (derived)."""
    settings.add_arguments(parser, ProxyConfig)


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    return settings.from_args(ProxyConfig, args)


def config_argv(config: ProxyConfig) -> list[str]:
    """The command line that `python -m kvconnectors.integration.proxy` parses back into `config`."""
    return settings.to_argv(config)


async def serve(config: ProxyConfig, host: str, port: int, stop: asyncio.Event | None = None) -> None:
    """Run the proxy until `stop` is set, or SIGINT/SIGTERM (when called from the main thread)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    handled: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread: the caller owns shutdown
    proxy = PDProxy(config)
    try:
        await proxy.start(host, port)
        await stop.wait()
    finally:
        await proxy.stop()
        for sig in handled:
            loop.remove_signal_handler(sig)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(args, "log_level", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        config.validate()
    except ValueError as exc:
        print(f"kvconnectors proxy: error: {exc}", file=sys.stderr)
        return 2
    try:
        _run_loop(serve(config, config.host, config.port))
    except PortInUseError as exc:
        print(f"kvconnectors proxy: error: {exc.advice('--port')}", file=sys.stderr)
        return 2
    return 0


def _run_loop(coro: Any) -> None:
    """uvloop when installed (it ships with vLLM): the proxy's per-request cost is mostly event-loop
    and HTTP parsing work, which uvloop roughly halves."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvconnectors.integration.proxy",
                                     description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    add_arguments(parser)
    return pipe_safe(lambda: run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
