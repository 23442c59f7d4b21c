"""Shared-secret peer authentication: mutual, bound to the session (HMAC-SHA256 over a transcript).

Protocol v4 (wire.py):

    client                                           server
    Hello(version, compat, peer, client_nonce)  ─▶
                                                ◀──  Welcome(server_nonce, proof_s)     (secret held)
    checks proof_s; then Proof(proof_c)         ─▶   checks proof_c
                                                ◀──  Ack(ok)

    T       = SHA-256(DOMAIN, version, compat, peer, client_nonce, server_nonce[, protection]), each part
              length-prefixed; `protection` (Hello.protection) only when it is not the default "handshake",
              so a default handshake reads exactly as before the setting existed
    proof_s = HMAC-SHA256(secret, DOMAIN | "server" | T)
    proof_c = HMAC-SHA256(secret, DOMAIN | "client" | T)
    key     = HKDF-SHA256(ikm=secret, salt=T, info="kvconnectors session key v1")   (RFC 5869, 32 bytes)

Both sides contribute a fresh nonce, and each proves the secret over both nonces and the Hello, with
its own role label. So: a client never signs a value the other side chose alone (the old one-way
challenge did, which let a fake server hand it the real server's nonce and forward the answer); a
proof made for one connection is worthless on another (its nonces differ); a client's proof cannot
be reflected as a server's (the labels differ); and a client holding the secret refuses a server
that cannot prove it. `key` is derived from the same transcript for use after the handshake (a
sealed connection, below); by default the handshake itself does not protect the frames that follow
it (a transparent relay on the path can still pass them along, read them, or change them: see the
README's threat model).

wire_protection "aead" (sealed.py) closes that: both sides name it in the handshake (Hello.protection,
echoed in Welcome.protection, and part of T, so a relay that strips or adds it breaks both proofs),
then seal every frame and every KV byte after it in AES-256-GCM records, keyed per direction from
`key` (HKDF-Expand, "c2s" / "s2c"), with a per-direction record counter as the nonce. It needs the
shared secret and protocol v4; sides that disagree are refused at the handshake, naming both values.

v3 peers (the previous version) spoke a one-way challenge: the server proved nothing and the client
signed the server's nonce. Neither side speaks it while it holds the secret (issue 34: a peer that
claimed "v3 only" could downgrade a consumer that did); without a secret v3 authenticates nothing.

The secret comes from an environment variable or a file, never from the command line, where
`ps` and shell history would show it (`load_secret`). A world-readable file is refused; a
group-readable one is warned about (Kubernetes mounts secrets 0440 under an fsGroup). A file that
others may write is refused (mode bits g+w or o+w), and so is one that others could replace: each
directory on its real path, and the directory of the name given (where a Kubernetes mount keeps its
symlinks), must not be group- or world-writable unless it is sticky (like /tmp, or a secret
volume's 1777 root) and the entry in it is ours or root's. A secret shorter than 16 bytes, or with
fewer than 8 distinct byte values ("aaaaaaaaaaaaaaaa"), is refused, from the file and from the
variable: `openssl rand -hex 32` makes a good one.

Rotation. The file (or the variable) may hold two secrets, one per line: the first is *current*,
the one this side proves itself with; the second is *also accepted* from peers. A handshake works
when the two sides share one secret: the server proves with its current secret, the client checks
that proof under each secret it accepts and proves itself with the one that matched, and the
server checks the client's proof under each it accepts (`verify_any`); both derive the session key
from the secret of the client's proof. Because the server proves first, a client accepts a server
only when the server's *current* secret is one the client knows, so a roll takes three steps, each
a rolling restart of the whole pool (the secret is read at start):

    1. "OLD\nNEW"  everyone still proves with OLD and starts accepting NEW
    2. "NEW\nOLD"  everyone proves with NEW and still accepts OLD
    3. "NEW"       OLD is gone

Any two neighbouring steps agree, so the pool never splits. `load_secret` returns a `Secrets`: the
bytes of the current secret (so every caller that takes `bytes` keeps working) with `.accepted`.
A secret with a newline inside cannot be expressed: each line is one secret, stripped (a file or
variable of one line reads exactly as before).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass

from kvconnectors.errors import ConfigError
from kvconnectors.logs import get_logger

logger = get_logger(__name__)

SECRET_ENV = "KVCONNECTORS_SECRET"
NONCE_BYTES = 32
MIN_SECRET_BYTES = 16
MIN_DISTINCT_BYTES = 8
MAX_SECRETS = 2  # current + one also accepted, during a rotation
_MAX_SECRET_FILE = 64 * 1024
DOMAIN = b"kvconnectors-auth-v2"           # v4's transcript
ROLE_SERVER, ROLE_CLIENT = b"server", b"client"
_SESSION_INFO = b"kvconnectors session key v1"
_warned_group: set[str] = set()


class Secrets(bytes):
    """The shared secret(s) of this side: the bytes are the *current* secret (what this side proves
    itself with: `prove_role(secrets, ...)`); `accepted` adds the one also accepted
    during a rotation (module docstring). Compares and hashes as its current secret; its repr
    shows neither."""

    alternate: bytes | None

    def __new__(cls, current: bytes, alternate: bytes | None = None) -> "Secrets":
        self = super().__new__(cls, current)
        self.alternate = bytes(alternate) if alternate and alternate != current else None
        return self

    @property
    def current(self) -> bytes:
        return bytes(self)

    @property
    def accepted(self) -> tuple[bytes, ...]:
        return (bytes(self),) if self.alternate is None else (bytes(self), self.alternate)

    def __repr__(self) -> str:
        return f"Secrets(<{len(self.accepted)} hidden>)"

    __str__ = __repr__

    def __reduce__(self):  # pickles (a config handed to a worker process) with both secrets
        return (Secrets, (bytes(self), self.alternate))


def accepted_secrets(secret: bytes) -> tuple[bytes, ...]:
    """Every secret `secret` accepts: a Secrets' `accepted`, or the plain bytes alone."""
    return secret.accepted if isinstance(secret, Secrets) else (bytes(secret),)


