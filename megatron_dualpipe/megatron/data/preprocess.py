"""``megatron-dualpipe preprocess``: a jsonl corpus into Megatron's indexed dataset.

What Megatron-LM's ``tools/preprocess_data.py`` does at document level, through
Megatron-Core's own parts: the string of each key of ``json_keys`` in each JSON line is one
document, tokenized by Megatron-Core's ``huggingface`` tokenizer (:mod:`.hf_tokenizer`) with
the end-of-document id appended; ``IndexedDatasetBuilder`` writes
``<prefix>_<key>_document.bin`` and ``.idx``, one dataset per key. ``workers`` > 1
tokenizes in that many forked processes and writes the same bytes as one. Every problem is
one sentence naming the file (and the corpus's line); a prefix's two files appear complete,
together, or not at all. How and why: docs/training.md, "Your own data".
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import multiprocessing
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy

from ...lifetime import die_with_parent
from .hf_tokenizer import (
    TokenizerError,
    check_huggingface_dir,
    end_of_document_problem,
    huggingface_tokenizer,
)

__all__ = [
    "DEFAULT_MAX_DOCUMENT_CHARS",
    "PreprocessError",
    "Preprocessed",
    "Written",
    "dataset_prefix",
    "check_options",
    "document_texts",
    "preprocess",
]

#: Megatron-LM's default ``--json-keys`` and the level in its output names.
TEXT_KEY = "text"
LEVEL = "document"
#: The longest document tokenized by default: about 0.8 GB of tokenizer memory.
DEFAULT_MAX_DOCUMENT_CHARS = 4_000_000
#: A chunk of lines handed to a worker: about this many bytes of corpus.
CHUNK_BYTES = 1 << 20
#: How often a waiting parent checks its workers, and a waiting worker its parent (s).
POLL_S = 0.5
#: Signals held back while the finished files are renamed and while workers are forked
#: (what ends a run as an exception).
_HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
#: How long a worker has to end after SIGTERM before it is killed: one forked with the stop
#: signals held (see :class:`_Workers`) and stuck before its loop unholds them never sees
#: SIGTERM.
_END_S = 5.0


class PreprocessError(TokenizerError):
    """The corpus, the tokenizer or the output cannot be used (one sentence)."""


@dataclass(frozen=True)
class Written:
    """One dataset a run wrote: its key, its prefix (``data_path``), documents and tokens
    (end-of-document ids included)."""

    key: str
    prefix: str
    documents: int
    tokens: int


@dataclass(frozen=True)
class Preprocessed:
    """What a preprocessing run wrote (one dataset per JSON key), the corpus bytes it read,
    its wall time in seconds and its workers."""

    written: tuple[Written, ...]
    bytes_read: int
    seconds: float
    workers: int


def dataset_prefix(output_prefix: str, key: str) -> str:
    """Megatron-LM's name for the dataset of ``key``: ``<output_prefix>_<key>_document``."""
    return f"{output_prefix}_{key}_{LEVEL}"


# --------------------------------------------------------------------------------------
# Encoding: the same function in-process (one worker) and in each forked worker.


@dataclass(frozen=True)
class _Chunk:
    """Consecutive raw lines of the corpus, the first being line ``first`` (from 1)."""

    index: int
    first: int
    lines: list[bytes]


@dataclass(frozen=True)
class _Encoded:
    """A chunk's documents: per key, the token count of each document and all its tokens."""

    documents: int
    lengths: tuple[numpy.ndarray, ...]
    tokens: tuple[numpy.ndarray, ...]


@dataclass(frozen=True)
class _Encoder:
    """Turns lines into token ids; raises PreprocessError naming the first bad line."""

    path: Path
    keys: tuple[str, ...]
    tokenizer: Any
    eod: int
    dtype: type
    max_chars: int

    def encode(self, chunk: _Chunk) -> _Encoded:
        per_key: list[list[list[int]]] = [[] for _ in self.keys]
        documents = 0
        for number, line in enumerate(chunk.lines, start=chunk.first):
            if not line.strip():
                continue
            for ids, text in zip(per_key, self.texts(number, line), strict=True):
                ids.append([*self.tokenizer.tokenize(text), self.eod])
            documents += 1
        lengths = tuple(numpy.array([len(d) for d in docs], numpy.int64) for docs in per_key)
        tokens = tuple(
            numpy.array(list(itertools.chain.from_iterable(docs)), self.dtype) for docs in per_key
        )
        return _Encoded(documents, lengths, tokens)

    def texts(self, number: int, line: bytes) -> list[str]:
        """Each key's document on line ``number``."""
        return document_texts(self.path, number, line, self.keys, self.max_chars)


