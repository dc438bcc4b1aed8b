"""``megatron-dualpipe preprocess``: a jsonl corpus into Megatron's indexed dataset; the
work is :func:`megatron_dualpipe.megatron.data.preprocess.preprocess`."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..progress import Progress
from .common import add_json_keys, unwind_on_stop_signals

__all__ = ["add", "run"]


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "preprocess",
        help="tokenize a jsonl corpus into Megatron's indexed dataset (.bin/.idx)",
        description='Tokenize every line\'s "text" of a jsonl file with a Hugging Face '
        "tokenizer directory, append the end-of-document token, and write Megatron's indexed "
        "dataset PREFIX_text_document.bin/.idx (what Megatron-LM's tools/preprocess_data.py "
        "writes); train on it with data_path: PREFIX_text_document.",
    )
    p.add_argument("--input", type=Path, required=True, help="the corpus, one JSON object a line")
    p.add_argument(
        "--tokenizer",
        type=Path,
        required=True,
        metavar="DIR",
        help="a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json)",
    )
    p.add_argument(
        "--output-prefix",
        required=True,
        metavar="PREFIX",
        help="where to write: PREFIX_KEY_document.bin and .idx for each key (folders are made)",
    )
    add_json_keys(p, "the keys whose strings are documents, one dataset each")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="tokenizing processes (default 1); the output does not depend on it",
    )
    p.add_argument(
        "--max-document-chars",
        type=int,
        metavar="N",
        help="refuse a document of more characters (default: 4,000,000, about 0.8 GB to tokenize)",
    )


def run(args: argparse.Namespace) -> None:
    from ..megatron.compat.known_warnings import silence_known_warnings
    from ..megatron.data.preprocess import preprocess  # imports torch and megatron

    silence_known_warnings()
    given = args.max_document_chars
    limit = {} if given is None else {"max_document_chars": given}
    with unwind_on_stop_signals(), Progress(delay_s=0.5) as bar:
        bar.phase(f"tokenizing {args.input}")
        began = time.monotonic()

        def progress(done: int, total: int) -> None:
            seconds = max(time.monotonic() - began, 1e-9)
            bar.total, bar.done = total, done
            bar.note = f"{done / seconds / 1e6:.1f} MB/s"

        result = preprocess(
            args.input,
            args.tokenizer,
            args.output_prefix,
            json_keys=args.json_keys,
            workers=args.workers,
            progress=progress,
            **limit,
        )
    seconds = max(result.seconds, 1e-9)
    for written in result.written:
        print(
            f"wrote {written.prefix}.bin and {written.prefix}.idx: {written.documents:,} "
            f"documents, {written.tokens:,} tokens (each document ends in the end-of-document "
            f"token); train on it with data_path: {written.prefix}"
        )
    print(
        f"{result.bytes_read / 1e6:,.1f} MB in {result.seconds:.1f} s with {result.workers} "
        f"worker(s): {result.written[0].documents / seconds:,.0f} documents/s, "
        f"{result.bytes_read / seconds / 1e6:.1f} MB/s"
    )
