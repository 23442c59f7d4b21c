"""StoreConfig: every knob of the tiered store, declared once (type, constraint, default, doc) and
checked at construction.

Every invalid value raises ConfigError naming the key and the value, so a bad
`kv_connector_extra_config` fails at start-up with a message an operator can act on. The field
types say what each value must be (kvconnectors/settings.py checks them); `__post_init__` adds
what a type cannot say (sizes, names, directories, one field against another).
"""

from __future__ import annotations

import difflib
import os
import re
import tempfile
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from kvconnectors import settings
from kvconnectors.errors import ConfigError
from kvconnectors.store.sizes import format_size, size_setting

PAGE = 4096  # O_DIRECT alignment we require (covers 512-byte and 4 KiB logical blocks)
_NAME_RE = re.compile(r"^[A-Za-z0-9_.]{1,64}$")  # no "-": it separates fields in file names

ODirectMode = Literal["auto", True, False]

# Shared declared types (TieredConfig uses them too).
Size = Annotated[int | float | str, Meta(extra={settings.EXPECT: "a size: bytes, or a string like '8g' or '512MiB'"})]
Seconds = Annotated[float, Meta(gt=0, extra={settings.EXPECT: "a finite number of seconds > 0",
                                             settings.FINITE: True})]
Dirs = Annotated[list[Annotated[str, Meta(min_length=1)]],
                 Meta(extra={settings.EXPECT: "a list of directory paths"})]


def _doc(text: str) -> Meta:
    return Meta(description=text)


class StoreConfig(msgspec.Struct):
    slot_bytes: Annotated[Size, _doc("bytes of one (layer, block)")]
    dram_bytes: Annotated[Size, _doc("the DRAM arena, preallocated once")]
    nvme_dirs: Annotated[Dirs, _doc("directories of the NVMe tier, one extent file each; they must exist "
                                    "unless nvme_create_dirs")] = []
    nvme_bytes: Annotated[Size, _doc("total over all dirs; 0 disables the tier")] = 0
    nvme_create_dirs: Annotated[bool, _doc("create missing nvme_dirs (mkdir -p) instead of refusing them")] = False
    lease_ttl_s: Annotated[Seconds, _doc("lease of a staged entry")] = 30.0
    shm_name: Annotated[str | None, _doc("name under /dev/shm for same-host zero-copy readers")] = None
    io_threads: Annotated[int, Meta(ge=1, description="NVMe I/Os in flight")] = 4
    o_direct: Annotated[bool | str, Meta(description="auto: use it where the filesystem accepts it",
                                         extra={settings.EXPECT: "'auto', true or false"})] = "auto"
    instance_name: Annotated[str, _doc("goes into file names, for humans and cleanup logs")] = "default"
    tombstones: Annotated[int, Meta(ge=1, description="how many ended keys still answer 'lease expired'")] = 10_000
    max_io_bytes: Annotated[Size, _doc("cap of one coalesced NVMe I/O")] = 8 << 20
    dram_prefault: Annotated[bool, _doc("touch the arena at start so staging never page-faults")] = True

    def __post_init__(self) -> None:
        if isinstance(self.nvme_dirs, (str, os.PathLike)):  # a lone path is a common slip
            self.nvme_dirs = [self.nvme_dirs]
        if isinstance(self.nvme_dirs, (list, tuple)):  # pathlib.Path entries are paths too
            self.nvme_dirs = [os.fspath(d) if isinstance(d, os.PathLike) else d for d in self.nvme_dirs]
        settings.check_fields(self)
        self.slot_bytes = size_setting("slot_bytes", self.slot_bytes)
        self.dram_bytes = size_setting("dram_bytes", self.dram_bytes)
        self.nvme_bytes = size_setting("nvme_bytes", self.nvme_bytes, allow_zero=True)
        self.max_io_bytes = size_setting("max_io_bytes", self.max_io_bytes)
        if self.dram_bytes < self.slot_bytes:
            raise ConfigError("dram_bytes", self.dram_bytes,
                              f"smaller than one slot (slot_bytes={format_size(self.slot_bytes)})")
        self.o_direct = _o_direct(self.o_direct)
        if self.o_direct is True and self.slot_bytes % PAGE:
            raise ConfigError("o_direct", True, f"needs slot_bytes to be a multiple of {PAGE}, got {self.slot_bytes}")
        if not _NAME_RE.match(self.instance_name):
            raise ConfigError("instance_name", self.instance_name, "must be 1-64 characters of [A-Za-z0-9_.]")
        if self.shm_name is not None and not _NAME_RE.match(self.shm_name):
            raise ConfigError("shm_name", self.shm_name,
                              "must be 1-64 characters of [A-Za-z0-9_.] (a file in /dev/shm)")
        self._check_nvme()

    def _check_nvme(self) -> None:
        dirs = [os.path.abspath(d) for d in self.nvme_dirs]
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
            _check_writable_dir(d, create=self.nvme_create_dirs)

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
        """Build from a JSON-ish mapping (e.g. kv_connector_extra_config["store"]); unknown keys fail
        with the closest known one, missing required ones name themselves."""
        return settings.from_mapping(cls, d, "store")


def _o_direct(value: bool | str) -> ODirectMode:
    if isinstance(value, bool) or value == "auto":
        return value
    if isinstance(value, str) and value.lower() in ("auto", "true", "false", "on", "off", "yes", "no", "1", "0"):
        v = value.lower()
        return "auto" if v == "auto" else v in ("true", "on", "yes", "1")
    raise ConfigError("o_direct", value, "must be 'auto', true or false")


def _check_writable_dir(d: str, create: bool) -> None:
    if create:
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as exc:
            raise ConfigError("nvme_dirs", d, f"cannot create the directory: {exc.strerror or exc}") from None
    elif not os.path.lexists(d):
        # A typo must not become a fresh directory on the root disk: refuse, and say what is close.
        raise ConfigError("nvme_dirs", d, "does not exist" + _near(d) + "; create it, or set nvme_create_dirs: "
                          "true to have the store create it")
    if not os.path.isdir(d):
        raise ConfigError("nvme_dirs", d, "is not a directory")
    # access() lies for root and on some mounts; creating a file is the real test.
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvc-probe-", dir=d)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError("nvme_dirs", d, f"is not writable: {exc.strerror or exc}") from None


def _near(d: str) -> str:
    """ " (did you mean '/mnt/nvme0'?)" when the parent holds a directory of a close name."""
    parent, name = os.path.split(d)
    try:
        siblings = [e.name for e in os.scandir(parent) if e.is_dir()]
    except OSError:
        return f" (nor does its parent {parent})" if not os.path.isdir(parent) else ""
    close = difflib.get_close_matches(name, siblings, n=1)
    return f" (did you mean {os.path.join(parent, close[0])!r}?)" if close else ""
