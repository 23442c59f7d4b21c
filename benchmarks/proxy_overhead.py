"""How much latency the P/D proxy adds: the same requests through the proxy and done "by hand"
(the client runs both legs itself, exactly as the proxy would), interleaved in one run.

    python -m kvconnectors.benchmarks.proxy_overhead --requests 200
    python -m kvconnectors.benchmarks.proxy_overhead --requests 2000 --fake-upstreams   # no engines

Overhead per request = latency via proxy - latency by hand, reported as p50/p99 of each and the
difference of medians. Both paths run the prefill leg and the decode leg against the same
instances, so the servers' time on both legs (the prefill round trip included) is in both and
cancels: what is left is the extra client -> proxy hop and the proxy's own work (parsing and
rebuilding bodies, its two upstream requests from its own process, relaying the answer), less the
client's own work on the second leg, which only the by-hand path does.

`--fake-upstreams` runs the same comparison against tiny aiohttp stand-ins for the vLLM
instances (in one separate process) instead of real engines: that isolates the proxy's own cost
from engine noise, and is what to profile against. Its output is labelled `"upstreams": "fake"`
and written to its own file; the target is defined on real engines. Loopback only; bounded in
count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web
from tqdm import tqdm

from kvconnectors.benchmarks.common import add_results_argument, module_main, save_results

NIXL_STYLE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}


async def _direct(s: aiohttp.ClientSession, prefill: str, decode: str, body: dict) -> float:
    t0 = time.perf_counter()
    p_body = dict(body, max_tokens=1, stream=False, kv_transfer_params=NIXL_STYLE)
    async with s.post(f"{prefill}/v1/completions", json=p_body) as r:
        params = (await r.json())["kv_transfer_params"]
    async with s.post(f"{decode}/v1/completions", json=dict(body, kv_transfer_params=params)) as r:
        await r.read()
        assert r.status == 200
    return time.perf_counter() - t0


async def _proxied(s: aiohttp.ClientSession, proxy: str, body: dict) -> float:
    t0 = time.perf_counter()
    async with s.post(f"{proxy}/v1/completions", json=body) as r:
        await r.read()
        assert r.status == 200
    return time.perf_counter() - t0


async def measure(proxy: str, prefill: str, decode: str, model: str, n: int, stream: bool = False,
                  progress: bool = True, prompt_tokens: int = 64) -> dict:
    by_hand, via_proxy = [], []
    async with aiohttp.ClientSession() as s:
        for i in tqdm(range(n), desc="requests (pairs)", unit="pair", disable=not progress):
            # Token ids stay under 1020 (any vocabulary has them); 64 tokens: ids 20+i%50 ... 83+i%50.
            prompt = [20 + (i % 50 + k) % 1000 for k in range(prompt_tokens)]
            body = {"model": model, "prompt": prompt, "max_tokens": 2,
                    "temperature": 0.0, "ignore_eos": True, **({"stream": True} if stream else {})}
            # Alternate the order so drift and caching hit both paths alike.
            if i % 2:
                by_hand.append(await _direct(s, prefill, decode, body))
                via_proxy.append(await _proxied(s, proxy, body))
            else:
                via_proxy.append(await _proxied(s, proxy, body))
                by_hand.append(await _direct(s, prefill, decode, body))
    return {**summarize(by_hand, via_proxy, stream), "prompt_tokens": prompt_tokens}


def summarize(by_hand: list[float], via_proxy: list[float], stream: bool = False) -> dict:
    """Percentiles of each path and of the per-pair differences (seconds in, ms out). Engine
    latency varies by milliseconds from request to request, so the p50 difference comes with a
    bootstrap 95% interval (how well n pairs pin it down) and the raw pairs are kept."""
    diff = np.array(via_proxy) - np.array(by_hand)
    ms = lambda xs, q: round(float(np.percentile(xs, q)) * 1e3, 3)  # noqa: E731
    lo, hi = _median_ci95(diff)
    return {"requests": len(diff), "stream": stream,
            "by_hand_ms": {"p50": ms(by_hand, 50), "p99": ms(by_hand, 99)},
            "via_proxy_ms": {"p50": ms(via_proxy, 50), "p99": ms(via_proxy, 99)},
            "added_ms": {"p50": ms(diff, 50), "p99": ms(diff, 99),
                         "p50_ci95": [round(lo * 1e3, 3), round(hi * 1e3, 3)],
                         "median_of_medians": round((statistics.median(via_proxy) - statistics.median(by_hand)) * 1e3, 3)},
            "pairs_ms": {"by_hand": [round(x * 1e3, 3) for x in by_hand],
                         "via_proxy": [round(x * 1e3, 3) for x in via_proxy]}}


def _median_ci95(xs: np.ndarray, rounds: int = 1000) -> tuple[float, float]:
    """Bootstrap 95% interval of the median (fixed seed: the same data gives the same interval)."""
    rng = np.random.default_rng(0)
    meds = np.concatenate([np.median(xs[rng.integers(0, len(xs), (100, len(xs)))], axis=1)
                           for _ in range(rounds // 100)])
    lo, hi = np.percentile(meds, [2.5, 97.5])
    return float(lo), float(hi)


# --------------------------------------------------------------------------------------------
# fake upstreams: the proxy's own cost, without engines

FAKE_ENGINE_ID = "fake-prefill"


def _fake_kv_params() -> dict[str, Any]:
    """What a NixlConnector prefill instance answers with (similar size)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": FAKE_ENGINE_ID,
            "remote_block_ids": [[1, 2, 3, 4]], "remote_host": "127.0.0.1", "remote_port": 5600,
            "tp_size": 1}