def load_secret(secret_file: str | None = None, env: str = SECRET_ENV) -> Secrets | None:
    """The shared secret(s), or None when neither the file nor the env var is set. The file wins.
    ConfigError (naming secret_file, or the variable, never the value) when the file cannot be read,
    others may read, write or replace it, or a secret is weak (fewer than 16 bytes or 8 distinct
    byte values); more than two secrets are refused."""
    if secret_file:
        try:
            fd = os.open(secret_file, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
            try:
                st = os.fstat(fd)  # the file itself, through any symlinks (a Kubernetes mount is one)
                if not stat.S_ISREG(st.st_mode):
                    raise ConfigError("secret_file", secret_file, "is not a regular file")
                check_secret_mode(secret_file, st.st_mode)
                check_secret_path(secret_file, st)
                with os.fdopen(os.dup(fd), "rb") as f:
                    data = f.read(_MAX_SECRET_FILE + 1)
            finally:
                os.close(fd)
        except OSError as exc:
            raise ConfigError("secret_file", secret_file, f"cannot be read: {exc.strerror}") from None
        if len(data) > _MAX_SECRET_FILE:
            raise ConfigError("secret_file", secret_file, f"is larger than {_MAX_SECRET_FILE} bytes: not a secret file")
        return _parse_secrets("secret_file", secret_file, data.strip(), "holds")
    value = os.environ.get(env)
    if value is None or value == "":
        return None
    raw = value.encode()
    # one line reads exactly as before (the value as it is); a newline inside separates two secrets
    return _parse_secrets(env, "<hidden>", raw if b"\n" not in raw.strip(b"\r\n") else raw.strip(), "is")


def _parse_secrets(key: str, shown: str, data: bytes, verb: str) -> Secrets:
    lines = [line.strip() for line in data.split(b"\n")] if b"\n" in data else [data]
    lines = [line for line in lines if line]
    if not lines:
        raise ConfigError(key, shown, f"{verb} empty; put a secret in it (e.g. openssl rand -hex 32)")
    if len(lines) > MAX_SECRETS:
        raise ConfigError(key, shown, (
            f"{verb} {len(lines)} lines; it holds at most two secrets, one per line: the current one, and during "
            "a rotation one more that is also accepted"))
    for i, line in enumerate(lines):
        which = "" if len(lines) == 1 else (" (its first line: the current secret)" if i == 0 else
                                            " (its second line: the secret also accepted)")
        check_secret_strength(key, shown, line, which)
    return Secrets(lines[0], lines[1] if len(lines) > 1 else None)


def check_secret_strength(key: str, shown: str, secret: bytes, which: str = "") -> None:
    """Refuse a secret anyone could guess or brute-force: fewer than MIN_SECRET_BYTES bytes, or
    fewer than MIN_DISTINCT_BYTES distinct byte values (a repeated character or a short pattern)."""
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(key, shown, (
            f"holds a secret of fewer than {MIN_SECRET_BYTES} bytes{which}; use a longer, random one "
            "(e.g. openssl rand -hex 32)"))
    if len(set(secret)) < MIN_DISTINCT_BYTES:
        raise ConfigError(key, shown, (
            f"holds a weak secret{which}: {len(set(secret))} distinct byte values, fewer than "
            f"{MIN_DISTINCT_BYTES} (a repeated character or pattern); use a random one (e.g. openssl rand -hex 32)"))


def check_secret_mode(secret_file: str, mode: int) -> None:
    """Refuse a secret file any user of the host may read, or one its group or others may write;
    warn about one its group may read."""
    if mode & stat.S_IROTH:
        raise ConfigError("secret_file", secret_file, (
            f"is readable by every user of this host (mode {stat.S_IMODE(mode):04o}); make it readable by "
            "its owner only (chmod 600; in Kubernetes, the secret volume's defaultMode 0400, or 0440 with "
            "an fsGroup)"))
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError("secret_file", secret_file, (
            f"is writable by {'every user of this host' if mode & stat.S_IWOTH else 'its group'} (mode "
            f"{stat.S_IMODE(mode):04o}): whoever may write it chooses the secret; chmod 600"))
    if mode & stat.S_IRGRP and secret_file not in _warned_group:
        _warned_group.add(secret_file)
        logger.warning("secret_file %s is readable by its group (mode %04o): every member of that group can "
                       "join the transfer plane; fine for a Kubernetes fsGroup mount, else chmod 600",
                       secret_file, stat.S_IMODE(mode))


def check_secret_path(secret_file: str, st: os.stat_result) -> None:
    """Refuse a secret file others could replace (ConfigError naming the directory): every directory
    on its real path, and the directory of the name as given (a symlink there could be repointed),
    must not be writable by group or others, unless sticky (others cannot rename or remove what is
    not theirs: /tmp, a Kubernetes secret volume's 1777 root) and the entry in it is ours or root's.
    `st`: the fstat of the file that was opened. The file and each of those directories must also be
    this user's or root's: their owner may rewrite or replace them whatever their mode."""
    trusted = (os.geteuid(), 0)
    if st.st_uid not in trusted:
        raise ConfigError("secret_file", secret_file, (
            f"belongs to uid {st.st_uid}, who may rewrite it whatever its mode; a secret file must be this "
            f"process's user's (uid {os.geteuid()}) or root's"))
    given = os.path.abspath(secret_file)
    real = os.path.realpath(given)
    checks: list[tuple[str, str]] = [(os.path.dirname(given), given)]  # (directory, entry in it)
    entry = real
    while True:
        parent = os.path.dirname(entry)
        checks.append((parent, entry))
        if parent == entry or parent == os.sep:
            break
        entry = parent
    for directory, entry in checks:
        try:
            dst = os.stat(directory)
            est = os.lstat(entry)
        except OSError:
            continue  # gone meanwhile: the open above decided
        if dst.st_uid not in trusted:
            raise ConfigError("secret_file", secret_file, (
                f"lies in directory {directory}, which belongs to uid {dst.st_uid}: its owner could replace the "
                f"secret. Keep the file in a directory of this user's (uid {os.geteuid()}) or root's"))
        if not dst.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            continue
        if dst.st_mode & stat.S_ISVTX and est.st_uid in trusted:
            continue
        who = "every user of this host" if dst.st_mode & stat.S_IWOTH else "its group"
        raise ConfigError("secret_file", secret_file, (
            f"lies in directory {directory}, which {who} may write (mode {stat.S_IMODE(dst.st_mode):04o}"
            + (f", sticky, but {entry} belongs to uid {est.st_uid}" if dst.st_mode & stat.S_ISVTX else ", not sticky")
            + "): anyone who may write it could replace the secret. Keep the file in a directory only its owner may "
            "write (chmod go-w on it), or in a sticky one such as /tmp"))


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


# ---------------------------------------------------------------------- v4: mutual, over a transcript
def transcript(version: int, compat: str, peer: str, client_nonce: bytes, server_nonce: bytes,
               protection: str = "handshake") -> bytes:
    """SHA-256 of everything the handshake agreed on, each part length-prefixed (unambiguous).
    `protection` joins only when it is not the default, so default transcripts are unchanged."""
    h = hashlib.sha256(DOMAIN)
    parts = [str(version).encode(), compat.encode(), peer.encode(), client_nonce, server_nonce]
    if protection != "handshake":
        parts.append(b"protection=" + protection.encode())
    for part in parts:
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return h.digest()


def prove_role(secret: bytes, role: bytes, th: bytes) -> bytes:
    return hmac.new(secret, DOMAIN + b"\0" + role + b"\0" + th, hashlib.sha256).digest()


def verify_role(secret: bytes, role: bytes, th: bytes, mac: bytes | None) -> bool:
    """`mac` is `role`'s proof of `th` under `secret` (its current secret alone, for a Secrets)."""
    return isinstance(mac, bytes) and hmac.compare_digest(prove_role(bytes(secret), role, th), mac)


def verify_any(secret: bytes, role: bytes, th: bytes, mac: bytes | None) -> bytes | None:
    """The secret, of those `secret` accepts (a Secrets' `accepted`, or plain bytes alone), under
    which `mac` is `role`'s proof of transcript `th`; None when none is. Every candidate is checked
    (no early exit). The caller continues with the secret returned: a client proves with it and both
    sides derive `session_key` from the one the client's proof matched (module docstring, Rotation)."""
    found = None
    for candidate in accepted_secrets(secret):
        if verify_role(candidate, role, th, mac) and found is None:
            found = candidate
    return found


def session_key(secret: bytes, th: bytes) -> bytes:
    """HKDF-SHA256 (RFC 5869): extract with the transcript as salt, expand to one 32-byte block."""
    prk = hmac.new(th, secret, hashlib.sha256).digest()
    return hmac.new(prk, _SESSION_INFO + b"\x01", hashlib.sha256).digest()


@dataclass(frozen=True)
class Session:
    """What the server knows about a connection after its handshake; landing and logs read it.

    id:            unique per connection; with a secret, derived from the transcript (both sides
                   can compute it), else random.
    authenticated: the peer proved the shared secret (mutual for v4, one way for v3).
    mutual:        the peer also checked ours (v4).
    peer:          its address, "host:port".
    peer_name:     the name it gave in its Hello (part of the authenticated transcript under a secret).
    key:           the session key (v4 with a secret), else None.
    protection:    the wire_protection both sides agreed on ("handshake", or "aead": sealed).
    """
    id: str
    version: int
    authenticated: bool
    mutual: bool
    peer: str
    peer_name: str = ""
    key: bytes | None = None
    protection: str = "handshake"


def session_id(th: bytes | None) -> str:
    return hashlib.sha256(b"id\0" + th).hexdigest()[:32] if th is not None else secrets.token_hex(16)
