"""Issue 34, items 5, 6 (second half) and 7: secure by default.

- Exposure is decided on the address, not its spelling: every unspecified address (`0`, `0.0`,
  `::0`, `0:0:0:0:0:0:0:0`, ...) is a wildcard, and any bind that is not loopback needs the shared
  secret unless `allow_insecure` (the connector's settings, the Ray backend's store planning and
  `serve-pd --host` share one definition: kvconnectors/transport/exposure.py).
- A /dev/shm arena file is never adopted: created O_EXCL | O_NOFOLLOW, 0600; a stale file of ours is
  replaced, a symlink or another user's file refused; a consumer opens a peer's arena only when it
  is a regular file of its user (or root) that no one else may write.
- Secret files writable by others, or in a directory others may write (without the sticky bit), are
  refused, and so are weak secrets (fewer than 16 bytes, or fewer than 8 distinct byte values), from
  the file and from the environment; two secrets may be accepted during a rotation.

Seen to fail on 02ed128, the code before the fix (run there with --runxfail): `0`, `0.0`, `0.0.0`,
`00`, `0x0`, `::0`, `0:0:0:0:0:0:0:0`, `::ffff:0.0.0.0` and 10.1.2.3, 192.0.2.7, 2001:db8::1,
node-7.cluster.local accepted without a secret (DID NOT RAISE); no transport/exposure.py; Ray's
planning gave `0` no advertise_host and only warned about the node's IP; `serve-pd --host 10.1.2.3`
went on to build servers; secret files 0602/0622/0620/0660, and one in a 0777 directory, accepted;
16 identical bytes, "ab" x 16 and "abcdefg" x 5 accepted from the file and the variable; no
Secrets/verify_any; a stale 0666 arena adopted (mode 0666 kept), a symlink at the arena path
followed, another user's file adopted; no open_peer_arena. (A 15-byte secret was refused before.)
"""

from __future__ import annotations

import argparse
import logging
import os
import stat

import pytest

from kvconnectors.errors import ConfigError
from kvconnectors.tiered.config import TieredConfig
from kvconnectors.transport.auth import SECRET_ENV, load_secret

from sec_helpers import SECRET

WILDCARD_SPELLINGS = ["0", "0.0", "0.0.0", "00", "0x0", "::0", "0:0:0:0:0:0:0:0", "::ffff:0.0.0.0"]
LOOPBACK_SPELLINGS = ["127.0.0.1", "127.1", "127.0.0.2", "0x7f.1", "::1", "0:0:0:0:0:0:0:1", "::ffff:127.0.0.1",
                      "localhost"]
ROUTABLE = ["10.1.2.3", "192.0.2.7", "2001:db8::1", "node-7.cluster.local"]
STRONG = b"9f2c1e7a4b6d8053e1c2a9f4b7d6e3a1"


@pytest.fixture(autouse=True)
def no_env_secret(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)


@pytest.fixture
def secret_file(tmp_path) -> str:
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return str(path)


# ------------------------------------------------------------------------------- item 5: exposure
@pytest.mark.parametrize("spelling", WILDCARD_SPELLINGS)
def test_every_spelling_of_the_wildcard_is_a_wildcard(spelling, secret_file) -> None:
    """Without a secret refused like 0.0.0.0 (it binds every interface); without advertise_host
    refused (tickets would name the wildcard); with both, accepted."""
    with pytest.raises(ConfigError) as exc:
        TieredConfig.from_extra({"bind_host": spelling, "advertise_host": "10.1.2.3"})
    assert exc.value.key == "bind_host" and "allow_insecure" in exc.value.why and "secret" in exc.value.why
    with pytest.raises(ConfigError) as exc:
        TieredConfig.from_extra({"bind_host": spelling, "secret_file": secret_file})
    assert exc.value.key == "advertise_host"
    cfg = TieredConfig.from_extra({"bind_host": spelling, "advertise_host": "10.1.2.3", "secret_file": secret_file})
    assert (cfg.bind_host, cfg.advertise_host) == (spelling, "10.1.2.3")
    from kvconnectors.transport.exposure import is_loopback, is_wildcard

    assert is_wildcard(spelling) and not is_loopback(spelling)


