"""The command lines' shared edges (kvconnectors/cli_types.py): port ranges, log levels in any case,
a taken port as one line with exit 2, output into a pipe whose reader left, each default shown once
in --help, and a top-level --help written for users. No server is left running: a proxy or serve-pd
started here fails at its bind, before serving anything."""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvconnectors.integration import launcher as L
from kvconnectors.integration import proxy as P
from kvconnectors import cli

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def proxy_parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    P.add_arguments(parser)
    return parser.parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", *argv])


def serve_pd_parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    L.add_arguments(parser)
    return parser.parse_args(["--model", "/models/tiny", *argv])


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port some other process listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


# ---------------------------------------------------------------------------------------------------
# ports

PORT_FLAGS = [(proxy_parse, "--port", "port"), (serve_pd_parse, "--proxy-port", "proxy_port")]


@pytest.mark.parametrize("parse, flag, dest", PORT_FLAGS)
@pytest.mark.parametrize("value", ["0", "1", "65535"])
def test_listen_port_flags_take_0_to_65535(parse: Callable[..., argparse.Namespace], flag: str, dest: str,
                                           value: str) -> None:
    """0 (any free port, what PDCluster passes), 1 and 65535 are taken as given. Negative control:
    with a 1-65535 type on these flags, "0" exits 2 and this test fails."""
    assert getattr(parse(flag, value), dest) == int(value)


