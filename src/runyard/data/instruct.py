"""prepare_instruct: the data stage for instruction (sft) and preference (dpo) stages.

Steps, as for a text corpus (pipeline.py), but by conversation:
  1. list and fingerprint the inputs (sha256 of every file's bytes; settings; the tokenizer; the context)
  2. read records (instruct_sources.py), normalise every message, count and drop empty responses
  3. exact duplicates (hash of the whole normalised conversation) and near duplicates (MinHash + LSH over
     the conversation's text), each removal counted
  4. split train/held-out by a seeded hash of the conversation, or of its group (all records of a group,
     e.g. one module's functions, land on the same side)
  5. render each conversation with the chat template (chat.py), tokenize its segments, mark the
     assistant's tokens; conversations longer than the context are dropped or truncated (spec policy)
  6. write both splits as sample stores (samples.py) and the data report
The outputs live in `<cache>/instruct/<fingerprint>/`, written to a temporary directory and renamed into
place whole, so an interrupted preparation never leaves a store that reads as complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from tokenizers import Tokenizer

from runyard.data import minhash
from runyard.data.chat import (
    CHAT_TEMPLATE_DIR,
    TEMPLATE_INPUTS,
    ChatTemplate,
    ChatTemplateRefused,
    choose_template,
)
from runyard.data.clean import text_hash
from runyard.data.dedup import exact_duplicates, near_duplicates
from runyard.data.instruct_report import write_instruct_report
from runyard.data.instruct_sources import KEEP_BAD, BadRecords, Record, RecordError, iter_records
from runyard.data.normalize import normalize_text
from runyard.data.pipeline import _source_base
from runyard.data.samples import SampleStore, write_store
from runyard.data.sources import list_source_files, read_bytes
from runyard.data.split import heldout_mask
from runyard.data.tokenizer import eos_token_beside, load_tokenizer
from runyard.errors import DataError
from runyard.spec.data_instruct import InstructDataSpec
from runyard.system.files import atomic_write_json

log = logging.getLogger(__name__)

INSTRUCT_VERSION = 1  # bump when the output changes for the same inputs
Kind = Literal["sft", "dpo"]
SPLITS = ("train", "heldout")
SAMPLE_CHARS = 300


@dataclass(frozen=True)
class PreparedInstruct:
    """Where a stage's prepared records are and what they hold."""

    kind: Kind
    directory: Path
    fingerprint: str
    stats: dict[str, Any]
    pad_id: int
    eos_id: int
    template: ChatTemplate
    tokenizer_path: Path

    def stores(self, split: str) -> list[SampleStore]:
        """The split's store (sft), or its chosen and rejected stores (dpo)."""
        if self.kind == "sft":
            return [SampleStore(self.directory, split)]
        return [SampleStore(self.directory, f"{split}.chosen"), SampleStore(self.directory, f"{split}.rejected")]

    def references(self, split: str = "heldout") -> list[dict[str, str]]:
        """Each sample's last user message and reference response (`prompt`, `response`), in order."""
        return json.loads((self.directory / f"{split}.responses.json").read_text(encoding="utf-8"))


def trained_chat_template(report_dirs: list[Path]) -> str | None:
    """The chat template of the last fine-tuning stage that wrote a data report among `report_dirs` (in
    stage order): the template the exported model was trained with, for its tokenizer_config.json."""
    for directory in reversed(report_dirs):
        path = directory / "report.json"
        if path.is_file():
            template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
            if isinstance(template, dict) and isinstance(template.get("source"), str):
                return template["source"]
    return None


