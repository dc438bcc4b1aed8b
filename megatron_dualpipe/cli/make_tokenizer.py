"""``megatron-dualpipe make-tokenizer``: a byte-level BPE trained offline on a corpus; the
work is :func:`megatron_dualpipe.megatron.data.make_tokenizer.make_tokenizer`."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..progress import Progress
from .common import add_json_keys, unwind_on_stop_signals

__all__ = ["add", "run"]


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-tokenizer",
        help="train a byte-level BPE tokenizer on a corpus, offline, for preprocess and train",
        description="Train a byte-level BPE (GPT-2's recipe, with the tokenizers library) on "
        "the documents of a jsonl corpus (or a .txt file, a document a line) and save it with "
        "transformers' save_pretrained: the directory preprocess --tokenizer and train's "
        "tokenizer_model take. Nothing is downloaded.",
    )
    p.add_argument("--input", type=Path, required=True, help="the corpus (jsonl, or .txt)")
    p.add_argument("--output", type=Path, required=True, metavar="DIR", help="the tokenizer folder")
    p.add_argument("--vocab-size", type=int, default=32000, metavar="N", help="default 32000")
    add_json_keys(p, "the keys whose strings are documents")
    p.add_argument("--eod", default="<|endoftext|>", metavar="TOKEN", help="its end-of-document "
                   "token (default: <|endoftext|>)")  # fmt: skip
    p.add_argument("--min-frequency", type=int, default=0, metavar="N", help="the fewest "
                   "occurrences of a pair merged (default: the tokenizers library's)")  # fmt: skip


def run(args: argparse.Namespace) -> None:
    from ..megatron.data.make_tokenizer import make_tokenizer

    with unwind_on_stop_signals(), Progress(delay_s=0.5) as bar:
        bar.phase(f"training a BPE on {args.input}")
        options = {k: getattr(args, k) for k in ("vocab_size", "json_keys", "eod", "min_frequency")}
        made = make_tokenizer(args.input, args.output, **options)
    print(
        f"wrote {made.directory}: a byte-level BPE of {made.vocab_size:,} tokens trained on "
        f"{made.documents:,} documents, end-of-document token {args.eod}; use it with "
        f"preprocess --tokenizer {made.directory} and train's tokenizer_model: {made.directory}"
    )
