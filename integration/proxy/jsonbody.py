"""The client's JSON body, decoded only as deep as the proxy needs it: its top-level object, each
value kept as the JSON it came as (`msgspec.Raw`, a view of the received bytes, no copy).

The proxy sets a few top-level fields and passes everything else on, so nothing below the top level
is ever built as Python objects (decoded whole, 16 MiB of `[{},{},...]` was ~400 MiB of dicts).
msgspec still checks the whole document while it skips the raw values: syntax and nesting depth,
but not the UTF-8 of the strings it skips, which `check_utf8` does. What is built is one key and one
Raw per top-level field, ~150 bytes each; a body of millions of tiny fields would cost 15x its size,
so a body with more JSON strings (each key is one) than --max-body-strings is refused before it is
decoded, counted at C speed (`bytes.count`).
"""

from __future__ import annotations

import codecs
from typing import Any

import msgspec

from .errors import ProxyError

Fields = dict[str, msgspec.Raw]
_decode_fields = msgspec.json.Decoder(Fields).decode
_encode = msgspec.json.Encoder().encode
UTF8_SLICE = 1 << 20  # check_utf8's step: its decoded text is dropped slice by slice
LEG_CHUNK = 256 << 10  # a leg's body goes to the socket in pieces of at most this


def json_strings(data: bytes | bytearray, limit: int) -> int:
    """The number of JSON strings in `data` (keys and string values at any depth), exactly when it is
    over `limit`: its quotes less the escaped ones (after an odd run of backslashes), halved. A quote
    inside a string is always escaped, so text in prompts adds nothing. The first count takes only a
    quote after exactly one backslash for escaped (at C speed, no copy), so it can only count more
    (a quote after 3, 5, ... is escaped too); only a body it puts over `limit` is counted again,
    exactly, on a copy without the escaped backslashes (JSON-in-JSON, e.g. tool-call arguments, has
    such runs)."""
    quick = (data.count(b'"') - data.count(b'\\"') + data.count(b'\\\\"')) // 2
    if quick <= limit:
        return quick
    plain = data.replace(b"\\\\", b"")  # every escaped backslash gone: a quote after a backslash is escaped
    return (plain.count(b'"') - plain.count(b'\\"')) // 2


def check_utf8(data: bytes | bytearray) -> None:
    """Raise UnicodeDecodeError unless `data` is UTF-8; ASCII (most bodies) costs one C-speed scan."""
    if data.isascii():
        return
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(data)
    for start in range(0, len(view), UTF8_SLICE):
        decoder.decode(view[start:start + UTF8_SLICE], final=start + UTF8_SLICE >= len(view))


def decode_body(data: bytes | bytearray, max_strings: int) -> Fields:
    """The top-level fields of a request body. 400 ProxyError for anything that is not a JSON object
    in UTF-8, and over `max_strings` strings (a body too complex, not too large: not a 413)."""
    strings = json_strings(data, max_strings)
    if strings > max_strings:
        raise ProxyError(400, "invalid_request_error", (
            f"invalid JSON body: about {strings} JSON strings (keys and string values), more than the proxy "
            f"decodes ({max_strings}, --max-body-strings)"), "too_many_strings")
    try:
        check_utf8(data)
        return _decode_fields(data)
    except UnicodeDecodeError as exc:
        raise ProxyError(400, "invalid_request_error", f"invalid JSON body: not UTF-8 ({exc.reason})") from None
    except msgspec.ValidationError as exc:  # the only type checked: the top level's
        raise ProxyError(400, "invalid_request_error", f"invalid JSON body: the body must be a JSON object "
                         f"({exc})") from None
    except ValueError as exc:  # msgspec.DecodeError is a ValueError
        raise ProxyError(400, "invalid_request_error", f"invalid JSON body: {exc}") from None
    except RecursionError:  # msgspec's depth guard: deeply nested arrays or objects
        raise ProxyError(400, "invalid_request_error", "invalid JSON body: nested too deeply") from None


def decode_object(raw: msgspec.Raw | None) -> Fields:
    """A field that should hold a JSON object (kv_transfer_params), its values still raw; {} for
    anything else. Its strings were counted with the body's."""
    if raw is None:
        return {}
    try:
        return _decode_fields(raw)
    except (ValueError, RecursionError):
        return {}



class LegBody:
    """A leg's body as JSON without a copy of the client's bytes: the top-level keys and the values
    the proxy set are encoded; every field still raw goes out as the view of the received bytes it
    is. Sent as `chunks()` (a fresh iterator per attempt: the prefill leg may be retried) of at most
    LEG_CHUNK bytes, so the socket's send buffer never holds a copy of a large field either; `size`
    is its Content-Length. A 16 MiB prompt costs the proxy its 16 MiB once, not three times."""

    def __init__(self, body: dict[str, Any]):
        parts: list[bytes | memoryview] = []
        for i, (key, value) in enumerate(body.items()):
            head = (b"{" if i == 0 else b",") + _encode(key) + b":"
            parts += [head, memoryview(value)] if isinstance(value, msgspec.Raw) else [head + _encode(value)]
        parts.append(b"}" if parts else b"{}")
        self.parts = parts
        self.size = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)

    async def chunks(self):
        for part in self.parts:
            view = memoryview(part)
            for start in range(0, view.nbytes, LEG_CHUNK):
                yield view[start:start + LEG_CHUNK]

