"""The proxy's command line: `kvconnectors proxy` (add_arguments, run) and
`python -m kvconnectors.integration.proxy` (main), both serving a PDProxy until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from kvconnectors.cli_types import HelpFormatter, PortInUseError, pipe_safe

from .app import PDProxy
from .config import ProxyConfig, add_arguments, config_from_args

__all__ = ["add_arguments", "main", "run", "serve"]

DESCRIPTION = "The prefill/decode proxy: one OpenAI endpoint in front of pools of vLLM prefill and decode servers."


async def serve(config: ProxyConfig, host: str, port: int, stop: asyncio.Event | None = None) -> None:
    """Run the proxy until `stop` is set, or SIGINT/SIGTERM (when called from the main thread)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    handled: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread: the caller owns shutdown
    proxy = PDProxy(config)
    try:
        await proxy.start(host, port)
        await stop.wait()
    finally:
        await proxy.stop()
        for sig in handled:
            loop.remove_signal_handler(sig)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(args, "log_level", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        config.validate()
    except ValueError as exc:
        print(f"kvconnectors proxy: error: {exc}", file=sys.stderr)
        return 2
    try:
        _run_loop(serve(config, config.host, config.port))
    except PortInUseError as exc:
        flag = "--metrics-port" if config.metrics_port and exc.port == config.metrics_port else "--port"
        print(f"kvconnectors proxy: error: {exc.advice(flag)}", file=sys.stderr)
        return 2
    return 0


def _run_loop(coro: Any) -> None:
    """uvloop when installed (it ships with vLLM): the proxy's per-request cost is mostly event-loop
    and HTTP parsing work, which uvloop roughly halves."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvconnectors.integration.proxy",
                                     description=DESCRIPTION, formatter_class=HelpFormatter)
    add_arguments(parser)
    return pipe_safe(lambda: run(parser.parse_args(argv)))
