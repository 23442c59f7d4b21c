"""kvconnectors log records where pytest's caplog sees them.

An engine started earlier in the process may have routed kvconnectors' logger through vLLM's
(logs.use_vllm_logging, run when vLLM loads the plugin or imports the connector); caplog reads the
root logger. `plain_logging()` lifts that bridge for a block and puts it back after.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from kvconnectors import logs


@contextlib.contextmanager
def plain_logging() -> Iterator[None]:
    root = logging.getLogger(logs.ROOT)
    bridges = [h for h in root.handlers if isinstance(h, logs.ToVllm)]
    if not bridges:
        yield
        return
    level, propagate = root.level, root.propagate
    for handler in bridges:
        root.removeHandler(handler)
    root.setLevel(logging.NOTSET)
    root.propagate = True
    try:
        yield
    finally:
        for handler in bridges:
            root.addHandler(handler)
        root.setLevel(level)
        root.propagate = propagate
