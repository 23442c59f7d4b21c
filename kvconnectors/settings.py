"""Declared settings: a msgspec Struct's fields are the one source of each setting's type,
constraints (`Literal`, `Meta(ge=..., le=...)`), default and help text (`Meta(description=...)`).

- `check_fields(obj)` checks every field of a constructed Struct against its declared type and
  raises ConfigError(key, value, "must be <what the type says>"); the configs call it first in
  `__post_init__`, so direct construction and mappings are checked the same way.
- `from_mapping(cls, mapping, what)` refuses unknown keys with a "did you mean" and missing ones.
- `describe(tp)` words a declared type for an error message; `doc(cls, name)` is a field's help.
- `add_arguments(parser, cls)` / `from_args(cls, ns)` / `to_argv(obj)`: command-line flags derived
  from the same fields (name -> --flag-name, the default, the doc as help), so a flag cannot drift
  from its setting.

The checks are msgspec's own (`msgspec.convert(..., strict=True)`: no "30" for 30, no true for 1);
only the wording is ours, read from the declared type, never from msgspec's message text.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import math
import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from kvconnectors.errors import ConfigError

# Meta(extra=...) keys understood here
EXPECT = "expect"   # replaces the generated wording of what a value must be
FINITE = "finite"   # True: refuse nan/inf, which no `gt`/`lt` bound does (msgspec has no finite check)
CLI = "cli"         # False: the setting has no command-line flag
PARSE = "parse"     # argparse type (str -> value); its ArgumentTypeError names the value
FORMAT = "format"   # value -> str, the inverse of PARSE, for to_argv (default: str)
METAVAR = "metavar"
REPEAT = "repeat"   # True: a list setting given as one flag per item (--prefill A --prefill B)


@functools.lru_cache(maxsize=None)
def fields(cls: type) -> tuple[msgspec.structs.FieldInfo, ...]:
    return msgspec.structs.fields(cls)


def _field(cls: type, name: str) -> msgspec.structs.FieldInfo:
    return next(f for f in fields(cls) if f.name == name)


def _split(tp: Any) -> tuple[Any, list[Meta]]:
    """(the type inside Annotated, its Meta annotations); nested Annotated aliases are flat in typing."""
    if typing.get_origin(tp) is Annotated:
        base, *meta = typing.get_args(tp)
        return base, [m for m in meta if isinstance(m, Meta)]
    return tp, []


def _extra(metas: list[Meta]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in metas:
        out.update(m.extra or {})
    return out


def _bound(metas: list[Meta], name: str) -> Any:
    return next((getattr(m, name) for m in metas if getattr(m, name) is not None), None)


def doc(cls: type, name: str) -> str:
    """The field's `Meta(description=...)`, or ""."""
    return _bound(_split(_field(cls, name).type)[1], "description") or ""


def extra(cls: type, name: str) -> dict[str, Any]:
    """The field's `Meta(extra=...)`, merged over the aliases it is built from, or {}."""
    return _extra(_split(_field(cls, name).type)[1])


def check_fields(obj: msgspec.Struct) -> None:
    """Check and normalise (int -> float where declared float) every field of `obj`, in order."""
    for f in fields(type(obj)):
        value = getattr(obj, f.name)
        try:
            converted = msgspec.convert(value, f.type, strict=True, from_attributes=True)
        except msgspec.ValidationError:
            raise ConfigError(f.name, value, "must be " + describe(f.type)) from None
        if isinstance(converted, float) and not math.isfinite(converted) and _wants_finite(f.type):
            raise ConfigError(f.name, value, "must be " + describe(f.type))
        setattr(obj, f.name, converted)


def _wants_finite(tp: Any) -> bool:
    base, metas = _split(tp)
    if _extra(metas).get(FINITE):
        return True
    return typing.get_origin(base) in (typing.Union, types.UnionType) and any(map(_wants_finite, typing.get_args(base)))


def from_mapping(cls: type, mapping: Mapping[str, Any] | None, what: str) -> Any:
    """`cls(**mapping)` after refusing unknown keys (with the closest known one) and missing ones."""
    mapping = dict(mapping or {})
    known = [f.name for f in fields(cls)]
    for key in sorted(set(mapping) - set(known)):
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(key, mapping[key],
                          f"unknown {what} setting; {hint}(known settings: {', '.join(sorted(known))})")
    for f in fields(cls):
        if f.required and f.name not in mapping:
            raise ConfigError(f.name, None, "is required")
    return cls(**mapping)


