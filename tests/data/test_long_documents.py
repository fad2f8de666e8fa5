"""A long document is encoded a piece at a time (its encoder memory follows the piece, not the
document), and the pieces' tokens are exactly the whole document's: cut only where byte-level BPE's
split regex ends a pre-token anyway, and only for tokenizers where that holds."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from runyard.data.tokenize import cut_points, cuts_at_lines, encode_documents, line_pieces
from runyard.data.tokenizer import train_bpe

EDGES = [
    "def f(x):\n    return x  \n\n\t\tif y:\n        pass\r\n  z = 'it''s'  \n",
    "a  b   c\n d\n\ne \t f\r\ng\n \nh 's  't 12 345\n  ...  !!  ?? \n",
    "trailing spaces   \n   \n   ",
    "   leading and    inner     runs of spaces    ",
    "unicode: café  naïve\n  Ωmega  日本語 テキスト\n  é  x",
    "<|endoftext|> inside  <|endoftext|>\n  text  " * 3,  # added tokens: encoded whole
    "x" * 500 + "\n" + "y " * 300,
    "    ",
    "",
]


def real_texts() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(stdlib.glob("*.py"))[:40]:
        try:
            out.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    return out


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_bpe(real_texts()[:20], vocab_size=1200, min_frequency=2, max_bytes=2_000_000)


@pytest.mark.parametrize("max_chars", [1, 7, 64, 1000])
def test_pieces_encode_to_the_whole_documents_tokens(tok: Tokenizer, max_chars: int):
    texts = real_texts() + EDGES
    assert cuts_at_lines(tok)
    whole_tokens, whole_lengths = encode_documents(tok, texts, 0, np.dtype(np.uint16))
    tokens, lengths = encode_documents(tok, texts, 0, np.dtype(np.uint16), max_piece_chars=max_chars)
    np.testing.assert_array_equal(lengths, whole_lengths)
    np.testing.assert_array_equal(tokens, whole_tokens)
    for text in texts:
        pieces = line_pieces(text, max_chars)
        assert "".join(pieces) == text
        if len(text) > max_chars:
            assert len(pieces) > 1 or len(cut_points(text)) == 0
            # a piece is longer than asked only where no cut point falls within reach
            assert all(len(p) <= max_chars or len(cut_points(p)) == 0 or max_chars < 64 for p in pieces)


def test_each_cut_point_keeps_the_tokens_on_its_own(tok: Tokenizer):
    text = EDGES[0] + EDGES[1] + EDGES[4] + EDGES[6]
    whole = tok.encode(text).ids
    points = cut_points(text)
    assert len(points) > 10
    for p in points.tolist():
        assert tok.encode(text[:p]).ids + tok.encode(text[p:]).ids == whole, (p, text[p - 5 : p + 5])


def test_tokenizers_where_cutting_could_change_tokens_are_encoded_whole(tok: Tokenizer):
    prefixed = Tokenizer.from_str(tok.to_str())
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    normalized = Tokenizer.from_str(tok.to_str())
    normalized.normalizer = normalizers.NFKC()
    word_level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    for other in (prefixed, normalized, word_level):
        assert not cuts_at_lines(other)
    text = "word " * 400
    whole = encode_documents(prefixed, [text], 0, np.dtype(np.uint16))
    cut = encode_documents(prefixed, [text], 0, np.dtype(np.uint16), max_piece_chars=50)
    np.testing.assert_array_equal(cut[0], whole[0])  # encoded whole: a prefix space per piece would differ
