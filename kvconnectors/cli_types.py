"""What every command line of the project shares: argparse types (ports, log levels, positive
numbers), a help formatter that shows each default once, a friendly error for a port that is
taken, and output that survives a reader leaving early (`kvconnectors plan --json | head`).

argparse turns an ArgumentTypeError into "argument --flag: <message>", so each message here names
the value it refuses and what would be accepted; the flag comes from argparse.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import select
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any

# ---------------------------------------------------------------------------------------------------
# argument types

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
MAX_PORT = 65535


def _whole_number(text: str) -> int | None:
    """Plain decimal digits only: int() would also take "+8", "8_000" and "٨" (Arabic-Indic eight)."""
    text = text.strip()
    return int(text) if re.fullmatch(r"[0-9]+", text) else None


def port(text: str) -> int:
    """argparse type: a TCP port to connect to or listen on, 1-65535."""
    n = _whole_number(text)
    if n is None or not 1 <= n <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: expected a whole number from 1 to {MAX_PORT}")
    return n


def port_or_zero(text: str) -> int:
    """argparse type: a port to listen on, 1-65535, or 0 for any free port (the server logs which)."""
    n = _whole_number(text)
    if n is None or not 0 <= n <= MAX_PORT:
        raise argparse.ArgumentTypeError(
            f"invalid port {text!r}: expected a whole number from 1 to {MAX_PORT}, or 0 for any free port")
    return n


def log_level(text: str) -> str:
    """argparse type: a log level in any case (`debug`, `Info`, `WARNING`), returned upper case."""
    name = text.strip().upper()
    if name not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"invalid log level {text!r}: expected one of {', '.join(LOG_LEVELS).lower()} (any case)")
    return name


def positive_float(value: str) -> float:
    """argparse type: seconds > 0."""
    try:
        x = float(value)
    except ValueError:
        x = -1.0
    if not x > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {value!r}")
    return x


def non_negative_int(value: str) -> int:
    """argparse type: a whole number >= 0."""
    n = _whole_number(value)
    if n is None:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value!r}")
    return n


def positive_int(value: str) -> int:
    """argparse type: a whole number >= 1."""
    n = _whole_number(value)
    if n is None or n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value!r}")
    return n


# ---------------------------------------------------------------------------------------------------
# --help

# help text that already says what the default is, in its own words
_STATES_DEFAULT = re.compile(r"%\(default\)|\bdefault:|\bby default\b", re.IGNORECASE)


def _says_nothing(default: Any) -> bool:
    """Defaults that "(default: ...)" would only add noise for: unset, an off flag, empty."""
    return default is None or default is False or (isinstance(default, (str, tuple, list)) and not default)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Adds "(default: X)" to an option's help exactly once: not where the help already states its
    default ("default: ...", "by default", %(default)s), and not for None, False or empty defaults
    (the help says what happens then). Keeps the description's own line breaks (examples, tables)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (_STATES_DEFAULT.search(text) or action.default is argparse.SUPPRESS or _says_nothing(action.default)
                or not (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE))):
            return text
        return text + " (default: %(default)s)"


# ---------------------------------------------------------------------------------------------------
# a port that is taken


class PortInUseError(OSError):
    """A server could not listen on host:port because something else already does. Its errno stays
    EADDRINUSE, so code that catches OSError still does."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(errno.EADDRINUSE, f"port {port} on {host} is already in use")
        self.host, self.port = host, port

    def advice(self, flag: str) -> str:
        """One line for a command-line user: which port, and what to do about it."""
        return (f"port {self.port} on {self.host} is already in use: stop the process listening there, "
                f"or choose another port with {flag} (0 picks a free one)")


@contextlib.contextmanager
def binding(host: str, port: int) -> Iterator[None]:
    """Around a bind or listen: a taken port becomes PortInUseError, every other error passes as it is."""
    try:
        yield
    except PortInUseError:
        raise
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise PortInUseError(host, port) from exc


def check_port_free(host: str, port: int) -> None:
    """Raise PortInUseError now if a server could not listen on host:port, before slow work that
    would end in that error. Binds as asyncio does (SO_REUSEADDR: a port left in TIME_WAIT counts
    as free). Port 0 is always free; any other bind problem (an unknown host, a privileged port) is
    left to the real bind, which reports it in full."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio does: the v4 and v6 binds are separate
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                with binding(host, port):
                    sock.bind(address)
            except PortInUseError:
                raise
            except OSError:
                return


# ---------------------------------------------------------------------------------------------------
# output into a pipe whose reader left


def _stdout_reader_gone() -> bool:
    """True when stdout is a pipe or socket nobody reads any more (poll reports an error or hang-up
    on its write end), so a BrokenPipeError came from our output, not from some connection."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # replaced by a non-file (e.g. pytest's capture)
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def pipe_safe(main: Callable[[], int]) -> int:
    """Run a command's main; if its reader goes away (`| head`), end quietly with status 0.

    Python's docs (signal module, "Note on SIGPIPE") recommend this: on BrokenPipeError point stdout
    at /dev/null, so the interpreter's last flush does not raise again. Status 0 because stopping
    early was the reader's choice, not a failure of the command (`set -o pipefail` scripts that pipe
    into `head` keep working). stdout is flushed here, inside the handler, not at interpreter exit
    where the error would print "Exception ignored ... BrokenPipeError". A BrokenPipeError from
    anything else (a socket whose peer died) is re-raised: it is a real failure. A usage error
    (SystemExit 2) whose stdout lost its reader too ends with 0: its message went to stderr anyway.
    """
    try:
        try:
            code = main()
        except SystemExit:  # --help and usage errors: their text may still sit in the buffer
            sys.stdout.flush()
            raise
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0
