"""The client's identity file: what `save_identity` writes reads back; a malformed one is a clear error."""

from __future__ import annotations

import json

import pytest

from runyard.errors import RunyardError
from runyard.market.client import MarketClient
from runyard.market.signing import generate_keypair


@pytest.mark.parametrize(
    "content, expect",
    [
        ("{bad", "cannot read market identity"),
        ("[1, 2]", "is not an object"),
        ('{"url": 5, "token": "t"}', "is not an object"),
        ('{"token": "t"}', "names no market url"),
    ],
)
def test_malformed_identity_file_is_a_clear_error(tmp_path, content, expect):
    path = tmp_path / "identity.json"
    path.write_text(content)
    with pytest.raises(RunyardError, match=expect):
        MarketClient.from_identity_file(path)


def test_identity_file_round_trip(tmp_path):
    path = tmp_path / "identity.json"
    path.write_text(json.dumps({"url": "http://127.0.0.1:9", "token": "t", "private_key": None}))
    client = MarketClient.from_identity_file(path)
    assert client.token == "t"

    # What save_identity writes (secret: mode 0600) reads back as the same account and key.
    saver = MarketClient("http://127.0.0.1:9")
    saver.token, saver.private_key = "tok-2", generate_keypair()[0]
    saved = tmp_path / "saved.json"
    saver.save_identity(saved)
    assert saved.stat().st_mode & 0o777 == 0o600
    again = MarketClient.from_identity_file(saved)
    assert (again.base_url, again.token, again.private_key) == (saver.base_url, "tok-2", saver.private_key)
    assert [f.name for f in tmp_path.iterdir() if f.name not in ("identity.json", "saved.json")] == []