def _fake_completion(n: int) -> dict[str, Any]:
    return {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake",
            "choices": [{"index": 0, "text": "t" * n, "token_ids": list(range(n)), "logprobs": None,
                         "finish_reason": "length", "stop_reason": None}],
            "usage": {"prompt_tokens": 64, "total_tokens": 64 + n, "completion_tokens": n}}


def _fake_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "BadRequestError", "code": status}},
                             status=status)


async def _fake_prefill(request: web.Request) -> web.Response:
    body = await request.json()
    kv = body.get("kv_transfer_params") or {}
    # Refuse what the proxy must never send, so a broken proxy fails the benchmark.
    if kv.get("do_remote_decode") is not True or body.get("max_tokens") != 1 or body.get("stream"):
        return _fake_error(400, f"not a prefill leg: {body}")
    return web.json_response({**_fake_completion(1), "kv_transfer_params": _fake_kv_params()})


async def _fake_decode(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body.get("kv_transfer_params") != _fake_kv_params():
        return _fake_error(400, "decode leg without the prefill's kv_transfer_params")
    n = int(body.get("max_tokens", 2))
    if not body.get("stream"):
        return web.json_response(_fake_completion(n))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(n):
        event = {"id": "cmpl-fake", "choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
        await resp.write(f"data: {json.dumps(event)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


def _fake_app(role: str) -> web.Application:
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake"}]})

    app = web.Application()
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", _fake_prefill if role == "prefill" else _fake_decode)
    return app


async def _serve_fakes_async(conn: Any) -> None:
    runners, ports = [], []
    for role in ("prefill", "decode"):
        runner = web.AppRunner(_fake_app(role), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        ports.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    conn.send(ports)
    # Serve until the parent closes its end of the pipe (or dies).
    await asyncio.get_running_loop().run_in_executor(None, _wait_closed, conn)
    for runner in runners:
        await runner.cleanup()


def _wait_closed(conn: Any) -> None:
    try:
        conn.recv()
    except EOFError:
        pass


def _serve_fakes(conn: Any) -> None:
    """Child process: a fake prefill and a fake decode instance on one event loop (uvloop, like
    vLLM's own server, when installed)."""
    try:
        import uvloop
        run_loop = uvloop.run
    except ImportError:
        run_loop = asyncio.run
    run_loop(_serve_fakes_async(conn))


class FakeUpstreams:
    """A fake prefill and decode instance in their own process (not sharing the GIL with the
    client or the proxy)."""

    def __init__(self) -> None:
        self.prefill_url = self.decode_url = ""
        self._proc: Any = None
        self._conn: Any = None

    def __enter__(self) -> "FakeUpstreams":
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_fakes, args=(child,), name="kvc-fake-upstreams", daemon=True)
        self._proc.start()
        child.close()
        try:
            if not self._conn.poll(60):
                raise EOFError
            p, d = self._conn.recv()
        except EOFError:  # timed out, or the child died first
            self.__exit__()
            raise RuntimeError("fake upstreams did not start within 60 s") from None
        self.prefill_url, self.decode_url = f"http://127.0.0.1:{p}", f"http://127.0.0.1:{d}"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._proc is not None:
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(timeout=10)


def run_fake(n: int, out: Path, stream: bool = False, progress: bool = True, prompt_tokens: int = 64) -> dict:
    """The comparison against fake upstreams, the proxy in its own process as in production."""
    from kvconnectors.integration import launcher
    from kvconnectors.integration.cluster import ProxyProcess
    from kvconnectors.serving import free_port

    log_dir = out / "proxy_overhead_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    with FakeUpstreams() as fakes:
        argv = ["--prefill", fakes.prefill_url, "--decode", fakes.decode_url, "--port", str(free_port()),
                "--log-level", "WARNING"]
        proxy = ProxyProcess(argv, launcher.parse_proxy_argv(argv), log_dir).start()
        try:
            result = asyncio.run(measure(proxy.url, fakes.prefill_url, fakes.decode_url, "fake", n, stream,
                                         progress, prompt_tokens))
        finally:
            proxy.stop()
    return {"upstreams": "fake", **result}


# --------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=200, help="request pairs (one by hand, one via the proxy)")
    parser.add_argument("--model-variant", default="tiny", help="tiny-model variant served by both instances")
    parser.add_argument("--stream", action="store_true", help="streamed (SSE) decode responses")
    parser.add_argument("--prompt-tokens", type=int, default=64,
                        help="prompt length in token ids (the proxy parses and re-encodes every body)")
    parser.add_argument("--fake-upstreams", action="store_true",
                        help="fake aiohttp instances instead of vLLM engines: the proxy's own cost only "
                             "(written to proxy_overhead_fake.json)")
    parser.add_argument("--out", type=Path, default=Path("artifacts/bench"), help="folder for proxy_overhead.json")
    add_results_argument(parser)


def render(result: dict) -> str:
    label = " (FAKE upstreams: the proxy's own cost, not engine latency)" if result.get("upstreams") == "fake" else ""
    lo, hi = result["added_ms"]["p50_ci95"]
    return "\n".join([
        f"by hand   p50 {result['by_hand_ms']['p50']:8.3f} ms   p99 {result['by_hand_ms']['p99']:8.3f} ms{label}",
        f"via proxy p50 {result['via_proxy_ms']['p50']:8.3f} ms   p99 {result['via_proxy_ms']['p99']:8.3f} ms",
        f"added     p50 {result['added_ms']['p50']:8.3f} ms   p99 {result['added_ms']['p99']:8.3f} ms "
        f"(p50 95% CI {lo:.3f} .. {hi:.3f} ms; target: < 2 ms p50)"])


def _report(result: dict, args: argparse.Namespace, stem: str) -> None:
    """STEM.json under --out, the summary on stdout, and both under --results-dir when given."""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    text = render(result)
    print(text)
    if getattr(args, "results_dir", None):
        save_results(args.results_dir, stem, text, result)


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.requests <= 5000:
        raise SystemExit(f"--requests {args.requests}: must be in [1, 5000]")
    stream, tokens = getattr(args, "stream", False), getattr(args, "prompt_tokens", 64)
    if tokens < 1:
        raise SystemExit(f"--prompt-tokens {tokens}: must be >= 1")
    suffix = ("_stream" if stream else "") + (f"_{tokens}tok" if tokens != 64 else "")
    if getattr(args, "fake_upstreams", False):
        result = run_fake(args.requests, args.out, stream, progress=sys.stderr.isatty(), prompt_tokens=tokens)
        _report(result, args, f"proxy_overhead_fake{suffix}")
        return 0
    from kvconnectors.integration.cluster import PDCluster
    from kvconnectors.testing.tinymodel import ensure_tiny_model

    model = str(ensure_tiny_model(args.model_variant))
    # The proxy gets its own process, as in production: in this one it would share the GIL
    # with the measuring client and be charged for the client's work.
    with PDCluster(model, log_dir=args.out / "proxy_overhead_logs", proxy_process=True) as pd:
        result = asyncio.run(measure(pd.proxy_url, pd.prefill[0].url, pd.decode[0].url,
                                     pd.prefill[0].served_model_name, args.requests, stream,
                                     prompt_tokens=tokens))
    _report({"upstreams": "vllm", **result}, args, f"proxy_overhead{suffix}")
    return 0


if __name__ == "__main__":
    raise SystemExit(module_main("kvconnectors.benchmarks.proxy_overhead", __doc__, add_arguments, run))
