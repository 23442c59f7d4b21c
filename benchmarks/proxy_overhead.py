"""How much latency the P/D proxy adds: the same requests through the proxy and done "by hand"
(the client runs both legs itself, exactly as the proxy would), interleaved in one run.

    python -m benchmarks.proxy_overhead --requests 200

Overhead per request = latency via proxy - latency by hand, reported as p50/p99 of each and the
difference of medians. Loopback only; bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import aiohttp
import numpy as np
from tqdm import tqdm

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


async def measure(proxy: str, prefill: str, decode: str, model: str, n: int) -> dict:
    by_hand, via_proxy = [], []
    async with aiohttp.ClientSession() as s:
        for i in tqdm(range(n), desc="requests (pairs)", unit="pair"):
            body = {"model": model, "prompt": list(range(20 + i % 50, 84 + i % 50)), "max_tokens": 2,
                    "temperature": 0.0, "ignore_eos": True}
            # Alternate the order so drift and caching hit both paths alike.
            if i % 2:
                by_hand.append(await _direct(s, prefill, decode, body))
                via_proxy.append(await _proxied(s, proxy, body))
            else:
                via_proxy.append(await _proxied(s, proxy, body))
                by_hand.append(await _direct(s, prefill, decode, body))
    diff = np.array(via_proxy) - np.array(by_hand)
    ms = lambda xs, q: round(float(np.percentile(xs, q)) * 1e3, 3)  # noqa: E731
    return {"requests": n,
            "by_hand_ms": {"p50": ms(by_hand, 50), "p99": ms(by_hand, 99)},
            "via_proxy_ms": {"p50": ms(via_proxy, 50), "p99": ms(via_proxy, 99)},
            "added_ms": {"p50": ms(diff, 50), "p99": ms(diff, 99),
                         "median_of_medians": round((statistics.median(via_proxy) - statistics.median(by_hand)) * 1e3, 3)}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=200, help="request pairs (one by hand, one via the proxy)")
    parser.add_argument("--model-variant", default="tiny", help="tiny-model variant served by both instances")
    parser.add_argument("--out", type=Path, default=Path("artifacts/bench"), help="folder for proxy_overhead.json")


def run(args: argparse.Namespace) -> int:
    from integration.cluster import PDCluster
    from kvconnectors.testing.tinymodel import ensure_tiny_model

    if not 1 <= args.requests <= 5000:
        raise SystemExit(f"--requests {args.requests}: must be in [1, 5000]")
    model = str(ensure_tiny_model(args.model_variant))
    # The proxy gets its own process, as in production: in this one it would share the GIL
    # with the measuring client and be charged for the client's work.
    with PDCluster(model, log_dir=args.out / "proxy_overhead_logs", proxy_process=True) as pd:
        result = asyncio.run(measure(pd.proxy_url, pd.prefill[0].url, pd.decode[0].url,
                                     pd.prefill[0].served_model_name, args.requests))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "proxy_overhead.json").write_text(json.dumps(result, indent=2))
    print(f"by hand   p50 {result['by_hand_ms']['p50']:8.3f} ms   p99 {result['by_hand_ms']['p99']:8.3f} ms")
    print(f"via proxy p50 {result['via_proxy_ms']['p50']:8.3f} ms   p99 {result['via_proxy_ms']['p99']:8.3f} ms")
    print(f"added     p50 {result['added_ms']['p50']:8.3f} ms   p99 {result['added_ms']['p99']:8.3f} ms "
          f"(target: < 2 ms p50)")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    raise SystemExit(run(p.parse_args()))
