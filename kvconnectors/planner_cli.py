"""`kvconnectors plan`: the analytic planner (kvconnectors.planner) on the command line.

Pick presets (--model, --gpu, --link), override any field, describe the traffic, and read a table
plus a verdict; --json prints the whole plan, --plot writes a PNG (matplotlib, imported only then).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Callable

from kvconnectors.errors import ConfigError
from kvconnectors.planner import (GPUS, LINKS, MODELS, GPUSpec, LinkSpec, ModelSpec, Plan, Workload,
                                  fmt_time, plan, ttft_bulk_s, ttft_chunked_s, ttft_colocated_s,
                                  ttft_layerwise_s)

# ---------------------------------------------------------------------------------------------------
# argument types: argparse turns ArgumentTypeError into "argument --flag: <message>"


def _number(kind: Callable[[str], float], low: float, high: float | None, what: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not (value > low if high is None else low < value <= high):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value
    parse.__name__ = what  # argparse's fallback message uses the type's name
    return parse


_positive = _number(float, 0, None, "a number > 0")
_count = _number(int, 0, None, "a whole number >= 1")
_fraction = _number(float, 0, 1, "a fraction in (0, 1]")

_OVERRIDE = argparse.SUPPRESS  # absent unless given, so the preset's value stands


def add_arguments(parser: argparse.ArgumentParser) -> None:
    hw = parser.add_argument_group("model, GPU and link (a preset, then any field overridden)")
    hw.add_argument("--model", choices=sorted(MODELS), default="llama-8b",
                    help="model preset: llama-8b (8.0e9 params, 128 KiB KV/token), llama-70b "
                         "(70.6e9 params, 80 layers, 320 KiB KV/token), tiny (the project's 2-layer fp32 test model)")
    hw.add_argument("--params", type=_positive, default=_OVERRIDE, metavar="COUNT",
                    help="parameter count, e.g. 8.03e9 (default: the --model preset's); prefill costs 2 FLOPs "
                         "per parameter per token, decode reads params x --dtype-bytes per step")
    hw.add_argument("--layers", type=_count, default=_OVERRIDE, metavar="N",
                    help="transformer layers (default: the --model preset's)")
    hw.add_argument("--kv-heads", type=_count, default=_OVERRIDE, metavar="N",
                    help="KV heads, i.e. GQA groups, not query heads (default: the --model preset's)")
    hw.add_argument("--head-dim", type=_count, default=_OVERRIDE, metavar="N",
                    help="attention head dimension, elements (default: the --model preset's)")
    hw.add_argument("--dtype-bytes", type=_count, default=_OVERRIDE, metavar="BYTES",
                    help="bytes per weight and KV element: 4 fp32, 2 bf16/fp16, 1 fp8 "
                         "(default: the --model preset's)")
    hw.add_argument("--gpu", choices=sorted(GPUS), default="h100-sxm",
                    help="GPU preset (dense bf16 peak, memory bandwidth, memory): h100-sxm 989 TFLOP/s "
                         "3.35 TB/s 80 GB, h200 989/4.8/141, a100-80g 312/2.039/80, l40s 362/0.864/48")
    hw.add_argument("--peak-tflops", type=_positive, default=_OVERRIDE, metavar="TFLOPS",
                    help="dense bf16 peak, TFLOP/s, no sparsity (default: the --gpu preset's)")
    hw.add_argument("--mem-bw-tbs", type=_positive, default=_OVERRIDE, metavar="TBS",
                    help="memory bandwidth, TB/s = 1e12 bytes/s (default: the --gpu preset's)")
    hw.add_argument("--memory-gb", type=_positive, default=_OVERRIDE, metavar="GB",
                    help="device memory, GB = 1e9 bytes, only used to warn when a decode batch "
                         "does not fit (default: the --gpu preset's)")
    hw.add_argument("--mfu", type=_fraction, default=0.4, metavar="FRACTION",
                    help="model FLOPs utilisation prefill achieves, a fraction of --peak-tflops in (0, 1]")
    hw.add_argument("--link", choices=list(LINKS), default="100gbe",
                    help="prefill->decode link preset, one direction: nvlink 3600 Gb/s (450 GB/s), "
                         "ib200 200 Gb/s, 100gbe 100 Gb/s, 25gbe 25 Gb/s")
    hw.add_argument("--link-gbps", type=_positive, default=_OVERRIDE, metavar="GBPS",
                    help="effective link rate, Gbit/s one direction, e.g. 80 for a 100 GbE link "
                         "that achieves 10 GB/s (default: the --link preset's)")

    wl = parser.add_argument_group("traffic and serving")
    defaults = Workload()
    wl.add_argument("--prompt-tokens", type=_count, default=defaults.prompt_tokens, metavar="TOKENS",
                    help="prompt length of the arriving request, tokens")
    wl.add_argument("--output-tokens", type=_count, default=defaults.output_tokens, metavar="TOKENS",
                    help="tokens generated per request (decode pool sizing)")
    wl.add_argument("--users", type=_count, default=defaults.users, metavar="N",
                    help="decode streams batched on one decode GPU (each decode step reads their KV)")
    wl.add_argument("--context-tokens", type=_count, default=defaults.context_tokens, metavar="TOKENS",
                    help="live context per decoding user, tokens")
    wl.add_argument("--chunk-tokens", type=_count, default=defaults.chunk_tokens, metavar="TOKENS",
                    help="chunked-prefill chunk size, tokens (vLLM --max-num-batched-tokens)")
    wl.add_argument("--arrival-rate", type=_positive, default=defaults.arrival_rate, metavar="REQ_PER_S",
                    help="request arrival rate, requests/s (pool sizing by Little's law)")
    wl.add_argument("--utilization", type=_fraction, default=defaults.utilization, metavar="FRACTION",
                    help="target utilisation of each pool, in (0, 1]")
    wl.add_argument("--layer-group-size", type=_count, default=defaults.layer_group_size, metavar="LAYERS",
                    help="layers shipped together by layer-wise transfer (1 = each layer as soon as "
                         "it is computed); at most --layers")

    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the whole plan as JSON (times in seconds)")
    out.add_argument("--plot", metavar="PATH", default=None,
                     help="also write a PNG: TTFT vs prompt length per link and the worst decode gaps")
    parser.set_defaults(_plan_parser=parser)  # so run() can report cross-field errors argparse-style


def run(args: argparse.Namespace) -> int:
    try:
        result = plan_from_args(args)
    except ConfigError as exc:  # a cross-field check (e.g. --layer-group-size > --layers)
        args._plan_parser.error(f"argument --{exc.key.replace('_', '-')}: {exc.why}, got {exc.value!r}")
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_plan(result))
    if args.plot:
        write_plot(result, args.plot)
        # keep stdout pure JSON when --json is given
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _overrides(args: argparse.Namespace, names: tuple[str, ...]) -> dict:
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def plan_from_args(args: argparse.Namespace) -> Plan:
    model: ModelSpec = replace(MODELS[args.model], **_overrides(
        args, ("params", "layers", "kv_heads", "head_dim", "dtype_bytes")))
    gpu: GPUSpec = replace(GPUS[args.gpu], **_overrides(args, ("peak_tflops", "mem_bw_tbs", "memory_gb")))
    link: LinkSpec = LINKS[args.link]
    if hasattr(args, "link_gbps"):
        link = LinkSpec(f"{args.link}@{args.link_gbps:g}Gb/s", gbps=args.link_gbps)
    workload = Workload(
        prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens, users=args.users,
        context_tokens=args.context_tokens, chunk_tokens=args.chunk_tokens,
        arrival_rate=args.arrival_rate, utilization=args.utilization, mfu=args.mfu,
        layer_group_size=args.layer_group_size)
    return plan(model, gpu, link, workload)


# ---------------------------------------------------------------------------------------------------
# text


def format_plan(p: Plan) -> str:
    m, g, w = p.model, p.gpu, p.workload
    rows = [
        f"model     {m.name}: {m.params:,.0f} params, {m.layers} layers, {m.kv_heads} KV heads x "
        f"{m.head_dim} dims x {m.dtype_bytes} B -> {m.kv_bytes_per_token / 1024:g} KiB KV/token, "
        f"{m.weight_bytes / 1e9:.3g} GB weights",
        f"gpu       {g.name}: {g.peak_tflops:g} TFLOP/s at {w.mfu:.0%} MFU, {g.mem_bw_tbs:g} TB/s, "
        f"{g.memory_gb:g} GB",
        f"traffic   {w.prompt_tokens}-token prompts, {w.output_tokens} output tokens, "
        f"{w.arrival_rate:g} req/s; {w.users} decode users x {w.context_tokens} tokens of context",
        "",
        f"prefill       {fmt_time(p.prefill_per_token_s)}/token, {fmt_time(p.prefill_s)} per prompt",
        f"decode step   {fmt_time(p.decode_step_weights_only_s)} weights only, "
        f"{fmt_time(p.decode_step_s)} with {w.users} users",
        "",
        f"{'':<24}{'worst decode gap':>18}{'TTFT (idle)':>17}",
    ]
    for label, gap, ttft in (
            ("colocated", p.worst_gap_colocated_s, fmt_time(p.ttft_colocated_s)),
            (f"chunked ({w.chunk_tokens} tokens)", p.worst_gap_chunked_s, fmt_time(p.ttft_chunked_s)),
            ("disaggregated", p.worst_gap_disaggregated_s, "per link below")):
        rows.append(f"  {label:<22}{fmt_time(gap):>18}{ttft:>17}")
    rows += [
        "",
        f"{'link':<18}{'KV/token':>10}{'KV/prompt':>11}{'TTFT bulk':>11}{'TTFT layer-wise':>17}"
        f"   split? bulk / layer-wise",
    ]
    for a in p.links:
        mark = "*" if a.link == p.chosen.link else " "
        rows.append(
            f"{mark} {a.link.name:<16}{fmt_time(a.transfer_per_token_s):>10}{fmt_time(a.transfer_prompt_s):>11}"
            f"{fmt_time(a.ttft_bulk_s):>11}{fmt_time(a.ttft_layerwise_s):>17}"
            f"   {_yes_no(a.split_bulk):>6} / {_yes_no(a.split_layerwise)}")
    pools = p.pools
    rows += [
        f"  layer-wise ships {w.layer_group_size} layer(s) at a time; split when the TTFT a link adds "
        f"is below the {fmt_time(p.stall_removed_s)} freeze it removes",
        "",
        f"pools at {w.utilization:.0%} utilisation (Little's law): prefill {pools.prefill_gpus:.3g} GPUs, "
        f"decode {pools.decode_gpus_batched:.3g} GPUs batching {w.users} streams "
        f"({pools.decode_gpus_one_stream:.3g} at one stream per GPU)",
        "",
        f"verdict: {p.verdict}",
    ]
    return "\n".join(rows)


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


# ---------------------------------------------------------------------------------------------------
# plot


def write_plot(p: Plan, path: str) -> None:
    """TTFT vs prompt length (colocated, chunked, and per link bulk and layer-wise) beside the worst
    decode gaps for the configured prompt."""
    import numpy as np
    from matplotlib.figure import Figure  # no pyplot: no global state, Agg canvas for PNG

    # linear axes: the per-link lines are straight and fan out, so the transfer tax is visible
    prompts = np.unique(np.linspace(1, max(16384, 2 * p.workload.prompt_tokens), 64).astype(int))
    workloads = [replace(p.workload, prompt_tokens=int(n)) for n in prompts]
    model, gpu = p.model, p.gpu

    def series(fn: Callable[[Workload], float]) -> list[float]:
        return [fn(w) * 1e3 for w in workloads]  # ms

    fig = Figure(figsize=(12, 4.8), layout="constrained")
    ttft_ax, gap_ax = fig.subplots(1, 2, width_ratios=(2, 1))
    ttft_ax.plot(prompts, series(lambda w: ttft_colocated_s(model, gpu, w)), color="black", lw=3,
                 alpha=0.5, zorder=3, label="colocated (prefill only)")
    ttft_ax.plot(prompts, series(lambda w: ttft_chunked_s(model, gpu, w)), color="grey", ls="--",
                 label=f"colocated, {p.workload.chunk_tokens}-token chunks")
    for a, colour in zip(p.links, ("C0", "C1", "C2", "C3", "C4", "C5")):
        link = a.link
        ttft_ax.plot(prompts, series(lambda w: ttft_bulk_s(model, gpu, link, w)), color=colour,
                     label=f"{link.name} bulk")
        ttft_ax.plot(prompts, series(lambda w: ttft_layerwise_s(model, gpu, link, w)), color=colour,
                     ls=":", label=f"{link.name} layer-wise")
    ttft_ax.set(xlabel="prompt length (tokens)", ylabel="TTFT on an idle system (ms)",
                title=f"TTFT, {model.name} on {gpu.name} at {p.workload.mfu:.0%} MFU")
    ttft_ax.grid(True, alpha=0.3)
    ttft_ax.legend(fontsize=7, ncol=2)

    names = ["colocated", f"chunked\n({p.workload.chunk_tokens} tok)", "disaggregated"]
    gaps = [p.worst_gap_colocated_s * 1e3, p.worst_gap_chunked_s * 1e3, p.worst_gap_disaggregated_s * 1e3]
    bars = gap_ax.bar(names, gaps, color=["black", "grey", "C2"])
    gap_ax.bar_label(bars, fmt="%.3g ms")
    gap_ax.set(ylabel="worst decode gap (ms)",
               title=f"one {p.workload.prompt_tokens}-token prompt arrives,\n"
                     f"{p.workload.users} users decoding")
    fig.savefig(path, format="png", dpi=120)
