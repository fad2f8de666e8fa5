"""The `export-gguf` verb: a run's exported decoder as one GGUF file, for llama.cpp and Ollama."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from runyard.cli.readers import say_if_live
from runyard.cli.run_progress import finished_export
from runyard.model.hf.gguf import PRE_TOKENIZER, TYPES, default_gguf_path, write_gguf
from runyard.system.diskspace import human_bytes

DESCRIPTION = f"""\
Write RUN_DIR/export (its checksums verified first) as a GGUF file: the `llama` architecture's
metadata, the tokenizer (byte-level BPE vocabulary and merges, special tokens, chat template; the
pre-tokenizer declared as {PRE_TOKENIZER!r}) and every tensor under llama.cpp's names, in --type.
llama.cpp, llama-cpp-python and Ollama load the file as it is, e.g. `llama-cli -m FILE`, or in an
Ollama Modelfile: `FROM ./FILE`.
"""


def register(verbs: argparse._SubParsersAction, argv: Sequence[str]) -> None:
    p = verbs.add_parser(
        "export-gguf",
        help="write a run's exported decoder as a GGUF file for llama.cpp and Ollama",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", type=Path, help="run directory (or its export/ directory)")
    p.add_argument("--out", type=Path, default=None,
                   help="the GGUF file to write (default: RUN_DIR/model.TYPE.gguf)")
    p.add_argument("--type", dest="type_name", choices=sorted(TYPES), default="f32",
                   help="tensor type: f32 (exact), f16, bf16, or q8_0 (8-bit blocks; norms stay f32) "
                        "(default %(default)s)")
    p.set_defaults(handler=cmd_export_gguf)


def cmd_export_gguf(args) -> int:
    say_if_live(args.run_dir)
    export_dir = finished_export(args.run_dir)
    out = args.out if args.out is not None else default_gguf_path(export_dir, args.type_name)
    write_gguf(export_dir, out, args.type_name)
    print(f"wrote {out} ({human_bytes(out.stat().st_size)}, {args.type_name})")
    return 0
