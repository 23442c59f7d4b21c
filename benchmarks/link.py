"""Layer-wise transfer on real links: TTFT of a long prompt between emulated hosts.

Prefill on host `pre`, decode on `dec`, proxy and client on `cli` (network namespaces on this
machine, kvconnectors/testing/hosts.py); the prefill host's link is shaped with tc tbf to rates
where the bulk transfer takes about half, about as long as, and twice as long as the prefill.
Side by side, on the same link and prompts, for each rate:

  colocated        one server prefills and decodes (no link): the prefill time P
  pull             TieredConnector pull: prefill, then the decode pulls every layer
  push-bulk        TieredConnector push, every layer in one message after the last layer
  push-layerwise   TieredConnector push, layer groups streamed while later layers compute
  nixl             vLLM's NixlConnector (UCX over the veth)

TTFT is the latency of a 1-token completion through the proxy (median of --reps). The planner's
model of each, from the measured P and the link's rate: bulk = P + X, layer-wise = max(P + X/g, X +
P/g) (g: layer groups, X: the KV's bytes over the rate). Targets: layer-wise TTFT <= 1.15 x max(P, X)
+ one group; bulk within 25% of P + X. Exit status 1 when a target is missed, 2 when a run failed.
Needs root (network namespaces) and the `deep` tiny model (8 layers), generated locally.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvconnectors.benchmarks.common import add_results_argument, fmt, out_dir, progress, publish, setup_env, table

CONFIGS = ("pull", "push-bulk", "push-layerwise", "nixl")
PLACEMENT = {"prefill": "pre", "decode": "dec", "proxy": "cli"}
LAYERWISE_SLACK = 1.15
BULK_TOLERANCE = 0.25


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=3000, help="prompt length (tokens) of every request")
    parser.add_argument("--reps", type=int, default=3, help="requests per (configuration, rate); the median counts")
    parser.add_argument("--ratios", default="0.5,1,2", metavar="R,R,...",
                        help="link rates as transfer/prefill time ratios: 0.5 = the bulk transfer takes half "
                             "the prefill time")
    parser.add_argument("--group", type=int, default=2, help="push-layerwise: layers per message")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"which of {', '.join(CONFIGS)} to run")
    parser.add_argument("--variant", default="deep", help="tiny-model variant (deep: 8 layers)")
    parser.add_argument("--out", default=None, help="directory for link.json and link.png (default artifacts/bench)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_results_argument(parser)


# ----------------------------------------------------------------------------------- the model
def layer_groups(layers: int, group: int) -> int:
    return -(-layers // group)


def predictions(prefill_s: float, transfer_s: float, groups: int) -> dict[str, float]:
    """The planner's two-stage pipeline (kvconnectors.planner.pipelined_s) on measured inputs."""
    from kvconnectors.planner import pipelined_s

    return {"pull": prefill_s + transfer_s, "push-bulk": prefill_s + transfer_s,
            "push-layerwise": pipelined_s(prefill_s, transfer_s, 1 / groups), "nixl": prefill_s + transfer_s}


def verdicts(rows: list[dict[str, Any]], groups: int) -> list[dict[str, Any]]:
    checks = []
    for r in rows:
        p, x, m = r["prefill_s"], r["transfer_s"], r["ttft_s"]
        lw, bulk = m.get("push-layerwise"), m.get("push-bulk")
        if lw is not None:
            bound = LAYERWISE_SLACK * max(p, x) + max(p, x) / groups
            checks.append({"rate_mbit": r["rate_mbit"], "check": "layer-wise <= 1.15 x max(P, X) + one group",
                           "value_s": lw, "bound_s": bound, "met": lw <= bound})
        if bulk is not None:
            want = p + x
            checks.append({"rate_mbit": r["rate_mbit"], "check": "bulk within 25% of P + X", "value_s": bulk,
                           "bound_s": want, "met": abs(bulk - want) <= BULK_TOLERANCE * want})
    return checks


# ------------------------------------------------------------------------------------- running
def _ttft(url: str, model: str, prompt: list[int]) -> float:
    from kvconnectors.serving import post_json

    t0 = time.perf_counter()
    post_json(f"{url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0},
              timeout=300)
    return time.perf_counter() - t0


