"""The `data:` section of a job spec. Owned by the data stage; spec.py embeds it.

Every cleaning step is an optional section with defaults chosen so that a corpus of source code (the
stdlib demo) passes almost untouched: prose-oriented quality filters are off until a spec sets them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, model_validator

from runyard.spec.data_predictive import ImagesSpec, TableSpec

DEFAULT_MEMORY_LIMIT = 4 << 30
MIN_MEMORY_LIMIT = 512 << 20  # an interpreter with numpy, tokenizers and pyarrow, twice, and room to work


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizerSpec(_Strict):
    """The tokenizer: a byte-level BPE trained on the training split (HF `tokenizers`), or one loaded
    from `path`."""

    path: str | None = Field(
        default=None,
        description="a `tokenizer.json` to load instead of training one; it must contain the "
        "end-of-document token `<|endoftext|>`",
    )
    vocab_size: int = Field(
        default=4096,
        ge=260,
        le=1_000_000,
        description="vocabulary of the trained BPE, counting the 256 byte tokens and `<|endoftext|>`. A "
        "corpus too small to support it yields fewer tokens: the data report and a warning say how many",
    )
    min_frequency: int = Field(default=2, ge=1, description="a pair of tokens is merged only if it occurs this often")
    train_max_bytes: int = Field(
        default=50_000_000, gt=0, description="bytes of training-split text (the first, in document order) fed to BPE training"
    )


class NormalizeSpec(_Strict):
    """Text normalisation applied to every document before filtering."""

    nfc: bool = Field(default=True, description="Unicode NFC composition")
    line_endings: bool = Field(default=True, description="CRLF and CR become LF")
    control_chars: bool = Field(default=True, description="drop C0/C1 controls other than tab and newline")
    trailing_whitespace: bool = Field(default=True, description="strip spaces and tabs at line ends")


class FilterSpec(_Strict):
    """Quality filters. Each is off when its bound is null. The defaults only drop empty documents and
    degenerate ones (nearly all lines the same), so source code passes; prose corpora should set the
    Gopher-style bounds; each field below names the one value recommended for prose and documentation
    (min_words 50, max_symbol_word_ratio 0.1, max_non_alpha_word_fraction 0.3, max_top_ngram_fraction 0.2).
    Table, heading and literal-block lines of technical text are recognised first (markup_aware), so tables,
    `#####` headings and code or program output do not count as repetition or symbols. Each removal is counted under its rule, with
    samples naming the measured value and what tripped it."""

    enabled: bool = Field(default=True, description="apply the quality filters at all")
    markup_aware: bool = Field(
        default=True,
        description="recognise table lines (reST grid and simple tables, Markdown tables) and heading lines "
        "(Markdown `#` headings at a line's start, reST over/underlines such as `=====`): every rule but the "
        "character counts reads the text without their markup (table cells and titles still count as words), "
        "and a repeated heading title is not repetition; literal blocks (Markdown ``` and ~~~ fences, reST `::` "
        "blocks, `.. code-block::`/`.. code::` directives) are left out of every rule but the character and word counts",
    )
    min_chars: int | None = Field(default=1, ge=0, description="remove documents shorter than this many characters")
    max_chars: int | None = Field(default=None, ge=1, description="remove documents longer than this many characters")
    min_words: int | None = Field(default=None, ge=0, description="remove documents with fewer whitespace-separated words (prose: 50)")
    max_words: int | None = Field(default=None, ge=1, description="remove documents with more whitespace-separated words")
    min_mean_word_length: float | None = Field(
        default=None, ge=0, description="remove documents whose mean word length (characters) is below this"
    )
    max_mean_word_length: float | None = Field(
        default=None, gt=0, description="remove documents whose mean word length (characters) is above this"
    )
    max_symbol_word_ratio: float | None = Field(
        default=None, ge=0, description="bound on ('#' characters + ellipses) per word, outside table, heading and literal-block markup "
        "(prose: 0.1)"
    )
    max_non_alpha_word_fraction: float | None = Field(
        default=None, ge=0, le=1, description="bound on the fraction of words with no alphabetic character (prose and documentation: 0.3)"
    )
    max_duplicate_line_fraction: float | None = Field(
        default=0.9,
        ge=0,
        le=1,
        description="bound on the fraction of non-blank lines that repeat an earlier line (table borders and "
        "heading underlines aside)",
    )
    max_duplicate_paragraph_fraction: float | None = Field(
        default=None, ge=0, le=1, description="bound on the fraction of paragraphs that repeat an earlier paragraph"
    )
    top_ngram_n: int = Field(default=2, ge=1, le=10, description="words per n-gram for max_top_ngram_fraction")
    max_top_ngram_fraction: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="bound on the fraction of word characters covered by the most frequent word n-gram "
        "(Gopher), outside table and heading markup (prose: 0.2 with top_ngram_n 2)",
    )
    max_ellipsis_line_fraction: float | None = Field(
        default=None, ge=0, le=1, description="bound on the fraction of lines ending in '...' or '…'"
    )
    max_bullet_line_fraction: float | None = Field(
        default=None, ge=0, le=1, description="bound on the fraction of lines starting with a bullet ('•', '- ', '* ', ...)"
    )
    samples_per_reason: int = Field(
        default=3, ge=0, le=100, description="removed documents kept in the data report per rule"
    )


class PiiSpec(_Strict):
    """PII scrubbing, off by default: matches are replaced by placeholders (`<EMAIL>`, `<PHONE>`, `<IP>`,
    `<CARD>`), counted, and shown before/after in the data report. Documentation addresses (RFC 5737 and
    RFC 3849 examples, private, loopback and link-local ranges), version strings, digit runs without a
    phone number's shape and decimals are left alone."""

    enabled: bool = Field(default=False, description="scrub PII at all")
    emails: bool = Field(default=True, description="replace e-mail addresses (example.com/.org/.net and .test, .example, .invalid domains excepted)")
    phones: bool = Field(
        default=True,
        description="replace phone numbers: international (+CC) or with a trunk prefix/area code in "
        "parentheses and separated groups; a bare digit run is not a phone number",
    )
    ip_addresses: bool = Field(default=True, description="replace public IPv4 and IPv6 addresses")
    credit_cards: bool = Field(
        default=True, description="replace card numbers: 13-19 digits, grouped by spaces or dashes, passing the Luhn check"
    )
    samples_per_kind: int = Field(
        default=3, ge=0, le=100, description="replacements shown before/after in the data report per kind"
    )


