"""The main job: a real prefill->decode handoff on the embedded tiny model.

Generates the tiny model, computes a colocated reference, launches one prefill and one decode
`vllm serve` instance with TieredConnector plus the P/D proxy, sends a streaming workload
through the proxy (progress bar), checks every output token for token against the colocated
run, prints TTFT/ITL percentiles, bytes moved, transfer GB/s and failures, and writes a plot.

It lives with the benchmarks: like `bench e2e` it drives integration/'s PDCluster and workload and
records its result as they do (common.save_results), and kvconnectors/ imports neither folder.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvconnectors.testing.prompts import block_edge_lengths, token_prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=24, help="number of requests in the workload")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens generated per request")
    parser.add_argument("--transport", choices=("tcp", "shm", "nixl"), default="tcp",
                        help="TieredConnector transport between the prefill and decode instances")
    parser.add_argument("--variant", default="tiny", help="tiny-model variant (see `kvconnectors make-model`)")
    parser.add_argument("--out", type=Path, default=Path("artifacts/demo"),
                        help="folder for summary.json, demo.png and the server logs")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    parser.add_argument("--results-dir", type=Path, default=None, metavar="DIR",
                        help="also save the printed block as demo.txt (the command line first) and the summary "
                             "as demo.json in this folder, e.g. docs/results (what the README quotes)")


def _metric_sum(metrics: dict, name: str) -> float:
    return sum(v for _, v in metrics.get(name, []))


def run(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the demo prints its own story; logs go to --out
    import vllm  # noqa: F401 - without vLLM, fail now (the CLI names the extra), before the model is generated
    from kvconnectors.testing.engines import generate_ids, llm_engine
    from kvconnectors.testing.tinymodel import ensure_tiny_model

    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        print("kvconnectors demo: --requests, --concurrency and --max-tokens must be >= 1", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    model = str(ensure_tiny_model(args.variant))
    print(f"[demo] model: {model}")
    lengths = [block_edge_lengths(32)[i % 6] + 16 * (i // 6) for i in range(args.requests)]
    prompts = token_prompts(lengths, seed=2026)

    print("[demo] colocated reference run (one in-process engine)...")
    with llm_engine(model) as llm:
        reference = generate_ids(llm, prompts, args.max_tokens)

    from kvconnectors.integration.cluster import PDCluster
    from kvconnectors.integration.workload import percentiles, run_workload
    from kvconnectors.testing.compare import first_mismatch

    print(f"[demo] starting 1 prefill + 1 decode vllm serve with TieredConnector ({args.transport}) "
          "and the proxy...")
    started = time.monotonic()
    with PDCluster(model, transport=args.transport, log_dir=args.out / "logs") as pd:
        print(f"[demo] ready in {time.monotonic() - started:.0f} s; proxy at {pd.proxy_url}")
        name = pd.prefill[0].served_model_name
        results = run_workload(pd.proxy_url, name, prompts, args.max_tokens, concurrency=args.concurrency,
                               desc="P/D requests")
        decode_metrics = pd.decode[0].metrics()
        prefill_metrics = pd.prefill[0].metrics()

    mismatches = [(r.index, first_mismatch([reference[r.index]], [r.token_ids])) for r in results if not r.error]
    wrong = [(i, m) for i, m in mismatches if m]
    errors = [r for r in results if r.error]
    moved = _metric_sum(decode_metrics, "kvconnectors:transfer_bytes_total")
    xfer_s = _metric_sum(decode_metrics, "kvconnectors:transfer_seconds_sum")
    failures = _metric_sum(decode_metrics, "kvconnectors:transfer_failures_total")
    ttft = percentiles([r.ttft_s for r in results if r.ttft_s is not None])
    itl = percentiles([g for r in results for g in r.gaps_s])
    summary = {
        "requests": len(results), "identical_to_colocated": len(mismatches) - len(wrong),
        "wrong_outputs": len(wrong), "failed_requests": len(errors),
        "ttft_ms": {k: round(v * 1e3, 2) for k, v in ttft.items()},
        "itl_ms": {k: round(v * 1e3, 2) for k, v in itl.items()},
        "kv_bytes_moved": int(moved), "kv_bytes_staged": int(_metric_sum(prefill_metrics, "kvconnectors:staged_bytes_total")),
        "transfer_gbps": round(moved / xfer_s / 1e9, 3) if xfer_s else None,
        "transfer_failures": int(failures), "transport": args.transport,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    # one block, printed and (with --results-dir) saved as it was printed: the README quotes it
    lines = [
        f"  decode output == colocated : {summary['identical_to_colocated']}/{len(results)} requests"
        + ("  OK" if not wrong and not errors else "  MISMATCH"),
        f"  TTFT p50 / p99              : {summary['ttft_ms']['p50']:.1f} / {summary['ttft_ms']['p99']:.1f} ms",
        f"  ITL  p50 / p99              : {summary['itl_ms']['p50']:.2f} / {summary['itl_ms']['p99']:.2f} ms",
        f"  KV moved                    : {moved / 1e6:.2f} MB in {xfer_s * 1e3:.1f} ms of transfers"
        f" ({summary['transfer_gbps']} GB/s)",
        f"  failures                    : {len(errors)} requests, {int(failures)} transfers"]
    lines += [f"  request {i}: {m}" for i, m in wrong[:5]]
    lines += [f"  request {r.index} failed: {r.error}" for r in errors[:5]]
    if not args.no_plot:
        lines.append(f"  plot                        : {_plot(results, args.out / 'demo.png')}")
    lines.append(f"  summary                     : {args.out / 'summary.json'}")
    text = "\n".join(lines)
    print()
    print(text)
    if args.results_dir is not None:
        from kvconnectors.benchmarks.common import save_results

        save_results(args.results_dir, "demo", text, summary)
    return 0 if not wrong and not errors and summary["kv_bytes_moved"] > 0 else 1


def _plot(results: list, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if not r.error and r.ttft_s is not None]
    t0 = min((r.token_times[0] - r.ttft_s for r in ok), default=0.0)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar([r.index for r in ok], [r.ttft_s * 1e3 for r in ok], color="tab:blue")
    a.set(title="Time to first token (prefill + KV transfer + first decode step)", xlabel="request",
          ylabel="ms")
    for r in ok:
        if r.gaps_s:
            b.plot([t - t0 for t in r.token_times[1:]], [g * 1e3 for g in r.gaps_s], ".", ms=3)
    b.set(title="Inter-token gaps on the decode instance", xlabel="time since start (s)", ylabel="ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
