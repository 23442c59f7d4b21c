"""Shared pieces of the benchmarks: environment, statistics, tables, JSON and PNG output.

Statistics. Every timed iteration gives one duration. "median" is the median duration and "p99" the
99th percentile duration (linear interpolation, so with a handful of iterations it is close to the
slowest one). Throughput and per-token cost are derived from those durations, so "GB/s p99" is the
throughput of the p99 (slow-tail) iteration, i.e. the lower bound almost every iteration beat.
1 GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

import kvconnectors
from kvconnectors.cli_types import HelpFormatter, pipe_safe
from kvconnectors.transport.ucx_env import set_cpu_defaults


def source_checkout() -> Path | None:
    """The source checkout kvconnectors runs from (an editable install or PYTHONPATH), or None when
    it is installed from a wheel. Found from the package, not this file: installed, this file lives at
    kvconnectors/benchmarks/, in a checkout at benchmarks/."""
    root = Path(kvconnectors.__file__).resolve().parents[1]
    return root if (root / "setup.py").is_file() else None


CHECKOUT = source_checkout()
# A checkout keeps its outputs in the checkout, from any working directory; an installed copy writes
# below the working directory (never into site-packages).
DEFAULT_OUT = (CHECKOUT or Path()) / "artifacts" / "bench"
RESULTS_DIR = (CHECKOUT or Path()) / "docs" / "results"  # runs the README quotes (see docs/results/README.md)
RESULT_JSON_MAX_BYTES = 50_000
RAW_SAMPLE_KEYS = frozenset({"runs", "raw"})  # per-repetition samples: kept in artifacts/, not in docs/results
MAX_LIST_NUMBERS = 16  # a longer list of numbers is a sample, kept as its n / min / median / max


def setup_env() -> None:
    """UCX settings every process that loads NIXL or Mooncake needs on a CPU-only host (without
    UCX_MODULES=^ib it segfaults at exit once libibverbs1 is installed), and quieter engine logs.
    setdefault: an RDMA host can still override them."""
    set_cpu_defaults()
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


def description(doc: str | None) -> str:
    """A module docstring up to its "Usage:" paragraph."""
    return (doc or "").split("\nUsage:")[0].strip()


def module_main(module: str, doc: str | None, add_arguments: Callable[[argparse.ArgumentParser], None],
                run: Callable[[argparse.Namespace], int], argv: list[str] | None = None) -> int:
    """`python -m kvconnectors.benchmarks.X`: the benchmark's own flags and help (as `kvconnectors bench X`)."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description(doc),
                                     formatter_class=HelpFormatter)
    add_arguments(parser)
    return pipe_safe(lambda: run(parser.parse_args(argv)))


