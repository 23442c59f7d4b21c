"""Shared pieces of the benchmarks: environment, statistics, tables, JSON and PNG output.

Statistics. Every timed iteration gives one duration. "median" is the median duration and "p99" the
99th percentile duration (linear interpolation, so with a handful of iterations it is close to the
slowest one). Throughput and per-token cost are derived from those durations, so "GB/s p99" is the
throughput of the p99 (slow-tail) iteration, i.e. the lower bound almost every iteration beat.
1 GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "artifacts" / "bench"


def setup_env() -> None:
    """UCX settings every process that loads NIXL or Mooncake needs on a CPU-only host (without
    UCX_MODULES=^ib it segfaults at exit once libibverbs1 is installed). setdefault: an RDMA host
    can still override them."""
    os.environ.setdefault("UCX_MODULES", "^ib")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake: errors only (it logs INFO lines otherwise)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL: no INFO line per agent


def summarize(times_s: Sequence[float], nbytes: int, tokens: int) -> dict[str, float]:
    t = np.asarray(times_s, dtype=np.float64)
    med = float(np.median(t))
    p99 = float(np.percentile(t, 99))
    return {
        "iterations": int(t.size),
        "median_s": med,
        "p99_s": p99,
        "min_s": float(t.min()),
        "gbps_median": nbytes / med / 1e9,
        "gbps_p99": nbytes / p99 / 1e9,
        "us_per_token_median": med / tokens * 1e6,
        "us_per_token_p99": p99 / tokens * 1e6,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        return f"{x:.{digits}f}" if abs(x) >= 10 ** -digits else f"{x:.2g}"
    return str(x)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A plain-text table; `align` is one letter per column, l or r (default: first l, rest r)."""
    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    align = align or "l" + "r" * (len(headers) - 1)

    def line(vals: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if a == "l" else v.rjust(w) for v, w, a in zip(vals, widths, align)).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def host_info() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(),
                            "cpus": os.cpu_count(), "numpy": np.__version__}
    try:
        info["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def out_dir(path: str | os.PathLike | None) -> Path:
    d = Path(path) if path else DEFAULT_OUT
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_json(path: Path, obj: Any) -> None:
    def default(x: Any) -> Any:
        if isinstance(x, (np.integer,)):
            return int(x)
        if isinstance(x, (np.floating,)):
            return float(x)
        if isinstance(x, Path):
            return str(x)
        raise TypeError(f"not JSON serialisable: {type(x).__name__}")

    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=default) + "\n")
    os.replace(tmp, path)


def bar_chart(path: Path, labels: Sequence[str], median: Sequence[float], p99: Sequence[float],
              colors: Sequence[str], title: str, ylabel: str = "GB/s (median; p99 as the dark tick)",
              notes: Sequence[str] = (), legend: Sequence[tuple[str, str]] = ()) -> None:
    """Bars of the median with the p99 (slow-tail) value marked, one colour per kind of path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(labels) + 2), 4.8))
    x = np.arange(len(labels))
    bars = ax.bar(x, median, color=colors, edgecolor="black", linewidth=0.5)
    ax.scatter(x, p99, marker="_", s=600, color="black", zorder=3)
    for b, v in zip(bars, median):
        ax.annotate(f"{v:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                    fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(x, labels, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    if legend:
        ax.legend(handles=[Patch(color=c, label=l) for l, c in legend], fontsize=8, loc="upper right")
    if notes:
        fig.text(0.01, 0.01, "\n".join(notes), fontsize=7, va="bottom", family="monospace")
        fig.subplots_adjust(bottom=0.17 + 0.03 * len(notes))
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def progress(total: int, desc: str, enabled: bool = True):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="it", file=sys.stderr, disable=not enabled, leave=False,
                dynamic_ncols=True)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows defaults and keeps the description's own line breaks (the path tables)."""


def description(doc: str | None) -> str:
    """A module docstring up to its "Usage:" paragraph."""
    return (doc or "").split("\nUsage:")[0].strip()


def module_main(module: str, doc: str | None, add_arguments: Callable[[argparse.ArgumentParser], None],
                run: Callable[[argparse.Namespace], int], argv: list[str] | None = None) -> int:
    """`python -m benchmarks.X`: the benchmark's own flags and help (the same as `kvconnectors bench X`)."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description(doc),
                                     formatter_class=HelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def publish(result: dict[str, Any], out: str | os.PathLike | None, stem: str,
            plot: Callable[[dict[str, Any], Path], None], render: Callable[[dict[str, Any]], str],
            quiet: bool = False) -> dict[str, Any]:
    """Write a benchmark's JSON and PNG under `out` (their paths go into result["files"]) and print
    its tables unless quiet; returns the result."""
    d = out_dir(out)
    result["files"] = {"json": str(d / f"{stem}.json"), "png": str(d / f"{stem}.png")}
    write_json(d / f"{stem}.json", result)
    plot(result, d / f"{stem}.png")
    if not quiet:
        print(render(result))
    return result
