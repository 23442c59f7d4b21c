"""End-to-end P/D benchmark on real vLLM servers: the seed articles' interference scenario.

Several users stream long answers while long prompts arrive. Colocated (whole prefill), the
long prefills freeze every stream; chunked prefill bounds the freeze; disaggregated, the decode
instance never prefills. Runs, side by side in one invocation:

  colocated   one server on both cores, whole-prompt prefill
  chunked     one server on both cores, chunked prefill (--chunk tokens per step)
  tiered      1 prefill (core 0) + 1 decode (core 1), TieredConnector, our proxy (pull: the
              decode fetches the whole KV after the prefill ends)
  tiered-push       the same, push mode, layer-wise: layer groups stream to the decode's landing
                    store while the prefill computes the next layers (--group layers per message)
  tiered-push-bulk  the same, push mode, but every layer in one message after the last layer
  nixl        1 prefill (core 0) + 1 decode (core 1), vLLM's NixlConnector, our proxy

and reports ITL p50/p99 and the worst inter-token gap while long prompts are in flight, the long
prompts' TTFT, goodput under an SLO, plus a PNG of inter-token gaps over time. Every thread of
each server is pinned to its core (floating helper threads would starve the compute).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from benchmarks.common import DEFAULT_OUT, setup_env, table

CONFIGS = ("colocated", "chunked", "tiered", "tiered-push", "tiered-push-bulk", "nixl")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    parser.add_argument("--variant", default="deep", help="tiny-model variant (deep: 8 layers, 4k context)")
    parser.add_argument("--users", type=int, default=3, help="streaming users decoding throughout")
    parser.add_argument("--user-tokens", type=int, default=1000,
                        help="tokens each streaming user generates (enough to stream through every arrival)")
    parser.add_argument("--long-prompts", type=int, default=3, help="long prompts arriving during the streams")
    parser.add_argument("--long-tokens", type=int, default=3000, help="tokens per long prompt")
    parser.add_argument("--interval", type=float, default=3.0,
                        help="seconds between long-prompt arrivals. The default keeps the disaggregated prefill "
                             "pool (one core: ~2.3 s per 3,000-token prompt here) at ~80%% utilization, the "
                             "planner's sizing rule; at 1.5 s it is overloaded (~150%%) and long prompts queue "
                             "behind each other, which measures the pool's size, not the transfer")
    parser.add_argument("--chunk", type=int, default=256, help="chunked-prefill token budget per step")
    parser.add_argument("--group", type=int, default=2, help="tiered-push: layers per pushed message "
                                                             "(layer_group_size)")
    parser.add_argument("--slo-itl-ms", type=float, default=100.0, help="SLO: a user's p99 inter-token gap")
    parser.add_argument("--slo-ttft-ms", type=float, default=5000.0, help="SLO: a long prompt's time to first token")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for e2e.json and e2e.png")


async def _stream(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int,
                  start_at: float, t0: float) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    sent = time.perf_counter()
    times: list[float] = []
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            return {"sent": sent - t0, "times": [], "error": f"HTTP {r.status}"}
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                ids = json.loads(line[5:])["choices"][0].get("token_ids") or []
                times.extend([time.perf_counter() - t0] * len(ids))
    return {"sent": sent - t0, "times": times, "error": None}


async def _scenario(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    from kvconnectors.testing.prompts import token_prompts

    users = token_prompts([64] * args.users, vocab_size=768, seed=1)
    longs = token_prompts([args.long_tokens] * args.long_prompts, vocab_size=768, seed=2)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        # warm-up, so first-request costs do not land in the measurement
        await _stream(s, url, model, users[0], 4, 0.0, time.perf_counter())
        t0 = time.perf_counter()
        tasks = [_stream(s, url, model, p, args.user_tokens, 0.0, t0) for p in users]
        tasks += [_stream(s, url, model, p, 4, 1.0 + i * args.interval, t0) for i, p in enumerate(longs)]
        results = await asyncio.gather(*tasks)
    return {"users": results[:args.users], "longs": results[args.users:]}


def _metrics(run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    windows = [(r["sent"], r["times"][0]) for r in run["longs"] if r["times"]]
    gaps, in_flight = [], []
    for u in run["users"]:
        t = u["times"]
        for a, b in zip(t, t[1:]):
            gaps.append(b - a)
            if any(a < w1 and b > w0 for w0, w1 in windows):
                in_flight.append(b - a)
    ttft = [r["times"][0] - r["sent"] for r in run["longs"] if r["times"]]
    duration = max((r["times"][-1] for r in run["users"] + run["longs"] if r["times"]), default=1.0)
    good = sum(1 for u in run["users"] if len(u["times"]) > 1
               and np.percentile(np.diff(u["times"]), 99) * 1e3 <= args.slo_itl_ms)
    good += sum(1 for x in ttft if x * 1e3 <= args.slo_ttft_ms)
    ms = lambda xs, q: round(float(np.percentile(xs, q)) * 1e3, 2) if xs else None  # noqa: E731
    return {"itl_p50_ms": ms(gaps, 50), "itl_p99_ms": ms(gaps, 99),
            "worst_gap_ms": round(max(gaps) * 1e3, 2) if gaps else None,
            "worst_gap_long_in_flight_ms": round(max(in_flight) * 1e3, 2) if in_flight else None,
            "long_ttft_ms_mean": round(float(np.mean(ttft)) * 1e3, 2) if ttft else None,
            "long_ttft_ms_max": round(max(ttft) * 1e3, 2) if ttft else None,
            "goodput_rps": round(good / duration, 3), "slo_met": good, "requests": len(run["users"]) + len(run["longs"]),
            "errors": [r["error"] for r in run["users"] + run["longs"] if r["error"]]}


def _run_config(name: str, model: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from integration.cluster import PDCluster
    from kvconnectors.serving import VllmServer

    base = f"--max-model-len 4096 --max-num-batched-tokens 4096 --max-num-seqs {args.users + args.long_prompts + 1}"
    if name in ("colocated", "chunked"):
        extra = ["--max-model-len", "4096", "--max-num-seqs", str(args.users + args.long_prompts + 1)]
        extra += (["--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096"] if name == "colocated"
                  else ["--enable-chunked-prefill", "--max-num-batched-tokens", str(args.chunk)])
        # Both cores for the one colocated server: its OpenMP threads bind to cores 0 and 1.
        with VllmServer(model, name=name, extra_args=extra, env={"VLLM_CPU_OMP_THREADS_BIND": "0-1"},
                        log_path=log_dir / f"{name}.log") as server:
            return asyncio.run(_scenario(server.url, server.served_model_name, args))
    connector = "NixlConnector" if name == "nixl" else "TieredConnector"
    mode, kv = "pull", None
    if name.startswith("tiered-push"):
        # bulk: above any prompt length, so every layer goes in one message after the last layer
        min_tokens = 1 << 30 if name.endswith("bulk") else 0
        mode = "push"
        kv = {"kv_connector_extra_config": {"layer_group_size": args.group, "layerwise_min_tokens": min_tokens}}
    with PDCluster(model, connector=connector, vllm_args=base, log_dir=log_dir / name, proxy_process=True,
                   mode=mode, kv_extra=kv) as pd:
        return asyncio.run(_scenario(pd.proxy_url, pd.prefill[0].served_model_name, args))


def run(args: argparse.Namespace) -> int:
    setup_env()
    from kvconnectors.testing.tinymodel import ensure_tiny_model

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {CONFIGS}")
    model = str(ensure_tiny_model(args.variant))
    args.out.mkdir(parents=True, exist_ok=True)
    raw, results = {}, {}
    for name in configs:
        print(f"[e2e] {name} ...", flush=True)
        raw[name] = _run_config(name, model, args, args.out / "e2e_logs")
        results[name] = _metrics(raw[name], args)
    base = results.get("colocated")
    rows = []
    for name, m in results.items():
        rel_gap = (m["worst_gap_long_in_flight_ms"] / base["worst_gap_long_in_flight_ms"]
                   if base and m["worst_gap_long_in_flight_ms"] and base["worst_gap_long_in_flight_ms"] else None)
        rel_ttft = (m["long_ttft_ms_mean"] / base["long_ttft_ms_mean"]
                    if base and m["long_ttft_ms_mean"] and base["long_ttft_ms_mean"] else None)
        m["worst_gap_vs_colocated"] = round(rel_gap, 3) if rel_gap else None
        m["long_ttft_vs_colocated"] = round(rel_ttft, 3) if rel_ttft else None
        rows.append([name, m["itl_p50_ms"], m["itl_p99_ms"], m["worst_gap_long_in_flight_ms"], m["worst_gap_vs_colocated"],
                     m["long_ttft_ms_mean"], m["long_ttft_vs_colocated"], m["goodput_rps"], len(m["errors"])])
    print(table(["config", "ITL p50 ms", "ITL p99 ms", "worst gap (long in flight) ms", "x colocated",
                 "long TTFT ms", "x colocated", "goodput req/s", "errors"], rows))
    print("targets for tiered: worst gap <= 0.15x colocated; long-prompt TTFT <= 2.5x colocated")
    (args.out / "e2e.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()
                                                            if not k.startswith("_")},
                                                   "results": results, "raw": raw}, indent=2))
    _plot(raw, args.out / "e2e.png")
    print(f"wrote {args.out / 'e2e.json'} and {args.out / 'e2e.png'}")
    return 0


def _plot(raw: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(raw), 1, figsize=(10, 2.4 * len(raw)), sharex=True, squeeze=False)
    for ax, (name, run) in zip(axes[:, 0], raw.items()):
        for r in run["longs"]:
            if r["times"]:
                ax.axvspan(r["sent"], r["times"][0], color="tab:red", alpha=0.15)
        for u in run["users"]:
            t = u["times"]
            ax.plot(t[1:], np.diff(t) * 1e3, ".", ms=2)
        ax.set_ylabel("gap ms")
        ax.set_title(f"{name}: inter-token gaps of streaming users (red: long prompt in prefill)", fontsize=9)
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    raise SystemExit(run(p.parse_args()))
