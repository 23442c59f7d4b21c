"""StoreConfig: every knob of the tiered store, normalised and validated at construction.

Every invalid value raises ConfigError naming the key and the value, so a bad
`kv_connector_extra_config` fails at start-up with a message an operator can act on.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any, Literal

from kvconnectors.errors import ConfigError
from kvconnectors.store.sizes import format_size, parse_size

PAGE = 4096  # O_DIRECT alignment we require (covers 512-byte and 4 KiB logical blocks)
_NAME_RE = re.compile(r"^[A-Za-z0-9_.]{1,64}$")  # no "-": it separates fields in file names

ODirectMode = Literal["auto", True, False]


@dataclass
class StoreConfig:
    slot_bytes: int | str                         # bytes of one (layer, block)
    dram_bytes: int | str                         # the DRAM arena, preallocated once
    nvme_dirs: list[str] = field(default_factory=list)
    nvme_bytes: int | str = 0                     # total over all dirs; 0 disables the tier
    lease_ttl_s: float = 30.0
    shm_name: str | None = None                   # name under /dev/shm for same-host zero-copy readers
    io_threads: int = 4                           # NVMe I/Os in flight
    o_direct: ODirectMode | str = "auto"          # auto: use it where the filesystem accepts it
    instance_name: str = "default"                # goes into file names, for humans and cleanup logs
    tombstones: int = 10_000                      # how many ended keys still answer "lease expired"
    max_io_bytes: int | str = 8 << 20             # cap of one coalesced NVMe I/O
    dram_prefault: bool = True                    # touch the arena at start so staging never page-faults

    def __post_init__(self) -> None:
        self.slot_bytes = _size("slot_bytes", self.slot_bytes)
        self.dram_bytes = _size("dram_bytes", self.dram_bytes)
        self.nvme_bytes = _size("nvme_bytes", self.nvme_bytes, allow_zero=True)
        self.max_io_bytes = _size("max_io_bytes", self.max_io_bytes)
        if self.dram_bytes < self.slot_bytes:
            raise ConfigError("dram_bytes", self.dram_bytes,
                              f"smaller than one slot (slot_bytes={format_size(self.slot_bytes)})")
        self.o_direct = _o_direct(self.o_direct)
        if self.o_direct is True and self.slot_bytes % PAGE:
            raise ConfigError("o_direct", True, f"needs slot_bytes to be a multiple of {PAGE}, got {self.slot_bytes}")
        if isinstance(self.lease_ttl_s, bool) or not isinstance(self.lease_ttl_s, (int, float)) \
                or not math.isfinite(self.lease_ttl_s) or self.lease_ttl_s <= 0:
            raise ConfigError("lease_ttl_s", self.lease_ttl_s, "must be a finite number of seconds > 0")
        self.lease_ttl_s = float(self.lease_ttl_s)
        for key in ("io_threads", "tombstones"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(key, v, "must be an integer >= 1")
        if not isinstance(self.instance_name, str) or not _NAME_RE.match(self.instance_name):
            raise ConfigError("instance_name", self.instance_name, "must be 1-64 characters of [A-Za-z0-9_.]")
        if self.shm_name is not None and (not isinstance(self.shm_name, str) or not _NAME_RE.match(self.shm_name)):
            raise ConfigError("shm_name", self.shm_name,
                              "must be 1-64 characters of [A-Za-z0-9_.] (a file in /dev/shm)")
        self._check_nvme()

    def _check_nvme(self) -> None:
        if isinstance(self.nvme_dirs, (str, os.PathLike)):  # a lone path is a common slip
            self.nvme_dirs = [self.nvme_dirs]
        dirs = [os.path.abspath(os.fspath(d)) for d in self.nvme_dirs]
        if len(set(dirs)) != len(dirs):
            raise ConfigError("nvme_dirs", self.nvme_dirs, "lists a directory twice")
        self.nvme_dirs = dirs
        if self.nvme_bytes and not dirs:
            raise ConfigError("nvme_bytes", self.nvme_bytes, "is > 0 but nvme_dirs is empty")
        if not self.nvme_bytes:
            return
        per_dir = self.nvme_bytes // len(dirs)
        if per_dir < self.slot_bytes:
            raise ConfigError("nvme_bytes", self.nvme_bytes,
                              f"gives {format_size(per_dir)} per directory, less than one slot "
                              f"({format_size(self.slot_bytes)}) over {len(dirs)} directories")
        for d in dirs:
            _check_writable_dir(d)

    @property
    def dram_slots(self) -> int:
        return self.dram_bytes // self.slot_bytes  # type: ignore[operator]

    @property
    def nvme_slots_per_dir(self) -> int:
        if not self.nvme_bytes:
            return 0
        return (self.nvme_bytes // len(self.nvme_dirs)) // self.slot_bytes  # type: ignore[operator]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StoreConfig":
        """Build from a JSON-ish mapping (e.g. kv_connector_extra_config["store"]); unknown keys fail."""
        known = {f.name for f in dataclasses.fields(cls)}
        for k in d:
            if k not in known:
                raise ConfigError(k, d[k], f"unknown store setting (known: {', '.join(sorted(known))})")
        for k in ("slot_bytes", "dram_bytes"):
            if k not in d:
                raise ConfigError(k, None, "is required")
        return cls(**d)


def _size(key: str, value: Any, allow_zero: bool = False) -> int:
    try:
        n = parse_size(value)
    except ValueError as exc:
        raise ConfigError(key, value, str(exc)) from None
    if n == 0 and not allow_zero:
        raise ConfigError(key, value, "must be > 0")
    return n


def _o_direct(value: Any) -> ODirectMode:
    if value is True or value is False or value == "auto":
        return value
    if isinstance(value, str) and value.lower() in ("auto", "true", "false", "on", "off", "yes", "no", "1", "0"):
        v = value.lower()
        return "auto" if v == "auto" else v in ("true", "on", "yes", "1")
    raise ConfigError("o_direct", value, "must be 'auto', true or false")


def _check_writable_dir(d: str) -> None:
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as exc:
        raise ConfigError("nvme_dirs", d, f"cannot create the directory: {exc.strerror or exc}") from None
    if not os.path.isdir(d):
        raise ConfigError("nvme_dirs", d, "is not a directory")
    # access() lies for root and on some mounts; creating a file is the real test.
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvc-probe-", dir=d)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError("nvme_dirs", d, f"is not writable: {exc.strerror or exc}") from None
