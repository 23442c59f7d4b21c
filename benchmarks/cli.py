"""`kvconnectors bench <benchmark>`: the benchmark sub-commands.

    kvconnectors bench transfer --preset 8b --tokens 2048 --block-tokens 16
    kvconnectors bench tiers --bytes 256MiB
    kvconnectors bench e2e
    kvconnectors bench proxy --requests 200
    kvconnectors bench layerwise --preset 8b --tokens 2000 --group 4
    kvconnectors bench device --device cuda --layout all
    kvconnectors bench link --tokens 3000

Each benchmark module also runs on its own: `python -m kvconnectors.benchmarks.transfer`,
`python -m kvconnectors.benchmarks.tiers`, `python -m kvconnectors.benchmarks.layerwise`,
`python -m kvconnectors.benchmarks.device`.
"""

from __future__ import annotations

import argparse
import sys

from kvconnectors.benchmarks.common import description
from kvconnectors.cli_types import HelpFormatter, pipe_safe

# name -> (module, one-line help); modules are imported only when their sub-command is parsed
BENCHMARKS: dict[str, tuple[str, str]] = {
    "transfer": ("kvconnectors.benchmarks.transfer",
                 "KV of N tokens through memcpy, a raw socket, our tcp/shm/nixl, NIXL and Mooncake, side by side."),
    "tiers": ("kvconnectors.benchmarks.tiers",
              "The store's spill/restore GB/s beside raw O_DIRECT writes/reads of the same bytes."),
    "e2e": ("kvconnectors.benchmarks.e2e",
            "Streaming users while long prompts arrive: colocated, chunked, TieredConnector, NIXL."),
    "proxy": ("kvconnectors.benchmarks.proxy_overhead",
              "Latency the P/D proxy adds, beside the same requests done by hand."),
    "layerwise": ("kvconnectors.benchmarks.layerwise",
                  "TTFT of a pushed prompt: prefill alone, bulk and layer-wise over emulated links; short-prompt "
                  "crossover."),
    "link": ("kvconnectors.benchmarks.link",
             "TTFT of a long prompt between emulated hosts on shaped links: colocated, pull, push bulk, push "
             "layer-wise, NIXL, beside the planner's model; needs root."),
    "device": ("kvconnectors.benchmarks.device",
               "The mover's Stager/Loader on GPU-shaped caches beside plain index_select/index_copy_ (cuda or cpu); "
               "no vLLM."),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    import importlib

    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    for name, (module_name, help_text) in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=description(module.__doc__) or help_text,
                           formatter_class=HelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_bench_run=module.run)
    parser.set_defaults(_bench_help=parser.format_help)


def run(args: argparse.Namespace) -> int:
    bench = getattr(args, "_bench_run", None)
    if bench is None:
        help_text = getattr(args, "_bench_help", None)
        print(help_text() if help_text else "choose a benchmark: " + ", ".join(BENCHMARKS), file=sys.stderr)
        return 2
    return int(bench(args) or 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvconnectors.benchmarks.cli",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    return pipe_safe(lambda: run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