@pytest.mark.parametrize("host", ROUTABLE)
def test_a_routable_bind_without_a_secret_is_refused_unless_allow_insecure(host, secret_file, monkeypatch,
                                                                          caplog) -> None:
    with pytest.raises(ConfigError) as exc:
        TieredConfig.from_extra({"bind_host": host})
    assert exc.value.key == "bind_host" and exc.value.value == host
    assert "secret_file" in exc.value.why and SECRET_ENV in exc.value.why and "allow_insecure" in exc.value.why
    with caplog.at_level(logging.WARNING):
        assert TieredConfig.from_extra({"bind_host": host, "allow_insecure": True}).bind_host == host
    assert "without a shared secret" in caplog.text
    assert TieredConfig.from_extra({"bind_host": host, "secret_file": secret_file}).advertise_host == host
    monkeypatch.setenv(SECRET_ENV, STRONG.decode())
    assert TieredConfig.from_extra({"bind_host": host}).bind_host == host
    from kvconnectors.transport.exposure import is_loopback, is_wildcard

    assert not is_loopback(host) and not is_wildcard(host)


def test_loopback_spellings_need_no_secret() -> None:
    from kvconnectors.transport.exposure import check_exposure, is_loopback, is_wildcard

    for host in LOOPBACK_SPELLINGS:
        assert is_loopback(host) and not is_wildcard(host), host
        check_exposure("bind_host", host, has_secret=False, allow_insecure=False)  # no error
        assert TieredConfig.from_extra({"bind_host": host}).advertise_host == host
    for host in ("", "[::]"):  # what bind() reads as "any address"
        assert is_wildcard(host)
    for host in ("localhost.example", "127.0.0.1.example", "10.0.0.1", "::2"):
        assert not is_loopback(host), host


def test_ray_store_planning_refuses_a_node_address_without_a_secret(monkeypatch, tmp_path) -> None:
    """The Ray backend's rules (no Ray needed): the node's IP without a secret is refused, not
    warned about; every wildcard spelling gets advertise_host; allow_insecure or a secret passes."""
    from kvconnectors.integration.ray import stores

    node = "192.0.2.7"

    def plan(extra):
        return stores.plan(extra, kv_role="kv_producer", node_ip=node, tp_size=1, port_offset=lambda: 0,
                           free_ports=lambda n, host: 7000)

    extra = dict(plan({}).updates)
    assert extra["bind_host"] == node
    with pytest.raises(ConfigError) as exc:
        stores.secret_source(extra)
    assert SECRET_ENV in exc.value.why and "secret_file" in exc.value.why and "allow_insecure" in exc.value.why
    for spelling in ("0", "::0", "0.0.0.0", ""):
        assert plan({"bind_host": spelling}).updates.get("advertise_host") == node, spelling
    with pytest.raises(ConfigError):
        stores.secret_source({"bind_host": "0"})
    assert stores.secret_source({**extra, "allow_insecure": True}) is None
    assert stores.secret_source({"bind_host": "127.1"}) is None
    path = tmp_path / "secret"
    path.write_bytes(STRONG)
    path.chmod(0o600)
    assert stores.secret_source({**extra, "secret_file": str(path)}) == f"secret_file {path}"
    monkeypatch.setenv(SECRET_ENV, STRONG.decode())
    assert stores.secret_source(extra) == f"env {SECRET_ENV}"


def _serve_pd(*argv: str) -> argparse.Namespace:
    from kvconnectors.integration import launcher

    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    return parser.parse_args(["--model", "/models/tiny", "--dry-run", "--log-dir", "/tmp/x", *argv])