def _colocated(model: str, prompt: list[int], reps: int, log_dir: Path) -> float:
    from kvconnectors.serving import VllmServer

    extra = ["--max-model-len", "4096", "--max-num-batched-tokens", "4096"]
    with VllmServer(model, name="colocated", extra_args=extra, core=0, log_path=log_dir / "colocated.log") as s:
        _ttft(s.url, s.served_model_name, prompt)  # warm-up
        return statistics.median(_ttft(s.url, s.served_model_name, prompt) for _ in range(reps))


def _cluster(name: str, model: str, hosts: Any, secret_file: str, group: int, log_dir: Path) -> Any:
    from kvconnectors.integration.cluster import PDCluster

    base = "--max-model-len 4096 --max-num-batched-tokens 4096"
    if name == "nixl":
        return PDCluster(model, connector="NixlConnector", vllm_args=base, log_dir=log_dir / name, hosts=hosts,
                         placement=PLACEMENT)
    extra: dict[str, Any] = {"secret_file": secret_file}
    mode = "pull"
    if name.startswith("push"):
        mode = "push"
        extra.update(layer_group_size=group, layerwise_min_tokens=1 << 30 if name == "push-bulk" else 0)
    return PDCluster(model, vllm_args=base, log_dir=log_dir / name, mode=mode, hosts=hosts, placement=PLACEMENT,
                     kv_extra={"kv_connector_extra_config": extra})


def _kv_bytes(pd: Any, name: str) -> float:
    """KV bytes the decode loaded (pull) or the prefill pushed, summed over the run so far."""
    side = pd.prefill[0] if name.startswith("push") else pd.decode[0]
    metric = "kvconnectors:pushed_bytes_total" if name.startswith("push") else "kvconnectors:transfer_bytes_total"
    return sum(v for _, v in side.metrics().get(metric, []))


def run_link(tokens: int = 3000, reps: int = 3, ratios: tuple[float, ...] = (0.5, 1.0, 2.0), group: int = 2,
             configs: tuple[str, ...] = CONFIGS, variant: str = "deep", show_progress: bool = True,
             log_dir: Path | None = None) -> dict[str, Any]:
    from kvconnectors.testing.hosts import Hosts
    from kvconnectors.testing.prompts import token_prompts
    from kvconnectors.testing.tinymodel import VARIANTS, ensure_tiny_model

    model = str(ensure_tiny_model(variant))
    spec = VARIANTS[variant]
    item = 4 if spec.dtype == "float32" else 2
    kv_bytes = tokens * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2 * item  # K and V, every layer
    prompt = token_prompts([tokens], seed=61)[0]
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kvc-link-"))
    groups = layer_groups(spec.num_layers, group)
    prefill_s = _colocated(model, prompt, reps, log_dir)
    rates = [kv_bytes * 8 / (r * prefill_s) / 1e6 for r in ratios]   # Mbit/s giving X = r * P
    ttft: dict[str, dict[float, float]] = {c: {} for c in configs}
    errors: dict[str, str] = {}
    moved: dict[str, float] = {}
    secret = Path(tempfile.mkdtemp(prefix="kvc-link-secret-")) / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    bar = progress(len(configs) * len(rates) * reps, "link", show_progress)
    try:
        with Hosts(["pre", "dec", "cli"]) as hosts:
            for name in configs:
                bar.set_postfix_str(name)
                try:
                    with _cluster(name, model, hosts, str(secret), group, log_dir) as pd:
                        served = pd.prefill[0].served_model_name
                        with pd.inside_client():
                            _ttft(pd.proxy_url, served, prompt)  # warm-up, on the unshaped link
                        for rate in rates:
                            hosts.shape("pre", egress=f"{rate:.3f}mbit")
                            with pd.inside_client():
                                times = [_ttft(pd.proxy_url, served, prompt) for _ in range(reps)]
                            bar.update(reps)
                            ttft[name][rate] = statistics.median(times)
                        hosts.unshape("pre")
                        if name != "nixl":
                            with pd.inside_client():
                                moved[name] = _kv_bytes(pd, name)
                except Exception as exc:  # one configuration failing must not hide the others
                    errors[name] = f"{type(exc).__name__}: {exc}"[:500]
                    hosts.unshape("pre")
    finally:
        bar.close()
        secret.unlink(missing_ok=True)
    rows = []
    for ratio_, rate in zip(ratios, rates):
        x = kv_bytes * 8 / (rate * 1e6)
        rows.append({"ratio": ratio_, "rate_mbit": round(rate, 3), "prefill_s": prefill_s, "transfer_s": x,
                     "ttft_s": {c: ttft[c].get(rate) for c in configs if rate in ttft[c]},
                     "predicted_s": predictions(prefill_s, x, groups)})
    checks = verdicts(rows, groups)
    return {"config": {"tokens": tokens, "reps": reps, "group": group, "layers": spec.num_layers, "groups": groups,
                       "kv_bytes": kv_bytes, "variant": variant, "configs": list(configs)},
            "prefill_s": prefill_s, "rows": rows, "kv_bytes_counted": moved, "errors": errors, "verdicts": checks,
            "returncode": 2 if errors else (1 if any(not c["met"] for c in checks) else 0)}


