"""Tokenizer: train a byte-level BPE with HF `tokenizers` on the training split, or load one.

Byte-level means every input is representable (no unknown token); the end-of-document token
`<|endoftext|>` is special id 0 in a trained tokenizer, and for a loaded one it must exist in its vocab.
A tokenizer that comes from a model directory (a Hugging Face model or a runyard export) is its
`tokenizer.json` with the `tokenizer_config.json` beside it, read as transformers reads it (an older
layout's special_tokens_map.json and added_tokens.json included), whose `eos_token` is the
end-of-document token; an export writes the same pair (`tokenizer_config_for`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from runyard.errors import DataError

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Files older transformers wrote beside tokenizer_config.json; it still reads them when the config has no
# `added_tokens_decoder` (tokenization_utils_base's `_from_pretrained`).
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
ADDED_TOKENS_FILE = "added_tokens.json"


def vocab_shortfall(asked: int, got: int) -> str:
    """Why a trained vocabulary is smaller than the spec asked, and what to do about it."""
    return (
        f"data.tokenizer.vocab_size asked for {asked:,} tokens but the training text (up to "
        f"data.tokenizer.train_max_bytes) supports only {got:,}: no further pair occurs "
        f"data.tokenizer.min_frequency times. The vocabulary has {got:,} tokens; set vocab_size to {got:,} "
        "or less, add text, or lower min_frequency."
    )


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int, max_bytes: int) -> Tokenizer:
    """Train a byte-level BPE on `texts`, reading at most `max_bytes` (UTF-8) of them in order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def capped() -> Iterator[str]:
        used = 0
        for text in texts:
            if used >= max_bytes:
                return
            size = len(text.encode("utf-8"))
            if used + size > max_bytes:
                text = text.encode("utf-8")[: max_bytes - used].decode("utf-8", errors="ignore")
                size = max_bytes - used
            used += size
            yield text

    tok.train_from_iterator(capped(), trainer=trainer)
    return tok


def load_tokenizer(path: str | Path, eos_token: str = EOS_TOKEN) -> Tokenizer:
    """Load a `tokenizer.json`; raises DataError if it is unreadable or lacks the end-of-document token."""
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on bad files
        raise DataError(f"cannot load tokenizer {path}: {exc}") from None
    if tok.token_to_id(eos_token) is None:
        raise DataError(f"tokenizer {path} has no end-of-document token {eos_token!r} in its vocabulary")
    return tok


def eos_id(tok: Tokenizer, eos_token: str = EOS_TOKEN) -> int:
    token_id = tok.token_to_id(eos_token)
    if token_id is None:
        raise DataError(f"tokenizer has no {eos_token!r} token")
    return token_id


def read_tokenizer_config(directory: str | Path) -> dict[str, Any]:
    """The `tokenizer_config.json` of a model directory as transformers reads it: when it has no
    `added_tokens_decoder` (the layout of older transformers), the special tokens of a
    special_tokens_map.json beside it override its own. DataError naming the file when it is missing or
    not a JSON object."""
    path = Path(directory) / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        raise DataError(f"{path} is missing; a model directory's tokenizer needs it (its eos_token)")
    data = _json_object(path)
    special_map = Path(directory) / SPECIAL_TOKENS_MAP_FILE
    if "added_tokens_decoder" not in data and special_map.is_file():
        data = {**data, **_json_object(special_map)}
    return data


def _json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise DataError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def check_added_tokens(tok: Tokenizer, directory: str | Path) -> None:
    """The added tokens a model directory lists beside tokenizer.json (tokenizer_config.json's
    `added_tokens_decoder`, else a legacy added_tokens.json) must be in tokenizer.json at the same ids,
    since runyard tokenizes with tokenizer.json alone. DataError naming the file and the token."""
    directory = Path(directory)
    config_path = directory / TOKENIZER_CONFIG_FILE
    config = _json_object(config_path) if config_path.is_file() else {}
    listed: dict[str, int] = {}
    source = config_path
    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        for index, token in decoder.items():
            content = token.get("content") if isinstance(token, dict) else token
            if isinstance(content, str) and str(index).isdigit():
                listed[content] = int(index)
    elif (directory / ADDED_TOKENS_FILE).is_file():
        source = directory / ADDED_TOKENS_FILE
        listed = {k: v for k, v in _json_object(source).items() if isinstance(v, int)}
    for content, index in sorted(listed.items(), key=lambda kv: kv[1]):
        found = tok.token_to_id(content)
        if found != index:
            where = "is not in it" if found is None else f"has id {found} there"
            raise DataError(f"{source} lists added token {content!r} at id {index}, but {directory / TOKENIZER_FILE} "
                            f"{where}: transformers and runyard would tokenize differently; save the tokenizer "
                            "again with transformers' save_pretrained")


def special_token(config: dict[str, Any], field: str) -> str | None:
    """A special token of a tokenizer_config.json (`eos_token`, `bos_token`...): a string, or
    transformers' {"content": ...} form; None when unset."""
    value = config.get(field)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def eos_token_beside(tokenizer_path: str | Path) -> str:
    """The end-of-document token for `tokenizer_path`: the `eos_token` of a tokenizer_config.json in
    the same directory, or runyard's `<|endoftext|>` when there is none."""
    config_path = Path(tokenizer_path).parent / TOKENIZER_CONFIG_FILE
    if not config_path.is_file():
        return EOS_TOKEN
    token = special_token(read_tokenizer_config(config_path.parent), "eos_token")
    if token is None:
        raise DataError(f"{config_path}: field 'eos_token' is missing; it names the end-of-document token")
    return token


def load_model_tokenizer(directory: str | Path) -> tuple[Tokenizer, dict[str, Any]]:
    """(tokenizer, tokenizer config) of a model directory: tokenizer.json and tokenizer_config.json,
    whose eos_token must be in the vocabulary. DataError naming the file and field otherwise."""
    directory = Path(directory)
    path = directory / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(f"{path} is missing; a model directory must hold its tokenizer")
    config = read_tokenizer_config(directory)
    tok = load_tokenizer(path, eos_token_beside(path))
    check_added_tokens(tok, directory)
    return tok, config


def token_ids(tok: Tokenizer, config: dict[str, Any]) -> dict[str, int | None]:
    """bos/eos/pad token ids of a tokenizer and its config, as config.json and generation_config.json
    carry them (None where the config names no such token)."""
    out: dict[str, int | None] = {}
    for kind in ("bos", "eos", "pad"):
        token = special_token(config, f"{kind}_token")
        out[f"{kind}_token_id"] = tok.token_to_id(token) if token is not None else None
    return out


def tokenizer_config_for(context_length: int, chat_template: str | None = None) -> dict[str, Any]:
    """The tokenizer_config.json of a tokenizer runyard trained (byte-level BPE, `<|endoftext|>` ending
    every document, no start token), so transformers' AutoTokenizer loads the export."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config
