"""Shared-secret peer authentication (HMAC-SHA256 over a server nonce).

The secret comes from an environment variable or a file, never from the command line, where
`ps` and shell history would show it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from kvconnectors.errors import ConfigError

SECRET_ENV = "KVCONNECTORS_SECRET"
_DOMAIN = b"kvconnectors-auth-v1"


def load_secret(secret_file: str | None = None, env: str = SECRET_ENV) -> bytes | None:
    """The shared secret, or None when neither the file nor the env var is set."""
    if secret_file:
        path = Path(secret_file)
        try:
            data = path.read_bytes().strip()
        except OSError as exc:
            raise ConfigError("secret_file", secret_file, f"cannot be read: {exc.strerror}") from None
        if len(data) < 16:
            raise ConfigError("secret_file", secret_file, "holds fewer than 16 bytes; use a longer secret")
        return data
    value = os.environ.get(env)
    if value is None or value == "":
        return None
    if len(value) < 16:
        raise ConfigError(env, "<hidden>", "shorter than 16 characters; use a longer secret")
    return value.encode()


def new_nonce() -> bytes:
    return secrets.token_bytes(32)


def prove(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, _DOMAIN + nonce, hashlib.sha256).digest()


def verify(secret: bytes, nonce: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(prove(secret, nonce), mac)