def decode_line(path: Path, number: int, line: bytes) -> str:
    """Line ``number`` of ``path`` as text; PreprocessError naming it when it is not UTF-8."""
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PreprocessError(
            f"{path} line {number}: not UTF-8 text ({err.reason} at byte {err.start + 1} of "
            "the line): save the corpus as UTF-8"
        ) from None


def document_texts(
    path: Path, number: int, line: bytes, keys: Sequence[str], max_chars: int
) -> list[str]:
    """The string of each of ``keys`` in line ``number`` of the jsonl corpus ``path``;
    PreprocessError naming the line when it is not UTF-8, not a JSON object holding a
    string for every key, or holds one longer than ``max_chars``."""
    where = f"{path} line {number}"
    try:
        record = json.loads(decode_line(path, number, line))
    except json.JSONDecodeError as err:
        raise PreprocessError(
            f"{where}: not JSON ({err.msg} at column {err.colno}): write one JSON object "
            'per line, such as {"text": "..."}'
        ) from None
    texts = []
    for key in keys:
        if not isinstance(record, dict) or key not in record:
            raise PreprocessError(
                f'{where}: no "{key}" field: each line must be a JSON object with the '
                f'document in "{key}" (or name its keys with --json-keys)'
            )
        text = record[key]
        if not isinstance(text, str):
            raise PreprocessError(f'{where}: "{key}" is {type(text).__name__}, not a string')
        if len(text) > max_chars:
            raise PreprocessError(
                f'{where}: the "{key}" document is {len(text):,} characters, more than '
                f"--max-document-chars {max_chars:,} (tokenizing it would take about "
                f"{len(text) * 200 / 1e9:.1f} GB): split it into smaller documents, or "
                "raise --max-document-chars"
            )
        texts.append(text)
    return texts


def _chunks(
    path: Path, stream: Any, after: _Chunk, progress: Callable[[int], None]
) -> Iterator[_Chunk]:
    """The rest of the corpus, from the line after chunk ``after``, as chunks of about
    CHUNK_BYTES; ``progress(bytes read)`` after each."""
    index, number, done = 0, after.first + len(after.lines), sum(map(len, after.lines))
    lines: list[bytes] = []
    size = 0
    try:
        for line in stream:
            lines.append(line)
            size += len(line)
            if size >= CHUNK_BYTES:
                yield _Chunk(index, number, lines)
                index, number, done = index + 1, number + len(lines), done + size
                progress(done)
                lines, size = [], 0
    except OSError as err:
        raise PreprocessError(f"--input: cannot read {path}: {err.strerror or err}") from None
    if lines:
        yield _Chunk(index, number, lines)
        progress(done + size)


# --------------------------------------------------------------------------------------
# Workers.


@contextlib.contextmanager
def _stops_deferred() -> Iterator[None]:
    """Within the block a stop signal whose handler is Python's (the one that raises, as
    ``train`` and ``preprocess`` install) is noted, not raised; leaving the block, the
    first one noted goes to that handler. For ``multiprocessing.Queue.put``: it takes a
    ``threading.Condition``, whose ``__enter__`` is Python code, so a stop raised just
    after it takes its lock (before the ``with`` holds it) leaves the lock taken, and the
    queue's close, ours or the one at exit, then waits on it for ever (likely why
    ``preprocess`` twice did not end after SIGTERM in CI)."""
    noted: list[int] = []
    handlers = {s: signal.getsignal(s) for s in _HELD_SIGNALS}
    raising = {s: h for s, h in handlers.items() if callable(h)}
    for signum in raising:
        signal.signal(signum, lambda signum, frame: noted.append(signum))
    try:
        yield
    finally:
        for signum, handler in raising.items():
            signal.signal(signum, handler)
        if noted:
            raising[noted[0]](noted[0], None)


