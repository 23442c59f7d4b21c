"""Whether a directory's filesystem accepts O_DIRECT, asked independently of the store.

The store decides per NVMe directory between O_DIRECT and buffered I/O (`NvmeTier._try_direct`).
A test that merely skips when the store reports "buffered" cannot catch a regression to buffered
I/O, so tests ask this probe instead: where the filesystem accepts O_DIRECT, the store must use
it (`require_direct`); only where the probe itself is refused (tmpfs, some overlays) may a test
skip, with the probe's reason. The probe shares no code with the store on purpose: a bug in the
store's own probe must not also convince the test that O_DIRECT is unsupported.
"""

from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

BLOCK = 4096  # covers 512-byte and 4 KiB logical blocks, the alignment the store requires


@dataclass(frozen=True)
class Probe:
    directory: str
    supported: bool
    reason: str   # what was refused, or "O_DIRECT accepted"


def probe(directory: str | os.PathLike[str]) -> Probe:
    """Open a fresh file in `directory` with O_DIRECT and do one aligned write and read of it from
    page-aligned memory (an anonymous mmap); some filesystems accept the flag at open and refuse
    the first I/O, so both steps count. The file is removed whatever happens."""
    d = str(directory)
    if not hasattr(os, "O_DIRECT"):
        return Probe(d, False, "O_DIRECT is not defined on this platform")
    path = os.path.join(d, f".odirect-probe-{uuid.uuid4().hex}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        _unlink(path)  # some kernels create the file before refusing the flag
        return Probe(d, False, f"open(O_DIRECT) in {d}: {exc.strerror or exc}")
    buf = mmap.mmap(-1, BLOCK)  # anonymous mappings are page-aligned
    try:
        buf.write(b"\xa5" * BLOCK)
        if os.pwritev(fd, [buf], 0) != BLOCK or os.preadv(fd, [buf], 0) != BLOCK:
            return Probe(d, False, f"short O_DIRECT I/O in {d}")
        return Probe(d, True, "O_DIRECT accepted")
    except OSError as exc:
        return Probe(d, False, f"aligned I/O with O_DIRECT in {d}: {exc.strerror or exc}")
    finally:
        buf.close()
        os.close(fd)
        _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def first_supporting(candidates: Iterable[str | os.PathLike[str]]) -> tuple[Path | None, list[Probe]]:
    """The first candidate directory whose filesystem accepts O_DIRECT (None if none does), and
    every probe made, so a skip can say why each candidate was refused."""
    probes: list[Probe] = []
    for c in candidates:
        p = probe(c)
        probes.append(p)
        if p.supported:
            return Path(c), probes
    return None, probes


def require_direct(modes: Mapping[str, str], reasons: Mapping[str, str] | None = None) -> None:
    """Per NVMe directory of a store (`modes`: directory -> "direct" | "buffered"): fail if the
    store is buffered where the filesystem accepts O_DIRECT; skip, with the probe's reason, only
    where the filesystem refuses it."""
    import pytest  # only the checks need it; `probe` is usable outside a test run

    if not modes:
        pytest.fail("the store reports no NVMe directories: nothing to check O_DIRECT on")
    refused = []
    for directory, mode in modes.items():
        p = probe(directory)
        if p.supported and mode != "direct":
            why = (reasons or {}).get(directory, "no reason reported")
            pytest.fail(f"{directory}: the filesystem accepts O_DIRECT ({p.reason}) but the store uses "
                        f"{mode!r} I/O there (store's reason: {why})")
        if not p.supported and mode != "direct":
            refused.append(p.reason)
    if refused:
        pytest.skip("filesystem refuses O_DIRECT: " + "; ".join(refused))
