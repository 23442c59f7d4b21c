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

colocated is always run: it is the reference. Every other configuration's greedy token ids are
compared with it, request by request, token for token. The verdicts come from the measured numbers:
no failed request and no mismatch anywhere, and for the TieredConnector configurations the targets
in TARGETS. The exit status is 1 when any verdict fails.
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

from kvconnectors.benchmarks.common import (DEFAULT_OUT, add_results_argument, module_main, ratio, save_results,
                                            setup_env, table, write_json)
from kvconnectors.testing.compare import first_mismatch

CONFIGS = ("colocated", "chunked", "tiered", "tiered-push", "tiered-push-bulk", "nixl")
REFERENCE = "colocated"  # the outputs and the "x colocated" ratios are measured against it
# The README's targets for TieredConnector (metric -> upper bound on the ratio to colocated): the
# freeze a long prefill causes in the streams, and what one prefill core costs the long prompts' TTFT.
TARGETS: dict[str, float] = {"worst_gap_vs_colocated": 0.15, "long_ttft_vs_colocated": 2.5}
TARGET_LABELS = {"worst_gap_vs_colocated": "worst gap (long in flight) vs colocated",
                 "long_ttft_vs_colocated": "long-prompt TTFT vs colocated"}
TARGET_CONFIGS = ("tiered", "tiered-push", "tiered-push-bulk")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of the configurations above")
    parser.add_argument("--variant", default="deep", help="tiny-model variant (deep: 8 layers, 4k context)")
    parser.add_argument("--users", type=int, default=3, help="streaming users decoding throughout")
    parser.add_argument("--user-tokens", type=int, default=1000,
                        help="tokens each streaming user generates (enough to stream through every arrival)")
    parser.add_argument("--long-prompts", type=int, default=3, help="long prompts arriving during the streams")
    parser.add_argument("--long-tokens", type=int, default=3000, help="tokens per long prompt")
    parser.add_argument("--long-output-tokens", type=int, default=16,
                        help="tokens each long prompt generates; all but the first are decoded from the "
                             "transferred KV and compared with colocated")
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
    add_results_argument(parser)


async def _stream(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int,
                  start_at: float, t0: float) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    sent = time.perf_counter()
    times: list[float] = []
    token_ids: list[int] = []
    finish, error = None, None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                return {"sent": sent - t0, "times": [], "token_ids": [], "finish_reason": None,
                        "error": f"HTTP {r.status}: {(await r.text())[:300]}"}
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:  # vLLM reports a failure after the 200 as an SSE event
                    error = str(chunk["error"])[:300]
                    break
                choice = chunk["choices"][0]
                ids = choice.get("token_ids") or []
                times.extend([time.perf_counter() - t0] * len(ids))
                token_ids.extend(ids)
                finish = choice.get("finish_reason") or finish
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"sent": sent - t0, "times": times, "token_ids": token_ids, "finish_reason": finish,
            "error": error or incomplete(token_ids, finish, max_tokens)}


def incomplete(token_ids: list[int], finish_reason: str | None, max_tokens: int) -> str | None:
    """Why a stream that returned 200 still failed, or None. With ignore_eos every request must end
    on its length: anything else (a cut stream, an abort) is a failed request, not an output."""
    if finish_reason != "length":
        return f"finish_reason {finish_reason!r}, expected 'length' ({len(token_ids)} tokens)"
    if len(token_ids) != max_tokens:
        return f"{len(token_ids)} tokens, expected {max_tokens}"
    return None