@pytest.mark.parametrize("parse, flag, dest", PORT_FLAGS)
@pytest.mark.parametrize("value", ["65536", "99999", "-1", "abc", "8_000"])
def test_listen_port_flags_refuse_out_of_range(parse: Callable[..., argparse.Namespace], flag: str, dest: str,
                                               value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each refusal names the flag, the value and the range, with exit 2 and no traceback. Negative
    control: with the old `type=int`, 99999 was accepted (and taken modulo 65536 at bind) and this
    test fails on "no SystemExit"."""
    with pytest.raises(SystemExit) as info:
        parse(flag, value)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert f"argument {flag}: invalid port {value!r}: expected a whole number from 1 to 65535, or 0" in err, err


@pytest.mark.parametrize("value, ok", [("1", True), ("65535", True), ("0", False), ("65536", False),
                                       ("-1", False), ("abc", False)])
def test_kv_store_port_is_1_to_65535(value: str, ok: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """`--decode URL,kv=HOST:PORT` connects to PORT, so 0 means nothing there. Negative control: a
    range check of 0-65535 in parse_hostport makes the "0" case pass parsing and this test fail."""
    argv = ("--decode", f"http://127.0.0.1:2,kv=127.0.0.1:{value}")
    if ok:
        assert proxy_parse(*argv).decode[-1].kv_addr == f"127.0.0.1:{int(value)}"
        return
    with pytest.raises(SystemExit):
        proxy_parse(*argv)
    assert f"argument --decode: invalid kv address '127.0.0.1:{value}'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# log level


@pytest.mark.parametrize("value", ["debug", "Debug", "DEBUG", " debug "])
def test_log_level_in_any_case(value: str) -> None:
    """Negative control: with the old `choices=[...]` and no type, "debug" exits 2 and this fails."""
    assert proxy_parse("--log-level", value).log_level == "DEBUG"


def test_unknown_log_level_names_value_and_levels(capsys: pytest.CaptureFixture[str]) -> None:
    """Negative control: a type that returns any text upper-cased passes "verbose" on to logging
    (which raises later) and this test fails on "no SystemExit"."""
    with pytest.raises(SystemExit) as info:
        proxy_parse("--log-level", "verbose")
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "argument --log-level: invalid log level 'verbose': expected one of debug, info, warning, error" in err


# ---------------------------------------------------------------------------------------------------
# a port that is taken


@pytest.mark.timeout(60)
def test_proxy_on_a_taken_port_says_so_in_one_line(busy_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    """The proxy CLI, in-process, on a port another socket listens on: exit 2, one line naming the
    port and the flag. (Its instances refuse connections at once, so the start-up health round is
    quick.) Negative control: without `binding(...)` around PDProxy.start's site.start(), the
    asyncio OSError escapes main() and this test fails with it."""
    rc = P.main(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--port", str(busy_port),
                 "--connect-timeout", "1", "--health-timeout", "1", "--log-level", "error"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert (f"kvconnectors proxy: error: port {busy_port} on 127.0.0.1 is already in use: stop the process "
            f"listening there, or choose another port with --port") in err, err
    assert "Traceback" not in err


def test_serve_pd_checks_the_proxy_port_before_starting_servers(busy_port: int, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """serve-pd with a taken --proxy-port stops before any vLLM server starts (they take minutes).
    Negative control: without the check_port_free call in launcher.run, build_server is reached and
    raises the AssertionError below."""
    def no_server(*args: object, **kwargs: object) -> None:
        raise AssertionError("a server was built although the proxy port is taken")

    monkeypatch.setattr(L, "build_server", no_server)
    assert L.run(serve_pd_parse("--proxy-port", str(busy_port))) == 2
    err = capsys.readouterr().err
    assert f"kvconnectors serve-pd: error: port {busy_port} on 127.0.0.1 is already in use" in err, err
    assert "--proxy-port" in err


def test_port_check_passes_a_port_left_in_time_wait() -> None:
    """A proxy stopped a moment ago leaves its port in TIME_WAIT; asyncio binds it again (SO_REUSEADDR),
    so the check must not call it taken. Port 0 always passes. Negative control: without the
    SO_REUSEADDR setsockopt in check_port_free, the bind below fails and PortInUseError is raised."""
    from kvconnectors.cli_types import check_port_free

    with socket.socket() as server:  # a server that closes its side of a connection first
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's servers do
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            conn, _ = server.accept()
            conn.close()
            client.recv(1)  # its FIN arrived: the server's side is now in TIME_WAIT
    check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", 0)


# ---------------------------------------------------------------------------------------------------
# a reader that leaves


def _run_into_closed_pipe(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run with stdout a pipe whose read end is already closed (what `| head -c 1` becomes)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, *argv], stdout=write_end, stderr=subprocess.PIPE, text=True,
                              timeout=120, env=ENV, cwd=REPO)
    finally:
        os.close(write_end)
    return proc


@pytest.mark.parametrize("argv", [["plan", "--json"], ["plan"], ["--help"]])
def test_output_into_a_closed_pipe_exits_0_quietly(argv: list[str]) -> None:
    """Negative control: with kvconnectors.cli.main calling _dispatch directly (no pipe_safe), these
    end in a BrokenPipeError traceback (status 1) or, when it surfaces only at the interpreter's last
    flush, in "Exception ignored ... BrokenPipeError" (status 120), and this test fails."""
    proc = _run_into_closed_pipe(["-m", "kvconnectors.cli", *argv])
    assert proc.returncode == 0, proc.stderr
    assert "BrokenPipeError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_broken_pipe_that_is_not_stdout_is_an_error() -> None:
    """A BrokenPipeError from a connection (stdout still read) keeps its traceback and status 1.
    Negative control: without the _stdout_reader_gone check in pipe_safe this exits 0."""
    code = ("import sys\nfrom kvconnectors.cli_types import pipe_safe\n"
            "def lost_peer():\n    raise BrokenPipeError(32, 'the peer of some socket closed')\n"
            "sys.exit(pipe_safe(lost_peer))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=ENV,
                          cwd=REPO)
    assert proc.returncode == 1 and "BrokenPipeError: [Errno 32] the peer of some socket closed" in proc.stderr, (
        proc.returncode, proc.stderr)


# ---------------------------------------------------------------------------------------------------
# --help

# a help line that states a default; two on one line is the same default said twice
_DEFAULT_STATED = re.compile(r"\bdefault:|\bby default\b|\bNone means\b", re.IGNORECASE)
_EMPTY_DEFAULT = re.compile(r"\(default: (None|\(\)|\[\]|)\)")


def _parsers(parser: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def _help_of_every_command() -> Iterator[tuple[str, str]]:
    for name, parser in _parsers(cli.build_parser(), "kvconnectors"):
        yield name, parser.format_help()
    # the `python -m ...` entry points build their own parsers
    from kvconnectors.benchmarks import cli as bench_cli
    from kvconnectors.benchmarks import transfer
    for name, main in (("python -m kvconnectors.integration.proxy", P.main), ("python -m kvconnectors.benchmarks.cli", bench_cli.main),
                       ("python -m kvconnectors.benchmarks.transfer (module_main)", transfer.main)):
        yield name, _help_printed_by(main)


def _help_printed_by(main: Callable[[list[str]], int]) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["--help"])
    return out.getvalue()


def test_help_states_each_default_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command and sub-command, and the standalone module entry points: no help line states
    a default twice, and none shows an empty one ("(default: None)"). COLUMNS is wide so that each
    option's help is one line. Negative control: with argparse.ArgumentDefaultsHelpFormatter in
    cli_types.HelpFormatter's place, `plan --plot` shows "(default: None)" and `make-model --root`
    reads "(default: $KVCONNECTORS_CACHE/models) (default: None)", and this test fails."""
    monkeypatch.setenv("COLUMNS", "1000")
    seen = 0
    for name, text in _help_of_every_command():
        seen += 1
        for line in text.splitlines():
            assert len(_DEFAULT_STATED.findall(line)) <= 1, f"{name} --help states a default twice:\n{line}"
            assert not _EMPTY_DEFAULT.search(line), f"{name} --help shows an empty default:\n{line}"
    assert seen >= len(cli.COMMANDS) + 5 + 3, f"only {seen} help texts: some command was not reached"


def test_help_formatter_adds_a_default_only_where_it_says_something(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rules one by one, on flags made for it. Negative control: without the _STATES_DEFAULT test
    in HelpFormatter._get_help_string, --said reads "(default: 8 workers) (default: 8)" and this fails."""
    from kvconnectors.cli_types import HelpFormatter

    monkeypatch.setenv("COLUMNS", "1000")
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    parser.add_argument("--said", type=int, default=8, help="workers (default: 8 workers)")
    parser.add_argument("--said-too", default="x", help="used by default")
    parser.add_argument("--plain", type=int, default=8, help="workers")
    parser.add_argument("--unset", default=None, help="a file")
    parser.add_argument("--empty", default="", help="extra words")
    parser.add_argument("--flag", action="store_true", help="switch on")
    lines = {line.split()[0]: line for line in parser.format_help().splitlines() if line.startswith("  --")}
    assert lines["--said"].endswith("workers (default: 8 workers)"), lines["--said"]
    assert lines["--said-too"].endswith("used by default"), lines["--said-too"]
    assert lines["--plain"].endswith("workers (default: 8)"), lines["--plain"]
    for flag, text in (("--unset", "a file"), ("--empty", "extra words"), ("--flag", "switch on")):
        assert lines[flag].endswith(text), lines[flag]


def test_top_level_help_speaks_to_users(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvconnectors --help`: what the tool is for, every command, a runnable example. Negative
    control: the old description ("one sub-command per module, registered lazily", no example)
    fails the checks below."""
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    assert "prefill" in out and "decode" in out and "vLLM" in out
    for command in cli.COMMANDS:
        assert re.search(rf"^\s+{re.escape(command)}\b", out, re.MULTILINE), f"{command} missing:\n{out}"
    assert re.search(r"^examples:\n\s+kvconnectors plan ", out, re.MULTILINE), out
    for developer_words in ("registered lazily", "sub-command per module", "add_arguments"):
        assert developer_words not in out
