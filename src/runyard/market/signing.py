"""Ed25519 signatures over a canonical JSON encoding.

The canonical encoding is JSON with keys sorted, no insignificant whitespace, UTF-8, and only
strings, integers, booleans, null, lists and objects: floats are refused because two encoders may
print the same float differently, and a signature must cover exactly one byte string. Keys and
signatures travel as unpadded base64url text.
"""

from __future__ import annotations

import base64
import binascii
import json

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from runyard.market.errors import BadRequest, SignatureInvalid


def b64encode(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def b64decode(text: str, what: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(f"{what} is not base64url text") from exc


def _check_canonical(value: object, path: str) -> None:
    if isinstance(value, bool | int | str) or value is None:
        return
    if isinstance(value, float):
        raise BadRequest(f"{path}: floats are not allowed in signed payloads; use integers")
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_canonical(item, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise BadRequest(f"{path}: object keys must be strings")
            _check_canonical(item, f"{path}.{key}")
        return
    raise BadRequest(f"{path}: {type(value).__name__} cannot be signed")


def canonical_bytes(payload: dict) -> bytes:
    """The one byte string a signature covers for `payload`."""
    _check_canonical(payload, "payload")
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def generate_keypair() -> tuple[str, str]:
    """A fresh (private_key, public_key) pair as base64url text of the raw 32-byte keys."""
    private = Ed25519PrivateKey.generate()
    raw_private = private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    raw_public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return b64encode(raw_private), b64encode(raw_public)


def public_key_of(private_key: str) -> str:
    private = Ed25519PrivateKey.from_private_bytes(b64decode(private_key, "private key"))
    return b64encode(private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))


# Curve25519's field prime and the Edwards curve constant d (RFC 8032, section 5.1).
_P = 2**255 - 19
_D = -121665 * pow(121666, _P - 2, _P) % _P


def _recover_x(y: int, sign: int) -> int | None:
    """The x coordinate of the point with this y and sign bit (RFC 8032, 5.1.3), or None."""
    if y >= _P:
        return None  # a non-canonical encoding
    x2 = (y * y - 1) * pow(_D * y * y + 1, _P - 2, _P) % _P
    if x2 == 0:
        return None if sign else 0
    x = pow(x2, (_P + 3) // 8, _P)
    if (x * x - x2) % _P:
        x = x * pow(2, (_P - 1) // 4, _P) % _P
    if (x * x - x2) % _P:
        return None
    return _P - x if (x & 1) != sign else x


def _double(pt: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """2·pt in extended coordinates (the addition formula of RFC 8032, 5.1.4, with pt twice)."""
    x, y, z, t = pt
    a, b = (y - x) * (y - x) % _P, (y + x) * (y + x) % _P
    c, d = 2 * t * t * _D % _P, 2 * z * z % _P
    e, f, g, h = b - a, d - c, d + c, b + a
    return e * f % _P, g * h % _P, f * g % _P, e * h % _P


def has_small_order(raw: bytes) -> bool:
    """True when the 32-byte encoding is not a point, is non-canonical, or is a point of order 1, 2,
    4 or 8 (8·P is the identity): keys for which one signature can verify for many messages."""
    y = int.from_bytes(raw, "little")
    sign, y = y >> 255, y & ((1 << 255) - 1)
    x = _recover_x(y, sign)
    if x is None:
        return True
    point = (x, y, 1, x * y % _P)
    for _ in range(3):
        point = _double(point)
    return point[0] % _P == 0 and (point[1] - point[2]) % _P == 0


def check_public_key(public_key: str) -> str:
    """Validate a base64url raw Ed25519 public key; return it unchanged. The identity point and the
    other small-order points are refused, and so are non-canonical encodings."""
    raw = b64decode(public_key, "public_key")
    if len(raw) != 32:
        raise BadRequest(f"public_key must be 32 raw bytes of Ed25519 key, got {len(raw)} bytes")
    try:
        Ed25519PublicKey.from_public_bytes(raw)
    except ValueError as exc:
        raise BadRequest(f"public_key is not a valid Ed25519 key: {exc}") from exc
    if has_small_order(raw):
        raise BadRequest("public_key is a small-order or non-canonical Ed25519 point; use a real key pair")
    return public_key


def sign(private_key: str, payload: dict) -> str:
    """Sign the canonical encoding of `payload`; returns the signature as base64url text."""
    private = Ed25519PrivateKey.from_private_bytes(b64decode(private_key, "private key"))
    return b64encode(private.sign(canonical_bytes(payload)))


def verify(public_key: str, payload: dict, signature: str, what: str) -> None:
    """Raise SignatureInvalid unless `signature` is `public_key`'s signature of `payload`."""
    raw_sig = b64decode(signature, f"{what} signature")
    if len(raw_sig) != 64:
        raise SignatureInvalid(f"{what} signature must be 64 bytes, got {len(raw_sig)}")
    key = Ed25519PublicKey.from_public_bytes(b64decode(public_key, "public key"))
    try:
        key.verify(raw_sig, canonical_bytes(payload))
    except InvalidSignature as exc:
        raise SignatureInvalid(
            f"{what} signature does not verify against the signer's registered key"
        ) from exc