async def _scenario(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    from kvconnectors.testing.prompts import token_prompts

    users = token_prompts([64] * args.users, vocab_size=768, seed=1)
    longs = token_prompts([args.long_tokens] * args.long_prompts, vocab_size=768, seed=2)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        # warm-up, so first-request costs do not land in the measurement
        await _stream(s, url, model, users[0], 4, 0.0, time.perf_counter())
        t0 = time.perf_counter()
        tasks = [_stream(s, url, model, p, args.user_tokens, 0.0, t0) for p in users]
        tasks += [_stream(s, url, model, p, args.long_output_tokens, 1.0 + i * args.interval, t0)
                  for i, p in enumerate(longs)]
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
    good = sum(1 for u in run["users"] if not u["error"] and len(u["times"]) > 1
               and np.percentile(np.diff(u["times"]), 99) * 1e3 <= args.slo_itl_ms)
    good += sum(1 for r in run["longs"] if not r["error"] and r["times"]
                and (r["times"][0] - r["sent"]) * 1e3 <= args.slo_ttft_ms)
    ms = lambda xs, q: round(float(np.percentile(xs, q)) * 1e3, 2) if xs else None  # noqa: E731
    return {"itl_p50_ms": ms(gaps, 50), "itl_p99_ms": ms(gaps, 99),
            "worst_gap_ms": round(max(gaps) * 1e3, 2) if gaps else None,
            "worst_gap_long_in_flight_ms": round(max(in_flight) * 1e3, 2) if in_flight else None,
            "long_ttft_ms_mean": round(float(np.mean(ttft)) * 1e3, 2) if ttft else None,
            "long_ttft_ms_max": round(max(ttft) * 1e3, 2) if ttft else None,
            "goodput_rps": round(good / duration, 3), "slo_met": good, "requests": len(run["users"]) + len(run["longs"]),
            "errors": [f"{kind}[{i}]: {r['error']}" for kind in ("users", "longs")
                       for i, r in enumerate(run[kind]) if r["error"]]}


def _run_config(name: str, model: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from kvconnectors.integration.cluster import PDCluster
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


def compare_outputs(reference: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """Token-for-token comparison of one configuration's requests with the reference's, request by
    request. A failed request (on either side) is not compared: it is an error, never a match."""
    identical, details = 0, []
    for kind in ("users", "longs"):
        for i, (ref, got) in enumerate(zip(reference[kind], run[kind], strict=True)):
            if ref["error"] or got["error"]:
                continue
            diff = first_mismatch([ref["token_ids"]], [got["token_ids"]])
            if diff is None:
                identical += 1
            else:
                details.append(f"{kind}[{i}]: {diff.removeprefix('prompt 0: ')}")
    return {"identical": identical, "mismatches": len(details), "mismatch_details": details}


def add_ratios(results: dict[str, dict[str, Any]]) -> None:
    """The "x colocated" columns: each configuration's worst gap and long TTFT over the reference's."""
    base = results.get(REFERENCE, {})
    for m in results.values():
        for key, metric in (("worst_gap_vs_colocated", "worst_gap_long_in_flight_ms"),
                            ("long_ttft_vs_colocated", "long_ttft_ms_mean")):
            r = ratio(m[metric], base.get(metric))
            m[key] = None if r is None else round(r, 3)


def verdicts(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every check the run must pass, from the measured numbers. A value that could not be measured
    (None) fails its target: a missing measurement is not a pass."""
    out = []
    for name, m in results.items():
        failed = len(m["errors"])
        out.append({"config": name, "check": "failed requests", "target": "0", "measured": str(failed),
                    "passed": failed == 0})
        if name != REFERENCE:
            n = m["requests"]
            out.append({"config": name, "check": "outputs == colocated", "target": f"{n}/{n}",
                        "measured": f"{m['identical']}/{n} ({m['mismatches']} differ)",
                        "passed": m["identical"] == n and m["mismatches"] == 0})
        if name in TARGET_CONFIGS:
            for key, bound in TARGETS.items():
                value = m.get(key)
                out.append({"config": name, "check": TARGET_LABELS[key], "target": f"<= {bound}x",
                            "measured": "not measured" if value is None else f"{value}x",
                            "passed": value is not None and value <= bound})
    return out


def exit_code(checks: list[dict[str, Any]]) -> int:
    """1 when any check failed (or there was none to pass), else 0."""
    return 0 if checks and all(c["passed"] for c in checks) else 1


def evaluate(raw: dict[str, dict[str, Any]], args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The measured numbers of every configuration's run (raw[REFERENCE] included) and the checks on them."""
    results = {name: _metrics(r, args) for name, r in raw.items()}
    for name, r in raw.items():
        if name != REFERENCE:
            results[name].update(compare_outputs(raw[REFERENCE], r))
    add_ratios(results)
    return results, verdicts(results)


def render(results: dict[str, dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    rows = [[name, m["itl_p50_ms"], m["itl_p99_ms"], m["worst_gap_long_in_flight_ms"], m["worst_gap_vs_colocated"],
             m["long_ttft_ms_mean"], m["long_ttft_vs_colocated"], m["goodput_rps"], len(m["errors"]),
             m.get("mismatches")] for name, m in results.items()]
    t1 = table(["config", "ITL p50 ms", "ITL p99 ms", "worst gap (long in flight) ms", "x colocated",
                "long TTFT ms", "x colocated", "goodput req/s", "errors", "mismatches"], rows)
    t2 = table(["config", "check", "target", "measured", "verdict"],
               [[c["config"], c["check"], c["target"], c["measured"], "PASS" if c["passed"] else "FAIL"]
                for c in checks], align="llrrl")
    notes = [f"{name}: {e}" for name, m in results.items() for e in m["errors"][:3]]
    notes += [f"{name}: {d}" for name, m in results.items() for d in m.get("mismatch_details", [])[:3]]
    failed = sum(not c["passed"] for c in checks)
    verdict = (f"e2e: FAIL ({failed} of {len(checks)} checks failed)" if exit_code(checks)
               else "e2e: all checks PASS")
    return "\n".join([t1, "", t2] + ([""] + notes if notes else []) + ["", verdict])


def run(args: argparse.Namespace) -> int:
    setup_env()
    from kvconnectors.testing.tinymodel import ensure_tiny_model

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {CONFIGS}")
    if REFERENCE not in configs:
        print(f"[e2e] adding {REFERENCE}: the reference every output and ratio is checked against", flush=True)
    configs = [REFERENCE] + [c for c in dict.fromkeys(configs) if c != REFERENCE]
    model = str(ensure_tiny_model(args.variant))
    args.out.mkdir(parents=True, exist_ok=True)
    raw = {}
    for name in configs:
        print(f"[e2e] {name} ...", flush=True)
        raw[name] = _run_config(name, model, args, args.out / "e2e_logs")
    results, checks = evaluate(raw, args)
    code = exit_code(checks)
    text = render(results, checks)
    print(text)
    summary = {"args": {k: str(v) for k, v in vars(args).items() if not k.startswith("_")},
               "targets": {"configs": list(TARGET_CONFIGS), **TARGETS}, "results": results, "verdicts": checks,
               "returncode": code}  # the README may quote only a run whose checks all passed
    # token ids stay out of the JSON (they would double its size); the comparison's result is in "results"
    slim = {name: {kind: [{k: v for k, v in req.items() if k != "token_ids"} for req in reqs]
                   for kind, reqs in one.items()} for name, one in raw.items()}
    write_json(args.out / "e2e.json", {**summary, "raw": slim})
    _plot(raw, args.out / "e2e.png")
    print(f"wrote {args.out / 'e2e.json'} and {args.out / 'e2e.png'}")
    if args.results_dir:
        save_results(args.results_dir, "e2e", text, summary)
    return code


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
    raise SystemExit(module_main("kvconnectors.benchmarks.e2e", __doc__, add_arguments, run))
