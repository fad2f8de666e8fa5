"""Who may call the control plane's HTTP API: the holder of its token, from this machine.

The daemon keeps a bearer token in `<state dir>/api-token`, a file only its owner can read (0600),
made when the daemon first starts and kept across restarts. Every call carries it
(`Authorization: Bearer <token>`); the CLI reads it from the state directory. Two more checks keep
a web browser on this machine from being used against the API (DNS rebinding, cross-site posts):
the Host header must name a loopback address, and a request with a body must say it is JSON
(`Content-Type: application/json`), which a plain HTML form cannot send.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path

from runyard.errors import RunyardError
from runyard.system.files import atomic_write_text

TOKEN_FILE = "api-token"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class TokenError(RunyardError):
    """The control plane's token file is missing, unreadable or readable by others."""


def token_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / TOKEN_FILE


def ensure_token(state_dir: str | Path) -> str:
    """The daemon's token, made (0600) if there is none yet; TokenError if the file is open to others."""
    path = token_path(state_dir)
    if not path.exists():
        atomic_write_text(path, secrets.token_urlsafe(32) + "\n", mode=0o600)
    return read_token(state_dir)


def read_token(state_dir: str | Path) -> str:
    """The token in the state directory; TokenError if it is missing, empty or group/world-accessible."""
    path = token_path(state_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise TokenError(f"{path} does not exist: the control plane makes it when it starts") from None
    except OSError as exc:
        raise TokenError(f"cannot read the control plane's token {path}: {exc.strerror}") from None
    with os.fdopen(fd) as fh:
        mode = os.fstat(fd).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise TokenError(f"{path} is readable by others (mode {stat.S_IMODE(mode):o}); it must be 0600. "
                             "Delete it and restart the control plane to make a new one")
        token = fh.read().strip()
    if not token:
        raise TokenError(f"{path} is empty; delete it and restart the control plane")
    return token


def bearer_ok(header: str | None, token: str) -> bool:
    """True if an Authorization header carries exactly this token (compared in constant time)."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode(), token.encode())


def host_ok(header: str | None) -> bool:
    """True if a Host header names a loopback address (any port): what a rebinding domain cannot send."""
    if not header:
        return False
    host = header.strip().lower()
    if host.startswith("["):  # [::1]:port
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host in LOOPBACK_HOSTS


def json_content_type(header: str | None) -> bool:
    """True for `application/json`, with or without parameters such as charset."""
    return bool(header) and header.split(";", 1)[0].strip().lower() == "application/json"