def _work(encoder: _Encoder, tasks: Any, results: Any, parent: int) -> None:
    """A worker's loop: encode each chunk from ``tasks`` into ``results`` (a PreprocessError
    as its message, anything else as its traceback). It dies with the parent (the kernel
    kills it, even mid-read of a chunk the parent was writing when it died; elsewhere it
    returns when it sees the parent gone). Stop signals are the parent's to handle:
    Ctrl-C reaches the whole process group, and the parent ends its workers itself. The
    tokenizers library's own threads are off in a worker: the workers are the parallelism
    (with both, N workers ran slower than one on two cores)."""
    die_with_parent(parent)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD_SIGNALS)  # held while it was forked
    while True:
        try:
            chunk = tasks.get(timeout=POLL_S)
        except queue.Empty:
            if os.getppid() != parent:
                results.cancel_join_thread()  # nobody reads what it still holds
                return
            continue
        try:
            results.put((chunk.index, encoder.encode(chunk)))
        except PreprocessError as err:
            results.put((chunk.index, PreprocessError(str(err))))
        except Exception:  # noqa: BLE001 - a bug or MemoryError: the parent raises it
            results.put((chunk.index, RuntimeError(traceback.format_exc())))


class _Workers:
    """``workers`` forked encoders (none for one: the parent encodes); ``encoded(chunks)``
    yields each chunk's encoding in input order. Leaving the block ends every worker."""

    def __init__(self, encoder: _Encoder, workers: int) -> None:
        self.encoder, self.workers = encoder, workers
        self.processes: list[Any] = []
        if workers > 1:
            context = multiprocessing.get_context("fork")
            self.tasks, self.results = context.Queue(), context.Queue()
            self.processes = [
                context.Process(
                    target=_work,
                    args=(encoder, self.tasks, self.results, os.getpid()),
                    name=f"preprocess-worker-{rank}",
                    daemon=True,
                )
                for rank in range(workers)
            ]
            # A stop signal during a fork would be raised in the middle of it (or lost in
            # an after-fork hook): it waits until every worker is started, and is raised by
            # the unblocking inside the try, so that the workers it stops are ended (raised
            # from the finally, it left __init__ with the workers running and unjoined).
            held = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
            try:
                for process in self.processes:
                    process.start()
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
            except BaseException:
                self.__exit__(None, None, None)
                raise
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)

    def __enter__(self) -> _Workers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        started = [process for process in self.processes if process.pid is not None]
        for process in started:
            process.terminate()
        for process in started:
            process.join(_END_S)
            if process.exitcode is None:
                process.kill()
                process.join()
        if self.processes:
            for channel in (self.tasks, self.results):
                channel.cancel_join_thread()
                channel.close()

    def encoded(self, chunks: Iterable[_Chunk]) -> Iterator[_Encoded]:
        if not self.processes:
            yield from map(self.encoder.encode, chunks)
            return
        source = iter(chunks)
        in_flight = 2 * self.workers + 1
        arrived: dict[int, _Encoded | Exception] = {}
        sent = done = 0
        exhausted = False
        while True:
            while not exhausted and sent - done < in_flight:
                chunk = next(source, None)
                if chunk is None:
                    exhausted = True
                else:
                    with _stops_deferred():
                        self.tasks.put(chunk)
                    sent += 1
            if exhausted and done == sent:
                return
            while done not in arrived:
                self._receive(arrived)
            result = arrived.pop(done)
            if isinstance(result, Exception):
                raise result
            yield result
            done += 1

    def _receive(self, arrived: dict[int, _Encoded | Exception]) -> None:
        try:
            index, result = self.results.get(timeout=POLL_S)
        except queue.Empty:
            for process in self.processes:
                if not process.is_alive():
                    raise PreprocessError(
                        f"--workers: tokenizing worker {process.name} died (exit code "
                        f"{process.exitcode}, out of memory?): lower --workers or "
                        "--max-document-chars"
                    ) from None
            return
        arrived[index] = result


# --------------------------------------------------------------------------------------
# Output: locked prefixes, temporary files, the paired rename, cleanup.


