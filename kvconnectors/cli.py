"""The `kvconnectors` command: one sub-command per module, imported only when that command runs.

Each sub-command lives in the module that does the work and exposes `add_arguments(parser)` and
`run(args) -> int`; this file only wires them up. `kvconnectors --help` imports none of them, so it
works with the base dependencies alone and stays fast (no vLLM, torch or aiohttp). A command whose
optional dependency is missing fails with one line naming the module and the extra to install
(extras.py), exit status 2. This dispatcher is the only place in kvconnectors/ that names the
`integration/` and `benchmarks/` folders (installed as kvconnectors.integration/.benchmarks), and only
as strings: the command line is the top of the arrows. DESCRIPTION and EPILOG are what a user reads
in `kvconnectors --help`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Collection

from kvconnectors import __version__
from kvconnectors.cli_types import HelpFormatter, pipe_safe
from kvconnectors.extras import missing_dependency

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

# name -> (module, one-line help); a module is imported only when its command runs or prints its --help
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("kvconnectors.planner_cli", "Should I split prefill and decode, and how many GPUs per pool?"),
    "demo": ("kvconnectors.benchmarks.demo", "Run a real prefill->decode handoff on the tiny model and compare with colocated."),
    "make-model": ("kvconnectors.testing.tinymodel", "Generate (or --list) the deterministic tiny test models."),
    "serve-pd": ("kvconnectors.integration.launcher",
                 "Launch prefill and decode `vllm serve` pools plus the P/D proxy."),
    "proxy": ("kvconnectors.integration.proxy", "Run the P/D proxy in front of running prefill/decode instances."),
    "check-config": ("kvconnectors.integration.preflight",
                     "Check a --kv-transfer-config before starting vLLM: print the effective settings or the refusal."),
    "conformance": ("kvconnectors.conformance.cli", "Run the connector conformance suite and print a matrix."),
    "bench": ("kvconnectors.benchmarks.cli", "Run a benchmark (transfer, tiers, layerwise, e2e, proxy, device)."),
}


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The command line. Each command in `commands` (default: every one) gets its module's flags and
    `run`, which imports the module; the others only their name and help line."""
    commands = COMMANDS if commands is None else commands
    parser = argparse.ArgumentParser(prog="kvconnectors", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        if name in commands:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The console script: every command's output may go into a pipe that closes early."""
    return pipe_safe(lambda: _dispatch(list(sys.argv[1:] if argv is None else argv)))


def _dispatch(argv: list[str]) -> int:
    command = next((a for a in argv if not a.startswith("-")), None)
    command = command if command in COMMANDS else None
    try:
        parser = build_parser([command] if command else [])
        args = parser.parse_args(argv)
        if not getattr(args, "_run", None):
            parser.print_help()
            return 2
        return int(args._run(args) or 0)
    except ModuleNotFoundError as exc:  # at the command's import or while it runs
        missing = missing_dependency(exc)
        if missing is None:  # not an optional package: a bug, show it whole
            raise
        print(f"kvconnectors {command}: error: {missing}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
