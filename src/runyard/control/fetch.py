"""Fetch a lease's data URLs for it, before its job starts (the job itself has no network).

The fetch runs on the provider's network, so a URL must not become a way into it: every address a
host resolves to must be a public one (not loopback, private, link-local -- the cloud metadata
service --, multicast or reserved) or in a network the operator allows (`--allow-data-network`), the connection
goes to the very address that was checked (no second lookup that DNS could answer differently),
and each redirect is checked the same way. No credentials are sent: no cookies, no netrc, no proxy
settings of the daemon. Each file is bounded in size (the total too), written to a temporary name
and renamed into place only when complete.
"""

from __future__ import annotations

import hashlib
import http.client
import ipaddress
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urljoin, urlsplit

from runyard.errors import RunyardError
from runyard.system.files import fsync_dir

MAX_REDIRECTS = 5
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
CHUNK = 1 << 20


class FetchError(RunyardError):
    """A data URL could not be fetched for a lease's job; the message names the URL and why."""


@dataclass(frozen=True)
class Fetched:
    url: str
    path: Path
    bytes: int
    sha256: str


def allowed_networks(cidrs: list[str]) -> list[Network]:
    """The operator's extra networks (CIDR strings); ValueError for one that is not a network."""
    return [ipaddress.ip_network(c, strict=False) for c in cidrs]


def is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """A unicast address of the public internet (an IPv4-mapped IPv6 address is judged as IPv4)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_unspecified)


def checked_address(host: str, port: int, networks: list[Network] | None = None) -> str:
    """One address of `host` to connect to, after checking that every address it resolves to is
    public or inside one of `networks`."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise FetchError(f"cannot resolve {host!r}: {exc.strerror}") from None
    addresses = [info[4][0] for info in infos]
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if not is_public(ip) and not any(ip.version == n.version and ip in n for n in networks or []):
            raise FetchError(f"{host!r} resolves to {ip}, which is not a public address; this provider "
                             "fetches data only from the public internet and the networks it allows")
    return addresses[0]


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to an address checked beforehand, whatever `host` resolves to now."""

    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self._address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._address = address

    def connect(self) -> None:
        raw = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(raw, server_hostname=self.host)  # type: ignore[attr-defined]


def fetch_url(url: str, dest: Path, max_bytes: int, networks: list[Network] | None = None,
              timeout_s: float = 60.0) -> Fetched:
    """Fetch `url` into `dest` (at most `max_bytes`), following up to MAX_REDIRECTS checked redirects."""
    current = url
    for _ in range(MAX_REDIRECTS + 1):
        parts = urlsplit(current)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password:
            raise FetchError(f"{url}: {current[:200]!r} is not an http(s) URL without credentials")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        address = checked_address(parts.hostname, port, networks)
        kind = _PinnedHTTPSConnection if parts.scheme == "https" else _PinnedHTTPConnection
        conn = kind(parts.hostname, port, address, timeout_s)
        try:
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn.request("GET", target, headers={"User-Agent": "runyard-lease-fetch", "Accept-Encoding": "identity"})
            response = conn.getresponse()
            if response.status in (301, 302, 303, 307, 308):
                location = response.getheader("Location")
                if not location:
                    raise FetchError(f"{url}: a redirect without a Location")
                current = urljoin(current, location)
                continue
            if response.status != 200:
                raise FetchError(f"{url}: the server answered {response.status} {response.reason}")
            declared = response.getheader("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise FetchError(f"{url}: {declared} bytes, more than the {max_bytes} bytes this provider fetches")
            return _save(url, response, dest, max_bytes)
        except (OSError, http.client.HTTPException) as exc:
            raise FetchError(f"{url}: {exc}") from None
        finally:
            conn.close()
    raise FetchError(f"{url}: more than {MAX_REDIRECTS} redirects")


def _save(url: str, response: http.client.HTTPResponse, dest: Path, max_bytes: int) -> Fetched:
    tmp = dest.with_name(f".{dest.name}.partial")
    digest, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            while block := response.read(CHUNK):
                size += len(block)
                if size > max_bytes:
                    raise FetchError(f"{url}: more than the {max_bytes} bytes this provider fetches")
                digest.update(block)
                out.write(block)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(dest.parent)
    return Fetched(url, dest, size, "sha256:" + digest.hexdigest())


def fetch_all(urls: dict[str, Path], max_total_bytes: int, networks: list[Network] | None = None) -> list[Fetched]:
    """Fetch every URL to its path (skipping those already fetched: a restarted attempt), the total
    bounded by `max_total_bytes`."""
    done: list[Fetched] = []
    left = max_total_bytes
    for url, dest in urls.items():
        if dest.is_file() and not dest.is_symlink():
            size = dest.stat().st_size
        else:
            size = fetch_url(url, dest, left, networks).bytes
        left -= size
        if left < 0:
            raise FetchError(f"the data URLs hold more than the {max_total_bytes} bytes this provider fetches")
        done.append(Fetched(url, dest, size, ""))
    return done