class _Dataset:
    """One dataset being written under ``<prefix>.incomplete-<pid>.bin/.idx``."""

    def __init__(self, key: str, prefix: str, dtype: type) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        self.key, self.prefix = key, prefix
        self.partial = f"{prefix}.incomplete-{os.getpid()}"
        self.builder = IndexedDatasetBuilder(self.partial + ".bin", dtype=dtype)
        self.documents = self.tokens = 0

    def add(self, lengths: numpy.ndarray, tokens: numpy.ndarray) -> None:
        start = 0
        for length in lengths.tolist():
            self.builder.add_document(tokens[start : start + length], [length])
            start += length
        self.documents += len(lengths)
        self.tokens += start

    def finish(self) -> None:
        """Close the ``.bin``, write the ``.idx``, both flushed to the disk."""
        self.builder.finalize(self.partial + ".idx")
        for suffix in (".bin", ".idx"):
            descriptor = os.open(self.partial + suffix, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)

    def publish(self) -> None:
        """Rename the pair: the old ``.idx`` goes first, so a stop halfway leaves a ``.bin``
        without an ``.idx`` (no dataset), never a mixed pair."""
        Path(self.prefix + ".idx").unlink(missing_ok=True)
        os.replace(self.partial + ".bin", self.prefix + ".bin")
        os.replace(self.partial + ".idx", self.prefix + ".idx")

    def discard(self) -> None:
        """Remove what is left of the temporary files (a failing close included)."""
        with contextlib.suppress(OSError):
            self.builder.data_file.close()
        for suffix in (".bin", ".idx"):
            Path(self.partial + suffix).unlink(missing_ok=True)


class _PrefixLock:
    """An exclusive ``flock`` on ``<prefix>.lock``, refused at once when another run holds
    it; the file is removed while still held, so a run never locks a removed file."""

    def __init__(self, prefix: str) -> None:
        self.path = prefix + ".lock"
        while True:
            descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(descriptor)
                raise PreprocessError(
                    f"--output-prefix: another preprocess is writing {prefix}.bin and .idx "
                    f"(it holds {self.path}): wait for it to finish, or choose another "
                    "--output-prefix"
                ) from None
            try:
                same = os.path.samestat(os.fstat(descriptor), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                self.descriptor = descriptor
                return
            os.close(descriptor)  # the holder removed it as we opened it: lock the new one

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.descriptor)


class _Outputs:
    """The locked, temporary datasets of one run; ``publish()`` renames them all, leaving
    the block any other way removes them."""

    def __init__(self, output_prefix: str, keys: Sequence[str], dtype: type) -> None:
        self.locks: list[_PrefixLock] = []
        self.datasets: list[_Dataset] = []
        self.published = False
        prefixes = [dataset_prefix(output_prefix, key) for key in keys]
        try:
            Path(prefixes[0]).parent.mkdir(parents=True, exist_ok=True)
            for prefix in prefixes:
                self.locks.append(_PrefixLock(prefix))
            for key, prefix in zip(keys, prefixes, strict=True):
                self.datasets.append(_Dataset(key, prefix, dtype))
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __enter__(self) -> _Outputs:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self.published:
            for dataset in self.datasets:
                dataset.discard()
        for lock in self.locks:
            lock.release()

    def add(self, encoded: _Encoded) -> None:
        for dataset, lengths, tokens in zip(
            self.datasets, encoded.lengths, encoded.tokens, strict=True
        ):
            dataset.add(lengths, tokens)

    def publish(self) -> None:
        for dataset in self.datasets:
            dataset.finish()
        held = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
        try:
            for dataset in self.datasets:
                dataset.publish()
            self.published = True
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _output_error(err: OSError, output_prefix: str, keys: Sequence[str]) -> PreprocessError:
    """One sentence for a failed write, naming the dataset (never the temporary file) and
    what to change."""
    names = " and ".join(f"{dataset_prefix(output_prefix, key)}.bin/.idx" for key in keys)
    where = Path(err.filename or dataset_prefix(output_prefix, keys[0])).parent
    reasons = {
        errno.ENOSPC: f"the disk holding {where} is full: free space there",
        errno.EDQUOT: f"the disk quota for {where} is used up: free space there",
        errno.EROFS: f"{where} is on a read-only file system: make it writable",
        errno.EEXIST: f"{err.filename} is a file, not a folder: move it",
        errno.ENOTDIR: f"{err.filename} is below a file, not a folder: move that file",
        errno.EACCES: f"there is no permission to write in {where}: grant it",
        errno.EPERM: f"there is no permission to write in {where}: grant it",
    }
    reason = reasons.get(err.errno, f"{err.strerror or err}: fix that")
    return PreprocessError(
        f"--output-prefix: cannot write {names}: {reason}, or choose another --output-prefix"
    )