def test_serve_pd_refuses_a_routable_host_without_a_secret_before_anything_starts(monkeypatch, capsys,
                                                                                   secret_file) -> None:
    from kvconnectors.integration import launcher

    monkeypatch.setattr(launcher, "cuda_device_count", lambda: 0)
    def build_server(*args, **kwargs):
        raise AssertionError("a server was built: nothing may be started or planned to start before the check")

    monkeypatch.setattr(launcher, "build_server", build_server)
    for host in ("10.1.2.3", "0.0.0.0", "0", "::"):
        assert launcher.run(_serve_pd("--host", host)) == 2, host
        err = capsys.readouterr().err
        assert "--host" in err and "--secret-file" in err and SECRET_ENV in err and "--allow-insecure" in err, err
    with pytest.raises(ValueError, match="--host"):  # PDCluster calls validate() itself
        launcher.validate(_serve_pd("--host", "10.1.2.3"))
    # NixlConnector has no shared secret: only --allow-insecure opens it to other hosts
    with pytest.raises(ValueError, match="--allow-insecure"):
        launcher.validate(_serve_pd("--host", "10.1.2.3", "--connector", "NixlConnector", "--secret-file",
                                    secret_file))
    launcher.validate(_serve_pd("--host", "10.1.2.3", "--connector", "NixlConnector", "--allow-insecure"))
    launcher.validate(_serve_pd("--host", "127.0.0.1"))
    launcher.validate(_serve_pd("--host", "10.1.2.3", "--allow-insecure"))
    # --secret-file reaches every instance's kv_connector_extra_config
    args = _serve_pd("--host", "10.1.2.3", "--secret-file", secret_file, "--mode", "push")
    launcher.validate(args)
    plans = launcher.plan_instances(args, cores=[0], port_fn=iter(range(30000, 30100)).__next__)
    assert [p.kv_transfer_config["kv_connector_extra_config"]["secret_file"] for p in plans] == [secret_file] * 2
    monkeypatch.setenv(SECRET_ENV, STRONG.decode())  # the servers inherit the launcher's environment
    launcher.validate(_serve_pd("--host", "10.1.2.3"))


# ------------------------------------------------------------------------------- item 7: secrets
@pytest.mark.parametrize("mode", [0o602, 0o622, 0o620, 0o660], ids=oct)
def test_a_secret_file_others_may_write_is_refused(tmp_path, mode) -> None:
    path = tmp_path / "secret"
    path.write_bytes(STRONG)
    path.chmod(mode)
    with pytest.raises(ConfigError) as exc:
        load_secret(str(path))
    assert exc.value.key == "secret_file" and f"{mode:04o}" in exc.value.why and "writable" in exc.value.why


