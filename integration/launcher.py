"""`kvconnectors serve-pd`: start prefill and decode vLLM servers plus the P/D proxy, as one unit.

What it does, in order:
  1. plans the instances: one `--kv-transfer-config` per instance (kv_producer for prefill,
     kv_consumer for decode), a free HTTP port each, a unique KV store port (TieredConnector) or
     NIXL side-channel port (NixlConnector) each, and a core each (instance i -> i % ncpu);
  2. starts every server (`VllmServer`: own process group, whole tree pinned, logs to
     `<log-dir>/<name>.log` and to the terminal with a `[prefill-0] ` prefix) and waits for /health;
  3. starts the proxy (in this process, as a subprocess, or not at all);
  4. runs until Ctrl-C / SIGTERM or until any instance dies, then stops everything (SIGTERM, then
     SIGKILL after a bounded wait). A failed start stops what was already started.

`--dry-run` prints the plan (every command line and config) without starting anything.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kvconnectors
from kvconnectors.cli_types import PortInUseError, check_port_free, port_or_zero, positive_int
from kvconnectors.serving import ServerStartError, VllmServer, free_port, stop_all

if TYPE_CHECKING:
    from kvconnectors.integration.proxy import ProxyConfig

log = logging.getLogger("kvconnectors.serve-pd")

CONNECTORS = ("TieredConnector", "NixlConnector")
TRANSPORTS = ("tcp", "shm", "nixl")
TIERED_MODULE = "kvconnectors.tiered"
# The directory that holds the `kvconnectors` package: servers must import it to load
# TieredConnector through kv_connector_module_path, installed or not. Taken from the package, not
# from this file: installed, this file lives at kvconnectors/integration/, in a checkout at integration/.
PACKAGE_ROOT = str(Path(kvconnectors.__file__).resolve().parents[1])


# --------------------------------------------------------------------------------------------
# plan


@dataclasses.dataclass
class InstancePlan:
    name: str                         # prefill-0, decode-1, ...
    role: str                         # prefill | decode
    port: int
    core: int | None
    kv_transfer_config: dict[str, Any]
    env: dict[str, str]
    kv_addr: str | None = None        # host:port of its KV store (TieredConnector), for push mode

    @property
    def kv_role(self) -> str:
        return self.kv_transfer_config["kv_role"]

    def url(self, host: str) -> str:
        return f"http://{host}:{self.port}"


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` updated by `extra`, recursing into dicts present in both (neither is modified)."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def kv_transfer_config(connector: str, kv_role: str, *, transport: str | None = None,
                       store_port: int | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One instance's `--kv-transfer-config`; `extra` is deep-merged on top."""
    if connector == "TieredConnector":
        cfg: dict[str, Any] = {
            "kv_connector": "TieredConnector",
            "kv_connector_module_path": TIERED_MODULE,
            "kv_role": kv_role,
            "kv_connector_extra_config": {"transport": transport or "tcp", "store_port": store_port},
        }
    elif connector == "NixlConnector":
        # kv_both is deprecated in vLLM 0.32; "cpu" lets NIXL register host DRAM directly.
        cfg = {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu"}
    else:
        raise ValueError(f"--connector {connector!r}: expected one of {CONNECTORS}")
    return deep_merge(cfg, extra or {})


def plan_instances(args: argparse.Namespace, cores: Sequence[int] | None = None,
                   port_fn: Callable[[], int] = free_port) -> list[InstancePlan]:
    """Prefill instances first, then decode; instance i is pinned to cores[i % len(cores)]."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else list(cores)
    extra = args.kv_transfer_config_extra or {}
    plans: list[InstancePlan] = []
    roles = [("prefill", "kv_producer")] * args.prefill + [("decode", "kv_consumer")] * args.decode
    counts = {"prefill": 0, "decode": 0}
    for i, (role, kv_role) in enumerate(roles):
        name = f"{role}-{counts[role]}"
        counts[role] += 1
        env: dict[str, str] = {}
        kv_addr = None
        if args.connector == "TieredConnector":
            store_port = port_fn()
            # push: decode instances run a landing store at store_port; the proxy passes its
            # address to the prefill instance, which streams layer groups there.
            mode = {"kv_connector_extra_config": {"transfer_mode": "push"}} if args.mode == "push" else {}
            cfg = kv_transfer_config("TieredConnector", kv_role, transport=args.transport,
                                     store_port=store_port, extra=deep_merge(mode, extra))
            port_in_cfg = cfg.get("kv_connector_extra_config", {}).get("store_port", store_port)
            kv_addr = f"{args.host}:{port_in_cfg}"
        else:
            cfg = kv_transfer_config("NixlConnector", kv_role, extra=extra)
            # Each engine's NIXL handshake listener needs its own port (default 5600 for all).
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port_fn())
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = args.host
        core = None if args.no_pin or not cores else cores[i % len(cores)]
        plans.append(InstancePlan(name, role, port_fn(), core, cfg, env, kv_addr))
    return plans


def server_args(plan: InstancePlan, args: argparse.Namespace) -> list[str]:
    """Extra argv for one server, after VllmServer's CPU defaults (later flags win in vLLM)."""
    return ["--kv-transfer-config", json.dumps(plan.kv_transfer_config, separators=(",", ":")),
            *shlex.split(args.vllm_args or "")]


def build_server(plan: InstancePlan, args: argparse.Namespace, log_dir: Path) -> VllmServer:
    return VllmServer(
        args.model, name=plan.name, served_model_name=args.served_model_name, host=args.host,
        port=plan.port, extra_args=server_args(plan, args), env=plan.env, core=plan.core,
        pythonpath=[PACKAGE_ROOT], log_path=log_dir / f"{plan.name}.log",
        stream_logs=not args.quiet, health_timeout=args.health_timeout)


def proxy_config(plans: Sequence[InstancePlan], args: argparse.Namespace,
                 extra_argv: Sequence[str] = ()) -> "ProxyConfig":
    """The proxy's settings for these plans, built directly (pools, host, port, mode); the user's
    --proxy-args (and `extra_argv`) amend them as the proxy's own flags would: a repeated flag
    (--prefill, --decode) adds instances, any other replaces the value. Validated: a bad flag or
    combination is a ValueError naming it, before any server starts."""
    from kvconnectors.integration import proxy as proxy_mod
    from kvconnectors import settings

    values: dict[str, Any] = {
        "host": args.proxy_host, "port": args.proxy_port, "mode": args.mode,
        "prefill": [proxy_mod.InstanceSpec(p.url(args.host)) for p in plans if p.role == "prefill"],
        "decode": [proxy_mod.InstanceSpec(p.url(args.host), p.kv_addr) for p in plans if p.role != "prefill"]}
    parser = _RaisingParser(prog="proxy")
    settings.add_arguments(parser, proxy_mod.ProxyConfig, overrides_only=True)
    try:
        given = vars(parser.parse_args([*shlex.split(args.proxy_args or ""), *extra_argv]))
        for key, value in given.items():
            values[key] = values[key] + value if key in ("prefill", "decode") else value
        config = proxy_mod.ProxyConfig(**values)
        config.validate()
    except ValueError as exc:
        raise ValueError(f"invalid proxy flags (check --proxy-args): {exc}") from None
    return config


def proxy_argv(plans: Sequence[InstancePlan], args: argparse.Namespace) -> list[str]:
    """The proxy's command line for these plans (`python -m kvconnectors.integration.proxy ...`), from proxy_config."""
    from kvconnectors.integration import proxy as proxy_mod

    return proxy_mod.config_argv(proxy_config(plans, args))


def validate(args: argparse.Namespace) -> None:
    """Reject bad combinations before anything starts; messages name the flag and value."""
    if args.prefill < 1 or args.decode < 1:
        raise ValueError(f"--prefill {args.prefill} / --decode {args.decode}: need at least one of each")
    if args.connector == "NixlConnector":
        if args.transport not in (None, "nixl"):
            raise ValueError(f"--transport {args.transport!r} does not apply to NixlConnector (it always uses NIXL)")
        if args.mode == "push":
            raise ValueError("--mode push needs TieredConnector (NixlConnector's own push flow is not "
                             "driven by this proxy)")


def json_object(value: str) -> dict[str, Any]:
    """argparse type: a JSON object."""
    try:
        obj = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON {value!r}: {exc}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return obj


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # type: ignore[override]
        raise ValueError(message)


def parse_proxy_argv(argv: Sequence[str]) -> "ProxyConfig":
    """A whole proxy command line (as `python -m kvconnectors.integration.proxy` takes it), parsed and validated."""
    from kvconnectors.integration import proxy as proxy_mod

    parser = _RaisingParser(prog="proxy")
    proxy_mod.add_arguments(parser)
    try:
        config = proxy_mod.config_from_args(parser.parse_args(list(argv)))
        config.validate()
    except ValueError as exc:
        raise ValueError(f"invalid proxy flags (check --proxy-args): {exc}") from None
    return config


def describe(plans: Sequence[InstancePlan], args: argparse.Namespace, log_dir: Path,
             proxy_cfg: "ProxyConfig | None" = None) -> str:
    from kvconnectors.integration import proxy as proxy_mod

    proxy_cfg = proxy_cfg or proxy_config(plans, args)
    lines = []
    for p in plans:
        srv = build_server(p, args, log_dir)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in {**({"VLLM_CPU_OMP_THREADS_BIND": str(p.core)}
                                                              if p.core is not None else {}), **p.env}.items())
        lines.append(f"# {p.name} ({p.kv_role}, core {p.core}, {p.url(args.host)}"
                     + (f", kv store {p.kv_addr}" if p.kv_addr else "") + ")")
        lines.append((env + " " if env else "") + shlex.join(srv.command()))
    lines.append("# proxy")
    lines.append(shlex.join([sys.executable, "-m", "kvconnectors.integration.proxy", *proxy_mod.config_argv(proxy_cfg)]))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (or hub id) served by every instance")
    parser.add_argument("--served-model-name", default=None,
                        help="model name clients send (default: the model directory's name)")
    parser.add_argument("--prefill", type=positive_int, default=1, metavar="N", help="number of prefill instances")
    parser.add_argument("--decode", type=positive_int, default=1, metavar="M", help="number of decode instances")
    parser.add_argument("--connector", choices=CONNECTORS, default="TieredConnector",
                        help="KV connector every instance loads")
    parser.add_argument("--transport", choices=TRANSPORTS, default=None,
                        help="TieredConnector transport: tcp (any host), shm (same host), nixl; "
                             "NixlConnector always uses NIXL (default: tcp)")
    parser.add_argument("--mode", choices=("pull", "push"), default="pull",
                        help="pull: decode fetches the KV after prefill; push: prefill streams it to the "
                             "chosen decode instance's store while computing (TieredConnector)")
    parser.add_argument("--kv-transfer-config-extra", type=json_object, default=None, metavar="JSON",
                        help="JSON object deep-merged into every instance's --kv-transfer-config, e.g. "
                             "'{\"kv_load_failure_policy\":\"recompute\",\"kv_connector_extra_config\":"
                             "{\"lease_ttl_s\":30}}'")
    parser.add_argument("--vllm-args", default="", metavar="ARGS",
                        help="extra arguments for every vLLM server, one shell-quoted string, e.g. "
                             "'--max-model-len 4096 --max-num-seqs 8' (they override the CPU defaults)")
    parser.add_argument("--host", default="127.0.0.1", help="address the vLLM servers listen on")
    parser.add_argument("--proxy-host", default="127.0.0.1", help="address the proxy listens on")
    parser.add_argument("--proxy-port", type=port_or_zero, default=8000,
                        help="port the proxy listens on; 0 picks a free one (the log says which)")
    parser.add_argument("--proxy", choices=("inprocess", "subprocess", "none"), default="inprocess",
                        help="run the proxy in this process, as `python -m kvconnectors.integration.proxy`, "
                             "or not at all")
    parser.add_argument("--proxy-args", default="", metavar="ARGS",
                        help="extra proxy flags, one shell-quoted string, e.g. '--prefill-timeout 60'")
    parser.add_argument("--no-pin", action="store_true",
                        help="do not pin instance i's whole process tree to core i %% ncpu")
    parser.add_argument("--health-timeout", type=float, default=300.0,
                        help="seconds to wait for every server's /health before giving up")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="where <instance>.log files go (default: a new temporary directory)")
    parser.add_argument("--quiet", action="store_true",
                        help="do not echo server logs to the terminal (they still go to --log-dir)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print every command and --kv-transfer-config, start nothing")