def publish(result: dict[str, Any], out: str | os.PathLike | None, stem: str,
            plot: Callable[[dict[str, Any], Path], None], render: Callable[[dict[str, Any]], str],
            quiet: bool = False, results_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Write a benchmark's JSON and PNG under `out` (their paths go into result["files"]), print its
    tables unless quiet, and with `results_dir` also save that text (the same string) and a summary
    JSON there (save_results); returns the result."""
    d = out_dir(out)
    result["files"] = {"json": str(d / f"{stem}.json"), "png": str(d / f"{stem}.png")}
    write_json(d / f"{stem}.json", result)
    plot(result, d / f"{stem}.png")
    text = render(result)
    if not quiet:
        print(text)
    if results_dir is not None:
        save_results(results_dir, stem, text, result)
    return result


# ============================================================================== runs the README quotes
def add_results_argument(parser: argparse.ArgumentParser) -> None:
    """--results-dir, the same for every producer of README numbers."""
    parser.add_argument("--results-dir", default=None, metavar="DIR",
                        help="also save this run where the README can quote it: NAME.txt (the command line, "
                             "then exactly the text printed) and NAME.json (its summary numbers), e.g. "
                             "docs/results")


def _program(path: str) -> str:
    """An installed program by its name (`/x/.venv/bin/python` -> `python`); a relative one (`./dev`) as given."""
    return Path(path).name if os.path.isabs(path) or "/bin/" in path else path


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed: `kvconnectors bench ...` for the console script, `python -m MODULE ...`
    for a module run (sys.argv[0] is then the module's file path, which no reader can type)."""
    argv = list(sys.argv if argv is None else argv)
    prog = _program(argv[0]) if argv else "python"
    if prog.endswith(".py"):
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        prog = f"python -m {spec.name}" if spec is not None else f"python {argv[0]}"
    return " ".join([prog] + [shlex.quote(a) for a in argv[1:]])


def summary_numbers(obj: Any) -> Any:
    """`obj` without its raw samples, so the committed JSON stays small: RAW_SAMPLE_KEYS are replaced by a
    note and a list of more than MAX_LIST_NUMBERS numbers by its n / min / median / max."""
    if isinstance(obj, dict):
        return {k: ("omitted: raw samples (the full run is in artifacts/)" if k in RAW_SAMPLE_KEYS
                    else summary_numbers(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        numbers = [x for x in obj if isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)]
        if len(obj) > MAX_LIST_NUMBERS and len(numbers) == len(obj):
            v = np.asarray(numbers, dtype=np.float64)
            return {"n": int(v.size), "min": float(v.min()), "median": float(np.median(v)), "max": float(v.max())}
        return [summary_numbers(x) for x in obj]
    return obj


def _git_state() -> dict[str, Any]:
    """The commit the run was made from, and whether the tree had local changes (None: not a checkout)."""
    def git(*args: str) -> str | None:
        if CHECKOUT is None:  # an installed copy: a repo around site-packages is not the code that ran
            return None
        try:
            p = subprocess.run(["git", *args], cwd=CHECKOUT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def save_results(results_dir: str | os.PathLike, name: str, text: str, result: Any,
                 command: str | None = None) -> tuple[Path, Path]:
    """NAME.txt: the command line, then `text` exactly as it was printed; NAME.json: the command, when,
    the git state, the host and summary_numbers(result). The README quotes the .txt verbatim
    (tests/unit/test_readme_results.py checks it). Returns both paths."""
    d = Path(results_dir)
    d.mkdir(parents=True, exist_ok=True)
    command = command or command_line()
    txt, js = d / f"{name}.txt", d / f"{name}.json"
    txt.write_text(f"{command}\n{text.rstrip()}\n")
    record = {"command": command, "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "git": _git_state(), "host": host_info(), "result": summary_numbers(result)}
    write_json(js, record)
    size = js.stat().st_size
    if size > RESULT_JSON_MAX_BYTES:  # loud, not fatal: the run is done; the README test refuses it
        print(f"warning: {js} is {size:,} bytes (> {RESULT_JSON_MAX_BYTES:,}): too large to commit", file=sys.stderr)
    print(f"results: {txt} and {js}", file=sys.stderr)
    return txt, js


def capture(results_dir: str | os.PathLike, name: str, cmd: Sequence[str], keep: str | None = None) -> int:
    """Run `cmd`, pass its stdout through and save it as a result: NAME.txt (the command, then its stdout,
    only the lines matching `keep` when given) and NAME.json (exit status, wall time, and every line of
    the form `WORD {json}` parsed, e.g. the soak test's `SOAK {...}`). For producers with no
    --results-dir of their own (the soak test, the planner, the test suite). Returns cmd's exit status."""
    pattern = re.compile(keep) if keep else None
    kept: list[str] = []
    tagged: dict[str, Any] = {}
    t0 = time.monotonic()
    with subprocess.Popen(list(cmd), stdout=subprocess.PIPE, text=True, bufsize=1) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            line = line.rstrip("\n")
            if pattern is None or pattern.search(line):
                kept.append(line)
            m = re.search(r"(?:^|\s)([A-Z][A-Z_]*) (\{.*\})\s*$", line)  # pytest may print a prefix
            if m:
                try:
                    tagged[m.group(1)] = json.loads(m.group(2))
                except json.JSONDecodeError:
                    pass
    rc = proc.wait()
    result = {"returncode": rc, "wall_s": round(time.monotonic() - t0, 1), "tagged": tagged}
    shown = [_program(cmd[0])] + [shlex.quote(a) for a in cmd[1:]]
    save_results(results_dir, name, "\n".join(kept), result, command=" ".join(shown))
    return rc


def main(argv: list[str] | None = None) -> int:
    """`python -m kvconnectors.benchmarks.common capture NAME [--keep REGEX] [--results-dir DIR] -- CMD ...`"""
    argv = list(sys.argv[1:] if argv is None else argv)
    # split at the first "--" by hand: argparse's REMAINDER would swallow the options after NAME
    ours, cmd = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m kvconnectors.benchmarks.common", description=capture.__doc__,
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("capture", help="run a command (after --) and save its output under --results-dir")
    p.add_argument("name", help="file stem: NAME.txt and NAME.json")
    p.add_argument("--keep", default=None, help="regular expression: save only the stdout lines it matches")
    p.add_argument("--results-dir", default=str(RESULTS_DIR), help="folder for NAME.txt and NAME.json")
    args = parser.parse_args(ours)
    if not cmd:
        parser.error("capture: give the command after --")
    return capture(args.results_dir, args.name, cmd, args.keep)


if __name__ == "__main__":
    sys.exit(pipe_safe(main))