class SourceSpec(_Strict):
    """One input. `path` is a local path, a glob, or an fsspec URL. `{stdlib}` in it expands to the
    running interpreter's standard library directory."""

    path: str = Field(
        description="a local file, a glob (`**` recurses) or an fsspec URL; `{stdlib}` expands to the "
        "interpreter's standard library. `runyard plan` fails when it matches no file"
    )
    format: Literal["text", "jsonl", "parquet", "csv", "npz", "image_folder", "sklearn"] = Field(
        default="text",
        description="language models: `text` (each file is one document), `jsonl` (one document per line) or "
        "`parquet` (one document per row). Tables: `csv` or `parquet` (one row per row). Images: `image_folder` "
        "(path is a folder with a subfolder of PNG/JPEG files per class) or `npz`. Either: `sklearn` (path names "
        "a data set scikit-learn ships: `breast_cancer`, `wine`, `iris`, `diabetes`, `digits`)",
    )
    text_field: str = Field(default="text", description="JSONL field / Parquet column holding the text")
    exclude: list[str] = Field(
        default_factory=list,
        description="glob patterns of paths to leave out (`*` crosses '/', so `**/test/**` drops every "
        "test directory)",
    )
    encoding_errors: Literal["replace", "skip"] = Field(
        default="replace",
        description="bytes that are not UTF-8: `replace` them with U+FFFD, or `skip` the document (both counted "
        "in the data report)",
    )
    compression: Literal["infer", "none", "gzip", "zstd"] = Field(
        default="infer", description="`infer` from the file name (.gz, .zst), or `none`, `gzip`, `zstd`"
    )
    kind: Literal["documents", "traffic"] = Field(
        default="documents",
        description="`documents` (a corpus), or `traffic`: requests a server logged (`runyard serve "
        "--log-requests`), which are not documents. A traffic source is cleaned with its own `filters` and "
        "`pii` (by default: a floor of 3 words, nothing else of the prose rules, PII scrubbing on), and the data "
        "report counts its records apart: read, removed per reason, duplicates, used",
    )
    filters: FilterSpec | None = Field(
        default=None,
        description="quality filters for this source's documents in place of `data.filters` (null: "
        "`data.filters`; a `traffic` source: the request filters)",
    )
    pii: PiiSpec | None = Field(
        default=None,
        description="PII scrubbing for this source's documents in place of `data.pii` (null: `data.pii`; a "
        "`traffic` source: scrubbing on)",
    )

    @model_validator(mode="after")
    def _traffic_defaults(self) -> SourceSpec:
        if self.kind == "traffic":
            if self.format not in ("jsonl", "text", "parquet"):
                raise ValueError(f"a traffic source is text: format jsonl, text or parquet, not {self.format!r}")
            if self.filters is None:
                self.filters = FilterSpec(**TRAFFIC_FILTERS)
            if self.pii is None:
                self.pii = PiiSpec(enabled=True)
        return self