# ---------------------------------------------------------------------------------------------------
# command lines


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _default(f: msgspec.structs.FieldInfo) -> Any:
    return f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default


def add_arguments(parser: argparse.ArgumentParser | Any, cls: type, *, overrides_only: bool = False) -> None:
    """One flag per field of `cls` (fields with Meta(extra={"cli": False}) have none). With
    `overrides_only`, nothing is required and only the flags given appear in the namespace: for
    flags that amend settings built elsewhere."""
    for f in fields(cls):
        base, metas = _split(f.type)
        x = _extra(metas)
        if x.get(CLI) is False:
            continue
        kw: dict[str, Any] = {"dest": f.name, "help": doc(cls, f.name)}
        if base is bool:
            if _default(f) is not False:
                raise TypeError(f"{cls.__name__}.{f.name}: a flag can only switch a setting on (default False)")
            kw["action"] = "store_true"
        else:
            kw["type"] = x.get(PARSE, str)
            if x.get(REPEAT):
                kw["action"] = "append"
            if typing.get_origin(base) is Literal:
                kw["choices"] = typing.get_args(base)
            if METAVAR in x:
                kw["metavar"] = x[METAVAR]
        if overrides_only:
            kw["default"] = argparse.SUPPRESS
        elif f.required:
            kw["required"] = True
        else:
            kw["default"] = _default(f)
        parser.add_argument(flag(f.name), **kw)


def from_args(cls: type, ns: argparse.Namespace) -> Any:
    """`cls` from a namespace add_arguments(..., cls) filled; settings without a flag keep their default."""
    return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})


def to_argv(obj: msgspec.Struct) -> list[str]:
    """The flags that `add_arguments` parses back into `obj`: each setting that is not its default."""
    argv: list[str] = []
    for f in fields(type(obj)):
        base, metas = _split(f.type)
        x = _extra(metas)
        value = getattr(obj, f.name)
        if x.get(CLI) is False or (not f.required and value == _default(f)):
            continue
        if base is bool:
            argv.append(flag(f.name))  # store_true: only True differs from the default
            continue
        fmt = x.get(FORMAT, str)
        for item in (value if x.get(REPEAT) else [value]):
            argv += [flag(f.name), fmt(item)]
    return argv


# ---------------------------------------------------------------------------------------------------
# wording


def describe(tp: Any) -> str:
    """What a value of declared type `tp` must be, in words: "an integer >= 1", "one of tcp, shm"."""
    base, metas = _split(tp)
    expect = _extra(metas).get(EXPECT)
    if expect:
        return expect
    origin, args = typing.get_origin(base), typing.get_args(base)
    if origin is Literal:
        return "one of " + ", ".join(str(v) for v in args)
    if origin in (typing.Union, types.UnionType):
        parts = [describe(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" (or null: unset)" if type(None) in args else "")
    if origin in (list, tuple, set, frozenset):
        return f"a list of {_plural(describe(args[0]))}" if args else "a list"
    if base is bool:
        return "true or false"
    if base is int:
        return "an integer" + _bounds(metas)
    if base is float:
        return "a number" + _bounds(metas)
    if base is str:
        pattern = _bound(metas, "pattern")
        return f"a string matching {pattern}" if pattern else \
            "a non-empty string" if _bound(metas, "min_length") else "a string"
    if base is dict or origin is dict:
        return "a mapping"
    if base is type(None):
        return "null"
    return f"a {getattr(base, '__name__', base)}"


def _bounds(metas: list[Meta]) -> str:
    ge, gt, le, lt = (_bound(metas, n) for n in ("ge", "gt", "le", "lt"))
    if ge is not None and le is not None:
        return f" in [{ge}, {le}]"
    parts = [f"{op} {v}" for op, v in ((">=", ge), (">", gt), ("<=", le), ("<", lt)) if v is not None]
    return " " + " and ".join(parts) if parts else ""


def _plural(noun: str) -> str:
    """'a string' -> 'strings'; longer phrases just lose their article."""
    for article in ("an ", "a "):
        if noun.startswith(article):
            rest = noun[len(article):]
            return rest if " " in rest else rest + "s"
    return noun
