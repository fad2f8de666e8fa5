from __future__ import annotations

import pytest

from runyard.market.errors import BadRequest, SignatureInvalid
from runyard.market.payloads import usage_record
from runyard.market.signing import canonical_bytes, check_public_key, generate_keypair, sign, verify


def test_canonical_encoding_is_key_order_independent_and_compact():
    assert canonical_bytes({"b": 1, "a": [True, None, "é"]}) == canonical_bytes(
        {"a": [True, None, "é"], "b": 1}
    )
    assert canonical_bytes({"b": 1, "a": 2}) == b'{"a":2,"b":1}'
    assert canonical_bytes({"a": "é"}) == '{"a":"é"}'.encode()


def test_floats_cannot_be_signed():
    with pytest.raises(BadRequest, match=r"payload\.x\[1\]: floats"):
        canonical_bytes({"x": [1, 2.5]})


def test_signature_round_trip_and_tampering():
    private, public = generate_keypair()
    payload = usage_record(1, 1, 100, 200, 50)
    signature = sign(private, payload)
    verify(public, payload, signature, "usage record")
    with pytest.raises(SignatureInvalid, match="does not verify"):
        verify(public, {**payload, "device_seconds": 51}, signature, "usage record")
    _, other_public = generate_keypair()
    with pytest.raises(SignatureInvalid):
        verify(other_public, payload, signature, "usage record")
    with pytest.raises(SignatureInvalid, match="64 bytes"):
        verify(public, payload, signature[:-8], "usage record")


def test_public_keys_are_checked():
    with pytest.raises(BadRequest, match="32 raw bytes"):
        check_public_key("AAAA")
    with pytest.raises(BadRequest, match="base64url"):
        check_public_key("not base64 at all!!")
