"""Helpers the launcher's unit tests share: its parser on a fake model, and port numbers."""

from __future__ import annotations

import argparse

from kvconnectors.integration import launcher as L


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    L.add_arguments(parser)
    return parser.parse_args(["--model", "/models/tiny", *argv])


def counter(start: int = 20000):
    state = {"n": start}

    def nxt() -> int:
        state["n"] += 1
        return state["n"]
    return nxt
