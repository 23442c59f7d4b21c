"""Human-readable byte sizes: "8g", "512MiB", "1.5GB", 4096.

Rule (documented because operators mix them up): binary units are powers of 1024 — the IEC
suffixes (KiB, MiB, GiB, TiB) *and* the bare single letters (k, m, g, t), as in docker/JVM flags;
the two-letter SI suffixes (KB, MB, GB, TB) are powers of 1000. Case is ignored; a trailing "b"/"B"
alone means bytes. Fractions are allowed ("1.5GiB") and rounded down to a whole byte.

In a config (`size_setting`), a decimal unit is accepted as decimal but logged once per key and
value as a warning with its byte count and the binary spelling: "8gb" is 8 000 000 000 bytes,
"8g" and "8GiB" are 8 589 934 592, and mixing them up is usually a mistake.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any

from kvconnectors.errors import ConfigError

log = logging.getLogger(__name__)

_UNITS: dict[str, int] = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _UNITS[_p] = 1024 ** _i
    _UNITS[_p + "ib"] = 1024 ** _i
    _UNITS[_p + "b"] = 1000 ** _i

_SIZE_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*([A-Za-z]*)\s*$")


def parse_size(value: int | float | str) -> int:
    """Return `value` as a non-negative whole number of bytes; raise ValueError if it is not one."""
    if isinstance(value, bool):  # bool is an int subclass; True bytes is always a mistake
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"size must be a finite number >= 0, got {value!r}")
        if not value.is_integer():  # 1.5 bytes is a unit left out ('1.5g'), not 1 byte
            raise ValueError(f"a number of bytes must be whole, got {value!r} (with a unit: '{value:g}g', "
                             f"'{value:g}MiB')")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"not a size: {value!r}")
    m = _SIZE_RE.match(value)
    if m is None:
        raise ValueError(f"not a size: {value!r} (examples: 4096, '64KiB', '8g', '1.5GB')")
    number, exponent, unit = m.groups()
    mult = _UNITS.get(unit.lower())
    if mult is None:
        raise ValueError(f"unknown size unit {unit!r} in {value!r} (use B, KiB/MiB/GiB/TiB, k/m/g/t or KB/MB/GB/TB)")
    number = number.replace("_", "")
    if "." in number or exponent:  # exact for ints, float only where a fraction was written
        return int(float(number + (f"e{exponent}" if exponent else "")) * mult)
    return int(number) * mult


def decimal_unit(value: Any) -> str | None:
    """The decimal (SI, powers of 1000) unit `value` is written in ("GB"), or None."""
    if not isinstance(value, str):
        return None
    m = _SIZE_RE.match(value)
    unit = m.group(3) if m else ""
    return unit if unit.lower() in _DECIMAL else None


_DECIMAL = {p + "b" for p in "kmgtp"}
_warned: set[tuple[str, str]] = set()  # (key, value) already warned about in this process


def size_setting(key: str, value: Any, *, allow_zero: bool = False) -> int:
    """A config size in bytes; ConfigError naming the key and value if it is not a positive size
    (or 0 with `allow_zero`); a decimal unit is accepted but warned about once (see above)."""
    try:
        n = parse_size(value)
    except ValueError as exc:
        raise ConfigError(key, value, f"is not a size ({exc}); use e.g. 1073741824, '8g' or '512MiB'") from None
    if n == 0 and not allow_zero:
        raise ConfigError(key, value, "must be a positive size")
    unit = decimal_unit(value)
    if unit is not None and (key, value) not in _warned:
        _warned.add((key, value))
        binary = value[: value.lower().rindex(unit.lower())].rstrip() + unit[0].upper() + "iB"
        log.warning("%s=%r uses the decimal unit %r: %d bytes (powers of 1000); if you meant binary "
                    "(powers of 1024) write %r = %d bytes", key, value, unit, n, binary, parse_size(binary))
    return n


def format_size(n: int) -> str:
    """Short binary rendering for messages: 16384 -> '16.0KiB'."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{int(x)}B" if unit == "B" else f"{x:.1f}{unit}"
        x /= 1024
    raise AssertionError("unreachable")