class _Stop(Exception):
    """SIGTERM during the blocking start-up phase."""


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="[serve-pd] %(message)s")
    try:
        validate(args)
        plans = plan_instances(args)
        proxy_cfg = proxy_config(plans, args)
        if args.proxy != "none" and not args.dry_run:
            check_port_free(proxy_cfg.host, proxy_cfg.port)  # now, not after minutes of vLLM start-up
    except PortInUseError as exc:
        print(f"kvconnectors serve-pd: error: {exc.advice('--proxy-port')}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"kvconnectors serve-pd: error: {exc}", file=sys.stderr)
        return 2
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvc-serve-pd-"))
    if args.dry_run:
        print(describe(plans, args, log_dir, proxy_cfg))
        return 0
    servers = [build_server(p, args, log_dir) for p in plans]
    proxy_proc: subprocess.Popen[bytes] | None = None

    def on_term(signum: int, frame: Any) -> None:
        raise _Stop()

    old_term = signal.signal(signal.SIGTERM, on_term)
    try:
        log.info("logs in %s", log_dir)
        for s in servers:  # launch all, then wait: the starts overlap
            log.info("starting %s on %s (core %s)", s.name, s.url, s.core)
            s.start(wait=False)
        deadline = time.monotonic() + args.health_timeout
        for s in servers:
            s.wait_healthy(timeout=max(1.0, deadline - time.monotonic()))
            log.info("%s healthy", s.name)
        if args.proxy == "subprocess":
            from kvconnectors.integration import proxy as proxy_mod

            proxy_proc = subprocess.Popen(
                [sys.executable, "-m", "kvconnectors.integration.proxy", *proxy_mod.config_argv(proxy_cfg)],
                cwd=PACKAGE_ROOT, start_new_session=True)
        # asyncio's own handlers replace on_term inside _supervise; until then on_term still covers
        return asyncio.run(_supervise(servers, proxy_cfg if args.proxy == "inprocess" else None, proxy_proc))
    except ServerStartError as exc:
        log.error("%s", exc)
        return 1
    except PortInUseError as exc:  # taken since the check above
        print(f"kvconnectors serve-pd: error: {exc.advice('--proxy-port')}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the proxy host is not an address of this machine
        log.error("could not start: %s", exc)
        return 1
    except (KeyboardInterrupt, _Stop):
        log.info("interrupted during start-up")
        return 130
    finally:
        # Already stopping: a second SIGTERM must not cut the teardown short (Ctrl-C still can).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if proxy_proc is not None and proxy_proc.poll() is None:
            proxy_proc.terminate()
            try:
                proxy_proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proxy_proc.kill()
        stop_all(servers)
        signal.signal(signal.SIGTERM, old_term)
        log.info("all instances stopped")


async def _supervise(servers: Sequence[VllmServer], proxy_cfg: "ProxyConfig | None",
                     proxy_proc: subprocess.Popen[bytes] | None) -> int:
    """Run the in-process proxy (if any) until a signal or until any instance exits."""
    from kvconnectors.integration import proxy as proxy_mod

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    pd: proxy_mod.PDProxy | None = None
    rc = 0
    try:
        if proxy_cfg is not None:
            pd = proxy_mod.PDProxy(proxy_cfg)
            port = await pd.start(proxy_cfg.host, proxy_cfg.port)
            log.info("proxy ready on http://%s:%s", proxy_cfg.host, port)
        while not stop.is_set():
            dead = [s for s in servers if s.poll() is not None]
            if dead:
                for s in dead:
                    log.error("%s exited with code %s; shutting everything down. Last log lines:\n%s",
                              s.name, s.poll(), s.log_tail(20))
                rc = 1
                break
            if proxy_proc is not None and proxy_proc.poll() is not None:
                log.error("proxy exited with code %s; shutting everything down", proxy_proc.returncode)
                rc = 1
                break
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
        else:
            log.info("signal received; shutting down")
    finally:
        if pd is not None:
            await pd.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return rc