def instruct_fingerprint(spec: InstructDataSpec, kind: str, seed: int, context_length: int,
                         tokenizer_path: Path, file_hashes: list[tuple[int, str, str]]) -> str:
    # Every file the rendering reads beside the tokenizer: its config and the chat template's files.
    tok_files = [Path(tokenizer_path)] + [Path(tokenizer_path).with_name(name) for name in TEMPLATE_INPUTS]
    extra_templates = Path(tokenizer_path).with_name(CHAT_TEMPLATE_DIR)
    tok_files += sorted(extra_templates.glob("*.jinja")) if extra_templates.is_dir() else []
    blob = json.dumps({
        "v": INSTRUCT_VERSION, "kind": kind, "seed": seed, "context_length": context_length,
        "settings": spec.model_dump(mode="json", exclude={"cache_dir", "length_grouping"}),
        "tokenizer": [hashlib.sha256(p.read_bytes()).hexdigest() for p in tok_files if p.is_file()],
        "files": file_hashes,
    }, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def load_prepared_instruct(directory: Path, tokenizer_path: Path) -> PreparedInstruct | None:
    path = directory / "prepared.json"
    if not path.is_file():
        return None
    meta = json.loads(path.read_text(encoding="utf-8"))
    template = ChatTemplate(meta["template"]["source"], meta["template"]["origin"],
                            tuple(tuple(x) for x in meta["template"]["special_tokens"]))
    return PreparedInstruct(meta["kind"], directory, meta["fingerprint"], meta["stats"], meta["pad_id"],
                            meta["eos_id"], template, Path(tokenizer_path))


def prepare_instruct(spec: InstructDataSpec, kind: Kind, tokenizer_path: Path, context_length: int, seed: int,
                     cache_root: Path, report_dir: Path | None = None, where: str = "stages[?].data") -> PreparedInstruct:
    """Run (or reuse) the instruction data stage; write its report into `report_dir` if given."""
    files = []
    for i, source in enumerate(spec.sources):
        found = list_source_files(source, i)
        if not found:
            raise DataError(f"{where}.sources[{i}].path {source.path!r} matched no files")
        files.extend(found)
    hashes = [(f.source, f.path, hashlib.sha256(read_bytes(f.path)).hexdigest()) for f in files]
    fp = instruct_fingerprint(spec, kind, seed, context_length, tokenizer_path, hashes)
    directory = cache_root / "instruct" / fp[:32]
    prepared = load_prepared_instruct(directory, tokenizer_path)
    if prepared is None:
        tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            _prepare(spec, kind, tokenizer_path, context_length, seed, files, fp, tmp, where)
            if directory.exists():  # another preparer finished first: same fingerprint, same content
                shutil.rmtree(tmp)
            else:
                os.replace(tmp, directory)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        prepared = load_prepared_instruct(directory, tokenizer_path)
        assert prepared is not None
    if report_dir is not None:
        write_instruct_report(report_dir, prepared.stats)
    return prepared


def conversation_text(record: Record) -> str:
    """The text a conversation is deduplicated by: every turn with its role (and the rejected answer)."""
    text = "\n".join(f"{m['role']}: {m['content']}" for m in record.messages)
    return text if record.rejected is None else f"{text}\nrejected: {record.rejected}"


def _read(spec: InstructDataSpec, files, preference: bool, counts: Counter, removed: Counter,
          samples: dict[str, list], where: str) -> list[Record]:
    records, bad, bad_total = [], [], 0
    for file in files:
        source = spec.sources[file.source]
        for record in iter_records(source, file, _source_base(source.path), preference, counts):
            counts["records_read"] += 1
            if isinstance(record, RecordError):  # found by the pre-pass first under on_bad_record: error
                bad_total += 1
                if len(bad) < KEEP_BAD:
                    bad.append(record)
                reason = f"bad_record.{record.problem}"
                removed[reason] += 1
                samples.setdefault(reason, []).append({"id": record.where, "field": record.field,
                                                       "expected": record.expected})
                continue
            if record.group is not None and len(spec.sources) > 1:  # groups of two sources never merge
                record.group = f"sources[{file.source}]:{record.group}"
            for m in record.messages:
                m["content"] = normalize_text(m["content"], spec.normalize)
            if record.rejected is not None:
                record.rejected = normalize_text(record.rejected, spec.normalize)
            empty = [m for m in record.messages if m["role"] == "assistant" and not m["content"].strip()]
            if empty or (record.rejected is not None and not record.rejected.strip()):
                removed["empty_response"] += 1
                samples.setdefault("empty_response", []).append({"id": record.id})
                continue
            if record.rejected is not None and record.rejected == record.messages[-1]["content"]:
                removed["chosen_equals_rejected"] += 1  # no preference to learn
                samples.setdefault("chosen_equals_rejected", []).append({"id": record.id})
                continue
            records.append(record)
    if bad_total and spec.on_bad_record == "error":
        raise BadRecords(where, bad, bad_total)
    return records


def _split(records: list[Record], hashes: list[bytes], seed: int, fraction: float) -> np.ndarray:
    """Held-out mask: by group where records have one, else by conversation; a group never straddles."""
    keys = [text_hash(r.group) if r.group is not None else h for r, h in zip(records, hashes, strict=True)]
    unique = sorted(set(keys))
    held_keys = {k for k, held in zip(unique, heldout_mask(unique, seed, fraction), strict=True) if held}
    return np.array([k in held_keys for k in keys], dtype=bool)


def _encode(tok: Tokenizer, template: ChatTemplate, messages: list[dict]) -> tuple[list[int], list[int], int]:
    """(tokens, supervised mask, where the last response starts) of one rendered conversation. Each
    segment is tokenized on its own, so a response's tokens are those an engine would generate after
    the rendered prompt."""
    segments = template.segments(messages)
    encoded = tok.encode_batch([text for text, _ in segments], add_special_tokens=False)
    tokens, mask, prompt_end = [], [], 0
    for (_, supervised), enc in zip(segments, encoded, strict=True):
        if supervised:
            prompt_end = len(tokens)
        tokens.extend(enc.ids)
        mask.extend([int(supervised)] * len(enc.ids))
    return tokens, mask, prompt_end


def _fit(sample: tuple[list[int], list[int], int], limit: int, policy: str) -> tuple[tuple | None, str | None]:
    """The sample within `limit` tokens under the policy, or None and why it was dropped."""
    tokens, mask, prompt_end = sample
    if sum(mask[1:]) == 0:
        return None, "no_response_tokens"
    if len(tokens) <= limit:
        return sample, None
    if policy == "drop":
        return None, "too_long_dropped"
    tokens, mask = tokens[:limit], mask[:limit]
    if sum(mask[1:]) == 0 or prompt_end >= limit - 1:
        return None, "too_long_truncated_to_nothing"
    return (tokens, mask, prompt_end), "truncated"


def _examples(template: ChatTemplate, records: list[Record], n: int = 2) -> list[dict]:
    """The first `n` conversations the template renders, cut into segments, for the report."""
    out = []
    for r in records:
        try:
            out.append({"id": r.id, "segments": template.segments(r.messages)})
        except ChatTemplateRefused:
            continue
        if len(out) == n:
            break
    return out


def _prepare(spec: InstructDataSpec, kind: Kind, tokenizer_path: Path, context_length: int, seed: int,
             files, fp: str, out: Path, where: str) -> None:
    counts: Counter = Counter()
    removed: Counter = Counter()
    removal_samples: dict[str, list] = {}
    records = _read(spec, files, kind == "dpo", counts, removed, removal_samples, where)
    if not records:
        raise DataError(f"{where}: the sources hold no usable records ({counts['records_read']} read)")
    texts = [conversation_text(r) for r in records]
    hashes = [text_hash(t) for t in texts]
    steps = [{"step": "read", "records": counts["records_read"]}, {"step": "usable", "records": len(records)}]
    keep = np.ones(len(records), dtype=bool)
    dedup = {"exact_removed": 0, "near_removed": 0, "threshold": spec.dedup.threshold}
    if spec.dedup.exact:
        dup = exact_duplicates(hashes)
        keep &= ~dup
        dedup["exact_removed"] = int(dup.sum())
        steps.append({"step": "exact_dedup", "records": int(keep.sum())})
    if spec.dedup.near and keep.sum() > 1:
        kept = np.flatnonzero(keep)
        kept_texts = [texts[i] for i in kept]
        sigs = minhash.signatures(kept_texts, spec.dedup.num_perm, spec.dedup.ngram, spec.dedup.seed)
        # pairs near the threshold decided by their exact Jaccard, as the pretraining data stage does
        near = near_duplicates(sigs, spec.dedup.threshold, spec.dedup.bands, texts=kept_texts, ngram=spec.dedup.ngram)
        keep[kept[near.duplicate]] = False
        dedup.update(near_removed=int(near.duplicate.sum()), bands=near.bands, rows=near.rows,
                     largest_clusters=[{"size": len(c), "kept": records[kept[c[0]]].id,
                                        "members": [records[kept[i]].id for i in c[1:4]]}
                                       for c in near.clusters[: spec.dedup.report_clusters]])
        steps.append({"step": "near_dedup", "records": int(keep.sum())})
    records = [r for r, k in zip(records, keep, strict=True) if k]
    hashes = [h for h, k in zip(hashes, keep, strict=True) if k]
    if len(records) < 2:
        raise DataError(f"{where}: only {len(records)} record(s) left after deduplication; a split needs 2")
    held = _split(records, hashes, seed, spec.heldout_fraction)

    eos_text = eos_token_beside(tokenizer_path)  # tokenizer_config.json's eos_token, else runyard's
    tok = load_tokenizer(tokenizer_path, eos_text)
    eos = tok.token_to_id(eos_text)
    if eos is None:
        raise DataError(f"{tokenizer_path}: the end-of-sequence token {eos_text!r} is not in the vocabulary")
    has_messages = any(r.meta.get("format") is None for r in records)
    template = choose_template(spec.chat_template, tokenizer_path, eos_text, has_messages,
                              f"{where} ({files[0].path})")
    limit = context_length + 1  # inputs and targets are the sample shifted by one
    split_stats = {}
    for split in SPLITS:
        chosen, rejected, responses = [], [], []
        fit_counts: Counter = Counter()
        groups = set()
        for record, is_held in zip(records, held, strict=True):
            if is_held != (split == "heldout"):
                continue
            try:
                encoded_a, encoded_b = _encode(tok, template, record.messages), None
                a, why_a = _fit(encoded_a, limit, spec.too_long)
                b, why_b = None, None
                if record.rejected is not None:
                    alt = record.messages[:-1] + [{"role": "assistant", "content": record.rejected}]
                    encoded_b = _encode(tok, template, alt)
                    b, why_b = _fit(encoded_b, limit, spec.too_long)
            except ChatTemplateRefused as exc:  # raise_exception: the template's own reason, counted
                removed["template_refused"] += 1
                removal_samples.setdefault("template_refused", []).append({"id": record.id, "reason": exc.reason})
                continue
            dropped = a is None or (record.rejected is not None and b is None)
            for why in {why_a, why_b} - {None}:
                fit_counts[why] += 1
            if dropped:
                why, encoded = (why_a, encoded_a) if a is None else (why_b, encoded_b)
                removed[why] += 1
                # a sample of every removal kind, so the report shows what was too long and by how much
                removal_samples.setdefault(why, []).append(
                    {"id": record.id, "reason": f"{len(encoded[0])} tokens, the context holds {limit}"
                     if why.startswith("too_long") else "no assistant token is supervised"})
                continue
            chosen.append(a)
            if b is not None:
                rejected.append(b)
            last_user = [m["content"] for m in record.messages if m["role"] == "user"][-1]
            responses.append({"prompt": last_user, "response": record.messages[-1]["content"]})
            groups.add(record.group)
        if not chosen:
            refused = removal_samples.get("template_refused")
            why_refused = (f"; the chat template refused {removed['template_refused']} conversation(s): "
                           f"{refused[0]['reason']}" if refused else "")
            raise DataError(f"{where}: no {split} record fits the context of {context_length} tokens "
                            f"(too_long: {spec.too_long}); counts: {dict(fit_counts)}{why_refused}")
        if kind == "sft":
            split_stats[split] = write_store(out, split, chosen)
        else:
            split_stats[split] = {"chosen": write_store(out, f"{split}.chosen", chosen),
                                  "rejected": write_store(out, f"{split}.rejected", rejected),
                                  "samples": len(chosen)}
        split_stats[split].update(records=len(chosen), groups=len(groups - {None}), fit=dict(fit_counts))
        atomic_write_json(out / f"{split}.responses.json", responses)
    stats = {
        "kind": kind, "fingerprint": fp, "seed": seed, "context_length": context_length,
        "read": dict(counts), "steps": steps, "removed": dict(removed),
        "removal_samples": {k: v[:3] for k, v in removal_samples.items()}, "dedup": dedup,
        "split": {"method": "by group where records have one, else by conversation: seeded hash < fraction",
                  "heldout_fraction": spec.heldout_fraction, "too_long": spec.too_long, **split_stats},
        "chat_template": {"origin": template.origin, "source": template.source},
        "examples": _examples(template, records),
    }
    atomic_write_json(out / "prepared.json", {
        "kind": kind, "fingerprint": fp, "stats": stats, "pad_id": eos, "eos_id": eos,
        "template": {"source": template.source, "origin": template.origin,
                     "special_tokens": [list(x) for x in template.special_tokens]},
    })