# What a logged request must pass by default: a prompt is short and often repeated (exact duplicates are
# removed by data.dedup), so of the document rules only a floor of a few words applies.
TRAFFIC_FILTERS = {"min_words": 3, "max_duplicate_line_fraction": None}


class DedupSpec(_Strict):
    """Exact (hash of normalised text) and near-duplicate (MinHash + LSH) removal."""

    exact: bool = Field(default=True, description="remove documents whose normalised text repeats an earlier one")
    near: bool = Field(default=True, description="remove near-duplicates (MinHash signatures, LSH candidate pairs)")
    threshold: float = Field(default=0.8, gt=0, lt=1, description="Jaccard similarity of word n-gram sets")
    num_perm: int = Field(default=128, ge=16, le=1024, description="MinHash permutations per signature")
    ngram: int = Field(default=5, ge=1, le=20, description="words per shingle")
    bands: int | None = Field(default=None, ge=1, description="LSH bands; default tuned to the threshold")
    seed: int = Field(default=1, ge=0, description="seed of the MinHash permutations")
    report_clusters: int = Field(default=10, ge=0, description="largest near-duplicate clusters listed in the data report")

    @model_validator(mode="after")
    def _bands_divide(self) -> DedupSpec:
        if self.bands is not None and self.num_perm % self.bands:
            raise ValueError(f"bands ({self.bands}) must divide num_perm ({self.num_perm})")
        return self


class StoreSpec(_Strict):
    """Where prepared shards are kept (the cold store): a path or any fsspec URL, labelled with a region."""

    url: str = Field(description="a local path or an fsspec URL (s3://, gs://, ...)")
    region: str | None = Field(default=None, description="the region the store is in, checked against data.residency")


class DataSpec(_Strict):
    """The data: where it comes from, how it is cleaned, deduplicated, split and tokenized, and where the
    prepared shards are kept."""

    sources: list[SourceSpec] = Field(min_length=1, description="the inputs, read in order")
    heldout_fraction: float = Field(
        default=0.05,
        gt=0.0,
        lt=0.5,
        description="fraction of documents held out for evaluation, chosen by a seeded hash of each document; "
        "tables and images: the fraction of rows or images in the test split, scored once at the end",
    )
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec, description="train or load the tokenizer")
    shard_tokens: int = Field(default=1 << 20, ge=1024, description="tokens per shard file")
    cache_dir: str | None = Field(
        default=None, description="token cache; default $RUNYARD_CACHE_DIR, else ~/.cache/runyard/data"
    )
    residency: list[str] | None = Field(default=None, description="regions where the data may sit; null: anywhere")
    workers: int | None = Field(
        default=None,
        ge=1,
        description="processes that clean and tokenize at once (local executor), or the most array tasks "
        "running at once (Slurm); default the core count locally, Slurm's choice on a cluster",
    )
    memory_limit: ByteSize = Field(
        default=DEFAULT_MEMORY_LIMIT,
        ge=MIN_MEMORY_LIMIT,
        description="peak memory of the whole data stage on one machine (the preparing process and its "
        "workers together; with Slurm, of each array task), as bytes or with a unit (`4GiB`, `800MB`); at least "
        "512 MiB. "
        "Every buffer is sized from it, whatever the corpus size; a single document too large for a "
        "worker's share is a clear error. Not in the dataset fingerprint",
    )
    chunk_bytes: int = Field(
        default=1 << 22,
        ge=1,
        description="text per tokenization chunk, in bytes (the unit of resume; not in the fingerprint; "
        "capped by what a worker's share of memory_limit can hold)",
    )
    normalize: NormalizeSpec = Field(default_factory=NormalizeSpec, description="text normalisation")
    filters: FilterSpec = Field(default_factory=FilterSpec, description="quality filters")
    pii: PiiSpec = Field(default_factory=PiiSpec, description="PII scrubbing")
    dedup: DedupSpec = Field(default_factory=DedupSpec, description="exact and near-duplicate removal")
    store: StoreSpec | None = Field(default=None, description="cold store the shards are published to")
    cache_region: str | None = Field(
        default=None, description="region of the local cache; default env RUNYARD_REGION"
    )
    table: TableSpec | None = Field(
        default=None, description="tabular tasks: the target column, feature types, missing values and the split"
    )
    images: ImagesSpec | None = Field(
        default=None, description="the image task: channels, resizing, pixel scale and the split (null: the defaults)"
    )