# --------------------------------------------------------------------------------------


def preprocess(
    input_path: str | Path,
    tokenizer_dir: str | Path,
    output_prefix: str,
    *,
    json_keys: Sequence[str] = (TEXT_KEY,),
    workers: int = 1,
    max_document_chars: int = DEFAULT_MAX_DOCUMENT_CHARS,
    progress: Callable[[int, int], None] | None = None,
) -> Preprocessed:
    """Tokenize ``input_path`` (jsonl) with the Hugging Face tokenizer in ``tokenizer_dir``
    into ``<output_prefix>_<key>_document.bin/.idx`` for each of ``json_keys``, with
    ``workers`` processes (the files do not depend on it); ``progress(bytes read, bytes in
    the corpus)`` is called as chunks are read. Raises :class:`PreprocessError` (the input
    and the options before any work)."""
    from megatron.core.datasets.indexed_dataset import DType

    began = time.monotonic()
    keys = check_options(json_keys, workers, max_document_chars)
    source = Path(input_path)
    check_huggingface_dir(tokenizer_dir, "--tokenizer")
    try:
        stream = source.open("rb")
        total = os.fstat(stream.fileno()).st_size
    except OSError as err:
        what = "does not exist" if isinstance(err, FileNotFoundError) else err.strerror
        raise PreprocessError(f"--input: {source} {what}: give a jsonl file") from None
    with stream:
        tokenizer = huggingface_tokenizer(tokenizer_dir, "--tokenizer")
        problem = end_of_document_problem(tokenizer, tokenizer_dir)
        if problem is not None:
            raise PreprocessError(f"--tokenizer: {problem}")
        dtype = DType.optimal_dtype(tokenizer.vocab_size)
        encoder = _Encoder(source, keys, tokenizer, tokenizer.eod, dtype, max_document_chars)
        first = _first_document(source, stream, encoder)
        report = progress or (lambda done, total: None)
        chunks = _chunks(source, stream, first, lambda done: report(done, total))
        try:
            # The workers first: they are forked holding neither the lock nor the files.
            with (
                _Workers(encoder, workers) as pool,
                _Outputs(output_prefix, keys, dtype) as outputs,
            ):
                outputs.add(encoder.encode(first))
                for encoded in pool.encoded(chunks):
                    outputs.add(encoded)
                outputs.publish()
        except OSError as err:
            raise _output_error(err, output_prefix, keys) from None
    written = tuple(Written(d.key, d.prefix, d.documents, d.tokens) for d in outputs.datasets)
    return Preprocessed(written, total, time.monotonic() - began, workers)


def check_options(json_keys: Sequence[str], workers: int, max_chars: int) -> tuple[str, ...]:
    """``json_keys`` as a tuple; PreprocessError for no key, a key twice, ``workers`` below
    1 (or above 1 where processes cannot fork), ``max_chars`` below 1."""
    keys = tuple(json_keys)
    if not keys or any(not key or "/" in key for key in keys):
        raise PreprocessError(
            f"--json-keys: {' '.join(keys) or 'nothing'} is not a list of JSON keys: name each "
            "key whose string is a document, e.g. --json-keys text"
        )
    if len(set(keys)) != len(keys):
        raise PreprocessError(f"--json-keys: {' '.join(keys)} names a key twice: name it once")
    if workers < 1:
        raise PreprocessError(f"--workers: {workers} is not a count of processes: give 1 or more")
    if workers > 1 and "fork" not in multiprocessing.get_all_start_methods():
        raise PreprocessError("--workers: this platform cannot fork workers: give --workers 1")
    if max_chars < 1:
        raise PreprocessError(f"--max-document-chars: {max_chars} is not a length: give 1 or more")
    return keys


def _first_document(source: Path, stream: Any, encoder: _Encoder) -> _Chunk:
    """The lines up to the first document, checked before any output is made (a bad first
    line or a corpus of blank lines is refused before work starts)."""
    lines: list[bytes] = []
    for line in stream:
        lines.append(line)
        if line.strip():
            encoder.texts(len(lines), line)
            return _Chunk(-1, 1, lines)
    raise PreprocessError(
        f"{source}: no documents (every line is blank): write one JSON object per line with "
        f'the document in "{encoder.keys[0]}"'
    )
