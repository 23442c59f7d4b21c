"""The `kvconnectors` command: one sub-command per module, registered lazily.

Each sub-command lives in the module that does the work and exposes
`add_arguments(parser)` and `run(args) -> int`; this file only wires them up, so
`kvconnectors --help` stays fast (no vLLM or torch import until a command runs).
DESCRIPTION and EPILOG are what a user reads in `kvconnectors --help`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvconnectors import __version__
from kvconnectors.cli_types import HelpFormatter, pipe_safe

DESCRIPTION = """\
Disaggregated prefill/decode serving for vLLM with TieredConnector: decide whether splitting
prefill and decode pays off for your model and link, launch prefill and decode `vllm serve` pools
behind one OpenAI endpoint, check a KV connector against the conformance suite, and measure the
KV transfer paths."""

EPILOG = """\
examples:
  kvconnectors plan --model llama-8b --gpu h100-sxm --link 100gbe
  kvconnectors serve-pd --model /models/llama-3-8b --prefill 1 --decode 2

`kvconnectors COMMAND --help` lists a command's options."""

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("kvconnectors.planner_cli", "Should I split prefill and decode, and how many GPUs per pool?"),
    "demo": ("kvconnectors.demo", "Run a real prefill->decode handoff on the tiny model and compare with colocated."),
    "make-model": ("kvconnectors.testing.tinymodel", "Generate the deterministic tiny test model."),
    "serve-pd": ("kvconnectors.integration.launcher",
                 "Launch prefill and decode `vllm serve` pools plus the P/D proxy."),
    "proxy": ("kvconnectors.integration.proxy", "Run the P/D proxy in front of running prefill/decode instances."),
    "conformance": ("kvconnectors.conformance.cli", "Run the connector conformance suite and print a matrix."),
    "bench": ("kvconnectors.benchmarks.cli", "Run a benchmark (transfer, tiers, layerwise, e2e, proxy, device)."),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvconnectors", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        if only is not None and name != only:
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # a sub-command whose extra is not installed
            if only == name:  # say why now, before argparse trips over its own arguments
                parser.error(f"{name} is unavailable: {exc}")
            p.set_defaults(_unavailable=f"{name} is unavailable: {exc}")
            continue
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The console script: every command's output may go into a pipe that closes early."""
    return pipe_safe(lambda: _dispatch(list(sys.argv[1:] if argv is None else argv)))


def _dispatch(argv: list[str]) -> int:
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if getattr(args, "_unavailable", None):
        parser.error(args._unavailable)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