# ----------------------------------------------------------------------------------- reporting
def render(result: dict[str, Any]) -> str:
    c = result["config"]
    configs = c["configs"]
    lines = [f"link: {c['tokens']}-token prompt, {c['layers']} layers ({c['groups']} groups of {c['group']}), "
             f"{c['kv_bytes'] / 2**20:.1f} MiB of KV; colocated prefill P = {result['prefill_s'] * 1e3:.0f} ms "
             f"(median of {c['reps']}); prefill host's egress shaped with tc tbf"]
    headers = ["rate Mbit/s", "X/P", "X ms"] + [f"{n} ms" for n in configs] + ["model bulk", "model lw"]
    rows = []
    for r in result["rows"]:
        rows.append([fmt(r["rate_mbit"], 1), fmt(r["ratio"]), fmt(r["transfer_s"] * 1e3, 0)]
                    + [fmt(r["ttft_s"][n] * 1e3, 0) if r["ttft_s"].get(n) is not None else "-" for n in configs]
                    + [fmt(r["predicted_s"]["push-bulk"] * 1e3, 0), fmt(r["predicted_s"]["push-layerwise"] * 1e3, 0)])
    lines.append(table(headers, rows))
    for v in result["verdicts"]:
        lines.append(f"{'MET ' if v['met'] else 'MISS'} {v['rate_mbit']:.1f} Mbit/s: {v['check']}: "
                     f"{v['value_s'] * 1e3:.0f} ms vs {v['bound_s'] * 1e3:.0f} ms")
    for name, err in result["errors"].items():
        lines.append(f"FAILED {name}: {err}")
    return "\n".join(lines)


def _plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    rates = [r["rate_mbit"] for r in rows]
    for name in result["config"]["configs"]:
        ys = [r["ttft_s"].get(name) for r in rows]
        if any(y is not None for y in ys):
            ax.plot(rates, [y * 1e3 if y is not None else float("nan") for y in ys], marker="o", label=name)
    for key, style in (("push-bulk", "--"), ("push-layerwise", ":")):
        ax.plot(rates, [r["predicted_s"][key] * 1e3 for r in rows], style, color="gray",
                label=f"model: {key.split('-')[1]}")
    ax.axhline(result["prefill_s"] * 1e3, color="black", lw=0.8, label="colocated prefill")
    ax.set_xscale("log")
    ax.set_xlabel("prefill host's link (Mbit/s)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(f"{result['config']['tokens']}-token prompt across emulated hosts")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    setup_env()
    ratios = tuple(float(x) for x in args.ratios.split(",") if x.strip())
    configs = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown or not ratios or any(r <= 0 for r in ratios) or args.tokens < 1 or args.reps < 1 or args.group < 1:
        raise SystemExit(f"--configs {unknown or ''} / --ratios {args.ratios!r} / --tokens / --reps / --group: "
                         f"configs from {CONFIGS}, positive ratios and sizes")
    result = run_link(args.tokens, args.reps, ratios, args.group, configs, args.variant, not args.no_progress,
                      out_dir(args.out) / "link_logs")
    publish(result, args.out, "link", _plot, render, results_dir=args.results_dir)
    print(json.dumps({"returncode": result["returncode"]}))
    return result["returncode"]


def main(argv: list[str] | None = None) -> int:
    from kvconnectors.benchmarks.common import module_main

    return module_main(__name__, __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