def test_a_secret_file_in_a_directory_others_may_write_is_refused(tmp_path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    path = shared / "secret"
    path.write_bytes(STRONG)
    path.chmod(0o600)
    for mode in (0o777, 0o775, 0o757):
        shared.chmod(mode)
        with pytest.raises(ConfigError) as exc:
            load_secret(str(path))
        assert exc.value.key == "secret_file" and str(shared) in exc.value.why, exc.value
    shared.chmod(0o1777)  # sticky (like /tmp, or a Kubernetes secret mount's root): others cannot replace our file
    assert load_secret(str(path)) == STRONG
    # a symlink to it from a world-writable directory (anyone could point it elsewhere) is refused too
    links = tmp_path / "links"
    links.mkdir()
    (links / "secret").symlink_to(path)
    shared.chmod(0o700)
    links.chmod(0o777)
    with pytest.raises(ConfigError):
        load_secret(str(links / "secret"))
    links.chmod(0o755)
    assert load_secret(str(links / "secret")) == STRONG

    # a Kubernetes secret volume: its root 1777 (sticky) holds `..data -> ..<timestamp>` and
    # `secret -> ..data/secret`; the real file is 0440 (fsGroup) or 0400 in a 0755 directory
    mount = tmp_path / "mount"
    mount.mkdir()
    real = mount / "..2024_01_01_00_00_00.000000001"
    real.mkdir()
    (real / "secret").write_bytes(STRONG + b"\n")
    (real / "secret").chmod(0o440)
    real.chmod(0o755)
    (mount / "..data").symlink_to(real.name)
    (mount / "secret").symlink_to("..data/secret")
    mount.chmod(0o1777)
    assert load_secret(str(mount / "secret")) == STRONG


def test_a_secret_file_or_directory_of_another_user_is_refused(tmp_path) -> None:
    """Review follow-up: an owner may rewrite or replace what is theirs whatever its mode, so a
    secret file of another user (0640 bob:kvc), or one in another user's 0755 directory, is
    refused; root's are trusted (a Kubernetes secret volume)."""
    other = 65534  # nobody
    home = tmp_path / "bob"
    home.mkdir()
    path = home / "secret"
    path.write_bytes(STRONG)
    path.chmod(0o640)
    os.chown(path, other, -1)
    with pytest.raises(ConfigError) as exc:
        load_secret(str(path))
    assert exc.value.key == "secret_file" and f"uid {other}" in exc.value.why, exc.value
    os.chown(path, os.geteuid(), -1)
    os.chown(home, other, -1)
    home.chmod(0o755)
    with pytest.raises(ConfigError) as exc:
        load_secret(str(path))
    assert str(home) in exc.value.why and f"uid {other}" in exc.value.why, exc.value
    os.chown(home, os.geteuid(), -1)
    assert load_secret(str(path)) == STRONG


@pytest.mark.parametrize("weak", [b"a" * 16, b"ab" * 16, b"abcdefg" * 5,
                                  b"0123456789abcde"])  # 15 bytes: refused before too
def test_weak_secrets_are_refused_from_file_and_environment(tmp_path, monkeypatch, weak) -> None:
    """Fewer than 16 bytes (the last one: 15), or fewer than 8 distinct byte values."""
    path = tmp_path / "secret"
    path.write_bytes(weak)
    path.chmod(0o600)
    with pytest.raises(ConfigError) as exc:
        load_secret(str(path))
    assert exc.value.key == "secret_file" and ("16 bytes" in exc.value.why or "distinct" in exc.value.why)
    monkeypatch.setenv(SECRET_ENV, weak.decode())
    with pytest.raises(ConfigError) as exc:
        load_secret()
    assert exc.value.key == SECRET_ENV and weak.decode() not in str(exc.value)  # the value is never shown
    path.write_bytes(STRONG)
    assert load_secret(str(path)) == STRONG
    monkeypatch.setenv(SECRET_ENV, STRONG.decode())
    assert load_secret() == STRONG


def _handshake(server: bytes, client: bytes) -> bytes | None:
    """The v4 handshake's secret checks (server.py / client.py make the same calls): the server proves
    with its current secret; the client checks that under any secret it accepts, proves with the one
    that matched, and the server checks the client's proof under any it accepts. Returns the secret
    both sides derived the session key from, or None when either side refused."""
    from kvconnectors.transport import auth

    th = auth.transcript(4, "compat", "peer", auth.new_nonce(), auth.new_nonce())
    seen = auth.verify_any(client, auth.ROLE_SERVER, th, auth.prove_role(server, auth.ROLE_SERVER, th))
    if seen is None:
        return None
    matched = auth.verify_any(server, auth.ROLE_CLIENT, th, auth.prove_role(seen, auth.ROLE_CLIENT, th))
    if matched is None:
        return None
    assert auth.session_key(matched, th) == auth.session_key(seen, th)
    return matched


def test_rotation_accepts_two_secrets_while_the_pool_rolls(tmp_path, monkeypatch) -> None:
    from kvconnectors.transport import auth
    from kvconnectors.transport.auth import Secrets, verify_any

    old, new, other = b"old-secret-" + STRONG[:16], b"new-secret-" + STRONG[16:], b"unrelated-secret-0123456789"
    path = tmp_path / "secret"
    path.write_bytes(new + b"\n" + old + b"\n")
    path.chmod(0o600)
    both = load_secret(str(path))
    assert isinstance(both, Secrets) and both == new and both.current == new and both.accepted == (new, old)
    assert "new-secret" not in repr(both)
    monkeypatch.setenv(SECRET_ENV, (old + b"\n" + new).decode())
    assert load_secret().accepted == (old, new)
    # a server holding [new, old] accepts a client's proof made with old; a proof for the other role is no proof
    th = auth.transcript(4, "c", "p", auth.new_nonce(), auth.new_nonce())
    assert verify_any(Secrets(new, old), auth.ROLE_CLIENT, th, auth.prove_role(old, auth.ROLE_CLIENT, th)) == old
    assert verify_any(Secrets(new, old), auth.ROLE_SERVER, th, auth.prove_role(old, auth.ROLE_CLIENT, th)) is None
    # the three steps of a roll: [old] -> [old, new] -> [new, old] -> [new]; any two neighbours agree
    steps = [old, Secrets(old, new), Secrets(new, old), new]
    for a, b in zip(steps, steps[1:]):
        assert _handshake(a, b) is not None and _handshake(b, a) is not None
    assert _handshake(old, Secrets(new, old)) == old        # a client holding [new, old] accepts a server with [old]
    assert _handshake(Secrets(new, old), Secrets(old, new)) in (new, old)
    assert _handshake(Secrets(new, old), other) is None     # a client with an unrelated secret
    assert _handshake(other, Secrets(new, old)) is None     # a server with an unrelated secret
    assert _handshake(new, old) is None
    # a third secret is a mistake, not a wider window
    path.write_bytes(b"\n".join([new, old, other]))
    with pytest.raises(ConfigError, match="at most two"):
        load_secret(str(path))


# ------------------------------------------------------------------------------- item 6: arenas
@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    from kvconnectors.store import arena

    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setattr(arena, "SHM_DIR", str(d))
    return d


def _arena(name: str):
    from kvconnectors.store.arena import DramArena

    return DramArena(4096, 4 * 4096, shm_name=name, prefault=False)


def test_an_existing_arena_file_is_not_adopted_with_its_mode(shm_dir) -> None:
    """A stale file of ours (a crashed run), mode 0666: replaced by a new file, 0600, its bytes gone."""
    name = f"kvc_sec_0_{os.getpid()}"
    stale = shm_dir / name
    stale.write_bytes(b"stale KV " * 1000)
    stale.chmod(0o666)
    os.link(stale, shm_dir / "old")  # whoever kept a name for the old file keeps only the old file
    a = _arena(name)
    try:
        st = os.stat(a.shm_path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid() and st.st_size == 4 * 4096
        assert not os.path.samefile(a.shm_path, shm_dir / "old")
        assert (shm_dir / "old").read_bytes() == b"stale KV " * 1000  # not truncated, not written: not ours
        with open(a.shm_path, "rb") as f:
            assert f.read() == bytes(4 * 4096)  # none of the old bytes
    finally:
        a.close()


def test_a_symlink_at_the_arena_path_is_refused(shm_dir, tmp_path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"not an arena")
    name = f"kvc_sec_1_{os.getpid()}"
    (shm_dir / name).symlink_to(target)
    with pytest.raises(ConfigError) as exc:
        _arena(name)
    assert exc.value.key == "shm_name" and "symbolic link" in exc.value.why and str(shm_dir / name) in exc.value.why
    assert target.read_bytes() == b"not an arena" and (shm_dir / name).is_symlink()  # nothing followed


def test_an_arena_file_of_another_user_is_refused(shm_dir, monkeypatch) -> None:
    name = f"kvc_sec_2_{os.getpid()}"
    (shm_dir / name).write_bytes(b"theirs")
    (shm_dir / name).chmod(0o666)
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)  # the file now reads as another user's
    with pytest.raises(ConfigError) as exc:
        _arena(name)
    assert exc.value.key == "shm_name" and f"uid {me}" in exc.value.why
    assert (shm_dir / name).read_bytes() == b"theirs"


def test_opening_a_peer_arena_checks_what_it_opens(shm_dir, tmp_path) -> None:
    from kvconnectors.store.arena import ArenaRefused, map_peer_arena, open_peer_arena

    a = _arena(f"kvc_sec_3_{os.getpid()}")
    try:
        fd, st = open_peer_arena(a.shm_path, slot=4096, min_bytes=4 * 4096)
        os.close(fd)
        assert st.st_size == 4 * 4096
        mm = map_peer_arena(a.shm_path, slot=4096)
        assert len(mm) == 4 * 4096
        mm.close()
        link = shm_dir / "kvc_link"
        link.symlink_to(a.shm_path)
        with pytest.raises(ArenaRefused, match="symbolic link"):
            open_peer_arena(str(link))
        os.chmod(a.shm_path, 0o622)
        with pytest.raises(ArenaRefused, match="writable"):
            open_peer_arena(a.shm_path)
        os.chmod(a.shm_path, 0o600)
        with pytest.raises(ArenaRefused, match="slots"):
            open_peer_arena(a.shm_path, slot=4096, min_bytes=5 * 4096)
    finally:
        a.close()
    loose = shm_dir / "kvc_loose"
    loose.write_bytes(b"\0" * 4096)
    loose.chmod(0o600)
    with pytest.raises(ArenaRefused, match="live store"):  # no store holds its lock
        open_peer_arena(str(loose))
    os.mkfifo(shm_dir / "kvc_fifo", 0o600)
    with pytest.raises(ArenaRefused, match="FIFO"):
        open_peer_arena(str(shm_dir / "kvc_fifo"))
