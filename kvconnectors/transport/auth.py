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

v3 peers (the previous version) speak the old one-way challenge (`prove_legacy`): the server proves
nothing, and the client signs the server's nonce.

The secret comes from an environment variable or a file, never from the command line, where
`ps` and shell history would show it. A world-readable file is refused; a group-readable one is
warned about (Kubernetes mounts secrets 0440 under an fsGroup).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from kvconnectors.errors import ConfigError
from kvconnectors.logs import get_logger

logger = get_logger(__name__)

SECRET_ENV = "KVCONNECTORS_SECRET"
NONCE_BYTES = 32
_LEGACY_DOMAIN = b"kvconnectors-auth-v1"   # v3's one-way challenge
DOMAIN = b"kvconnectors-auth-v2"           # v4's transcript
ROLE_SERVER, ROLE_CLIENT = b"server", b"client"
_SESSION_INFO = b"kvconnectors session key v1"
_warned_group: set[str] = set()


def load_secret(secret_file: str | None = None, env: str = SECRET_ENV) -> bytes | None:
    """The shared secret, or None when neither the file nor the env var is set."""
    if secret_file:
        path = Path(secret_file)
        try:
            mode = path.stat().st_mode  # the file itself (a Kubernetes mount is a symlink to it)
            data = path.read_bytes().strip()
        except OSError as exc:
            raise ConfigError("secret_file", secret_file, f"cannot be read: {exc.strerror}") from None
        check_secret_mode(secret_file, mode)
        if len(data) < 16:
            raise ConfigError("secret_file", secret_file, "holds fewer than 16 bytes; use a longer secret")
        return data
    value = os.environ.get(env)
    if value is None or value == "":
        return None
    if len(value) < 16:
        raise ConfigError(env, "<hidden>", "shorter than 16 characters; use a longer secret")
    return value.encode()


def check_secret_mode(secret_file: str, mode: int) -> None:
    """Refuse a secret file any user of the host may read; warn about one its group may read."""
    if mode & stat.S_IROTH:
        raise ConfigError("secret_file", secret_file, (
            f"is readable by every user of this host (mode {stat.S_IMODE(mode):04o}); make it readable by "
            "its owner only (chmod 600; in Kubernetes, the secret volume's defaultMode 0400, or 0440 with "
            "an fsGroup)"))
    if mode & stat.S_IRGRP and secret_file not in _warned_group:
        _warned_group.add(secret_file)
        logger.warning("secret_file %s is readable by its group (mode %04o): every member of that group can "
                       "join the transfer plane; fine for a Kubernetes fsGroup mount, else chmod 600",
                       secret_file, stat.S_IMODE(mode))


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
    return isinstance(mac, bytes) and hmac.compare_digest(prove_role(secret, role, th), mac)


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


# ---------------------------------------------------------------------- v3: one way (previous version)
def prove_legacy(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, _LEGACY_DOMAIN + nonce, hashlib.sha256).digest()


def verify_legacy(secret: bytes, nonce: bytes, mac: bytes) -> bool:
    return isinstance(mac, bytes) and hmac.compare_digest(prove_legacy(secret, nonce), mac)


# Names of before, for callers of the v3 helpers.
prove, verify = prove_legacy, verify_legacy
